"""The backward through the tangent (`flash_attention_backward` with `grad_tangent_out`): the six
gradients dQ, dK, dV, dtQ, dtK, dtV of a loss on (O, tO), against the float64 reference,
within twice PyTorch's own error (see tests/helpers.py).

This is "reverse over forward", the gradient a consistency-model or MeanFlow loss needs when it
uses the JVP's output: PyTorch's math path computes it with autograd through `torch.func.jvp`.
The kernels run as the autograd layer runs them (with the forward's rounding residuals);
`test_second_order_other_paths` covers the launchers without residuals and in precision "fast".
"""


import pytest
import torch
from helpers import (
    BF16,
    COMMON_GPU_CASES,
    DEVICE,
    F16,
    FUZZ_STRATEGIES,
    GPU_BIAS_CASES,
    Spec,
    assert_accurate,
    assert_deterministic,
    assert_empty_rows_are_zero,
    bias_params,
    cancellation_scale,
    check_other_backward_path,
    check_with_bias,
    cpu_grid,
    dtype_name,
    expected_second_order,
    expected_with_bias,
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


@pytest.mark.parametrize("spec", [Spec(nq=45, nk=70, causal=True),
                                  Spec(hq=4, hkv=2, nq=70, nk=45, mask="bool"),
                                  Spec(nq=33, nk=33, d=24, dv=40)], ids=lambda s: s.id)
def test_second_order_with_query_blocks_narrower_than_key_blocks(spec: Spec,
                                                                 monkeypatch) -> None:
    """The GPU lists' 16 x 32 dK/dV tile (chapter 5) has query blocks narrower than its key
    blocks, the reverse of the interpreter's 32 x 16: run that shape through both passes."""
    import triton

    import jvp_attention.backward as backward

    tuners = (backward._backward_dv_tangent, backward._backward_dk_tangent)
    for tuner in tuners:
        monkeypatch.setattr(tuner, "configs", [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32},
                                                             num_warps=4, num_stages=2)])
        monkeypatch.setattr(tuner, "tuned", {})
        monkeypatch.setattr(tuner, "cache", {})
        monkeypatch.setattr(tuner, "launches", {})  # launches remembered with their tiles
    check_second_order(spec, torch.float32)
    for tuner in tuners:
        assert (tuner.best_config.kwargs["BLOCK_M"], tuner.best_config.kwargs["BLOCK_N"]) == (16, 32)


@pytest.mark.parametrize("spec", [Spec(hq=4, hkv=2, nq=45, nk=70, causal=True),
                                  Spec(nq=33, nk=40, d=24, dv=40, mask="additive")],
                         ids=lambda s: s.id)
def test_second_order_in_one_key_side_pass(spec: Spec, monkeypatch) -> None:
    """SPLIT_KEY_SIDE = False: dK, dV, dtK and dtV from one pass over the queries (four
    accumulators), as before the split; same accuracy."""
    import jvp_attention.backward as backward

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
