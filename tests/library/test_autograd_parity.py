"""SDPA parity of the public API: every call a real model makes either gives PyTorch's answer
(within the accuracy rule of tests/helpers.py) or raises, on every path a user can reach:
eager, compiled, the drop-in, the kernels (GPU or interpreter) and the PyTorch fallback.

Each test here failed before the parity work: the compiled tangent was zero, a float mask's
gradient was None and its tangent dropped, float32 masks with 16-bit queries raised, empty
inputs raised, the fallback and the kernels accepted different calls, the drop-in fell
through silently (and then raised under forward-mode AD), the backward read the precision
mode of its own time, and autocast's mixed dtypes were refused.
"""

import math
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DEVICE,
    HAS_CUDA,
    Spec,
    allowed_error,
    assert_accurate,
    expected_with_bias,
    make_bias,
    make_problem,
    precision,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvp_attention
import jvp_attention.autograd as api
from jvp_attention import attention, attention_jvp, sdpa
from jvp_attention.launch import interpreting

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The paths of a CPU machine: the kernels in Triton's interpreter (what CI runs), and the
# PyTorch fallback (what a CPU machine without TRITON_INTERPRET runs). On a GPU: the kernels.
PATHS = ["kernels", "fallback"] if not HAS_CUDA else ["kernels"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Run the test on the kernels, or on the PyTorch fallback (the kernels switched off)."""
    if request.param == "fallback":
        monkeypatch.setattr(api, "uses_kernels", lambda query, key, value: False)
    return request.param


def leaves(*tensors):
    return [x.detach().clone().requires_grad_() for x in tensors]


# --- 1. torch.compile around torch.func.jvp ------------------------------------------------


def test_compiled_jvp_with_trainable_parameters_matches_eager() -> None:
    """A MeanFlow-style loss compiled whole: torch.func.jvp through a model whose parameters
    require grad, then a backward. The tangent was all zeros under compile (and with
    parameters compilation failed); now every output and gradient equals eager mode's, the
    backward runs on the kernels (never the reference), and fullgraph=True holds."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 48, device=DEVICE)
    x, tx = torch.randn(2, 12, 16, device=DEVICE), torch.randn(2, 12, 16, device=DEVICE)

    def model(x):
        q, k, v = lin(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return attention(q, k, v, is_causal=True)

    def loss(x, tx):
        out, t_out = torch.func.jvp(model, (x,), (tx,))
        return out.square().sum() + (t_out * out.detach()).sum(), t_out

    results = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        lin.zero_grad()
        with mock.patch.object(api, "reference_attention",
                               side_effect=AssertionError("reference used")):
            value, t_out = fn(x, tx)
            value.backward()
        results.append((value.detach(), t_out.detach(), lin.weight.grad.clone()))
    (eager_value, eager_tangent, eager_grad), (value, tangent, grad) = results
    assert eager_tangent.abs().max() > 0.1
    torch.testing.assert_close(tangent, eager_tangent, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(value, eager_value, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_jvp_step_on_the_gpu(mode: str) -> None:
    """The same loss under inductor (and CUDA graphs): outputs and gradients as in eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 256, 64, device="cuda", dtype=torch.bfloat16)
    tx = torch.randn_like(x)

    def loss(x, tx):
        def model(x):
            q, k, v = lin(x).unflatten(-1, (3, 4, 16)).permute(2, 0, 3, 1, 4)
            return attention(q, k, v)

        out, t_out = torch.func.jvp(model, (x,), (tx,))
        return out.float().square().mean() + (t_out.float() * out.detach().float()).mean()

    compiled = torch.compile(loss, mode=mode)
    results = []
    for fn in (loss, compiled, compiled, compiled):  # CUDA graphs record, then replay
        torch.compiler.cudagraph_mark_step_begin()
        lin.zero_grad()
        value = fn(x, tx)
        value.backward()
        # clones: a replay overwrites the graph's outputs in place
        results.append((value.detach().float().clone(), lin.weight.grad.float().clone()))
    for value, grad in results[1:]:
        torch.testing.assert_close(value, results[0][0], rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(grad, results[0][1], rtol=5e-2, atol=5e-3)


def _changing_lengths(lengths, backend: str, dtype: torch.dtype, device: str):
    """A compiled MeanFlow-style loss (torch.func.jvp through causal GQA attention with a
    learnable bias, then a backward through the output, the tangent a stopped target)
    called at each of `lengths`, and the same loss in eager mode: [(compiled, eager)] of
    (loss, grads of q, k, v and the bias) per length, and the number of graphs compiled.
    With `dynamic=None`, PyTorch's default, the second length recompiles with the sequence
    length symbolic, and that graph serves the lengths after it."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def loss(q, k, v, tq, tk, tv, bias):
        def attend(q, k, v):
            return attention(q, k, v, attn_mask=bias, is_causal=True, enable_gqa=True)

        out, t_out = torch.func.jvp(attend, (q, k, v), (tq, tk, tv))
        return (out.float() - t_out.detach().float()).square().sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(loss, backend=counter)
    torch.manual_seed(0)
    results = []
    for n in lengths:
        q, tq = (torch.randn(2, 4, n, 16, device=device, dtype=dtype) for _ in range(2))
        k, v, tk, tv = (torch.randn(2, 2, n, 16, device=device, dtype=dtype) for _ in range(4))
        bias = torch.randn(2, 1, n, n, device=device, dtype=dtype)
        pair = []
        for fn in (compiled, loss):
            xs = leaves(q, k, v, bias)
            value = fn(*xs[:3], tq, tk, tv, xs[3])
            value.backward()
            pair.append((value.detach(), *[x.grad for x in xs]))
        results.append(pair)
    return results, counter.frame_count


def test_compiled_jvp_at_changing_lengths_matches_eager() -> None:
    """Training at several sequence lengths (multi-resolution DiTs, video): the compiled
    loss, static at the first length and with the length symbolic from the second, gives
    eager mode's loss and gradients at each, and compiles two graphs for three lengths."""
    results, graphs = _changing_lengths((16, 24, 33), "aot_eager", torch.float32, DEVICE)
    for compiled, eager in results:
        for got, expected in zip(compiled, eager, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert graphs == 2


@pytest.mark.gpu
def test_compiled_jvp_at_changing_lengths_on_the_gpu() -> None:
    """The same under inductor on the GPU, where the graph traces the kernels' launches
    (chapter 7) with the length symbolic, across the lengths where the launches change
    (1024 keys: the bf16 carry; 4096: tensor descriptors)."""
    results, graphs = _changing_lengths((256, 384, 1100, 4200), "inductor", torch.bfloat16,
                                        "cuda")
    for compiled, eager in results:
        for got, expected in zip(compiled, eager, strict=True):
            torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert graphs <= 4


def test_torch_export_of_a_model_matches_eager() -> None:
    """torch.export of a module that calls attention (inference, as deployment exports it):
    the exported program keeps the library's operator and gives eager mode's output, with
    static shapes and with batch and length dynamic (run at a shape it was not traced at).
    (A torch.func.jvp inside torch.export fails in PyTorch itself: "Nested forward mode AD is
    not supported", whatever the model.)"""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48, device=DEVICE)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
            return attention(q, k, v, is_causal=True)

    block, x = Block(), torch.randn(2, 12, 16, device=DEVICE)
    static = torch.export.export(block, (x,))
    assert any("jvp_attention" in str(node.target) for node in static.graph.nodes)
    torch.testing.assert_close(static.module()(x), block(x), rtol=1e-5, atol=1e-5)
    dims = {"x": {0: torch.export.Dim("batch"), 1: torch.export.Dim("tokens", min=2)}}
    dynamic = torch.export.export(block, (x,), dynamic_shapes=dims)
    other = torch.randn(3, 20, 16, device=DEVICE)
    torch.testing.assert_close(dynamic.module()(other), block(other), rtol=1e-5, atol=1e-5)


# --- 2. a float mask with a tangent and a gradient -----------------------------------------

MASK_SPECS = [
    Spec(batch=2, hq=4, hkv=2, nq=13, nk=19, d=16, causal=True),
    Spec(nq=17, nk=11, d=16, dv=8, scale=0.4),
]


@pytest.mark.parametrize("shape", ["full", "head", "2d"])
@pytest.mark.parametrize("spec", MASK_SPECS, ids=[s.id for s in MASK_SPECS])
def test_learnable_bias_tangent_and_gradient(spec: Spec, shape: str, path: str) -> None:
    """A learnable additive bias (relative positions, ALiBi) broadcast over batch and heads:
    under torch.func.jvp its tangent adds to the scores' tangent, and a loss on both outputs
    gives it (and its tangent) gradients summed over the broadcast dimensions."""
    p = make_problem(spec, torch.float32)
    bias, t_bias = make_bias(spec, shape)
    xs = leaves(p.q, p.k, p.v, bias, *p.tangents, t_bias)
    opts = {"is_causal": spec.causal, "scale": spec.scale, "enable_gqa": spec.hq != spec.hkv}
    out, tangent_out = torch.func.jvp(
        lambda q, k, v, b: attention(q, k, v, attn_mask=b, **opts), tuple(xs[:4]),
        tuple(xs[4:]))
    torch.autograd.backward((out, tangent_out), (p.grad_out, p.grad_tangent_out))
    truth, floor = expected_with_bias(p, bias, t_bias)
    names = ("out", "tangent_out")
    assert_accurate({"out": out.detach(), "tangent_out": tangent_out.detach()},
                    {n: truth[n] for n in names}, {n: floor[n] for n in names}, p.dtype,
                    p.label, f"{path}: jvp with a bias tangent")
    truth, floor = expected_with_bias(p, bias, t_bias, grad=True, second_order=True)
    grads = dict(zip(("dq", "dk", "dv", "dmask", "dtq", "dtk", "dtv", "dmask_tangent"),
                     (x.grad for x in xs), strict=True))
    assert grads["dmask"] is not None and grads["dmask"].shape == bias.shape
    assert_accurate(grads, truth, floor, p.dtype, p.label, f"{path}: bias gradients")


@pytest.mark.parametrize("shape", ["head", "2d", "batch"])
def test_learnable_bias_gradient_of_a_plain_backward(shape: str, path: str) -> None:
    """A learnable bias without a tangent (MeanFlow's case: a parameter), shared by the
    batch, by everything, or by the heads (one per sample): its gradient through a plain
    backward, summed over the dimensions it broadcasts along."""
    spec = MASK_SPECS[0]
    p = make_problem(spec, torch.float32)
    bias, _ = make_bias(spec, shape)
    q, k, v, b = leaves(p.q, p.k, p.v, bias)
    attention(q, k, v, attn_mask=b, is_causal=True, enable_gqa=True).backward(p.grad_out)
    truth, floor = expected_with_bias(p, bias, None, grad=True)
    assert_accurate({"dq": q.grad, "dk": k.grad, "dv": v.grad, "dmask": b.grad}, truth,
                    floor, p.dtype, p.label, f"{path}: plain backward with a bias")


def test_alibi_slopes_through_a_broadcast_bias(path: str) -> None:
    """ALiBi: bias = slope[h] * -(i - j); the slopes' gradient and tangent flow through the
    user's own broadcast, as with PyTorch's math path."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 16, device=DEVICE) for _ in range(3))
    distance = -(torch.arange(10, device=DEVICE)[:, None] - torch.arange(10, device=DEVICE))
    distance = distance.abs().float()

    def loss(attend, slopes, t_slopes):
        def f(s):
            return attend(q, k, v, attn_mask=s[:, None, None] * distance)
        out, t_out = torch.func.jvp(f, (slopes,), (t_slopes,))
        return out.square().sum() + t_out.square().sum(), t_out

    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE, requires_grad=True)
    ref_slopes = slopes.detach().double().requires_grad_()
    value, t_out = loss(attention, slopes, torch.ones_like(slopes))
    value.backward()
    with sdpa_kernel(SDPBackend.MATH):
        want, want_t = loss(lambda q_, k_, v_, attn_mask: F.scaled_dot_product_attention(
            q_.double(), k_.double(), v_.double(), attn_mask=attn_mask), ref_slopes,
            torch.ones_like(ref_slopes))
    want.backward()
    torch.testing.assert_close(t_out.double(), want_t, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(slopes.grad.double(), ref_slopes.grad, rtol=1e-4, atol=1e-5)


# --- 3. a float32 mask with 16-bit queries ------------------------------------------------


def test_float32_mask_with_float16_queries(path: str) -> None:
    """What autocast produces: PyTorch accepts a mask of bool, float32 or query's dtype."""
    spec = MASK_SPECS[1]
    p = make_problem(spec, torch.float16)
    bias, t_bias = make_bias(spec, "2d", dtype=torch.float32)
    out, tangent_out = torch.func.jvp(
        lambda q, k, v: attention(q, k, v, attn_mask=bias, scale=spec.scale), (p.q, p.k, p.v),
        p.tangents)
    assert out.dtype == torch.float16
    truth, floor = expected_with_bias(p, bias, torch.zeros_like(bias))
    names = ("out", "tangent_out")
    assert_accurate({"out": out, "tangent_out": tangent_out}, {n: truth[n] for n in names},
                    {n: floor[n] for n in names}, p.dtype, p.label, f"{path}: float32 mask")


# --- 4. empty inputs ----------------------------------------------------------------------

EMPTY_SHAPES = {  # (query, key/value) shapes
    "nq=0": ((2, 3, 0, 8), (2, 3, 5, 8)),
    "nk=0": ((2, 3, 4, 8), (2, 3, 0, 8)),
    "batch=0": ((0, 3, 4, 8), (0, 3, 5, 8)),
    "heads=0": ((2, 0, 4, 8), (2, 0, 5, 8)),
}


@pytest.mark.parametrize("name", list(EMPTY_SHAPES))
def test_empty_inputs_match_sdpa(name: str, path: str) -> None:
    """PyTorch returns empty outputs (and zeros for Nk = 0: every row sees no key); so do we,
    with zero gradients and tangents rather than an error."""
    q_shape, kv_shape = EMPTY_SHAPES[name]
    q, k, v = leaves(torch.randn(q_shape, device=DEVICE), torch.randn(kv_shape, device=DEVICE),
                     torch.randn(kv_shape, device=DEVICE))
    out = attention(q, k, v)
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want.detach())
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()
    _, tangent = torch.func.jvp(attention, (q.detach(), k.detach(), v.detach()),
                                (torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)))
    assert tangent.shape == want.shape and not tangent.any()


# --- 5. one set of rules on every path ----------------------------------------------------


def test_float64_everywhere_passes_gradcheck(path: str) -> None:
    """float64 (what gradcheck needs) runs on every device, on PyTorch operations."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, device=DEVICE, requires_grad=True)
               for _ in range(3))
    mask = torch.randn(5, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, m: attention(q, k, v, attn_mask=m, is_causal=True), (q, k, v, mask))
    assert torch.autograd.gradgradcheck(lambda q, k, v: attention(q, k, v), (q, k, v))


def _nested_jvp(attend, q, k, v, tangents, outer, which):
    def inner(q_):
        return torch.func.jvp(attend, (q_, k, v), tangents)[which]
    return torch.func.jvp(inner, (q,), (outer,))[1]


@pytest.mark.parametrize("which", [0, 1], ids=["of-out", "of-tangent_out"])
def test_jvp_of_jvp_is_right(which: int, path: str) -> None:
    """Forward over forward, as PyTorch's math path computes it (it runs on PyTorch ops)."""
    p = make_problem(Spec(nq=9, nk=12, d=16), torch.float32)
    outer = torch.randn_like(p.q)
    got = _nested_jvp(attention, p.q, p.k, p.v, p.tangents, outer, which)
    want = _nested_jvp(lambda q, k, v: api.reference_attention(q, k, v).out, p.q.double(),
                       p.k.double(), p.v.double(), tuple(t.double() for t in p.tangents),
                       outer.double(), which)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_jvp_of_attention_jvp_raises() -> None:
    """The explicit API's tO has no tangent of its own (a forward-over-forward derivative of
    the fused pass): forward-mode AD raises rather than returning a zero."""
    p = make_problem(Spec(nq=9, nk=12, d=16), torch.float32)
    with pytest.raises(NotImplementedError, match="jvp"):
        torch.func.jvp(lambda q: attention_jvp(q, p.k, p.v, p.tangents)[1], (p.q,), (p.q,))


@pytest.mark.parametrize("through_jvp", [False, True], ids=["plain", "through-jvp"])
def test_double_backward_is_right(through_jvp: bool, path: str) -> None:
    """A gradient penalty (create_graph=True, then a loss on the gradient), also through
    torch.func.jvp: the kernels' gradients, differentiated again through the reference."""
    p = make_problem(Spec(nq=9, nk=12, d=16, mask="additive"), torch.float32)

    def penalty_grad(attend, q, k, v, tangents):
        q = q.detach().requires_grad_()
        if through_jvp:
            out, tangent_out = torch.func.jvp(lambda a, b, c: attend(a, b, c), (q, k, v),
                                              tangents)
            loss = out.square().sum() + tangent_out.square().sum()
        else:
            loss = attend(q, k, v).square().sum()
        (dq,) = torch.autograd.grad(loss, q, create_graph=True)
        return torch.autograd.grad(dq.square().sum() + q.square().sum(), q)[0]

    mask = p.attn_mask
    got = penalty_grad(lambda a, b, c: attention(a, b, c, attn_mask=mask), p.q, p.k, p.v,
                       p.tangents)
    want = penalty_grad(lambda a, b, c: api.reference_attention(a, b, c, mask.double()).out,
                        p.q.double(), p.k.double(), p.v.double(),
                        tuple(t.double() for t in p.tangents))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_vector_hessian_product_is_right(path: str) -> None:
    """`torch.autograd.functional.vhp` (a double backward: for a scalar function the same
    product as `hvp`, whose Hessian is symmetric) matches the reference."""
    p = make_problem(Spec(nq=9, nk=12, d=16, mask="additive"), torch.float32)
    direction = torch.randn_like(p.q)

    def product(attend, q, k, v, direction):
        return torch.autograd.functional.vhp(lambda a: attend(a, k, v).square().sum(), q,
                                             direction, strict=True)[1]

    mask = p.attn_mask
    got = product(lambda a, b, c: attention(a, b, c, attn_mask=mask), p.q, p.k, p.v, direction)
    want = product(lambda a, b, c: api.reference_attention(a, b, c, mask.double()).out,
                   p.q.double(), p.k.double(), p.v.double(), direction.double())
    assert want.abs().max() > 0
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())


@pytest.mark.parametrize("through_jvp", [False, True], ids=["plain", "through-jvp"])
def test_hessian_vector_product_by_the_double_backward_trick_is_right(
        through_jvp: bool, path: str) -> None:
    """`torch.autograd.functional.hvp` differentiates the double backward with respect to
    its cotangents (the "double backward trick"): the product must be the reference's, not
    the zeros a double backward that is constant in its cotangents gives (it did)."""
    p = make_problem(Spec(nq=9, nk=12, d=16, mask="additive"), torch.float32)
    direction = torch.randn_like(p.q)

    def product(attend, q, k, v, tangents, direction):
        def loss(q):
            if not through_jvp:
                return attend(q, k, v).square().sum()
            out, tangent_out = torch.func.jvp(lambda a: attend(a, k, v), (q,), (tangents[0],))
            return out.square().sum() + tangent_out.square().sum()

        return torch.autograd.functional.hvp(loss, q, direction, strict=True)[1]

    mask = p.attn_mask
    got = product(lambda a, b, c: attention(a, b, c, attn_mask=mask), p.q, p.k, p.v,
                  p.tangents, direction)
    want = product(lambda a, b, c: api.reference_attention(a, b, c, mask.double()).out,
                   p.q.double(), p.k.double(), p.v.double(),
                   tuple(t.double() for t in p.tangents), direction.double())
    assert want.abs().max() > 0
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())


@pytest.mark.parametrize("what", ["jacobian", "hessian"])
def test_vectorized_jacobian_and_hessian_are_right(what: str, path: str) -> None:
    """`torch.autograd.functional.jacobian`/`hessian` with `vectorize=True` run the backward
    on batched cotangents, tensors without storage (`is_grads_batched`): the call must take
    the operator, which the dispatcher batches, and match the reference."""
    p = make_problem(Spec(nq=5, nk=7, d=8, mask="additive"), torch.float32)
    mask = p.attn_mask

    def run(attend, q, k, v):
        if what == "jacobian":
            return torch.autograd.functional.jacobian(lambda a: attend(a, k, v).sum(-1), q,
                                                      vectorize=True)
        return torch.autograd.functional.hessian(lambda a: attend(a, k, v).square().sum(), q,
                                                 vectorize=True)

    got = run(lambda a, b, c: attention(a, b, c, attn_mask=mask), p.q, p.k, p.v)
    want = run(lambda a, b, c: api.reference_attention(a, b, c, mask.double()).out,
               p.q.double(), p.k.double(), p.v.double())
    assert want.abs().max() > 0
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_third_derivative_is_right(path: str) -> None:
    """A derivative of the double backward's result with respect to the inputs again (a
    third derivative) differentiates the reference once more."""
    p = make_problem(Spec(nq=9, nk=12, d=16, causal=True), torch.float32)
    u, w = torch.randn_like(p.q), torch.randn_like(p.k)

    def third(attend, q, k, v, u, w):
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        (dq,) = torch.autograd.grad(attend(q, k, v).square().sum(), q, create_graph=True)
        (dk,) = torch.autograd.grad((dq * u).sum(), k, create_graph=True)
        return torch.autograd.grad((dk * w).sum(), q)[0]

    got = third(lambda a, b, c: attention(a, b, c, is_causal=True), p.q, p.k, p.v, u, w)
    want = third(lambda a, b, c: api.reference_attention(a, b, c, None, True).out,
                 p.q.double(), p.k.double(), p.v.double(), u.double(), w.double())
    assert want.abs().max() > 0
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_torch_func_grad_keeps_the_kernels() -> None:
    """torch.func.grad differentiates with create_graph on: the first derivative must still
    come from the kernels (the reference only runs if it is differentiated again)."""
    p = make_problem(Spec(nq=9, nk=12, d=16), torch.float32)
    with mock.patch.object(api, "reference_attention", side_effect=AssertionError("reference")):
        grad = torch.func.grad(lambda q: attention(q, p.k, p.v).square().sum())(p.q)
    q = p.q.double().requires_grad_()
    api.reference_attention(q, p.k.double(), p.v.double()).out.square().sum().backward()
    torch.testing.assert_close(grad.double(), q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not interpreting(), reason="only Triton's interpreter miscomputes bf16")
def test_bfloat16_in_the_interpreter_raises() -> None:
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="interpreter"):
        attention(q, q, q)


def test_export_of_a_jvp_raises_and_export_of_the_forward_is_right(path: str) -> None:
    """torch.export of a function that calls torch.func.jvp around `attention` raises
    `Unsupported` on every path (the kernels' path asserted inside PyTorch's tracer; on
    PyTorch operations torch 2.13's export returned FakeTensors); exporting the forward alone
    works, and the exported program matches eager attention."""
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(3))

    class Forward(torch.nn.Module):
        def forward(self, q, k, v):
            return attention(q, k, v, is_causal=True)

    class Tangent(torch.nn.Module):
        def forward(self, q, k, v, t):
            return torch.func.jvp(lambda q_: attention(q_, k, v), (q,), (t,))

    exported = torch.export.export(Forward(), (q, k, v))
    later = [torch.randn_like(q) for _ in range(3)]
    got = exported.module()(*later)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, attention(*later, is_causal=True), rtol=0, atol=0)
    with pytest.raises(api.Unsupported, match="torch.export cannot capture torch.func.jvp"):
        torch.export.export(Tangent(), (q, k, v, torch.randn_like(q)))


def test_compiled_jvp_is_not_refused_as_an_export(path: str, monkeypatch) -> None:
    """Dynamo in torch 2.11 answers True to `torch.compiler.is_exporting()` under every
    torch.compile; the export refusal reads export's own flag, so a compiled jvp still runs
    (simulated here on any torch: is_exporting answers as is_compiling does)."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: torch.compiler.is_compiling())
    q, k, v, t = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(4))

    def tangent(q):
        return torch.func.jvp(lambda q_: attention(q_, k, v, is_causal=True), (q,), (t,))[1]

    compiled = torch.compile(tangent, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q), tangent(q), rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


HUGE_BIASES = {"lowest": torch.finfo(torch.float32).min, "1e30": -1e30, "1e9": -1e9}


def _masked_step(fn, q, k, v, tangents, bias) -> list[torch.Tensor]:
    """out and tangent_out under torch.func.jvp, then the gradients of q, k, v and the
    (learnable) bias of a loss that reads both."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, bias)]
    out, t_out = torch.func.jvp(lambda a, b, c: fn(a, b, c, attn_mask=leaves[3]),
                                tuple(leaves[:3]), tangents)
    (out.square().sum() + (t_out * out.detach()).sum()).backward()
    return [out.detach(), t_out.detach(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("fill", HUGE_BIASES.values(), ids=HUGE_BIASES.keys())
def test_rows_masked_entirely_by_a_huge_bias_average_as_sdpa(path: str, fill: float) -> None:
    """Rows whose every key has a huge finite bias (the dtype's lowest number, as Hugging
    Face builds masks; -1e30; -1e9): SDPA's fp32 math path rounds the scores away and
    averages the values, its gradients to match. The kernels gave zeros (the log2 fold
    overflowed to -inf) or, from about -1e7, gradients off by O(1) (fp32 could not hold log2
    of the row's sum beside the shift), and chapter 1's fallback zeros. Truth: float64 SDPA
    with the bias at -1e300, which rounds the scores away in float64 too; the allowance is
    PyTorch's fp32 math error against it, as everywhere."""
    torch.manual_seed(0)
    q, k, v, tq, tk, tv = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(6))
    hidden = torch.zeros(2, 20, 20, dtype=torch.bool, device=DEVICE)
    hidden[:, 2], hidden[:, 4, 1:], hidden[:, 7:, 3:9] = True, True, True  # rows 2, 4 entirely
    bias = torch.randn(2, 20, 20, device=DEVICE) * 0.5

    def step(fn, dtype, low):
        cast = [x.to(dtype) for x in (q, k, v, tq, tk, tv)]
        return _masked_step(fn, *cast[:3], tuple(cast[3:]), bias.to(dtype).masked_fill(hidden, low))

    with sdpa_kernel(SDPBackend.MATH):
        truth = step(F.scaled_dot_product_attention, torch.float64, -1e300)
        math32 = step(F.scaled_dot_product_attention, torch.float32, fill)
    ours = step(attention, torch.float32, fill)
    names = ("out", "tangent_out", "dq", "dk", "dv", "dmask")
    for name, got, pytorch, want in zip(names, ours, math32, truth, strict=True):
        error = (got.double() - want).abs().max().item()
        floor = (pytorch.double() - want).abs().max().item()
        allowed = allowed_error(torch.float32, floor, want.abs().max().item())
        assert error <= allowed, f"{path} {name}: {error:.2e} > {allowed:.2e} (floor {floor:.2e})"


# --- 6. the drop-in's fall-through ----------------------------------------------------------


def test_sdpa_fall_through_is_counted_warned_and_runs_math_under_jvp(path: str) -> None:
    """dropout_p > 0 falls through: once per reason a warning, always a count; under
    torch.func.jvp it reaches PyTorch's math backend (the fused ones raise on tangents)."""
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(3))
    api._warned_reasons.discard("dropout_p > 0")
    with sdpa() as routing, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.scaled_dot_product_attention(q, k, v)
        for _ in range(2):
            _, tangent = torch.func.jvp(
                lambda q_: F.scaled_dot_product_attention(q_, k, v, dropout_p=0.5), (q,), (q,))
    assert routing.routed == 1 and routing.fell_through == {"dropout_p > 0": 2}
    assert sum("dropout_p > 0" in str(w.message) for w in caught) == 1
    assert tangent.shape == q.shape and tangent.isfinite().all()
    with sdpa(strict=True), pytest.raises(NotImplementedError, match="dropout_p"):
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)


# --- 7. the precision mode travels with the call ------------------------------------------


def test_backward_uses_the_precision_of_its_forward() -> None:
    """Switching set_precision between a forward and its backward changes nothing."""
    p = make_problem(Spec(nq=33, nk=40, d=16), torch.float16)

    def grads(forward_mode, backward_mode):
        xs = leaves(p.q, p.k, p.v, *p.tangents)
        with precision(forward_mode):
            outs = torch.func.jvp(attention, tuple(xs[:3]), tuple(xs[3:]))
        with precision(backward_mode):
            torch.autograd.backward(outs, (p.grad_out, p.grad_tangent_out))
        return [x.grad for x in xs]

    for mode, other in (("fast", "accurate"), ("accurate", "fast")):
        for a, b in zip(grads(mode, other), grads(mode, mode), strict=True):
            assert torch.equal(a, b), f"forward {mode}, backward switched to {other}"
    assert any(not torch.equal(a, b) for a, b in zip(grads("fast", "fast"),
                                                     grads("accurate", "accurate"),
                                                     strict=True)), "the modes must differ"


def test_precision_is_a_context_manager_and_a_getter() -> None:
    """`jvp_attention.precision(mode)` sets the mode for a block and restores the previous
    one, also when the block raises; `get_precision` reads it; bad modes say what is wrong."""
    before = jvp_attention.get_precision()
    other = "fast" if before == "accurate" else "accurate"
    with jvp_attention.precision(other) as mode:
        assert mode == other and jvp_attention.get_precision() == other
        with jvp_attention.precision(before):
            assert jvp_attention.get_precision() == before
        assert jvp_attention.get_precision() == other
    assert jvp_attention.get_precision() == before
    with pytest.raises(RuntimeError, match="inside"), jvp_attention.precision(other):
        raise RuntimeError("inside")
    assert jvp_attention.get_precision() == before
    for bad in ("exact", None):
        with pytest.raises(ValueError, match="accurate"), jvp_attention.precision(bad):
            pass
        with pytest.raises(ValueError, match="accurate"):
            jvp_attention.set_precision(bad)
    assert jvp_attention.get_precision() == before


# --- 8. autocast --------------------------------------------------------------------------


def _autocast_dtype() -> torch.dtype:
    # bf16 on the GPU (what training uses); fp16 on the CPU (the interpreter refuses bf16)
    return torch.bfloat16 if HAS_CUDA else torch.float16


def test_autocast_casts_like_sdpa(path: str) -> None:
    """Hugging Face Llama under autocast: float32 q and k (after rotary), a 16-bit v. PyTorch's
    SDPA casts all three (and a float mask) to the autocast dtype; so does `attention`,
    tangents included, directly and through the drop-in."""
    dtype = _autocast_dtype()
    torch.manual_seed(0)
    q, k = (torch.randn(2, 4, 12, 16, device=DEVICE) for _ in range(2))
    v = torch.randn(2, 4, 12, 16, device=DEVICE, dtype=dtype)
    mask = torch.randn(12, 12, device=DEVICE)
    tangents = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))
    want, want_t = torch.func.jvp(
        lambda q, k, v: attention(q.to(dtype), k.to(dtype), v, attn_mask=mask.to(dtype)),
        (q, k, v), tangents)
    with torch.autocast(DEVICE, dtype=dtype):
        out, t_out = torch.func.jvp(lambda q, k, v: attention(q, k, v, attn_mask=mask),
                                    (q, k, v), tangents)
        with sdpa(strict=True) as routing:
            routed, routed_t = torch.func.jvp(
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                (q, k, v), tangents)
    assert routing.routed == 1
    for got in (out, t_out, routed, routed_t):
        assert got.dtype == dtype
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(t_out, want_t, rtol=0, atol=0)
    torch.testing.assert_close(routed_t, want_t, rtol=0, atol=0)
    assert math.isfinite(t_out.float().abs().max().item())


def test_mask_tangent_through_attention_jvp() -> None:
    """The explicit API takes the mask's tangent too, and checks it."""
    spec = MASK_SPECS[1]
    p = make_problem(spec, torch.float32)
    bias, t_bias = make_bias(spec, "2d")
    _, tangent_out = attention_jvp(p.q, p.k, p.v, p.tangents, attn_mask=bias,
                                   scale=spec.scale, mask_tangent=t_bias)
    truth, floor = expected_with_bias(p, bias, t_bias)
    assert_accurate({"tangent_out": tangent_out}, {"tangent_out": truth["tangent_out"]},
                    {"tangent_out": floor["tangent_out"]}, p.dtype, p.label, "attention_jvp")
    with pytest.raises(ValueError, match="mask_tangent"):
        attention_jvp(p.q, p.k, p.v, p.tangents, mask_tangent=t_bias)
