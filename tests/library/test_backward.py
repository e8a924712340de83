"""The backward kernels (`flash_attention_backward` without tangents): dQ, dK, dV against the
float64 reference, within twice PyTorch's own error (see tests/helpers.py).

The kernels differentiate their own forward: its saved O and LSE and, as the autograd layer
runs them, the rounding residuals of O (`test_backward_other_paths` covers the launchers without
residuals and in precision "fast").
"""


import pytest
import torch
from helpers import (
    BF16,
    BIAS_CASES,
    COMMON_GPU_CASES,
    DEVICE,
    F16,
    F32,
    FUZZ_STRATEGIES,
    GPU_BIAS_CASES,
    HAS_CUDA,
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
    expected_backward,
    expected_forward,
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
    precision,
)
from hypothesis import given

import jvp_attention.backward
from jvp_attention.backward import flash_attention_backward
from jvp_attention.forward import flash_attention_forward

# Tiny tensors: one intra-op thread is ~10x faster than a contended pool (conftest).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_backward(spec: Spec, dtype: torch.dtype, seed: int = 0, device: str = DEVICE,
                   residuals: bool = True) -> None:
    """dq, dk, dv accurate, finite everywhere, and dq zero on rows that see no key."""
    p = make_problem(spec, dtype, seed, device)
    truth, floor = expected_backward(p)
    ours = kernel_backward(p, residuals=residuals)
    cancellation = cancellation_scale(p)
    assert_accurate(ours, truth, floor, dtype, p.label, "backward",
                    cancellation=cancellation)
    assert_empty_rows_are_zero(p, ours)


@pytest.mark.parametrize("spec, dtype", cpu_grid())
def test_backward_grid(spec: Spec, dtype: torch.dtype) -> None:
    check_backward(spec, dtype)


@pytest.mark.parametrize("spec", [
    Spec(hq=2, hkv=1, nq=33, nk=17, d=40, mask="empty_rows", causal=True),
    Spec(batch=2, hq=2, hkv=1, nq=17, nk=40, d=64, layout="bnhd", cotangent="expanded"),
], ids=lambda s: s.id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
def test_backward_is_deterministic_and_writes_every_gradient(spec: Spec, dtype) -> None:
    """No atomics: two runs whose outputs start as different garbage agree bit for bit."""
    p = make_problem(spec, dtype, seed=4)
    assert_deterministic(kernel_backward, p)


@other_backward_paths
def test_backward_other_paths(spec: Spec, dtype: torch.dtype, path: str) -> None:
    check_other_backward_path(check_backward, spec, dtype, path)


@pytest.mark.parametrize("max_keys", [0, 1 << 20], ids=["stored", "transposed"])
@pytest.mark.parametrize("spec", [
    Spec(hq=4, hkv=2, nq=33, nk=40, d=24, dv=40, mask="keypad", causal=True),
    Spec(nq=17, nk=33, d=72, mask="additive", layout="bnhd"),
], ids=lambda s: s.id)
def test_key_gradients_in_either_layout(spec: Spec, max_keys: int, monkeypatch) -> None:
    """The first-order dK/dV kernel accumulates a key block's gradients as stored (keys x d)
    or transposed (d x keys) by the keys per row (`TRANSPOSED_MAX_KEYS`); both are accurate,
    and the launch takes the layout asked for."""
    import jvp_attention.backward as backward
    from jvp_attention.launch import AUTOTUNE_KEYS

    tuner = backward._backward_dkdv
    monkeypatch.setattr(backward, "TRANSPOSED_MAX_KEYS", max_keys)
    monkeypatch.setattr(tuner, "tuned", {})
    monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(tuner, "launches", {})  # launches remembered with their tiles
    check_backward(spec, torch.float16)
    assert {key[len(AUTOTUNE_KEYS)] for key in tuner.tuned} == {max_keys > 0}


def test_gqa_gradients_sum_over_the_group() -> None:
    """dK, dV of a shared key/value head equal the sum over its query heads' gradients taken
    with the heads repeated (the in-kernel GQA sum against an explicit one)."""
    p = make_problem(Spec(hq=4, hkv=2, nq=33, nk=17, d=16, causal=True), torch.float32)
    grouped = kernel_backward(p)
    p.k, p.v = (x.repeat_interleave(2, dim=1) for x in (p.k, p.v))
    p.spec = p.spec.with_(hkv=4)
    repeated = kernel_backward(p)
    torch.testing.assert_close(grouped["dq"], repeated["dq"], rtol=0, atol=1e-6)
    for name in ("dk", "dv"):
        summed = repeated[name].unflatten(1, (2, 2)).sum(2)
        torch.testing.assert_close(grouped[name], summed, rtol=1e-5, atol=1e-6)


def test_columns_at_other_strides_give_the_same_gradients() -> None:
    """Inputs, tangents and cotangents whose last dimension is not contiguous (copied by
    the launcher: the kernels read columns at unit stride) give the contiguous tensors'
    gradients bit for bit, first order and through the tangent."""
    p = make_problem(Spec(batch=1, hq=2, hkv=1, nq=19, nk=11, d=16, dv=24, mask="keypad",
                          causal=True), torch.float32)
    contiguous = kernel_backward(p), kernel_second_order(p)
    p.q, p.k, p.v, p.grad_out, p.grad_tangent_out = (
        x.mT.contiguous().mT for x in (p.q, p.k, p.v, p.grad_out, p.grad_tangent_out))
    p.tangents = tuple(x.mT.contiguous().mT for x in p.tangents)
    assert all(x.stride(-1) != 1 for x in (p.q, p.k, p.v, p.grad_out, *p.tangents))
    strided = kernel_backward(p), kernel_second_order(p)
    for ours, theirs in zip(strided, contiguous, strict=True):
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), name


@fuzz_settings("JVP_FUZZ_EXAMPLES", 100)
@given(**FUZZ_STRATEGIES)
def test_backward_fuzz(batch, hkv, group, nq, nk, d, dv, causal, mask, dtype, seed) -> None:
    check_backward(fuzz_spec(batch, hkv, group, nq, nk, d, dv, causal, mask), dtype, seed)


# --- GPU: realistic sizes (one dtype and causal setting per case; see test_forward.py) ---
GPU_CASES = COMMON_GPU_CASES + [
    (Spec(batch=1, hq=8, hkv=2, nq=4250, nk=4250, d=128, mask="keypad", causal=True,
          cotangent="expanded"), BF16),
    (Spec(batch=1, hq=4, hkv=1, nq=1000, nk=4250, d=96, mask="keypad"), F16),
    (Spec(batch=2, hq=4, hkv=4, nq=1000, nk=1000, d=192, dv=128, mask="additive4d",
          causal=True), BF16),
    (Spec(batch=1, hq=4, hkv=4, nq=1000, nk=1000, d=256, mask="empty_rows"), F16),
    (Spec(batch=1, hq=2, hkv=2, nq=8191, nk=8191, d=128, mask="bool", layout="bnhd",
          cotangent="bnhd"), BF16),
    (Spec(batch=2, hq=4, hkv=2, nq=4250, nk=1000, d=64, mask="empty_batch", causal=True,
          scale=0.2), F32),
    # bf16 at 1024 keys or more carries (chapter 5), with a head dim the forward cuts in two
    (Spec(batch=2, hq=4, hkv=2, nq=1100, nk=1100, d=72, causal=True), BF16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("spec, dtype", gpu_params(GPU_CASES))
def test_backward_gpu(spec: Spec, dtype: torch.dtype) -> None:
    check_backward(spec, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_gpu_16k(causal: bool) -> None:
    check_backward(Spec(batch=1, hq=4, hkv=4, nq=16384, nk=16384, d=128, causal=causal),
                   torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("name", ["_backward_dq", "_backward_dkdv"])
def test_every_backward_tile_is_reproducible_gpu(name: str, head_dim: int,
                                                 monkeypatch) -> None:
    """Each tile of the first-order backward's lists (the Triton kernels: chapter 12's
    warp-specialized backward switched off), forced in turn, gives bitwise the same dQ, dK
    and dV in five calls (bf16 "accurate", carried)."""
    monkeypatch.setenv("JVP_ATTENTION_WARP_SPECIALIZED", "0")
    p = make_problem(Spec(batch=2, hq=8, hkv=8, nq=1024, nk=1024, d=head_dim), BF16, seed=1,
                     device="cuda")
    assert_every_tile_reproducible(getattr(jvp_attention.backward, name),
                                   lambda: kernel_backward(p), monkeypatch)


@pytest.mark.gpu
def test_backward_gpu_is_deterministic() -> None:
    p = make_problem(Spec(batch=1, hq=8, hkv=2, nq=4250, nk=4250, d=128, mask="keypad",
                          causal=True, cotangent="expanded"), torch.bfloat16, device="cuda")
    assert_deterministic(kernel_backward, p)


def _truncated_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 toward zero, as the interpreter converts fp32 (the GPU rounds to
    nearest)."""
    bits = x.float().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).double()


# (q, k, v, dO) multipliers: the shifts must bring each into fp16's range, and dS with them.
CARRY_SCALES = {"unit": (1.0, 1.0, 1.0, 1.0), "tiny-dO-large-v": (1.0, 1.0, 1e3, 1e-8),
                "large-scores": (6.0, 6.0, 1.0, 1.0), "tiny-inputs": (1e-3, 1e-3, 1e-6, 1e3)}


@pytest.mark.parametrize("spec, scales", [
    (Spec(hq=2, hkv=1, nq=50, nk=37, d=40, causal=True), "unit"),
    (Spec(batch=2, hq=2, hkv=2, nq=40, nk=40, d=64, mask="keypad", scale=0.3), "unit"),
    (Spec(hq=2, hkv=2, nq=33, nk=33, d=16, cotangent="expanded"), "unit"),
    *((Spec(hq=2, hkv=1, nq=40, nk=29, d=32, causal=True), name)
      for name in ("tiny-dO-large-v", "large-scores", "tiny-inputs")),
], ids=lambda x: x if isinstance(x, str) else x.id)
@pytest.mark.skipif(HAS_CUDA, reason="checks the interpreter's bf16 (the GPU's bf16 gradients: "
                    "test_backward_gpu)")
def test_bf16_gradients_through_fp16_operands_on_cpu(spec: Spec, scales: str,
                                                     monkeypatch) -> None:
    """In "accurate" mode the bf16 backward of long rows runs on exact fp16 copies of q, k, v
    and dO (notebook 05; forced here at short rows), so, unlike other bf16 kernels, it runs
    correctly in the interpreter. The
    interpreter truncates fp32 to bf16 where the GPU rounds, so the floor here is the float64
    truth truncated the same way; the forward's outputs come from the float64 reference.
    Inputs scaled far from 1 check that the shifts keep every operand in fp16's range."""
    monkeypatch.setattr(jvp_attention.backward, "carries", lambda q, n_keys: True)
    p = make_problem(spec, torch.bfloat16, seed=8, device="cpu")
    q_scale, k_scale, v_scale, do_scale = CARRY_SCALES[scales]
    p.q, p.k, p.v = (x * c for x, c in ((p.q, q_scale), (p.k, k_scale), (p.v, v_scale)))
    p.grad_out = p.grad_out * do_scale
    forward_truth, _ = expected_forward(p, with_tangents=False)
    out = forward_truth["out"].to(torch.bfloat16)
    residual = (forward_truth["out"] - out.double()).to(torch.bfloat16)
    grads = flash_attention_backward(p.q, p.k, p.v, out, forward_truth["lse"].float(),
                                     p.grad_out, p.attn_mask, spec.causal, spec.scale,
                                     out_residual=residual)
    truth, _ = expected_backward(p)
    for name, grad in zip(("dq", "dk", "dv"), grads, strict=True):
        floor = (_truncated_to_bf16(truth[name]) - truth[name]).abs().max().item()
        error = (grad.double() - truth[name]).abs().max().item()
        tiny = 2.0**-20 * truth[name].abs().max().item()  # for gradients that are all ~0
        assert error <= 1.25 * floor + tiny, f"{p.label} {name}: {error:.2e} vs {floor:.2e}"


@pytest.mark.parametrize("with_residual", [False, True], ids=["stored-O", "residual"])
@pytest.mark.parametrize("layout", ["contiguous", "strided-dO", "gqa-d40", "padded-dO-d40"])
def test_carried_copies_write_delta(layout: str, with_residual: bool) -> None:
    """The carried backward's copy kernel also writes Delta = rowsum(dO * O), with O's
    rounding residual added back when there is one: the row-statistics launch it replaces
    computes the same fp32 sums."""
    torch.manual_seed(3)
    batch, heads, kv_heads, n, d = (2, 4, 2, 37, 40) if "d40" in layout else (2, 3, 3, 45, 32)
    q = torch.randn(batch, heads, n, d, dtype=torch.float16, device=DEVICE)
    k, v = (torch.randn(batch, kv_heads, n, d, dtype=torch.float16, device=DEVICE)
            for _ in range(2))
    out = torch.randn(batch, heads, n, d, dtype=torch.float16, device=DEVICE)
    residual = (1e-3 * torch.randn_like(out)) if with_residual else None
    grad_out = torch.randn(batch, heads, n, d, dtype=torch.float16, device=DEVICE)
    if layout == "strided-dO":  # (B, N, H, D) memory seen as (B, H, N, D)
        grad_out = grad_out.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "padded-dO-d40":  # rows d + 3 elements apart: no alignment to rely on
        grad_out = torch.cat([grad_out, torch.zeros_like(grad_out[..., :3])], -1)[..., :d]
    delta = torch.full((batch, heads, n), float("nan"), device=DEVICE)
    jvp_attention.backward.backward_operands(q, k, v, grad_out, out, residual, delta)
    o = out.double() + (residual.float().double() if with_residual else 0.0)
    terms = grad_out.double() * o.float().double()  # O + residual is summed in fp32 first
    # an fp32 sum of d products: within d unit roundoffs of their absolute sum, any order
    bound = d * 2.0**-24 * terms.abs().sum(-1)
    assert ((delta.double() - terms.sum(-1)).abs() <= bound).all()


def _copy_kernel_inputs(layout: str, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, O and dO (fp16) for the backward's copy launch: contiguous, or with GQA and
    a head dim that is not a power of two ("gqa-d40")."""
    torch.manual_seed(seed)
    batch, heads, kv_heads, n, d = (2, 4, 2, 37, 40) if "d40" in layout else (2, 3, 3, 45, 32)
    q, out, grad_out = (torch.randn(batch, heads, n, d, dtype=torch.float16, device=DEVICE)
                        for _ in range(3))
    k, v = (torch.randn(batch, kv_heads, n, d, dtype=torch.float16, device=DEVICE)
            for _ in range(2))
    return q, k, v, out, grad_out


@pytest.mark.parametrize("with_residual", [False, True], ids=["stored-O", "residual"])
@pytest.mark.parametrize("layout", ["contiguous", "gqa-d40"])
def test_carried_copies_zero_the_dq_sum(layout: str, with_residual: bool) -> None:
    """Asked to, the copy kernel also zeros the fp32 sum that chapter 12's dK/dV kernel adds
    dQ into (q's shape: every query row, whatever the key heads), in place of a fill
    launch, and writes the same copies, factors and Delta as without it."""
    q, k, v, out, grad_out = _copy_kernel_inputs(layout, seed=4)
    residual = (1e-3 * torch.randn_like(out)) if with_residual else None
    results = []
    for zero in (False, True):
        delta = torch.full(q.shape[:3], float("nan"), device=DEVICE)
        dq_sum = torch.full(q.shape, float("nan"), device=DEVICE) if zero else None
        copies = jvp_attention.backward.backward_operands(q, k, v, grad_out, out, residual,
                                                          delta, dq_sum)
        results.append((*copies, delta))
    assert (dq_sum == 0).all()
    for without, with_zeros in zip(*results, strict=True):
        assert torch.equal(without, with_zeros)


@pytest.mark.parametrize("layout", ["contiguous", "gqa-d40"])
def test_carried_copies_flat_where_no_epilogue_reads_rows(layout: str, monkeypatch) -> None:
    """The copy launch copies Q, K and V as flat arrays (no padded columns, no row
    arithmetic) and dO by rows, which Delta's epilogue reads: the same copies, factors and
    Delta, bit for bit, as copying all four by rows."""
    q, k, v, out, grad_out = _copy_kernel_inputs(layout, seed=5)
    flat_bits, cached = [], jvp_attention.launch.cached

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if self.kernel is jvp_attention.launch.carried_copies_kernel:
                    flat_bits.append(kwargs["FLAT"])
                return cached(self.kernel)[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(jvp_attention.launch, "cached", Spy)
    results = []
    for rows in (jvp_attention.backward.DELTA_ROWS, (0, 1, 2, 3)):
        monkeypatch.setattr(jvp_attention.backward, "DELTA_ROWS", rows)
        delta = torch.full(q.shape[:3], float("nan"), device=DEVICE)
        copies = jvp_attention.backward.backward_operands(q, k, v, grad_out, out, None, delta)
        results.append((*copies, delta))
    assert flat_bits == [0b0111, 0]
    for flat, by_rows in zip(*results, strict=True):
        assert torch.equal(flat, by_rows)


# --- the gradient of an additive mask (learnable biases: dL/dB = dS; notebook 05) ----------
# The launcher returns dS as (B, Hq, Nq, Nk) in the mask's dtype; the tests sum it over the
# dimensions the bias was broadcast along (as autograd of `expand` will) and compare with
# float64 autograd.
@pytest.mark.parametrize("spec, shape, dtype", bias_params())
def test_backward_mask_gradient(spec: Spec, shape: str, dtype: torch.dtype) -> None:
    check_with_bias(spec, shape, dtype, grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
def test_mask_gradient_is_zero_where_no_key_is_seen(dtype: torch.dtype) -> None:
    """Rows that see no key, -inf biases and the causal band: dmask exactly 0 there, and
    finite everywhere (the dQ kernel stores zeros above the band into an unfilled buffer)."""
    spec = Spec(hq=2, hkv=1, nq=33, nk=40, d=16, causal=True)
    ours = check_with_bias(spec, "full", dtype, grad=True, empty_rows=True)
    p = make_problem(spec, dtype)
    p.attn_mask, _ = make_bias(spec, "full", dtype, empty_rows=True)
    unseen = ~p.visible()
    assert p.empty_rows().any() and not ours["dmask"][unseen].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
def test_mask_gradient_of_a_bias_shared_by_the_heads(dtype: torch.dtype) -> None:
    """A (B, 1, Nq, Nk) bias (one per sample, as a padding mask made learnable): its
    gradient is dS summed over the heads, the backward's programs taking the heads fastest
    (only a bias shared by the batch takes the batch fastest)."""
    check_with_bias(Spec(batch=3, hq=4, hkv=2, nq=33, nk=40, d=16, causal=True), "batch",
                    dtype, grad=True)


def test_mask_gradient_of_an_fp32_mask_with_fp16_inputs() -> None:
    check_with_bias(Spec(batch=2, hq=2, hkv=1, nq=17, nk=33, d=16), "2d", torch.float16,
                    grad=True, mask_dtype=torch.float32)


@pytest.mark.parametrize("spec, shape", BIAS_CASES[::2], ids=lambda x: getattr(x, "id", x))
def test_carried_mask_gradient_forced_in_fp16(spec: Spec, shape: str, monkeypatch) -> None:
    """The first-order carry keeps a learnable mask's gradient (fp16 forced down the
    carrying path, as in test_forward): the dQ kernel brings dS back from its carried
    units, 2**e_ds with e_ds = 8 + e_o + e_v, before storing it."""
    monkeypatch.setattr(jvp_attention.backward, "carries", lambda q, n_keys: True)
    carried = []
    operands = jvp_attention.backward.carried_backward_operands
    monkeypatch.setattr(jvp_attention.backward, "carried_backward_operands",
                        lambda *args: carried.append(1) or operands(*args))
    check_with_bias(spec, shape, torch.float16, grad=True)
    assert carried, "the call did not carry"


def test_the_mask_gradient_check_catches_a_wrong_sign() -> None:
    spec = Spec(batch=2, hq=2, hkv=2, nq=33, nk=17, d=16, causal=True)
    p = make_problem(spec, torch.float32)
    bias, _ = make_bias(spec, "2d")
    truth, floor = expected_with_bias(p, bias, None, grad=True)
    ours = kernel_with_bias(p, bias, None, grad=True)
    assert_accurate(ours, truth, floor, torch.float32, p.label)
    with pytest.raises(AssertionError, match="dmask: max error"):
        assert_accurate({**ours, "dmask": -ours["dmask"]}, truth, floor, torch.float32,
                        p.label)


def test_mask_gradient_needs_an_additive_mask() -> None:
    p = make_problem(Spec(nq=17, nk=17, d=16, mask="bool"), torch.float32)
    fwd = flash_attention_forward(p.q, p.k, p.v, **p.options)
    for mask in (p.attn_mask, None):
        with pytest.raises(ValueError, match="mask_grad needs an additive"):
            flash_attention_backward(p.q, p.k, p.v, fwd.out, fwd.lse, p.grad_out, mask,
                                     mask_grad=True)


def test_mask_gradient_is_deterministic() -> None:
    p = make_problem(Spec(hq=2, hkv=1, nq=33, nk=17, d=16, causal=True), torch.float16)
    bias, _ = make_bias(p.spec, "full", torch.float16)
    assert_deterministic(lambda p, poison: kernel_with_bias(p, bias, None, grad=True,
                                                            poison=poison), p)


def test_backward_precision_argument_overrides_the_global_mode() -> None:
    p = make_problem(Spec(hq=2, hkv=1, nq=33, nk=17, d=16, causal=True), torch.float16)
    fwd = flash_attention_forward(p.q, p.k, p.v, **p.options)
    args = (p.q, p.k, p.v, fwd.out, fwd.lse, p.grad_out, None, True)
    with precision("accurate"):
        per_call = flash_attention_backward(*args, precision="fast")
        accurate = flash_attention_backward(*args)
    with precision("fast"):
        global_fast = flash_attention_backward(*args)
    assert all(torch.equal(a, b) for a, b in zip(per_call, global_fast, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(per_call, accurate, strict=True))
    with pytest.raises(ValueError, match="precision"):
        flash_attention_backward(*args, precision="exact")




@pytest.mark.gpu
@pytest.mark.parametrize("spec, shape, dtype", bias_params(GPU_BIAS_CASES, (F16, BF16, F32)))
def test_backward_mask_gradient_gpu(spec: Spec, shape: str, dtype: torch.dtype) -> None:
    """bf16 with 1100 keys carries: the first-order backward keeps the mask's gradient
    through the fp16 copies (notebook 05)."""
    check_with_bias(spec, shape, dtype, grad=True, device="cuda")
