"""The backward through the tangent (`flash_attention_backward` with `grad_tangent_out`): the six
gradients dQ, dK, dV, dtQ, dtK, dtV of a loss on (O, tO), against the float64 reference,
within twice PyTorch's own error (see tests/helpers.py).

This is "reverse over forward", the gradient a consistency-model or MeanFlow loss needs when it
uses the JVP's output: PyTorch's math path computes it with autograd through `torch.func.jvp`.
The kernels run as the autograd layer runs them (with the forward's rounding residuals);
`test_second_order_other_paths` covers the launchers without residuals and in precision "fast".
"""


from unittest import mock

import pytest
import torch
from helpers import (
    BF16,
    COMMON_GPU_CASES,
    DEVICE,
    F16,
    FUZZ_STRATEGIES,
    GPU_BIAS_CASES,
    HAS_CUDA,
    SECOND_ORDER_NAMES,
    Problem,
    Spec,
    assert_accurate,
    assert_deterministic,
    assert_empty_rows_are_zero,
    assert_every_tile_reproducible,
    bias_params,
    cancellation_scale,
    check_other_backward_path,
    check_with_bias,
    cpu_grid,
    dtype_name,
    expected_forward,
    expected_second_order,
    expected_with_bias,
    force_tile,
    fuzz_settings,
    fuzz_spec,
    gpu_params,
    kernel_backward,
    kernel_second_order,
    kernel_with_bias,
    make_bias,
    make_problem,
    other_backward_paths,
)
from hypothesis import given

import jvp_attention.backward as backward
from jvp_attention.accuracy import float64_truth
from jvp_attention.backward import flash_attention_backward
from jvp_attention.forward import flash_attention_forward

# Tiny tensors: one intra-op thread is ~10x faster than a contended pool (conftest).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_second_order(spec: Spec, dtype: torch.dtype, seed: int = 0,
                       device: str = DEVICE, residuals: bool = True) -> None:
    p = make_problem(spec, dtype, seed, device)
    truth, floor = expected_second_order(p)
    ours = kernel_second_order(p, residuals=residuals)
    cancellation = cancellation_scale(p, second_order=True)
    assert_accurate(ours, truth, floor, dtype, p.label, "second order",
                    cancellation=cancellation)
    assert_empty_rows_are_zero(p, ours)


@pytest.mark.parametrize("spec, dtype", cpu_grid())
def test_second_order_grid(spec: Spec, dtype: torch.dtype) -> None:
    check_second_order(spec, dtype)


KEY_SIDE_PASSES = ("_backward_dv_tangent", "_backward_dk_tangent")


def force_key_side_tiles(monkeypatch, configs: dict) -> None:
    """Make each second-order key-side pass (by name) tune over `configs[name]` alone."""
    for name, config in configs.items():
        force_tile(monkeypatch, getattr(backward, name), config)


def key_side_tile(block_m: int, block_n: int, transposed: bool, warps: int = 4,
                  stages: int = 2):
    import triton

    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "TRANSPOSED": transposed},
                         num_warps=warps, num_stages=stages)


@pytest.mark.parametrize("spec", [Spec(nq=45, nk=70, causal=True),
                                  Spec(hq=4, hkv=2, nq=70, nk=45, mask="bool"),
                                  Spec(nq=33, nk=33, d=24, dv=40)], ids=lambda s: s.id)
def test_second_order_with_query_blocks_narrower_than_key_blocks(spec: Spec,
                                                                 monkeypatch) -> None:
    """The GPU lists' 16 x 32 dK/dV tile (chapter 5) has query blocks narrower than its key
    blocks, the reverse of the interpreter's 32 x 16: run that shape through both passes."""
    force_key_side_tiles(monkeypatch, dict.fromkeys(KEY_SIDE_PASSES,
                                                    key_side_tile(16, 32, False)))
    check_second_order(spec, torch.float32)
    for name in KEY_SIDE_PASSES:
        best = getattr(backward, name).best_config.kwargs
        assert (best["BLOCK_M"], best["BLOCK_N"]) == (16, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("spec", [Spec(nq=45, nk=70, causal=True),
                                  Spec(hq=4, hkv=2, nq=70, nk=45, mask="bool"),
                                  Spec(batch=2, nq=33, nk=40, d=24, dv=40, mask="additive",
                                       layout="bnhd"),
                                  Spec(nq=33, nk=17, d=72, mask="empty_rows")],
                         ids=lambda s: s.id)
def test_second_order_with_transposed_key_side_passes(spec: Spec, dtype: torch.dtype,
                                                      monkeypatch) -> None:
    """The key side's passes accumulating dims x keys (`TRANSPOSED`), as the autotuner may
    choose on a GPU (chapter 5's `laid_out`): same accuracy as stored, every gradient
    written."""
    force_key_side_tiles(monkeypatch, {"_backward_dv_tangent": key_side_tile(32, 16, True),
                                       "_backward_dk_tangent": key_side_tile(16, 32, True)})
    check_second_order(spec, dtype)
    for name in KEY_SIDE_PASSES:
        assert getattr(backward, name).best_config.kwargs["TRANSPOSED"] is True


def test_the_key_side_passes_tune_their_layout() -> None:
    """On a GPU each pass's candidates hold both layouts; under the interpreter one stored
    tile; the first-order kernel's layout is passed by its launch, not tuned."""
    import triton

    from jvp_attention.launch import interpreting

    for name in KEY_SIDE_PASSES:
        layouts = {config.kwargs["TRANSPOSED"] for config in getattr(backward, name).configs}
        assert layouts == ({False} if interpreting() else {False, True}), name
    assert all(config.kwargs["TRANSPOSED"] is False
               for config in backward._backward_dkdv_tangent.configs)
    assert all("TRANSPOSED" not in config.kwargs for config in backward._backward_dkdv.configs)
    laid = backward.with_layout([triton.Config({"BLOCK_M": 64, "BLOCK_N": 16}, num_warps=8,
                                               num_stages=1)], True)[0]
    assert (laid.kwargs, laid.num_warps, laid.num_stages) == (
        {"BLOCK_M": 64, "BLOCK_N": 16, "TRANSPOSED": True}, 8, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=dtype_name)
@pytest.mark.parametrize("spec", [Spec(batch=2, hq=4, hkv=2, nq=1000, nk=1000, d=128,
                                       causal=True),
                                  Spec(batch=2, hq=4, hkv=4, nq=777, nk=1000, d=64,
                                       mask="bool"),
                                  Spec(batch=2, hq=4, hkv=4, nq=1000, nk=1000, d=72,
                                       layout="bnhd")], ids=lambda s: s.id)
def test_second_order_with_transposed_key_side_passes_gpu(spec: Spec, dtype: torch.dtype,
                                                          monkeypatch) -> None:
    """The transposed tiles of the GPU lists (wgmma alone, chapter 6) at realistic sizes."""
    force_key_side_tiles(monkeypatch, {
        "_backward_dv_tangent": key_side_tile(64, 32, True, warps=8),
        "_backward_dk_tangent": key_side_tile(64, 16, True, warps=8)})
    check_second_order(spec, dtype, device="cuda")


@pytest.mark.parametrize("spec", [Spec(hq=4, hkv=2, nq=45, nk=70, causal=True),
                                  Spec(nq=33, nk=40, d=24, dv=40, mask="additive")],
                         ids=lambda s: s.id)
def test_second_order_in_one_key_side_pass(spec: Spec, monkeypatch) -> None:
    """SPLIT_KEY_SIDE = False: dK, dV, dtK and dtV from one pass over the queries (four
    accumulators), as before the split; same accuracy."""
    tuner = backward._backward_dkdv_tangent
    monkeypatch.setattr(backward, "SPLIT_KEY_SIDE", False)
    monkeypatch.setattr(tuner, "tuned", {})
    monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(tuner, "launches", {})
    check_second_order(spec, torch.float16)
    assert tuner.tuned, "the one-pass kernel did not run"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
def test_second_order_is_deterministic_and_writes_every_gradient(dtype) -> None:
    p = make_problem(Spec(hq=2, hkv=1, nq=33, nk=17, d=40, mask="empty_rows", causal=True,
                          layout="bnhd"), dtype, seed=5)
    assert_deterministic(kernel_second_order, p)


@other_backward_paths
def test_second_order_other_paths(spec: Spec, dtype: torch.dtype, path: str) -> None:
    check_other_backward_path(check_second_order, spec, dtype, path)


def test_zero_tangent_cotangent_reduces_to_the_plain_backward() -> None:
    """With dtO = 0 the first three gradients are the plain backward's and dt* vanish."""
    p = make_problem(Spec(hq=2, hkv=1, nq=40, nk=33, d=64, mask="keypad", batch=2,
                          causal=True), torch.float32, seed=6)
    p.grad_tangent_out = torch.zeros_like(p.grad_out)
    second = kernel_second_order(p)
    plain = kernel_backward(p)
    for name in ("dq", "dk", "dv"):
        torch.testing.assert_close(second[name], plain[name], rtol=1e-5, atol=1e-6)
    for name in ("dtq", "dtk", "dtv"):
        assert not second[name].any(), f"{name} must be 0 when dtO = 0"


def test_the_accuracy_rule_catches_a_one_percent_gradient_error() -> None:
    """The gradients' allowance is a few roundings at the problem's scale: an error of 1 % of
    the largest gradient in any one entry of any of the six gradients fails, in both dtypes."""
    for dtype in (torch.float32, torch.float16):
        p = make_problem(Spec(hq=2, hkv=1, nq=17, nk=33, d=40, mask="keypad", batch=2,
                              causal=True), dtype, seed=7)
        truth, floor = expected_second_order(p)
        ours = kernel_second_order(p)
        assert_accurate(ours, truth, floor, dtype, p.label)
        largest = max(t.abs().max().item() for t in truth.values())
        for name in ours:
            off = dict(ours)
            off[name] = ours[name].clone()
            off[name][0, 0, 1, 0] += 0.01 * largest
            with pytest.raises(AssertionError, match=f"{name}: max error"):
                assert_accurate(off, truth, floor, dtype, p.label)


@fuzz_settings("JVP_FUZZ_EXAMPLES_SECOND_ORDER", 30)
@given(**FUZZ_STRATEGIES)
def test_second_order_fuzz(batch, hkv, group, nq, nk, d, dv, causal, mask, dtype, seed) -> None:
    check_second_order(fuzz_spec(batch, hkv, group, nq, nk, d, dv, causal, mask), dtype, seed)


# --- bf16 through exact fp16 copies (notebook 05, `second_order_shifts`) ------------------
# (q, k, v, tq, tk, tv, dO, dtO) multipliers: each limit on the shifts binds in one case.
SECOND_ORDER_CARRY_SCALES = {
    "unit": (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    "large-tangent-scores": (4.0, 4.0, 1.0, 30.0, 30.0, 30.0, 1.0, 1.0),
    "tiny-dtO": (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1e-6),
    "tiny-dO": (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1e-6, 1.0),
    "tiny-tangents": (1.0, 1.0, 1.0, 1e-6, 1e-6, 1e-6, 1.0, 1.0),
    "tq-over-tk": (1.0, 1.0, 1.0, 1e3, 1e-3, 1.0, 1.0, 1.0),
    "large-tv-small-v": (1.0, 1.0, 1e-2, 1.0, 1.0, 1e3, 1.0, 1.0),
    "tiny-inputs": (1e-3, 1e-3, 1e-6, 1e-3, 1e-3, 1e-9, 1e3, 1e2),
}


def _scaled_problem(spec: Spec, scales: str, device: str) -> Problem:
    """A bf16 problem with its inputs scaled by SECOND_ORDER_CARRY_SCALES[scales]."""
    p = make_problem(spec, torch.bfloat16, seed=9, device=device)
    factors = SECOND_ORDER_CARRY_SCALES[scales]
    p.q, p.k, p.v = (x * c for x, c in zip((p.q, p.k, p.v), factors[:3], strict=True))
    p.tangents = tuple(t * c for t, c in zip(p.tangents, factors[3:6], strict=True))
    p.grad_out, p.grad_tangent_out = p.grad_out * factors[6], p.grad_tangent_out * factors[7]
    return p


def _truncated_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 toward zero, as the interpreter converts fp32."""
    bits = x.float().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).double()


@pytest.mark.parametrize("spec, scales", [
    (Spec(hq=2, hkv=1, nq=50, nk=37, d=40, causal=True), "unit"),
    (Spec(batch=2, hq=2, hkv=2, nq=40, nk=40, d=32, mask="keypad", scale=0.3), "unit"),
    (Spec(hq=2, hkv=2, nq=33, nk=33, d=16, dv=24, cotangent="expanded"), "unit"),
    *((Spec(hq=2, hkv=1, nq=40, nk=29, d=32, causal=True), name)
      for name in list(SECOND_ORDER_CARRY_SCALES)[1:]),
    # a loose bound on |tS| must not push dO's copy into float16's subnormals (it did, at
    # 3.9x the floor on dV, when one shift served the whole tangent side)
    (Spec(hq=2, hkv=1, nq=384, nk=384, d=64, causal=True), "large-tangent-scores"),
    # nor may tiny tangent copies (or dtS^) lose their bits to the units of dK's sums
    *((Spec(hq=2, hkv=1, nq=128, nk=128, d=64, causal=True), name)
      for name in ("tiny-tangents", "large-tv-small-v")),
], ids=lambda x: x if isinstance(x, str) else x.id)
@pytest.mark.skipif(HAS_CUDA, reason="checks the interpreter's bf16 (the GPU's: "
                    "test_second_order_gpu)")
def test_bf16_second_order_through_fp16_operands_on_cpu(spec: Spec, scales: str,
                                                        monkeypatch) -> None:
    """In "accurate" mode the bf16 backward through the tangent of long rows runs on exact
    fp16 copies of its eight inputs (forced here at short rows), so it runs correctly in the
    interpreter, whose bf16 conversions truncate: the floor is the float64 truth truncated
    to bf16, the forward's outputs and their residuals come from the float64 reference.
    Inputs scaled far from 1 check that the shifts keep every operand in fp16's range and
    every rounded one in its normal range."""
    monkeypatch.setattr(backward, "carries", lambda q, n_keys: True)
    p = _scaled_problem(spec, scales, "cpu")
    forward_truth, _ = expected_forward(p)
    out, t_out = (forward_truth[n].to(torch.bfloat16) for n in ("out", "tangent_out"))
    residuals = [(forward_truth[n] - x.double()).to(torch.bfloat16)
                 for n, x in (("out", out), ("tangent_out", t_out))]
    with mock.patch.object(backward, "carried_second_order_operands",
                           wraps=backward.carried_second_order_operands) as carried:
        grads = flash_attention_backward(
            p.q, p.k, p.v, out, forward_truth["lse"].float(), p.grad_out, p.attn_mask,
            spec.causal, spec.scale, tangents=p.tangents, tangent_out=t_out,
            mu=forward_truth["mu"].float(), grad_tangent_out=p.grad_tangent_out,
            out_residual=residuals[0], tangent_out_residual=residuals[1])
    assert carried.called
    truth = float64_truth(p.q, p.k, p.v, tangents=p.tangents, grad_out=p.grad_out,
                          grad_tangent_out=p.grad_tangent_out, **p.options,
                          enable_gqa=spec.hq != spec.hkv)
    for name, grad in zip(SECOND_ORDER_NAMES, grads, strict=True):
        floor = (_truncated_to_bf16(truth[name]) - truth[name]).abs().max().item()
        error = (grad.double() - truth[name]).abs().max().item()
        tiny = 2.0**-20 * truth[name].abs().max().item()  # for gradients that are all ~0
        assert error <= 1.25 * floor + tiny, f"{p.label} {name}: {error:.2e} vs {floor:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("scales", SECOND_ORDER_CARRY_SCALES)
def test_bf16_second_order_through_fp16_operands_gpu(scales: str) -> None:
    """bf16 at CARRY_MIN_KEYS keys or more carries the backward through the tangent (chapter
    5): PyTorch's floor, whatever the inputs' scales."""
    p = _scaled_problem(Spec(batch=1, hq=4, hkv=2, nq=1100, nk=1100, d=64, causal=True),
                        scales, "cuda")
    with mock.patch.object(backward, "carried_second_order_operands",
                           wraps=backward.carried_second_order_operands) as carried:
        ours = kernel_second_order(p)
    assert carried.called
    truth, floor = expected_second_order(p)
    assert_accurate(ours, truth, floor, torch.bfloat16, p.label, f"carried, {scales}",
                    cancellation=cancellation_scale(p, second_order=True))


# --- GPU: realistic sizes (one dtype and causal setting per case; see test_forward.py) ---
GPU_CASES = COMMON_GPU_CASES + [
    (Spec(batch=1, hq=8, hkv=2, nq=4250, nk=4250, d=128, mask="keypad", causal=True), BF16),
    (Spec(batch=2, hq=4, hkv=1, nq=4250, nk=1000, d=96, mask="additive", scale=0.2,
          cotangent="tangent_only"), BF16),
    # Head dim 256 with the tangent once needed 299008 B of shared memory on the H200 (limit
    # 232448): fixed by 32 x 32 tiles in c7b1b6d.
    (Spec(batch=1, hq=4, hkv=4, nq=1000, nk=1000, d=256, dv=128, mask="empty_rows",
          layout="bnhd", cotangent="expanded"), F16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("spec, dtype", gpu_params(GPU_CASES))
def test_second_order_gpu(spec: Spec, dtype: torch.dtype) -> None:
    check_second_order(spec, dtype, device="cuda")


# --- a learnable additive mask through the tangent (dL/dB = dS, dL/dtB = dtS; notebook 06) --
@pytest.mark.parametrize("spec, shape, dtype", bias_params())
def test_second_order_with_a_learnable_mask(spec: Spec, shape: str, dtype) -> None:
    """The eight gradients of <dO, O> + <dtO, tO> with a mask tangent: dq..dtv, dmask,
    dmask_tangent."""
    check_with_bias(spec, shape, dtype, grad=True, second_order=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
def test_second_order_mask_gradients_where_no_key_is_seen(dtype) -> None:
    spec = Spec(hq=4, hkv=2, nq=33, nk=17, d=16, causal=True)
    ours = check_with_bias(spec, "full", dtype, grad=True, second_order=True, empty_rows=True)
    p = make_problem(spec, dtype)
    p.attn_mask, _ = make_bias(spec, "full", dtype, empty_rows=True)
    unseen = ~p.visible()
    for name in ("dmask", "dmask_tangent"):
        assert not ours[name][unseen].any(), f"{name} must be 0 where no key is seen"


def test_second_order_needs_the_mask_tangent() -> None:
    """The check has teeth: leaving tB out of the backward (tS without it) or flipping the
    sign of dtS fails it."""
    spec = Spec(batch=2, hq=2, hkv=1, nq=33, nk=17, d=16, causal=True)
    p = make_problem(spec, torch.float32)
    bias, t_bias = make_bias(spec, "2d")
    truth, floor = expected_with_bias(p, bias, t_bias, grad=True, second_order=True)
    ours = kernel_with_bias(p, bias, t_bias, grad=True, second_order=True)
    assert_accurate(ours, truth, floor, torch.float32, p.label)
    with pytest.raises(AssertionError, match="dmask_tangent: max error"):
        assert_accurate({**ours, "dmask_tangent": -ours["dmask_tangent"]}, truth, floor,
                        torch.float32, p.label)
    fwd, (out_res, t_out_res) = flash_attention_forward(
        p.q, p.k, p.v, bias, True, tangents=p.tangents, mask_tangent=t_bias, residuals=True)
    without = flash_attention_backward(
        p.q, p.k, p.v, fwd.out, fwd.lse, p.grad_out, bias, True, tangents=p.tangents,
        tangent_out=fwd.tangent_out, mu=fwd.mu, grad_tangent_out=p.grad_tangent_out,
        out_residual=out_res, tangent_out_residual=t_out_res, mask_grad=True)
    stale = dict(zip(("dq", "dk", "dv", "dtq", "dtk", "dtv", "dmask", "dmask_tangent"),
                     without, strict=True))
    stale = {n: x.sum_to_size(bias.shape) if n.startswith("dmask") else x
             for n, x in stale.items()}
    with pytest.raises(AssertionError, match="max error"):
        assert_accurate(stale, truth, floor, torch.float32, p.label)


def test_second_order_mask_gradients_are_deterministic() -> None:
    p = make_problem(Spec(hq=2, hkv=1, nq=33, nk=17, d=16, causal=True), torch.float16)
    bias, t_bias = make_bias(p.spec, "full", torch.float16)
    assert_deterministic(lambda p, poison: kernel_with_bias(
        p, bias, t_bias, grad=True, second_order=True, poison=poison), p)




@pytest.mark.gpu
@pytest.mark.parametrize("spec, shape, dtype", bias_params(GPU_BIAS_CASES[:2], (F16, BF16)))
def test_second_order_with_a_learnable_mask_gpu(spec: Spec, shape: str, dtype) -> None:
    check_with_bias(spec, shape, dtype, grad=True, second_order=True, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("name", [*KEY_SIDE_PASSES, "_backward_dq_tangent"])
def test_every_second_order_tile_is_reproducible_gpu(name: str, head_dim: int,
                                                     monkeypatch) -> None:
    """Each tile of the second-order lists, forced in turn, gives bitwise the same six
    gradients in five calls (bf16 "accurate", carried): a tile whose compiled form races,
    as 32 x 64 on 4 warps did in the dK pass at d = 128 (chapter 6), cannot return
    unnoticed."""
    p = make_problem(Spec(batch=2, hq=8, hkv=8, nq=1024, nk=1024, d=head_dim), BF16, seed=1,
                     device="cuda")
    assert_every_tile_reproducible(getattr(backward, name), lambda: kernel_second_order(p),
                                   monkeypatch)
