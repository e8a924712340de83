"""The public API (`jvp_attention.attention`, `attention_jvp`, `sdpa`) under every PyTorch
transform it promises: plain backward, forward_ad dual tensors, torch.func.jvp (and a loss on
its primal and tangent outputs), vmap, torch.compile, the SDPA drop-in, and its errors.

Each transform's results are held to the same rule as the kernels (tests/helpers.py): within
twice PyTorch's math-path error of the float64 truth.
"""

import warnings
from unittest import mock

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from helpers import (
    DEVICE,
    SECOND_ORDER_NAMES,
    Problem,
    Spec,
    assert_accurate,
    dtype_name,
    expected_backward,
    expected_forward,
    expected_second_order,
    make_problem,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvp_attention.autograd as api
from jvp_attention import attention, attention_jvp, sdpa

SPECS = [
    Spec(batch=2, hq=4, hkv=2, nq=17, nk=33, d=40, mask="keypad", causal=True),
    Spec(nq=33, nk=17, d=64, dv=32, mask="additive", scale=0.3),
    Spec(nq=17, nk=17, d=16, mask="empty_rows", layout="bnhd", cotangent="expanded"),
]
ids = [s.id for s in SPECS]


# Tiny tensors: one intra-op thread is ~10x faster than a contended pool (conftest).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE)


def sdpa64(q, k, v, **kwargs):
    """PyTorch's math attention in float64 (the backend that supports every transform)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs)


def options(p: Problem) -> dict:
    """`attention`'s keyword arguments for problem p."""
    return {"attn_mask": p.attn_mask, "is_causal": p.spec.causal, "scale": p.spec.scale,
            "enable_gqa": p.spec.hq != p.spec.hkv}


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [x.detach().clone().requires_grad_() for x in tensors]


def only(d: dict, *names: str) -> dict:
    return {n: d[n] for n in names}


# --- torch.compile (once: it takes ~40 s on CPU) ------------------------------------------


def test_torch_compile_fullgraph_forward_backward_and_attention_jvp() -> None:
    """One graph, no breaks, for `attention` (forward + backward) and for `attention_jvp`
    (forward + backward through the tangent); the results equal eager mode's."""
    torch._dynamo.reset()
    p = make_problem(Spec(hq=4, hkv=2, nq=17, nk=24, d=16, mask="bool", causal=True),
                     torch.float32)

    def plain(q, k, v):
        return attention(q, k, v, **options(p))

    def fused(q, k, v, tq, tk, tv):
        return attention_jvp(q, k, v, (tq, tk, tv), **options(p))

    for fn, inputs in ((plain, (p.q, p.k, p.v)), (fused, (p.q, p.k, p.v, *p.tangents))):
        results = []
        for candidate in (fn, torch.compile(fn, fullgraph=True)):
            xs = leaves(*inputs)
            outputs = candidate(*xs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            sum((o * torch.randn_like(o, generator=torch.Generator(o.device).manual_seed(i))).sum()
                for i, o in enumerate(outputs)).backward()
            results.append([*outputs, *(x.grad for x in xs)])
        for i, (eager, compiled) in enumerate(zip(*results, strict=True)):
            torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6,
                                       msg=lambda m, i=i, fn=fn: f"{fn.__name__} #{i}: {m}")


# --- plain backward -----------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_backward_matches_float64(spec: Spec) -> None:
    p = make_problem(spec, torch.float32)
    q, k, v = leaves(p.q, p.k, p.v)
    out = attention(q, k, v, **options(p))
    out.backward(p.grad_out)
    truth, floor = expected_forward(p, with_tangents=False)
    assert_accurate({"out": out.detach()}, only(truth, "out"), only(floor, "out"),
                    p.dtype, p.label, "attention")
    truth, floor = expected_backward(p)
    assert_accurate({"dq": q.grad, "dk": k.grad, "dv": v.grad}, truth, floor, p.dtype,
                    p.label, "attention backward")


def test_matches_sdpa_on_its_own_arguments() -> None:
    """SDPA's signature and semantics: 1-D mask, integer scale, GQA, causal with Nq != Nk."""
    q, k, v = (randn(*shape) for shape in ((2, 4, 9, 16), (2, 2, 12, 16), (2, 2, 12, 8)))
    mask = torch.arange(12, device=DEVICE) < 10
    for kwargs in ({"attn_mask": mask}, {"scale": 2}, {"is_causal": True},
                   {"attn_mask": torch.randn(9, 12, device=DEVICE)}):
        ours = attention(q, k, v, enable_gqa=True, **kwargs)
        if kwargs.get("attn_mask") is mask:  # PyTorch's own SDPA rejects a 1-D mask with GQA
            kwargs = {"attn_mask": mask.expand(9, 12)}
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5, msg=str(kwargs))


# --- forward mode -------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_forward_ad_dual_tensors(spec: Spec) -> None:
    p = make_problem(spec, torch.float32)
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip((p.q, p.k, p.v), p.tangents,
                                                            strict=True)]
        out, tangent_out = forward_ad.unpack_dual(attention(*duals, **options(p)))
    truth, floor = expected_forward(p)
    names = ("out", "tangent_out")
    assert_accurate({"out": out, "tangent_out": tangent_out}, only(truth, *names),
                    only(floor, *names), p.dtype, p.label, "forward_ad")


def test_forward_ad_with_some_inputs_dual() -> None:
    """Only the value carries a tangent: the others count as zero tangents."""
    p = make_problem(SPECS[0], torch.float32)
    with forward_ad.dual_level():
        out = attention(p.q, p.k, forward_ad.make_dual(p.v, p.tangents[2]), **options(p))
        tangent_out = forward_ad.unpack_dual(out).tangent
    p.tangents = (torch.zeros_like(p.q), torch.zeros_like(p.k), p.tangents[2])
    truth, floor = expected_forward(p)
    assert_accurate({"tangent_out": tangent_out}, only(truth, "tangent_out"),
                    only(floor, "tangent_out"), p.dtype, p.label, "forward_ad, v only")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_torch_func_jvp(spec: Spec, dtype: torch.dtype) -> None:
    p = make_problem(spec, dtype)
    out, tangent_out = torch.func.jvp(lambda q, k, v: attention(q, k, v, **options(p)),
                                      (p.q, p.k, p.v), p.tangents)
    truth, floor = expected_forward(p)
    names = ("out", "tangent_out")
    assert_accurate({"out": out, "tangent_out": tangent_out}, only(truth, *names),
                    only(floor, *names), dtype, p.label, "torch.func.jvp")


def test_torch_func_jvp_of_the_query_alone() -> None:
    """k and v closed over (constants): their tangents are zero."""
    p = make_problem(SPECS[1], torch.float32)
    _, tangent_out = torch.func.jvp(lambda q: attention(q, p.k, p.v, **options(p)), (p.q,),
                                    (p.tangents[0],))
    p.tangents = (p.tangents[0], torch.zeros_like(p.k), torch.zeros_like(p.v))
    truth, floor = expected_forward(p)
    assert_accurate({"tangent_out": tangent_out}, only(truth, "tangent_out"),
                    only(floor, "tangent_out"), p.dtype, p.label, "jvp in q alone")


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_jvp_then_loss_on_the_primal_output(spec: Spec) -> None:
    """The consistency-model pattern: jvp inside the forward, a loss on the primal only."""
    p = make_problem(spec, torch.float32)
    xs = leaves(p.q, p.k, p.v, *p.tangents)
    out, _ = torch.func.jvp(lambda q, k, v: attention(q, k, v, **options(p)), tuple(xs[:3]),
                            tuple(xs[3:]))
    out.backward(p.grad_out)
    truth, floor = expected_backward(p)
    assert_accurate(dict(zip(("dq", "dk", "dv"), (x.grad for x in xs[:3]), strict=True)),
                    truth, floor, p.dtype, p.label, "jvp, loss on out")
    for x in xs[3:]:
        assert x.grad is None or not x.grad.any(), "tangents get no gradient from out"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_jvp_then_loss_on_primal_and_tangent(spec: Spec, dtype: torch.dtype) -> None:
    """A loss on (out, tangent_out) after torch.func.jvp: all six gradients."""
    p = make_problem(spec, dtype)
    xs = leaves(p.q, p.k, p.v, *p.tangents)
    out, tangent_out = torch.func.jvp(lambda q, k, v: attention(q, k, v, **options(p)),
                                      tuple(xs[:3]), tuple(xs[3:]))
    torch.autograd.backward((out, tangent_out), (p.grad_out, p.grad_tangent_out))
    truth, floor = expected_second_order(p)
    assert_accurate(dict(zip(SECOND_ORDER_NAMES, (x.grad for x in xs), strict=True)), truth,
                    floor, dtype, p.label, "jvp, loss on out and tangent_out")


def test_loss_on_the_tangent_only() -> None:
    p = make_problem(SPECS[0].with_(cotangent="tangent_only"), torch.float32)
    xs = leaves(p.q, p.k, p.v, *p.tangents)
    _, tangent_out = torch.func.jvp(lambda q, k, v: attention(q, k, v, **options(p)),
                                    tuple(xs[:3]), tuple(xs[3:]))
    tangent_out.backward(p.grad_tangent_out)
    truth, floor = expected_second_order(p)
    assert_accurate(dict(zip(SECOND_ORDER_NAMES, (x.grad for x in xs), strict=True)), truth,
                    floor, p.dtype, p.label, "jvp, loss on tangent_out only")


@pytest.mark.parametrize("spec", SPECS[:2], ids=ids[:2])
def test_attention_jvp_equals_torch_func_jvp(spec: Spec) -> None:
    """The explicit-tangent API runs the same fused kernels: bitwise the same outputs and
    gradients as torch.func.jvp through `attention`."""
    p = make_problem(spec, torch.float32)
    results = []
    for use_func in (True, False):
        xs = leaves(p.q, p.k, p.v, *p.tangents)
        if use_func:
            outs = torch.func.jvp(lambda q, k, v: attention(q, k, v, **options(p)),
                                  tuple(xs[:3]), tuple(xs[3:]))
        else:
            outs = attention_jvp(*xs[:3], tuple(xs[3:]), **options(p))
        torch.autograd.backward(outs, (p.grad_out, p.grad_tangent_out))
        results.append([o.detach() for o in outs] + [x.grad for x in xs])
    names = ("out", "tangent_out", *SECOND_ORDER_NAMES)
    for name, a, b in zip(names, *results, strict=True):
        assert torch.equal(a, b), f"{name}: attention_jvp differs from torch.func.jvp"


# --- forward over reverse ----------------------------------------------------------------


def test_forward_over_reverse_runs_the_reference() -> None:
    """A jvp of a gradient (a Hessian-vector product, forward over reverse) and
    torch.func.hessian (jacfwd of jacrev): the kernels' backward has no forward rule, so a
    jvp beneath a gradient transform runs chapter 1's reference in PyTorch operations, with
    float64 SDPA's answer (it raised before)."""
    p = make_problem(Spec(batch=1, hq=2, hkv=1, nq=9, nk=12, d=16, causal=True), torch.float32)
    opts = {"is_causal": True, "enable_gqa": True}

    def hvp(attend, q, k, v, tq):
        grad_q = torch.func.grad(lambda x: attend(x, k, v, **opts).square().sum())
        return torch.func.jvp(grad_q, (q,), (tq,))[1]

    with mock.patch.object(api, "_pytorch_attention", wraps=api._pytorch_attention) as ref:
        got = hvp(attention, p.q, p.k, p.v, p.tangents[0])
    assert ref.called
    want = hvp(sdpa64, p.q.double(), p.k.double(), p.v.double(), p.tangents[0].double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    q, k, v = p.q[:, :1, :3, :4], p.k[:, :, :5, :4], p.v[:, :, :5, :4]
    got = torch.func.hessian(lambda x: attention(x, k, v, **opts).square().sum())(q)
    want = torch.func.hessian(lambda x: sdpa64(x, k, v, **opts).square().sum())(q.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_forward_over_reverse_with_forward_ad_raises() -> None:
    """The same through torch.autograd.forward_ad and torch.autograd.grad(create_graph=True)
    on a dual input: the gradient's tangent would be lost, so it raises instead."""
    p = make_problem(Spec(nq=9, nk=12, d=16), torch.float32)
    with forward_ad.dual_level(), pytest.raises(NotImplementedError):
        q = forward_ad.make_dual(p.q.clone().requires_grad_(), p.tangents[0])
        loss = attention(q, p.k, p.v).square().sum()
        torch.autograd.grad(loss, q, create_graph=True)


# --- vmap, leading dims -------------------------------------------------------------------


def test_vmap_over_a_leading_dim() -> None:
    torch.manual_seed(0)
    q, k, v = (randn(3, *shape) for shape in ((2, 4, 17, 16), (2, 2, 9, 16), (2, 2, 9, 8)))
    got = torch.func.vmap(lambda a, b, c: attention(a, b, c, enable_gqa=True))(q, k, v)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # Unbatched keys and values (in_dims None): broadcast over vmap's dimension.
    got = torch.func.vmap(lambda a: attention(a, k[0], v[0], enable_gqa=True))(q)
    want = F.scaled_dot_product_attention(q.double(), k[0].double(), v[0].double(),
                                          enable_gqa=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_vmap_of_jvp_over_a_batch_of_tangents() -> None:
    """Several tangent directions at once (a batched JVP), as vmap(jvp) gives."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(3))
    tqs = torch.randn(3, *q.shape, device=DEVICE)

    def tangent(tq):
        return torch.func.jvp(lambda a: attention(a, k, v), (q,), (tq,))[1]

    got = torch.func.vmap(tangent)(tqs)
    for i in range(3):
        want = torch.func.jvp(lambda a: sdpa64(a, k, v), (q.double(),), (tqs[i].double(),))[1]
        torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=1e-5)


def test_jvp_inside_other_transforms() -> None:
    """`attention` skips functorch's lifting inside one plain torch.func.jvp only; inside
    grad(jvp(...)) and jacfwd (vmap over jvp) the Functions are lifted as before, with the
    float64 results."""
    torch.manual_seed(2)
    q, k, v, tq = (torch.randn(1, 2, 5, 8, device=DEVICE) for _ in range(4))

    def tangent_norm(attend, q, k, v, tq):
        return torch.func.jvp(lambda a: attend(a, k, v), (q,), (tq,))[1].square().sum()

    got = torch.func.grad(tangent_norm, argnums=(1, 2))(attention, q, k, v, tq)
    want = torch.func.grad(tangent_norm, argnums=(1, 2))(
        sdpa64, q.double(), k.double(), v.double(), tq.double())
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-5)
    got = torch.func.jacfwd(lambda a: attention(a, k, v))(q)
    want = torch.func.jacfwd(lambda a: sdpa64(a, k.double(), v.double()))(q.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_per_sample_gradients_and_jacrev() -> None:
    """vmap of a gradient (per-sample gradients) through GQA and a learnable bias that vmap
    does not batch, jacrev (vmap over vjp) and the second order under vmap, causal: float64
    SDPA's answer,
    with one launch of each backward kernel for the whole vmap (the operators fold vmap's
    dimension into the batch), not one per sample."""
    torch.manual_seed(3)
    q, tq = (torch.randn(3, 1, 4, 9, 16, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(3, 1, 2, 12, 16, device=DEVICE) for _ in range(2))
    bias = torch.randn(1, 1, 9, 12, device=DEVICE)
    opts = {"is_causal": True, "enable_gqa": True}

    def per_sample(attend, q, k, v, bias):
        def loss(a, b, c, m):
            return attend(a, b, c, attn_mask=m, enable_gqa=True).square().sum()
        return torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2, 3)),
                               in_dims=(0, 0, 0, None))(q, k, v, bias)

    with mock.patch.object(api, "flash_attention_backward",
                           wraps=api.flash_attention_backward) as backward:
        got = per_sample(attention, q, k, v, bias)
    assert backward.call_count == 1
    want = per_sample(sdpa64, q.double(), k.double(), v.double(), bias.double())
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-5)
    got = torch.func.jacrev(lambda a: attention(a, k[0], v[0], **opts).sum(-1))(q[0])
    want = torch.func.jacrev(lambda a: sdpa64(a, k[0], v[0], **opts).sum(-1))(q[0].double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)

    def tangent_loss_grads(attend, q, k, v, tq):  # second order under vmap
        def loss(a, b, c, t):
            return torch.func.jvp(lambda x: attend(x, b, c, **opts), (a,), (t,))[1].square().sum()
        return torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v, tq)

    got = tangent_loss_grads(attention, q, k, v, tq)
    want = tangent_loss_grads(sdpa64, q.double(), k.double(), v.double(), tq.double())
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-5)


def test_jvp_of_a_vmapped_function() -> None:
    """torch.func.jvp of a vmapped function: beneath vmap the inputs carry their tangents,
    which `attention` cannot see at vmap's level; the vmap rule folds vmap's dimension and
    the fused forward with its JVP runs once, with float64 SDPA's output and tangent (it
    raised before). Keys and values unbatched by vmap too, and forward_ad's dual tensors
    under vmap."""
    torch.manual_seed(4)
    q, k, v, tq, tk, tv = (torch.randn(3, 1, 2, 9, 16, device=DEVICE) for _ in range(6))

    def run(attend, q, k, v, tq, tk, tv, in_dims):
        batched = torch.func.vmap(lambda a, b, c: attend(a, b, c, is_causal=True),
                                  in_dims=in_dims)
        return torch.func.jvp(batched, (q, k, v), (tq, tk, tv))

    for in_dims in ((0, 0, 0), (0, None, None)):
        shared = in_dims[1] is None  # keys and values (and their tangents) not batched
        kk, vv, tkk, tvv = (x[0] if shared else x for x in (k, v, tk, tv))
        with mock.patch.object(api, "flash_attention_forward",
                               wraps=api.flash_attention_forward) as forward:
            got = run(attention, q, kk, vv, tq, tkk, tvv, in_dims)
        assert forward.call_count == 1 and forward.call_args.args[6] is not None
        want = run(sdpa64, *(x.double() for x in (q, kk, vv, tq, tkk, tvv)), in_dims)
        for ours, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-5)
    with forward_ad.dual_level():  # the same with forward_ad's dual tensors under vmap
        duals = [forward_ad.make_dual(x, t) for x, t in zip((q, k, v), (tq, tk, tv), strict=True)]
        out = torch.func.vmap(lambda a, b, c: attention(a, b, c, is_causal=True))(*duals)
        tangent = forward_ad.unpack_dual(out).tangent
    want = run(sdpa64, *(x.double() for x in (q, k, v, tq, tk, tv)), (0, 0, 0))[1]
    torch.testing.assert_close(tangent.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 3, 4, 17, 16), (4, 17, 16)], ids=["5d", "3d"])
def test_any_leading_dims(shape) -> None:
    """(..., H, N, D) with two leading dims, and with none; forward, jvp and backward."""
    torch.manual_seed(2)
    q, k, v, tq, tk, tv = (torch.randn(shape, device=DEVICE) for _ in range(6))
    mask = torch.rand(shape[-2], shape[-2], device=DEVICE) < 0.8
    mask[:, 0] = True
    xs = leaves(q, k, v, tq, tk, tv)
    out, tangent_out = torch.func.jvp(lambda a, b, c: attention(a, b, c, attn_mask=mask),
                                      tuple(xs[:3]), tuple(xs[3:]))
    assert out.shape == shape
    (out.square().sum() + tangent_out.sum()).backward()
    ref = leaves(*(x.double() for x in (q, k, v, tq, tk, tv)))
    with sdpa_kernel(SDPBackend.MATH):
        ref_out, ref_tangent = torch.func.jvp(
            lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask),
            tuple(ref[:3]), tuple(ref[3:]))
    (ref_out.square().sum() + ref_tangent.sum()).backward()
    for name, a, b in zip(("out", "tangent_out", *SECOND_ORDER_NAMES), [out, tangent_out, *xs],
                          [ref_out, ref_tangent, *ref], strict=True):
        a = a.grad if isinstance(a, torch.Tensor) and a.is_leaf else a
        b = b.grad if isinstance(b, torch.Tensor) and b.is_leaf else b
        torch.testing.assert_close(a.detach().double(), b.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


# --- the SDPA drop-in ---------------------------------------------------------------------


def test_sdpa_routes_calls_to_attention() -> None:
    from torch.nn.functional import scaled_dot_product_attention as bound_early

    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(3))
    with mock.patch.object(api, "attention", wraps=api.attention) as spy, sdpa():
        routed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert spy.call_count == 1
        early = bound_early(q, k, v, is_causal=True)  # through the TorchFunctionMode
        assert spy.call_count == 2
    assert F.scaled_dot_product_attention is api._TORCH_SDPA, "sdpa() must restore SDPA"
    want = attention(q, k, v, is_causal=True)
    assert torch.equal(routed, want) and torch.equal(early, want)


def test_sdpa_transformer_encoder_layer_under_jvp_matches_math_path() -> None:
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0,
                                             batch_first=True, device=DEVICE)
    x, tx = torch.randn(2, 17, 32, device=DEVICE), torch.randn(2, 17, 32, device=DEVICE)
    with mock.patch.object(api, "attention", wraps=api.attention) as spy, sdpa():
        y, ty = torch.func.jvp(layer, (x,), (tx,))
    assert spy.call_count == 1, "nn.MultiheadAttention's SDPA call must reach jvp_attention"
    layer64 = layer.double()
    with sdpa_kernel(SDPBackend.MATH):
        y64, ty64 = torch.func.jvp(layer64, (x.double(),), (tx.double(),))
        y32, ty32 = torch.func.jvp(layer.float(), (x,), (tx,))
    floor = {"out": y32, "tangent_out": ty32}
    assert_accurate({"out": y, "tangent_out": ty}, {"out": y64, "tangent_out": ty64}, floor,
                    torch.float32, "float32 TransformerEncoderLayer(32, 4) x (2, 17, 32)",
                    "sdpa() + torch.func.jvp")


def test_sdpa_falls_through_for_what_it_cannot_take() -> None:
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(3))
    with mock.patch.object(api, "attention", wraps=api.attention) as spy, sdpa():
        torch.manual_seed(0)
        dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        wide = F.scaled_dot_product_attention(*(randn(1, 2, 5, 264) for _ in range(3)))
    assert spy.call_count == 0
    torch.manual_seed(0)
    assert torch.equal(dropped, api._TORCH_SDPA(q, k, v, dropout_p=0.5))
    assert wide.shape == (1, 2, 5, 264)


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_flop_counter_counts_what_the_math_path_counts(gqa: bool) -> None:
    """FlopCounterMode (a dispatch mode: it sees the operators) counts each call as PyTorch's
    math path's matrix products: the forward, the forward with its tangent, the primal
    backward and the backward through both outputs (tangents that require grad)."""
    from torch.utils.flop_counter import FlopCounterMode

    def math(q, k, v):  # the math path's products, without SDPA's own formula
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        return torch.softmax(q @ k.mT * q.shape[-1] ** -0.5, -1) @ v

    def counts(attend):
        shapes = [(2, 4, 5, 8), (2, 2 if gqa else 4, 7, 8), (2, 2 if gqa else 4, 7, 16)]
        primals = [torch.randn(s, device=DEVICE, requires_grad=True) for s in shapes]
        tangents = [torch.randn_like(x, requires_grad=True) for x in primals]
        found = []
        for step in ("forward", "jvp", "primal backward", "both backward"):
            with FlopCounterMode(display=False) as counter:
                if step == "forward":
                    attend(*primals)
                elif step == "jvp":
                    out, tangent_out = torch.func.jvp(attend, tuple(primals), tuple(tangents))
                elif step == "primal backward":
                    out.backward(torch.ones_like(out), retain_graph=True)
                else:
                    torch.autograd.backward((out, tangent_out),
                                            (torch.ones_like(out), torch.ones_like(out)))
            found.append(counter.get_total_flops())
        return found

    ours = counts(lambda q, k, v: attention(q, k, v, enable_gqa=gqa))
    assert ours == counts(math) and min(ours) > 0


def test_meta_tensors_give_shapes() -> None:
    """Meta tensors (a model shaped without memory) run chapter 1's PyTorch operations, which
    give the outputs' shapes: the forward, the jvp, the backward, and under autocast too."""
    q, k, v = (torch.randn(2, 4, 6, 8, device="meta") for _ in range(3))
    out, tangent_out = torch.func.jvp(attention, (q, k, v), (q, k, v))
    assert out.shape == tangent_out.shape == (2, 4, 6, 8) and out.is_meta and tangent_out.is_meta
    leaf = q.clone().requires_grad_()
    attention(leaf, k, v, is_causal=True).sum().backward()
    assert leaf.grad.shape == q.shape and leaf.grad.is_meta
    with torch.autocast("cpu", dtype=torch.bfloat16), sdpa(strict=True):
        assert F.scaled_dot_product_attention(q, k, v).shape == (2, 4, 6, 8)


def test_jit_trace_raises_on_the_kernels_path_and_the_drop_in_passes_it_on() -> None:
    """torch.jit.trace cannot record Triton launches (a trace would replay without them):
    `attention` raises `Unsupported` naming what works instead; under the drop-in the call
    falls through to PyTorch's SDPA, whose trace is right for new inputs."""
    q, k, v = (torch.randn(1, 2, 6, 8, device=DEVICE) for _ in range(3))
    assert api.uses_kernels(q, k, v)
    with pytest.raises(api.Unsupported, match="torch.export"):
        torch.jit.trace(lambda a, b, c: attention(a, b, c), (q, k, v), check_trace=False)

    def routed(a, b, c):
        with sdpa():
            return F.scaled_dot_product_attention(a, b, c)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fall-through's, and the tracer's
        traced = torch.jit.trace(routed, (q, k, v), check_trace=False)
    later = [torch.randn_like(q) for _ in range(3)]
    torch.testing.assert_close(traced(*later), api._TORCH_SDPA(*later))


def test_nested_tensors_fall_through_or_raise() -> None:
    """Nested (jagged) tensors, which PyTorch's SDPA takes: the drop-in passes them on, strict
    mode and `attention` raise `Unsupported` naming them."""
    nested = torch.nested.nested_tensor([torch.randn(3, 2, 8), torch.randn(5, 2, 8)],
                                        layout=torch.jagged, device=DEVICE).transpose(1, 2)
    with pytest.warns(UserWarning, match="nested"), sdpa() as routing:
        out = F.scaled_dot_product_attention(nested, nested, nested)
    assert routing.fell_through["nested tensors"] == 1 and routing.routed == 0
    want = api._TORCH_SDPA(nested, nested, nested)
    assert torch.equal(out.values(), want.values())
    with sdpa(strict=True), pytest.raises(api.Unsupported, match="nested"):
        F.scaled_dot_product_attention(nested, nested, nested)
    with pytest.raises(api.Unsupported, match="pad the sequences"):
        attention(nested, nested, nested)


def test_rank_2_inputs_fall_through_or_raise() -> None:
    """One sequence without a heads dim, (L, E), which PyTorch's SDPA takes (its math path):
    the drop-in passes it on, `attention` raises `Unsupported` saying to add a heads dim."""
    q, k, v = (torch.randn(6, 8, device=DEVICE) for _ in range(3))
    with pytest.warns(UserWarning, match="rank 2"), sdpa() as routing:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert routing.fell_through["inputs of rank 2"] == 1 and routing.routed == 0
    assert torch.equal(out, api._TORCH_SDPA(q, k, v, is_causal=True))
    with pytest.raises(api.Unsupported, match=r"unsqueeze\(0\)"):
        attention(q, k, v)
    torch.testing.assert_close(attention(q[None], k[None], v[None], is_causal=True)[0], out)


def test_sdpa_broadcasts_leading_dims_as_pytorch_does() -> None:
    """SDPA's math path broadcasts leading dims (a key/value of batch 1 and one head for a
    batch of queries with many heads), which `attention` does not take: the drop-in expands
    them and routes the call; output, tangent and the broadcast key's gradient (summed back
    by autograd) against float64."""
    q = torch.randn(2, 4, 9, 16, device=DEVICE)
    k, v = (torch.randn(1, 1, 9, 16, device=DEVICE) for _ in range(2))
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))

    def loss(sdpa_call, *inputs):
        out, tangent_out = torch.func.jvp(sdpa_call, inputs, tuple(
            t.to(inputs[0].dtype) for t in tangents))
        return out, tangent_out, torch.autograd.grad((out * tangent_out).sum(), inputs[1])[0]

    def run(dtype):
        return dict(zip(("out", "tangent_out", "dk"), loss(
            F.scaled_dot_product_attention,
            *(x.detach().to(dtype).requires_grad_() for x in (q, k, v))), strict=True))

    with sdpa() as routing:
        ours = run(torch.float32)
    assert routing.routed == 1 and not routing.fell_through
    with sdpa_kernel(SDPBackend.MATH):
        truth, floor = run(torch.float64), run(torch.float32)
    assert_accurate(ours, truth, floor, torch.float32, "broadcast leading dims")


def test_sdpa_passes_on_what_only_pytorch_takes(monkeypatch) -> None:
    """A scale that is a real number but not a float (NumPy, a 0-d tensor), which PyTorch's
    SDPA takes, is routed; a call outside `attention`'s contract (here one its check
    refuses) goes to PyTorch's SDPA; an invalid call gets PyTorch's own error and counts
    nothing; strict mode raises the library's error."""
    q, k, v = (torch.randn(2, 4, 9, 16, device=DEVICE) for _ in range(3))
    want = api._TORCH_SDPA(q, k, v, scale=0.5)
    for scale in (np.float32(0.5), torch.tensor(0.5)):
        with sdpa(strict=True) as routing:
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        assert routing.routed == 1
        torch.testing.assert_close(out, attention(q, k, v, scale=0.5), rtol=0, atol=0)
    with pytest.raises(TypeError, match="requires grad"):
        attention(q, k, v, scale=torch.tensor(0.5, requires_grad=True))

    def refuse(**call):
        raise ValueError("outside the contract")

    monkeypatch.setattr(api, "check_arguments", refuse)
    with sdpa() as routing:
        out = F.scaled_dot_product_attention(q, k, v, scale=0.5)
    assert routing.fell_through[api.OUTSIDE_CONTRACT] == 1 and routing.routed == 0
    torch.testing.assert_close(out, want)
    with sdpa(strict=True), pytest.raises(ValueError, match="outside the contract"):
        F.scaled_dot_product_attention(q, k, v)
    monkeypatch.undo()
    with sdpa() as routing, pytest.raises(RuntimeError, match="size of tensor"):
        F.scaled_dot_product_attention(q, k[:, :3], v[:, :3])
    assert routing.routed == 0 and not routing.fell_through


def test_sdpa_strict_raises() -> None:
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(3))
    with sdpa(strict=True):
        with pytest.raises(NotImplementedError, match="dropout_p"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        with pytest.raises(NotImplementedError, match="head dim"):
            F.scaled_dot_product_attention(*(randn(1, 2, 5, 264) for _ in range(3)))
    assert F.scaled_dot_product_attention is api._TORCH_SDPA


# --- bad inputs ---------------------------------------------------------------------------

Q, K, V = (torch.randn(2, 4, 9, 16, device=DEVICE) for _ in range(3))


def mask(*shape, dtype=torch.bool):
    return torch.ones(*shape, dtype=dtype, device=DEVICE)


BAD_INPUTS = {
    "query-not-a-tensor": (lambda: attention(Q.tolist(), K, V), TypeError, "query"),
    "rank-2": (lambda: attention(Q[0, 0], K[0, 0], V[0, 0]), NotImplementedError,
               "heads dim"),
    "rank-1": (lambda: attention(Q[0, 0, 0], K[0, 0, 0], V[0, 0, 0]), ValueError, "rank"),
    "rank-mismatch": (lambda: attention(Q, K[0], V[0]), ValueError, "query, key and value"),
    "batch-mismatch": (lambda: attention(Q, K[:1], V[:1]), ValueError, "leading"),
    "head-dim-mismatch": (lambda: attention(Q, K[..., :8], V), ValueError, "head dim"),
    "key-value-length": (lambda: attention(Q, K, V[:, :, :5]), ValueError, "key .* value"),
    "heads-without-enable_gqa": (lambda: attention(Q, K[:, :2], V[:, :2]), ValueError,
                                 "enable_gqa"),
    "gqa-not-divisible": (lambda: attention(Q, K[:, :3], V[:, :3], enable_gqa=True),
                          ValueError, "multiple"),
    "dtype-mismatch": (lambda: attention(Q, K.half(), V), TypeError, "dtype"),
    "mask-not-broadcastable": (lambda: attention(Q, K, V, attn_mask=mask(3, 9, 9)),
                               ValueError, "attn_mask"),
    "mask-too-many-dims": (lambda: attention(Q, K, V, attn_mask=mask(1, 1, 1, 1, 9)),
                           ValueError, "attn_mask"),
    "mask-int": (lambda: attention(Q, K, V, attn_mask=mask(9, 9, dtype=torch.int64)),
                 TypeError, "attn_mask"),
    "mask-float64": (lambda: attention(Q, K, V, attn_mask=mask(9, 9, dtype=torch.float64)),
                     TypeError, "attn_mask"),
    "head-dim-over-256": (lambda: attention(*(randn(1, 1, 4, 264) for _ in range(3))),
                          NotImplementedError, "head dim"),
    "value-dim-over-256": (lambda: attention(Q, K, randn(2, 4, 9, 300)), NotImplementedError,
                           "head dim"),
    "dropout": (lambda: attention(Q, K, V, dropout_p=0.1), NotImplementedError, "dropout_p"),
    "is_causal-not-bool": (lambda: attention(Q, K, V, is_causal=1), TypeError, "is_causal"),
    "is_causal-tensor": (lambda: attention(Q, K, V, is_causal=torch.tensor(True)), TypeError,
                         "is_causal"),
    "scale-not-a-number": (lambda: attention(Q, K, V, scale="0.1"), TypeError, "scale"),
    "scale-a-vector": (lambda: attention(Q, K, V, scale=torch.ones(2)), TypeError, "scale"),
    "enable_gqa-not-a-bool": (lambda: attention(Q, K, V, enable_gqa=1), TypeError,
                              "enable_gqa must be a bool"),
    "is_causal-numpy-bool": (lambda: attention(Q, K, V, is_causal=np.bool_(True)), TypeError,
                             "is_causal must be a bool, got numpy.bool"),
    "jvp-tangent-shape": (lambda: attention_jvp(Q, K, V, (Q, K[:, :, :5], V)), ValueError,
                          "tangent of key"),
    "jvp-tangent-dtype": (lambda: attention_jvp(Q, K, V, (Q, K, V.half())), ValueError,
                          "tangent of value"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_naming_the_argument(name: str) -> None:
    call, error, pattern = BAD_INPUTS[name]
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.gpu
def test_device_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="device"):
        attention(Q.cuda(), K.cpu(), V.cuda())
    with pytest.raises(ValueError, match="device"):
        attention(Q.cuda(), K.cuda(), V.cuda(), attn_mask=torch.ones(9, 9, dtype=torch.bool))


# --- the CPU fallback (no kernels) --------------------------------------------------------


@pytest.fixture
def without_kernels(monkeypatch):
    """What a CPU machine without TRITON_INTERPRET runs: chapter 1's tiled attention,
    differentiated by PyTorch itself."""
    monkeypatch.setattr(api, "uses_kernels", lambda query, key, value: False)


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_cpu_fallback_matches(spec: Spec, without_kernels) -> None:
    p = make_problem(spec, torch.float32, device="cpu")
    with mock.patch.object(api, "flash_attention_forward") as kernel:
        xs = leaves(p.q, p.k, p.v, *p.tangents)
        out, tangent_out = torch.func.jvp(lambda q, k, v: attention(q, k, v, **options(p)),
                                          tuple(xs[:3]), tuple(xs[3:]))
        torch.autograd.backward((out, tangent_out), (p.grad_out, p.grad_tangent_out))
        fused_out, fused_tangent = attention_jvp(p.q, p.k, p.v, p.tangents, **options(p))
    assert kernel.call_count == 0, "the fallback must not launch kernels"
    truth, floor = expected_forward(p)
    names = ("out", "tangent_out")
    for what, result in (("jvp", (out, tangent_out)), ("attention_jvp", (fused_out,
                                                                        fused_tangent))):
        assert_accurate(dict(zip(names, (r.detach() for r in result), strict=True)),
                        only(truth, *names), only(floor, *names), p.dtype, p.label,
                        f"fallback {what}")
    truth, floor = expected_second_order(p)
    assert_accurate(dict(zip(SECOND_ORDER_NAMES, (x.grad for x in xs), strict=True)), truth,
                    floor, p.dtype, p.label, "fallback gradients")


def test_cpu_fallback_takes_float64(without_kernels) -> None:
    q, k, v = (torch.randn(1, 2, 9, 16, dtype=torch.float64, device=DEVICE) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))


# --- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_name)
def test_jvp_then_loss_on_both_gpu(dtype: torch.dtype) -> None:
    """The training pattern at a realistic size, through the public API."""
    p = make_problem(Spec(batch=2, hq=8, hkv=2, nq=1000, nk=1000, d=128, mask="keypad",
                          causal=True, layout="bnhd"), dtype, device="cuda")
    xs = leaves(p.q, p.k, p.v, *p.tangents)
    out, tangent_out = torch.func.jvp(lambda q, k, v: attention(q, k, v, **options(p)),
                                      tuple(xs[:3]), tuple(xs[3:]))
    torch.autograd.backward((out, tangent_out), (p.grad_out, p.grad_tangent_out))
    truth, floor = expected_forward(p)
    names = ("out", "tangent_out")
    assert_accurate({"out": out.detach(), "tangent_out": tangent_out.detach()},
                    only(truth, *names), only(floor, *names), dtype, p.label, "api jvp")
    truth, floor = expected_second_order(p)
    assert_accurate(dict(zip(SECOND_ORDER_NAMES, (x.grad for x in xs), strict=True)), truth,
                    floor, dtype, p.label, "api jvp + loss on both")


@pytest.mark.gpu
def test_attention_on_the_second_gpu() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: checks that kernels launch on the inputs' device")
    p = make_problem(Spec(batch=1, hq=4, hkv=2, nq=1000, nk=1000, d=64, mask="keypad",
                          causal=True), torch.bfloat16, device="cuda:1")
    torch.cuda.set_device(0)
    xs = leaves(p.q, p.k, p.v, *p.tangents)
    out, tangent_out = torch.func.jvp(lambda q, k, v: attention(q, k, v, **options(p)),
                                      tuple(xs[:3]), tuple(xs[3:]))
    torch.autograd.backward((out, tangent_out), (p.grad_out, p.grad_tangent_out))
    assert out.device == tangent_out.device == torch.device("cuda:1")
    truth, floor = expected_second_order(p)
    assert_accurate(dict(zip(SECOND_ORDER_NAMES, (x.grad for x in xs), strict=True)), truth,
                    floor, p.dtype, p.label, "cuda:1 jvp + loss on both")
    truth, floor = expected_forward(p)
    names = ("out", "tangent_out")
    assert_accurate({"out": out.detach(), "tangent_out": tangent_out.detach()},
                    only(truth, *names), only(floor, *names), p.dtype, p.label, "cuda:1 jvp")
