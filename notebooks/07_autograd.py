# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 7: the public API, under every PyTorch transform
#
# The kernels are done; this chapter makes them a drop-in for
# `torch.nn.functional.scaled_dot_product_attention` (SDPA) that also works where SDPA's fast
# backends refuse: under forward-mode AD. Users call one function,
#
# ```python
# jvp_attention.attention(query, key, value, attn_mask=None, dropout_p=0.0,
#                         is_causal=False, scale=None, enable_gqa=False)
# ```
#
# with SDPA's signature and semantics on shapes `(..., H, N, D)`, and it works under plain
# backward, `torch.autograd.forward_ad` dual tensors, `torch.func.jvp` (with the primal
# output still differentiable, the way consistency-model and MeanFlow training use it), a
# backward through the tangent output (chapter 6), `torch.func.vmap` and `torch.compile`.
# For models one did not write, `with jvp_attention.sdpa():` routes every SDPA call the
# library supports to it and lets everything else fall through to PyTorch, counted and
# warned about once per reason.
#
# ## Three layers
#
# 1. **Custom operators** (`torch.library.custom_op`): `jvp_attention::forward`,
#    `::forward_jvp`, `::backward` and `::backward_tangent` wrap the launchers of chapters 2
#    and 5. Each has a *fake* implementation that only computes output shapes, so
#    `torch.compile` traces through them without running Triton or seeing Python it cannot
#    graph. In eager mode the Functions call the launchers directly: the dispatcher's work
#    per call (schema checks, its autograd and fake-tensor layers, Dynamo guards around
#    the implementation) is about as long as the kernels themselves at training shapes.
# 2. **Two autograd Functions**. `_Attention` takes (q, k, v) and returns O; its `backward`
#    runs the backward kernels. `_FusedTangent` takes (q, k, v, tq, tk, tv) and returns
#    (O, tO) from the *one* fused pass, and its `backward` takes cotangents of both O and tO
#    (chapter 6's kernels run only when tO's cotangent exists).
# 3. **The wrapper** `attention`: validates arguments, flattens leading dimensions, and asks
#    forward-mode AD whether the inputs carry tangents. If they do, it unpacks the duals,
#    calls the fused Function with primals and tangents as plain inputs, so the forward
#    kernel sees them, and hands forward-mode AD the dual `make_dual(O, tO)`.
#
# Why not a Function with a `jvp` rule? An autograd Function's `forward` receives plain
# tensors, and its `jvp` is only called *after* `forward`: a Function that waited for `jvp`
# would have to run a second kernel. Unpacking the duals first (`forward_ad.unpack_dual`,
# which also works inside `torch.func.jvp`) lets one launch produce O and tO together. And a
# `jvp` rule could not return tO itself (forward-mode AD refuses a tangent that is an output
# with a tangent of its own): it would cost a copy of tO per call, plus a zero tangent for
# tO that forward-mode AD materialises in full. `make_dual` takes tO as it is, with its
# autograd history, so a backward through the tangent (chapter 6) still reaches the
# Function. Dynamo, which runs no `jvp` rule at all, traces the same code.

# %%
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
FULL_SIZE = DEVICE == "cuda"

# %% [markdown]
# ## The custom operators
#
# Optional tensors (`attn_mask`) and Python scalars pass through the schema unchanged. The
# backward ops take every saved tensor explicitly: nothing is captured in closures, which is
# what lets `torch.compile` put them in a graph.

# %% tags=["export"]
"""Chapter 7: the public API: `attention` (SDPA-compatible, under every PyTorch transform) and
`sdpa()` (a drop-in that routes `F.scaled_dot_product_attention` here).

`notebooks/07_autograd.py` builds it and tests each transform.
"""

import contextlib
import functools
import inspect
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch._C._functorch import TransformType
from torch._functorch import eager_transforms
from torch._functorch.pyfunctorch import temporarily_pop_interpreter_stack
from torch._functorch.utils import unwrap_dead_wrappers
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import register_flop_formula

from jvp_attention.backward import flash_attention_backward, mask_grad_buffer, traceable_backward
from jvp_attention.forward import flash_attention_forward, lse_dtype, traceable_forward
from jvp_attention.launch import accurate, get_precision, interpreting
from jvp_attention.reference import check_sdpa_arguments, reference_attention, tiled_attention

Tensor = torch.Tensor
# The kernels take any strides, but Inductor must hand them the layouts it traced.
_FIXED_STRIDES = (torch.Tag.needs_fixed_stride_order,)
_LAUNCHERS: dict = {}


def _operator(name: str):
    """Register a launcher as the custom operator `jvp_attention::name`, keeping the plain
    function for eager calls (see `_launch`)."""
    def register(launcher):
        _LAUNCHERS[name] = launcher
        return torch.library.custom_op(f"jvp_attention::{name}", launcher, mutates_args=(),
                                       tags=_FIXED_STRIDES)
    return register


def _launch(name: str, *args):
    """Run operator `name`. On plain tensors in eager mode: the launcher itself, which skips
    the dispatcher's per-call work. Otherwise the operator: under torch.compile and
    AOTAutograd's tracing (fake and functional tensors: the operator is opaque and has a fake
    implementation), for functorch's wrapped tensors (a backward inside torch.func.grad: the
    operator unwraps them) and other tensors without storage (the batched cotangents of
    `torch.autograd.grad(..., is_grads_batched=True)`, which `torch.autograd.functional`'s
    `jacobian` and `hessian` take with `vectorize=True`: the dispatcher batches the
    operator), and under a dispatch mode (make_fx, FlopCounterMode), which should see the
    operator. For a compiled graph, the operator's traced twin (`_TRACED`)."""
    if _plain_eager(args):
        return _LAUNCHERS[name](*args)
    if _in_compiled_graph(args):
        name = _TRACED.get(name, name)
    return getattr(torch.ops.jvp_attention, name)(*args)


def _in_compiled_graph(args) -> bool:
    """Dynamo is tracing, or AOTAutograd is (a backward rule runs on fake and functional
    tensors; before torch 2.13, `is_compiling()` is False there)."""
    return torch.compiler.is_compiling() or any(
        isinstance(x, (FakeTensor, FunctionalTensor)) for x in args)


def _plain_eager(args) -> bool:
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    for x in args:  # a loop, not all(...): a generator's steps cost a call each
        if isinstance(x, Tensor) and (type(x) is not Tensor or _is_functorch_wrapped(x)
                                      or not _has_storage(x)):
            return False
    return True


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_has_storage = torch._C._has_storage


@_operator("forward")
def _forward_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                scale: float, residual: bool, precision: str) -> tuple[Tensor, Tensor, Tensor]:
    if not residual:
        result = flash_attention_forward(q, k, v, attn_mask, is_causal, scale,
                                         precision=precision)
        return result.out, result.lse, _NO_TENSOR(q)
    result, (out_residual, _) = flash_attention_forward(q, k, v, attn_mask, is_causal, scale,
                                                        residuals=True, precision=precision)
    return result.out, result.lse, out_residual


@_forward_op.register_fake
def _forward_fake(q, k, v, attn_mask, is_causal, scale, residual, precision):
    return (_empty_out(q, v), _empty_rows(q, lse_dtype(attn_mask)),
            _empty_out(q, v) if residual else _NO_TENSOR(q))


@_operator("forward_jvp")
def _forward_jvp_op(q: Tensor, k: Tensor, v: Tensor, tq: Tensor, tk: Tensor, tv: Tensor,
                    attn_mask: Tensor | None, mask_tangent: Tensor | None, is_causal: bool,
                    scale: float, residual: bool, precision: str,
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    tangents = (tq, tk, tv)
    if not residual:
        result = flash_attention_forward(q, k, v, attn_mask, is_causal, scale, tangents,
                                         mask_tangent=mask_tangent, precision=precision)
        return (result.out, result.tangent_out, result.lse, result.mu, _NO_TENSOR(q),
                _NO_TENSOR(q))
    result, residuals = flash_attention_forward(q, k, v, attn_mask, is_causal, scale, tangents,
                                                residuals=True, mask_tangent=mask_tangent,
                                                precision=precision)
    return result.out, result.tangent_out, result.lse, result.mu, *residuals


@_forward_jvp_op.register_fake
def _forward_jvp_fake(q, k, v, tq, tk, tv, attn_mask, mask_tangent, is_causal, scale, residual,
                      precision):
    out_like = _empty_out(q, v) if residual else _NO_TENSOR(q)
    return (_empty_out(q, v), _empty_out(q, v), _empty_rows(q, lse_dtype(attn_mask)),
            _empty_rows(q), out_like, out_like.new_empty(out_like.shape))


@_operator("backward")
def _backward_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 out_residual: Tensor, grad_out: Tensor, attn_mask: Tensor | None,
                 is_causal: bool, scale: float, mask_grad: bool, precision: str,
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = flash_attention_backward(q, k, v, out, lse, grad_out, attn_mask, is_causal, scale,
                                     out_residual=_tensor_or_none(out_residual),
                                     mask_grad=mask_grad, precision=precision)
    return grads if mask_grad else (*grads, _NO_TENSOR(q))


@_backward_op.register_fake
def _backward_fake(q, k, v, out, lse, out_residual, grad_out, attn_mask, is_causal, scale,
                   mask_grad, precision):
    # contiguous, like the kernels' results
    return (*(x.new_empty(x.shape) for x in (q, k, v)),
            _empty_mask_grad(q, k, attn_mask, mask_grad))


@_operator("backward_tangent")
def _backward_tangent_op(q: Tensor, k: Tensor, v: Tensor, tq: Tensor, tk: Tensor, tv: Tensor,
                         out: Tensor, lse: Tensor, tangent_out: Tensor, mu: Tensor,
                         out_residual: Tensor, tangent_out_residual: Tensor,
                         grad_out: Tensor, grad_tangent_out: Tensor, attn_mask: Tensor | None,
                         mask_tangent: Tensor | None, is_causal: bool, scale: float,
                         mask_grad: bool, precision: str,
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = flash_attention_backward(
        q, k, v, out, lse, grad_out, attn_mask, is_causal, scale, (tq, tk, tv), tangent_out,
        mu, grad_tangent_out, _tensor_or_none(out_residual),
        _tensor_or_none(tangent_out_residual), mask_tangent=mask_tangent,
        mask_grad=mask_grad, precision=precision)
    return grads if mask_grad else (*grads, _NO_TENSOR(q), _NO_TENSOR(q))


@_backward_tangent_op.register_fake
def _backward_tangent_fake(q, k, v, tq, tk, tv, out, lse, tangent_out, mu, out_residual,
                           tangent_out_residual, grad_out, grad_tangent_out, attn_mask,
                           mask_tangent, is_causal, scale, mask_grad, precision):
    return (*(x.new_empty(x.shape) for x in (q, k, v, q, k, v)),
            _empty_mask_grad(q, k, attn_mask, mask_grad),
            _empty_mask_grad(q, k, attn_mask if mask_tangent is None else mask_tangent,
                             mask_grad))


def _NO_TENSOR(q: Tensor) -> Tensor:  # noqa: N802 - reads as a constant at the call sites
    """The placeholder for an output that was not asked for: an empty tensor."""
    return q.new_empty((0,))


def _tensor_or_none(x: Tensor) -> Tensor | None:
    return x if x.numel() else None


def _wants_residual(*inputs: Tensor) -> bool:
    """Keep the outputs' rounding residuals for the backward: only if a backward can happen,
    for 16-bit inputs, in the accurate precision mode (inference pays nothing for them)."""
    differentiable = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    return differentiable and inputs[0].dtype != torch.float32 and accurate()


def _empty_out(q: Tensor, v: Tensor) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _empty_rows(q: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return q.new_empty(q.shape[:-1], dtype=dtype)


def _empty_mask_grad(q: Tensor, k: Tensor, mask: Tensor | None, mask_grad: bool) -> Tensor:
    """The (B, Hq, Nq, Nk) gradient of `mask` in its dtype, or the empty placeholder."""
    if not mask_grad:
        return _NO_TENSOR(q)
    return mask_grad_buffer(mask, (*q.shape[:-1], k.shape[-2]))


# %% [markdown]
# ## The autograd Functions
#
# `_Attention` is the primal path: forward and backward kernels, nothing else.
#
# `_FusedTangent` takes the tangents as ordinary inputs and returns (O, tO, LSE, μ) from the
# one fused launch; its `backward` takes cotangents of O and tO. It serves `attention` under
# forward-mode AD (eager and compiled alike), and the explicit API `attention_jvp` below.
#
# The tangent *of tO* would be a second-order forward derivative, which the fused pass does
# not compute: `_FusedTangent` has no `jvp` rule (Dynamo could not trace it if it had one),
# so forward-mode AD raises if it asks for one (a `jvp` of `attention_jvp`) rather than
# returning a silently wrong zero; a nested `torch.func.jvp` of `attention` never gets here
# (see the wrapper). `set_materialize_grads(False)` lets
# `backward` see `None` when nothing uses tO, and then the plain backward runs at its plain
# cost.
#
# The backwards run the kernels with autograd off. When their results may be differentiated
# again (a gradient penalty's `create_graph=True`, and every `torch.func.grad`, which always
# asks for a graph) the kernels' gradients pass through `_ReferenceSecondOrder`: nothing
# changes unless a second derivative is actually taken, and then it differentiates chapter 1's
# reference gradients in PyTorch operations (O(N²) memory, but right). The second derivative
# is tied the same way, as a function of the inputs *and* of the cotangents it was taken
# with, so a third derivative is right too, and so is a derivative of the double backward
# with respect to those cotangents: `torch.autograd.functional.hvp` takes its
# Hessian-vector product that way (the "double backward trick"), and when the second
# derivative was a constant to autograd, it silently returned zeros. Each Function records the precision mode of its
# forward, and its backward runs in that mode whatever `set_precision` says by then.
#
# Under `torch.compile`, AOTAutograd differentiates the operators rather than the Functions,
# so the operators get the same backward rules through `torch.library.register_autograd`.

# %% tags=["export"]
def _zeros_like(x: Tensor) -> Tensor:
    # A stride-0 view: the tangent of an output nobody differentiates costs no memory.
    return x.new_zeros(()).expand_as(x)


def _needs_graph(ctx, grad_outputs) -> bool:
    """Whether a backward's results may be differentiated again (create_graph=True, any
    torch.func.grad): autograd is on and something it saw requires a gradient."""
    if not torch.is_grad_enabled():
        return False
    tensors = [*ctx.saved_tensors, *grad_outputs]
    return any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _grads_by_reference(is_causal, scale, primals, tangents, mask, mask_tangent,
                        grad_outputs):
    """Gradients of (q, k, v[, tq, tk, tv], mask, mask_tangent) from chapter 1's reference in
    PyTorch operations, as a graph that PyTorch can differentiate again."""
    result = reference_attention(*primals, mask, is_causal, scale, enable_gqa=True,
                                 tangents=tangents, mask_tangent=mask_tangent)
    pairs = [(o, g) for o, g in zip((result.out, result.tangent_out), grad_outputs,
                                    strict=False) if g is not None]
    inputs = [*primals, *(tangents or ()), mask, mask_tangent]
    wanted = [isinstance(x, Tensor) and x.requires_grad for x in inputs]
    grads = iter(torch.autograd.grad(
        [o for o, _ in pairs], [x for x, w in zip(inputs, wanted, strict=True) if w],
        [g for _, g in pairs], create_graph=True, allow_unused=True) if any(wanted) else ())
    return [next(grads) if w else None for w in wanted]


def _vjp_by_reference(grads_of, inputs, cotangents, create_graph: bool) -> list:
    """The vector-Jacobian product of `grads_of`'s outputs at `inputs` with `cotangents`
    (one per output, None for none), aligned with `inputs`: None where an input does not
    require grad, zeros where no output reaches it."""
    wanted = [isinstance(x, Tensor) and x.requires_grad for x in inputs]
    pairs = [(g, c) for g, c in zip(grads_of(inputs), cotangents, strict=True)
             if g is not None and c is not None and g.requires_grad]
    found = iter(torch.autograd.grad(
        [g for g, _ in pairs], [x for x, w in zip(inputs, wanted, strict=True) if w],
        [c for _, c in pairs], create_graph=create_graph, allow_unused=True)
        if pairs and any(wanted) else [None] * sum(wanted))
    products = [next(found) if w else None for w in wanted]
    return [torch.zeros_like(x) if w and g is None else g
            for x, g, w in zip(inputs, products, wanted, strict=True)]


class _ReferenceSecondOrder(torch.autograd.Function):
    """Passes gradients computed elsewhere (the kernels') through unchanged; differentiating
    them (a double backward) differentiates `grads_of`, the same gradients in chapter 1's
    reference operations, instead. The derivative it returns is tied the same way, as a
    function of everything it read (the inputs and the cotangents), so a derivative of any
    order, and of the double backward with respect to its cotangents (the "double backward
    trick" of `torch.autograd.functional.hvp`), is right. Under vmap (per-sample gradients,
    `jacrev`) functorch runs each step batched."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grads_of, n_inputs, *tensors):
        return tuple(g.detach() for g in tensors[n_inputs:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        grads_of, n_inputs, *tensors = inputs
        ctx.grads_of = grads_of
        ctx.save_for_backward(*tensors[:n_inputs])

    @staticmethod
    def backward(ctx, *grad_grads):
        saved, grads_of = ctx.saved_tensors, ctx.grads_of
        n_saved = len(saved)
        # Fresh leaves: the partial derivatives through the reference only; the engine
        # carries them on through the graph that produced the inputs.
        leaves = [x.detach().requires_grad_() if isinstance(x, Tensor) and x.requires_grad
                  else x for x in saved]
        with torch.enable_grad():
            second = _vjp_by_reference(grads_of, leaves, grad_grads, create_graph=False)
        if torch.is_grad_enabled():  # the derivative may be differentiated again

            def derivative_of(xs):  # this derivative, as a function of what it read
                with torch.enable_grad():
                    return [g for g in _vjp_by_reference(grads_of, xs[:n_saved], xs[n_saved:],
                                                         create_graph=True) if g is not None]

            present = [g for g in second if g is not None]
            read = (*saved, *grad_grads)
            tied = iter(_ReferenceSecondOrder.apply(derivative_of, len(read), *read, *present))
            second = [None if g is None else next(tied) for g in second]
        return (None, None, *second, *(None for _ in grad_grads))


def _second_order_by_reference(ctx, grads, primals, tangents, mask, mask_tangent,
                               grad_outputs):
    """The kernels' `grads`, tied to everything they depend on through
    `_ReferenceSecondOrder` when they may be differentiated again (else returned as they
    are): a gradient penalty gets the right second derivative, plain backwards pay nothing."""
    if not _needs_graph(ctx, grad_outputs):
        return grads
    n_primals, n_tangents = len(primals), 0 if tangents is None else len(tangents)
    inputs = (*primals, *(tangents or ()), mask, mask_tangent, *grad_outputs)

    def grads_of(xs):
        cut = n_primals + n_tangents
        reference = _grads_by_reference(
            ctx.is_causal, ctx.scale, xs[:n_primals], tuple(xs[n_primals:cut]) or None,
            xs[cut], xs[cut + 1], xs[cut + 2:])
        return [r for r, g in zip(reference, grads, strict=False) if g is not None]

    present = [g for g in grads if g is not None]
    tied = iter(_ReferenceSecondOrder.apply(grads_of, len(inputs), *inputs, *present))
    return tuple(None if g is None else next(tied) for g in grads)


def _fold_vmap_dim(x: Tensor | None, dim: int | None, size: int,
                   stored: bool = False) -> Tensor | None:
    """Merge vmap's batch dimension into the leading batch dimension of a (B, ...) tensor.
    A tensor without it is repeated along it: as a stride-0 view, or `stored` in memory."""
    if not isinstance(x, Tensor):
        return x
    if dim is not None:
        return x.movedim(dim, 0).flatten(0, 1)
    x = x.expand(size, *x.shape).flatten(0, 1)
    return x.contiguous() if stored else x


def _vmap_by_folding(run, info, in_dims, *args, stored: bool = False):
    """A vmap rule for functions of (B, ...) tensors, `run`: vmap's dimension joins the
    batch (an empty placeholder stays empty)."""
    folded = [_fold_vmap_dim(x, d, info.batch_size, stored)
              for x, d in zip(args, in_dims, strict=True)]
    outputs = run(*folded)
    return tuple(o.unflatten(0, (info.batch_size, -1)) for o in outputs), (0,) * len(outputs)


# The operators batch the same way, so that a backward under vmap (per-sample gradients,
# `jacrev`) is one launch of each kernel rather than PyTorch's loop over the batch. Their
# saved inputs (out, the row statistics) are read as the forward stored them, so what
# vmap does not batch is repeated in memory.
for _op in (_forward_op, _forward_jvp_op, _backward_op, _backward_tangent_op):
    _op.register_vmap(functools.partial(_vmap_by_folding, _op, stored=True))


class _Attention(torch.autograd.Function):
    @staticmethod
    def vmap(info, in_dims, q, k, v, attn_mask, is_causal, scale, residual, precision):
        # Folded, the inputs are seen at the level below vmap's: inside torch.func.jvp (a
        # jvp of a vmapped function) they carry their tangents there, and `_attend` takes
        # the fused pass.
        folded = [_fold_vmap_dim(x, d, info.batch_size)
                  for x, d in zip((q, k, v, attn_mask), in_dims[:4], strict=True)]
        outputs = _attend(*folded, is_causal, scale, precision, _traced())
        return tuple(o.unflatten(0, (info.batch_size, -1)) for o in outputs), (0,) * 3

    @staticmethod
    def forward(q, k, v, attn_mask, is_causal, scale, residual, precision):
        return _launch("forward", q, k, v, attn_mask, is_causal, scale, residual, precision)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, attn_mask, is_causal, scale, _, precision = inputs
        out, lse, out_residual = output
        ctx.mark_non_differentiable(lse, out_residual)
        ctx.save_for_backward(q, k, v, attn_mask, out, lse, out_residual)
        ctx.is_causal, ctx.scale, ctx.precision = is_causal, scale, precision

    @staticmethod
    def backward(ctx, grad_out, *_):
        q, k, v, attn_mask, out, lse, out_residual = ctx.saved_tensors
        mask_grad = ctx.needs_input_grad[3]
        with torch.no_grad():
            dq, dk, dv, d_mask = _launch(
                "backward", q, k, v, out, lse, out_residual, grad_out, attn_mask,
                ctx.is_causal, ctx.scale, mask_grad, ctx.precision)
        grads = _second_order_by_reference(
            ctx, (dq, dk, dv, _mask_grad(d_mask, attn_mask, mask_grad)), (q, k, v), None,
            attn_mask, None, (grad_out,))
        return (*grads, None, None, None, None)


def _mask_grad(d_mask: Tensor, attn_mask: Tensor | None, wanted: bool) -> Tensor | None:
    """The kernels' mask gradient (in the mask's dtype already, a fallback's cast to it);
    autograd sums it over the dimensions the mask was broadcast along."""
    return d_mask.to(attn_mask.dtype) if wanted else None


class _FusedTangent(torch.autograd.Function):
    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_by_folding(_FusedTangent.apply, info, in_dims, *args)

    @staticmethod
    def forward(q, k, v, tq, tk, tv, attn_mask, mask_tangent, is_causal, scale, residual,
                precision):
        return _launch("forward_jvp", q, k, v, tq, tk, tv, attn_mask, mask_tangent,
                                        is_causal, scale, residual, precision)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, tq, tk, tv, attn_mask, mask_tangent, is_causal, scale, _, precision = inputs
        out, tangent_out, lse, mu, out_residual, tangent_out_residual = output
        ctx.mark_non_differentiable(lse, mu, out_residual, tangent_out_residual)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, tq, tk, tv, attn_mask, mask_tangent, out, lse,
                              tangent_out, mu, out_residual, tangent_out_residual)
        ctx.is_causal, ctx.scale, ctx.precision = is_causal, scale, precision

    @staticmethod
    def backward(ctx, grad_out, grad_tangent_out, *_):
        (q, k, v, tq, tk, tv, attn_mask, mask_tangent, out, lse, tangent_out, mu,
         out_residual, tangent_out_residual) = ctx.saved_tensors
        if grad_out is None and grad_tangent_out is None:
            return (None,) * 12
        grad_outputs = (grad_out, grad_tangent_out)
        if grad_out is None:
            grad_out = _zeros_like(out)
        wants_mask, wants_mask_tangent = ctx.needs_input_grad[6], ctx.needs_input_grad[7]
        with torch.no_grad():
            if grad_tangent_out is None:
                dq, dk, dv, d_mask = _launch(
                    "backward", q, k, v, out, lse, out_residual, grad_out, attn_mask,
                    ctx.is_causal, ctx.scale, wants_mask, ctx.precision)
                grads = (dq, dk, dv, None, None, None, _mask_grad(d_mask, attn_mask, wants_mask),
                         None)
            else:
                *grads, d_mask, d_mask_tangent = _launch(
                    "backward_tangent", q, k, v, tq, tk, tv, out, lse, tangent_out, mu, out_residual,
                    tangent_out_residual, grad_out, grad_tangent_out, attn_mask, mask_tangent,
                    ctx.is_causal, ctx.scale, wants_mask or wants_mask_tangent, ctx.precision)
                grads = (*grads, _mask_grad(d_mask, attn_mask, wants_mask),
                         _mask_grad(d_mask_tangent, mask_tangent, wants_mask_tangent))
        grads = _second_order_by_reference(ctx, grads, (q, k, v), (tq, tk, tv), attn_mask,
                                           mask_tangent, grad_outputs)
        return (*grads, None, None, None, None)


# Function.apply binds default arguments through inspect.signature on every call (about as
# long as the rest of a call's Python): a precomputed __signature__ makes it a lookup.
for _function in (_Attention, _FusedTangent):
    _function.forward.__signature__ = inspect.signature(_function.forward)


# Under torch.compile, AOTAutograd differentiates the operators themselves (Dynamo traces a
# Function's forward, not its backward): give them the Functions' rules.
torch.library.register_autograd("jvp_attention::forward", _Attention.backward,
                                setup_context=_Attention.setup_context)
torch.library.register_autograd("jvp_attention::forward_jvp", _FusedTangent.backward,
                                setup_context=_FusedTangent.setup_context)


def _traced_twin(name: str, fake, traceable) -> None:
    """Register `name_traced`: operator `name` as a `torch.library.triton_op`, with its
    signature and `fake`. Traced, its body runs the launcher, whose launches enter the compiled graph
    (`launchable`); where `traceable(*args)` says the launcher's choices cannot be traced,
    it calls the opaque operator instead."""
    opaque = getattr(torch.ops.jvp_attention, name).default
    signature = inspect.signature(_LAUNCHERS[name])

    def body(*args):
        return _LAUNCHERS[name](*args) if traceable(*args) else opaque(*args)

    body.__signature__ = signature  # the schema is inferred from it
    # No source file, so that triton_op skips its scan for kernels (see below)
    body.__code__ = body.__code__.replace(co_filename=f"<{name}_traced>")
    torch.library.triton_op(f"jvp_attention::{name}_traced", body,
                            mutates_args=()).register_fake(fake)
    _TRACED[name] = f"{name}_traced"


# Which calls of each operator may be traced (the operators' arguments: q, k, v first).
def _forward_traceable(q, k, v, *args) -> bool:
    return traceable_forward(q, k, v)


def _backward_traceable(q, k, v, *args) -> bool:
    return traceable_backward(q, k, v, has_tangent=False)


def _backward_tangent_traceable(q, k, v, *args) -> bool:
    return traceable_backward(q, k, v, has_tangent=True)


# Under Triton's interpreter `wrap_triton` runs kernels even on traced tensors, so there the
# compiled path keeps the opaque operators.
_TRACED: dict[str, str] = {}
if not interpreting():
    _traced_twin("forward", _forward_fake, _forward_traceable)
    _traced_twin("forward_jvp", _forward_jvp_fake, _forward_traceable)
    _traced_twin("backward", _backward_fake, _backward_traceable)
    _traced_twin("backward_tangent", _backward_tangent_fake, _backward_tangent_traceable)
    for _function, _name in ((_Attention, "forward"), (_FusedTangent, "forward_jvp")):
        torch.library.register_autograd(f"jvp_attention::{_name}_traced", _function.backward,
                                        setup_context=_function.setup_context)


# %% [markdown]
# ### Counting FLOPs
#
# `torch.utils.flop_counter.FlopCounterMode`, the usual way to count a model's FLOPs (for
# its model FLOPs utilisation), is a dispatch mode: it sees the operators, and counts an
# operator without a formula as zero, so a model whose attention runs here would seem to
# spend nothing there. Each operator gets the count PyTorch's math path gives the same call,
# its matrix products: $F = 2 B H N_q N_k (D_{qk} + D_v)$ for the forward (PyTorch's own
# formula for SDPA, causal or not), $3F$ with the tangent (the forward's two products and
# four more: $t_S = t_Q K^\top + Q t_K^\top$, $t_O = t_P V + P t_V$), $2F$ for the
# backward and $6F$ for the backward through both outputs (each of those six products
# differentiated with respect to both its factors).

# %% tags=["export"]
_ATTENTION_PRODUCTS = {"forward": 1, "forward_jvp": 3, "backward": 2, "backward_tangent": 6}


def _attention_flops(products: int):
    """A `register_flop_formula` formula: `products` times the forward's F, from the shapes
    of q, k and v (every operator's first three arguments)."""
    def count(q_shape, k_shape, v_shape, *_, **__) -> int:
        batch, heads, n_q, head_dim = q_shape
        return products * 2 * batch * heads * n_q * k_shape[-2] * (head_dim + v_shape[-1])
    return count


for _name, _products in _ATTENTION_PRODUCTS.items():
    for _op in (_name, _TRACED.get(_name)):
        if _op is not None:
            register_flop_formula(getattr(torch.ops.jvp_attention, _op))(
                _attention_flops(_products))


# %% [markdown]
# ### Kernels that the compiled graph launches
#
# Opaque, an operator's Python runs on every call of a compiled graph too: our launcher,
# the autotuner's dispatch and the dispatcher's layers, which at DiT's short rows cost more
# host time than the GPU spends (chapter 8, "Compiled calls against PyTorch's compiled
# floor"). So each operator has a twin, `name_traced` (`_traced_twin`): the same launcher,
# signature, fake implementation and, for the forwards, autograd rule, registered as a
# `torch.library.triton_op`. For a compiled graph `_launch` calls the twin: while Dynamo
# traces, and while AOTAutograd traces a backward rule on fake and functional tensors
# (`_in_compiled_graph`; before torch 2.13 `is_compiling()` is False there). AOTAutograd
# then runs the twin's launcher once on functional tensors, each launch goes through
# `wrap_triton` (`launchable`, chapter 2), and the compiled graph holds the kernel launches
# themselves, which Inductor runs with its own lean launcher.
#
# Where the launcher's choices need the data or a compiler switch, the twin calls the
# opaque operator instead (`traceable_forward`, `traceable_backward`): tensor descriptors
# (they are chosen by the data's alignment: the forward's from 4096 keys, the first-order
# backward's from 1024 tokens), and head dims cut in two (d = 40, 72) in calls of more than
# `PADDED_MAX_SCORES` scores while this library compiles with its own ptxas
# (`sound_ptxas`: Inductor's compile workers would use Triton's, which faults at d = 40
# and 72). Smaller calls at those head dims enter the graph with one padded column tile
# (`launch_column_tiles`, chapter 2), whose host time saved outweighs the extra products.
# The bf16 carry's copy kernel cannot enter a graph either (it takes jit functions as
# arguments), but it need not keep the whole call out: the twin calls the copies through
# an opaque operator of their own (`graph_carry`, chapter 2; `value_operands`,
# `backward_operands`, `second_order_operands`) and traces the attention kernels that read
# them, so a graph carries wherever eager mode does, for two small launches' host time.
#
# The descriptors are only worth their opaque call where something else removes its host
# work. CUDA graphs do (`mode="reduce-overhead"`); without them an opaque call costs about
# 1 ms of Python per step, and at DiT-B/2's 1024 tokens a compiled MeanFlow step spent
# 58.7 of its 63.6 ms in the host's forward and backward (chapter 9). So a graph that runs
# its launches from Python (`host_bound_graph`, chapter 2) traces the backward's pointer
# kernels below 4096 tokens where eager mode would read through descriptors
# (`backward_tma_min_tokens`, chapter 5): some GPU time for all of that host time. From
# 4096 tokens it does the same, forward and backward, in calls of at most
# `GRAPH_POINTER_MAX_SCORES` = $2^{29}$ scores (`graph_takes_pointers`, chapter 2): at
# DiT-B/2's 4096 tokens (batch 2, $2^{28.6}$ scores) the opaque calls had left the compiled
# step bound by the host, 55.5 ms against 42.7 ms with CUDA graphs (chapter 9). Larger
# calls are bound by their GPU time, which hides the opaque call, and keep the descriptors
# and chapters 11-12's kernels. A graph that CUDA graphs replay keeps the opaque operator
# and its faster kernels.
#
# Until the copies had their own operator, such a graph traced the split products where
# eager mode carries, which cost GPU time the host could not hide in large calls. On the
# H200 (bf16, chapter 8's training shapes, compiled without CUDA graphs, GPU time per
# call): the MeanFlow call took 2.68 ms against eager's 2.05 at (32, 12, 1024, 64) and 2.80
# against 2.46 at (16, 16, 1024, 128); the second-order step 6.62 against 6.19 ms at
# (16, 16, 1024, 72) and 297 against 257 ms at (1, 12, 32760, 128). With the graph's own
# carry operator the forward with the tangent takes eager's time (0.926 against 0.927 ms
# at (32, 12, 1024, 64)), the MeanFlow call 2.22 and 2.48 ms (the pointer backward's
# share), and the second-order step 5.29 against eager's 5.32 ms.
#
# Registering a twin would import `torch._inductor` (about a second, paid by the first call
# of every process, compiled or not): `triton_op` scans the body's source for the kernels it
# launches, which it cannot find behind `_LAUNCHERS` anyway, so the body is given no
# source file to scan.
#
# Comparing compiled steps with eager ones on the H200 found two ways in which a graph
# went wrong, both from handing a kernel something other than the whole tensor it reads. A
# bool mask was handed as its bytes, `mask.view(torch.uint8)`, a dtype view that Inductor
# fails to lower from bool. Worse, a bias with a tangent (a learnable bias inside
# `torch.func.jvp`) was handed as the view of the biases in one buffer of (bias, tangent)
# pairs, and the kernels read each tangent as the element after its bias, outside that
# view. Inductor hands a user's kernel its tensors at the strides they were traced with:
# it copied the view into a new buffer with the same strides, whose gaps, where the
# kernels read the tangents, were never written, and the compiled MeanFlow step's query
# gradient was off eager's by 28% of its largest entry, silently. Now `mask_operand`
# (chapter 2) hands the kernels a bool mask as it is (Triton reads a bool pointer as
# bytes) and the pairs whole, as a (B, H, Nq, 2, Nk) view (each row's biases, then their
# tangents; `mask_pairs`): whatever Inductor stores, it stores all that the kernels read,
# and both masks are launched by the graph.
# `tests/library/test_traced.py` compares compiled steps with eager ones on the GPU for
# each mask kind, fp32 biases beside bf16 queries (autocast's way) and the padded head
# dims.
#
# Under Triton's interpreter there is nothing to trace: `wrap_triton` runs interpreted
# kernels directly, so the CPU keeps the opaque operators. The graphs can still be traced
# there: `tests/library/test_traced.py` traces every twin on fake CUDA tensors with Triton
# given a Hopper target, and checks which calls launch kernels and that Inductor's
# analysis of each launch finds exactly the arguments the kernel writes (where that
# analysis fails, Inductor assumes every argument is written, and `out`, passed again as
# its own residual when there is none, would come back as an unwritten copy).
#
# On the H200 (bf16, DiT-B/2 at 256 px, (64, 12, 256, 64), `torch.compile` with the
# default mode), every kernel of a MeanFlow step and of a second-order step is launched by
# Inductor, and the host time per compiled call fell from 1.48 to 1.01 ms for the MeanFlow
# step and from 1.41 to 1.08 ms for the second-order step (chapter 8). The first compiled
# step at each shape compiles and times the kernels' tiles inside Inductor: 10-15 s there,
# in a fresh Inductor cache, about what the opaque operators' first call spends compiling
# and tuning them through Triton (6.5-16.7 s in chapter 8's runs).

# %% [markdown]
# ## Validation
#
# SDPA's contract is chapter 1's `check_sdpa_arguments`, the one validator of the references
# and of every entry point here. `check_arguments` adds this library's own limits to it and
# is what `attention`, `attention_jvp`, the drop-in and context parallelism call: invalid
# calls raise `TypeError`/`ValueError` as SDPA would, with messages that name the argument and
# show the shapes, and calls that SDPA takes but we cannot (nested tensors, calls traced
# by `torch.jit.trace`, inputs of rank 2 (one sequence without a heads dim, which SDPA's
# math path takes), dropout, head dims above 256, dtypes other than fp16, bf16, fp32 and float64, bfloat16 in Triton's
# interpreter, whose bfloat16 products are wrong) raise `Unsupported`, a
# `NotImplementedError` with a short `reason` that the drop-in counts. Masks may be bool, float32 or the query's dtype, as for
# SDPA (autocast hands fp32 masks to 16-bit queries; the kernels add the bias in fp32).

# %% tags=["export"]
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


class Unsupported(NotImplementedError):
    """A call that PyTorch's SDPA takes but jvp_attention cannot; `reason` says which rule."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def check_arguments(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    tangents: tuple[Tensor, Tensor, Tensor] | None = None,
    mask_tangent: Tensor | None = None,
) -> None:
    """Raise unless `attention` takes the call: SDPA's contract (`check_sdpa_arguments`),
    then this library's limits. Arguments as for `attention` and `attention_jvp`, after
    autocast's casts.

    Raises:
        TypeError, ValueError: For calls that SDPA would reject.
        Unsupported: For calls that SDPA takes but the library cannot.
    """
    # (no generator, no Python-level helper: this runs on every call)
    if (isinstance(query, Tensor) and query.dim() and isinstance(query.shape[-1], Tensor)
            and kernels_take(query)):  # torch.jit.trace's sizes are tensors
        raise Unsupported(
            "torch.jit.trace",
            "torch.jit.trace cannot record the Triton kernels' launches: capture the model "
            "with torch.export or torch.compile, which see jvp_attention's operators")
    if (isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)
            and min(query.dim(), key.dim(), value.dim()) == 2):  # SDPA's math path takes it
        raise Unsupported(
            "inputs of rank 2",
            f"query, key and value of shapes {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)}: jvp_attention takes (..., heads, length, dim); add a heads "
            "dim (x.unsqueeze(0)), or use torch's SDPA for this call")
    check_sdpa_arguments(query, key, value, attn_mask, is_causal, scale, enable_gqa, tangents,
                         mask_tangent)
    if query.is_nested or key.is_nested or value.is_nested or (
            isinstance(attn_mask, Tensor) and attn_mask.is_nested):
        raise Unsupported(
            "nested tensors",
            "nested (jagged) tensors are not supported: pad the sequences to one length and "
            "pass a key-padding attn_mask, or use torch's SDPA for this call")
    if dropout_p != 0.0:
        raise Unsupported(
            "dropout_p > 0",
            f"dropout_p={dropout_p}: jvp_attention has no attention dropout; pass dropout_p=0.0"
            " (or leave the model in eval mode) or use torch's SDPA for this call")
    if query.dtype not in (*KERNEL_DTYPES, torch.float64):
        raise Unsupported(f"dtype {query.dtype}",
                          f"dtype {query.dtype} is not supported; use float16, bfloat16, "
                          "float32 (the kernels) or float64 (PyTorch operations)")
    if query.dtype == torch.bfloat16 and interpreting() and not query.is_cuda:
        raise Unsupported(
            "bfloat16 in Triton's interpreter",
            "bfloat16 inputs under TRITON_INTERPRET=1: Triton's interpreter computes bfloat16 "
            "matrix products wrongly, so the kernels would return garbage. Use float16 or "
            "float32 on the CPU, or unset TRITON_INTERPRET to run PyTorch operations there.")
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        raise Unsupported("head dim > 256",
                          f"head dims up to {MAX_HEAD_DIM} are supported; got query "
                          f"{query.shape[-1]} and value {value.shape[-1]}")


def uses_kernels(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether a call runs the Triton kernels: for CUDA tensors, and for CPU tensors under
    the interpreter, of the kernels' dtypes and with something to compute. Everything else
    runs chapter 1's tiled PyTorch implementation, which PyTorch differentiates to any
    order: float64 (gradcheck), empty inputs, CPU tensors without the interpreter, and
    tensors on other devices (meta tensors, which shape a model without memory)."""
    if not kernels_take(query):
        return False
    return query.numel() > 0 and key.shape[-2] > 0 and value.shape[-1] > 0


def kernels_take(query: Tensor) -> bool:
    """Whether the kernels take `query`'s device and dtype: CUDA tensors, and CPU tensors
    under the interpreter, in float16, bfloat16 or float32."""
    on_kernels = query.is_cuda or (interpreting() and query.device.type == "cpu")
    return on_kernels and query.dtype in KERNEL_DTYPES


# %% [markdown]
# ## The wrapper
#
# Leading dimensions are flattened into one batch dimension with `reshape`, which is a view
# (no copy) whenever the layout allows, in particular for the usual 4-D inputs and for the
# `(B, N, H, D)` layout viewed as `(B, H, N, D)`. The mask is broadcast the same way; a mask
# with leading dimensions that are already broadcast stays a stride-0 view.
#
# What the kernels do not compute runs on chapter 1's `tiled_attention` in PyTorch
# operations, which PyTorch differentiates to any order: CPU tensors without the
# interpreter, float64 on any device (gradcheck's dtype), empty inputs (an output with no
# entries, or Nk = 0, where every row sees no key and gives zeros), a `jvp` of a `jvp`
# (forward over forward: `torch.func.jvp`'s nesting counter says so, and Dynamo can trace
# it), and a `jvp` beneath a gradient transform (forward over reverse: a jvp of
# `torch.func.grad`, `torch.func.hessian`), whose tangents would have to flow forward
# through the kernels' backward. For a Hessian-vector product on the kernels take it the
# other way round, reverse over forward (`torch.func.grad` of a jvp): chapter 6's kernels
# compute it. The same call therefore works on every device, or raises the same error.
#
# Under `torch.autocast` PyTorch casts SDPA's floating inputs (not float64) to the autocast
# dtype; `attention` applies the same rule first, so Hugging Face's mixed fp32 q/k and bf16 v
# work. A float mask's tangent is unpacked with the inputs' and passed to the fused kernel
# (it adds to tS); its gradient comes from the kernels as (B, Hq, Nq, Nk) dS, and autograd of
# the `expand` in `_as_4d` sums it over the broadcast dimensions.
#
# With tangents, `attention` unpacks the duals itself, runs `_FusedTangent` on primals and
# tangents, and returns `make_dual(out, tangent_out)`, which forward-mode AD (eager, and
# under `torch.compile`, which runs no `jvp` rule of a Function) takes as it is.

# %% tags=["export"]
def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Scaled dot-product attention with a fused forward-mode derivative.

    A drop-in for `torch.nn.functional.scaled_dot_product_attention` that also works under
    `torch.func.jvp` and `torch.autograd.forward_ad`: the output and its tangent come from
    one fused Triton pass, and gradients flow back through both.

    Args:
        query: (..., Hq, Nq, D), float16, bfloat16 or float32 (the kernels) or float64
            (PyTorch operations, on any device), any strides.
        key: (..., Hkv, Nk, D); Hkv == Hq unless `enable_gqa`.
        value: (..., Hkv, Nk, Dv); Dv may differ from D. Head dims up to 256.
        attn_mask: None, a bool mask (True = attend) or an additive float mask (float32 or
            query's dtype), broadcastable to (..., Hq, Nq, Nk). Never expanded in memory. A
            float mask may carry a tangent (it adds to the scores' tangent) and may require
            grad (its gradient is summed over the dimensions it was broadcast along).
        dropout_p: Must be 0.0 (dropout is not implemented).
        is_causal: Causal mask aligned top-left, as in PyTorch (query i sees keys j <= i).
            Unlike SDPA it may be combined with `attn_mask`.
        scale: Softmax scale; defaults to 1/sqrt(D).
        enable_gqa: Allow Hq to be a multiple of Hkv (grouped-query attention).

    Returns:
        The attention output, (..., Hq, Nq, Dv), in query's dtype. A row that sees no key
        (also every row when Nk = 0) gives zeros, as SDPA's math path does.

    Raises:
        TypeError, ValueError: For arguments SDPA would reject; the message names the
            argument and what was expected.
        Unsupported: (a NotImplementedError) for calls SDPA takes but this library cannot:
            dropout_p > 0, head dims above 256, bfloat16 under Triton's interpreter.

    Under `torch.autocast`, query, key, value and a float mask are first cast to the
    autocast dtype, as PyTorch's SDPA does.

    Example:
        >>> q, k, v = (torch.randn(2, 8, 128, 64) for _ in range(3))
        >>> t = tuple(torch.randn_like(x) for x in (q, k, v))
        >>> out, tangent = torch.func.jvp(attention, (q, k, v), t)
    """
    autocast_dtype = _autocast_dtype(query)
    if autocast_dtype is not None:
        query, key, value, attn_mask = (_autocast(x, autocast_dtype)
                                        for x in (query, key, value, attn_mask))
        with torch.autocast(query.device.type, enabled=False):
            return attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)
    check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if not uses_kernels(query, key, value) or jvp_nesting() > 1:
        return _pytorch_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    q, k, v, mask = _as_4d(query, key, value, attn_mask)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    out = _attend(q, k, v, mask, is_causal, scale, get_precision(), _traced())[0]
    return out if query.dim() == 4 else out.reshape(*query.shape[:-1], value.shape[-1])


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
            scale: float, precision: str, traced: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse, out_residual) of (B, H, N, D) inputs: the fused pass where forward-mode AD
    gives an input a tangent at its current level (`out` then carries tO as its tangent),
    the plain forward where none does. Under functorch's transforms in eager mode, where a
    jvp sits beneath vmap (a jvp of a vmapped function) the inputs' tangents are out of
    sight at vmap's level: `_Attention`'s vmap rule folds vmap's dimension into the batch
    and comes back here below it. Where a jvp sits beneath a gradient transform (forward
    over reverse: a jvp of `torch.func.grad`, `jacfwd` of `jacrev`, `torch.func.hessian`),
    the tangents would have to flow forward through the kernels' backward, which has no
    such rule: chapter 1's reference in PyTorch operations runs (empty lse and residual)."""
    if not traced and _functorch_depth():
        transform = _functorch_top().key()
        if transform == TransformType.Grad and jvp_nesting():
            return (_pytorch_attention(q, k, v, mask, is_causal, scale, True), _NO_TENSOR(q),
                    _NO_TENSOR(q))
        if transform == TransformType.Vmap and forward_ad._current_level >= 0:
            return _apply(_Attention, q, k, v, mask, is_causal, scale,
                          _wants_residual(q, k, v), precision)
    if traced:
        _refuse_export_of_a_jvp()
    primals, tangents = _primals_and_tangents(q, k, v, mask, traced)
    if tangents is None:
        return _apply(_Attention, q, k, v, mask, is_causal, scale, _wants_residual(q, k, v),
                      precision)
    # Unpack the duals, run the fused op on primals and tangents as plain inputs, and hand
    # forward-mode AD tO as the tangent of O: no copy, and Dynamo can trace it.
    out, tangent_out, lse, _, out_residual, _ = _apply(
        _FusedTangent, *primals[:3], *tangents[:3], primals[3], tangents[3], is_causal,
        scale, _wants_residual(*primals[:3], *tangents[:3]), precision)
    return _make_dual(out, tangent_out, traced), lse, out_residual


def attention_jvp(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    tangents: tuple[Tensor, Tensor, Tensor],
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    mask_tangent: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention and its tangent with the tangents passed explicitly (no forward-mode AD).

    The same fused pass as `attention` under `torch.func.jvp`, as a plain differentiable
    function: gradients flow to the inputs and to the tangents.

    Args:
        query, key, value, attn_mask, is_causal, scale, enable_gqa: As in `attention`.
        tangents: (t_query, t_key, t_value), shaped like (query, key, value).
        mask_tangent: The tangent of a float `attn_mask`, shaped like it; None for none.

    Returns:
        (out, tangent_out), both (..., Hq, Nq, Dv).

    Example:
        >>> q, k, v = (torch.randn(1, 4, 64, 32) for _ in range(3))
        >>> out, t_out = attention_jvp(q, k, v, (q, k, v))  # tangent along the inputs
    """
    check_arguments(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, tangents,
                    mask_tangent)
    if not uses_kernels(query, key, value):
        return _pytorch_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                                  tuple(tangents), mask_tangent)
    q, k, v, mask = _as_4d(query, key, value, attn_mask)
    tq, tk, tv = (t.reshape(x.shape) for t, x in zip(tangents, (q, k, v), strict=True))
    t_mask = None if mask_tangent is None else _as_4d_mask(mask_tangent, query, key)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    out, tangent_out = _FusedTangent.apply(q, k, v, tq, tk, tv, mask, t_mask, is_causal,
                                           scale, _wants_residual(q, k, v, tq, tk, tv),
                                           get_precision())[:2]
    shape = (*query.shape[:-1], value.shape[-1])
    return out.reshape(shape), tangent_out.reshape(shape)


def _pytorch_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                       tangents=None, mask_tangent=None):
    """Chapter 1's tiled implementation in PyTorch operations, differentiated by PyTorch:
    the output, or with `tangents` (out, tangent_out)."""
    _refuse_export_of_a_jvp()
    if query.numel() == 0 or key.shape[-2] == 0 or value.shape[-1] == 0:
        out = _empty_attention(query, key, value)
        if tangents is None:
            return out
        return out, _empty_attention(*tangents)
    result = tiled_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                             tangents, mask_tangent=mask_tangent)
    return result.out if tangents is None else (result.out, result.tangent_out)


def _refuse_export_of_a_jvp() -> None:
    """torch.export of a function that calls torch.func.jvp around `attention` cannot be
    right today: on the kernels' path PyTorch's export asserts inside its tracer, and on the
    PyTorch operations' path torch 2.13 lifts every tensor made inside the jvp by a factory
    (`torch.full`, `torch.zeros_like`) as a constant holding a FakeTensor, so the exported
    program returns FakeTensors. Raise instead of either."""
    if jvp_nesting() and _exporting():
        raise Unsupported(
            "torch.export of torch.func.jvp",
            "torch.export cannot capture torch.func.jvp around attention: export the "
            "function without the jvp (the forward is captured as jvp_attention's operator), "
            "or compile the jvp with torch.compile, which captures it")


def _exporting() -> bool:
    """torch.export is tracing. Read the flag export sets: Dynamo in torch 2.11 answers True
    to `torch.compiler.is_exporting()` under every torch.compile, not only export's."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else flag


def _empty_attention(query, key, value):
    """Attention with nothing to attend (Nk = 0) or nothing to compute: zeros, as SDPA's math
    path gives, built from the inputs so that gradients and tangents are zeros, not None."""
    group = max(query.shape[-3], 1) // max(key.shape[-3], 1)
    key, value = (x.repeat_interleave(group, dim=-3) for x in (key, value))
    return (query @ key.mT * 0) @ value


def _autocast_dtype(query: Tensor) -> torch.dtype | None:
    """The dtype autocast casts SDPA's inputs to, or None outside autocast (and on devices
    that have none: meta tensors, which shape a model without memory)."""
    if not isinstance(query, Tensor):
        return None
    device = query.device.type  # (an attribute, not a C query: Dynamo traces it)
    if not query.is_meta and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def _autocast(x: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Autocast's rule for an op of its lower-precision list: floating tensors other than
    float64 are cast (a differentiable cast: tangents and gradients follow)."""
    if x is None or not x.is_floating_point() or x.dtype == torch.float64:
        return x
    return x.to(dtype)


def _as_4d(query, key, value, attn_mask):
    """Flatten leading dims into one batch dim (a view whenever the layout allows); the mask
    is broadcast to (B, Hq, Nq, Nk) as a stride-0 view."""
    q, k, v = (x if x.dim() == 4 else x.reshape(-1, *x.shape[-3:])
               for x in (query, key, value))  # a reshape of a dual tensor is not free
    if attn_mask is None:
        return q, k, v, None
    return q, k, v, _as_4d_mask(attn_mask, query, key)


def _as_4d_mask(attn_mask: Tensor, query: Tensor, key: Tensor) -> Tensor:
    mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
    return mask.reshape(-1, *mask.shape[-3:])


def jvp_nesting() -> int:
    """How many torch.func.jvp transforms are active around this call (Dynamo traces this
    global, unlike functorch's interpreter stack)."""
    return eager_transforms.JVP_NESTING


def _apply(function: type[torch.autograd.Function], *args) -> tuple[Tensor, ...]:
    """`function.apply(*args)`, every argument given, with less of PyTorch's per-call Python
    where it changes nothing (the host time of a call at training shapes is mostly this):

    - Outside functorch's transforms, `Function.apply` binds the arguments to the forward's
      signature (about 80 Python calls) to fill in defaults, and none are missing here.
    - Inside exactly one eager `torch.func.jvp`, functorch lifts the Function on every call:
      a generated Function class that unwraps the inputs from the transform's level, runs
      this Function below it and wraps the outputs, with pytree passes over both. No input
      carries a tangent at that level (`attention` unpacked the duals), so the lifted `jvp`
      would never run: the three steps are done here directly.

    Anywhere else (vmap, grad, nested transforms, torch.compile): `function.apply`."""
    if torch.compiler.is_compiling():
        return function.apply(*args)
    depth = _functorch_depth()
    if depth == 0:
        return _apply_bound(function, unwrap_dead_wrappers(args))
    if depth != 1 or jvp_nesting() != 1:
        return function.apply(*args)
    level = _functorch_top().level()
    unwrapped = [_unwrap_for_grad(x, level) if isinstance(x, Tensor) else x for x in args]
    with temporarily_pop_interpreter_stack():
        outputs = _apply_bound(function, unwrapped)
    return tuple(_wrap_for_grad(x, level) for x in outputs)


def _apply_bound(function: type[torch.autograd.Function], args) -> tuple[Tensor, ...]:
    """What `Function.apply` does outside transforms once its arguments are bound."""
    return _FUNCTION_BASE_APPLY.__get__(None, function)(*args)


_FUNCTION_BASE_APPLY = torch._C._FunctionBase.__dict__["apply"]
_functorch_depth = torch._C._functorch.get_dynamic_layer_stack_depth
_functorch_top = torch._C._functorch.peek_interpreter_stack
_unwrap_for_grad, _wrap_for_grad = torch._C._functorch._unwrap_for_grad, torch._C._functorch._wrap_for_grad


def _primals_and_tangents(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, traced: bool,
                          ) -> tuple[list, tuple[Tensor, Tensor, Tensor, Tensor | None] | None]:
    """The primals of q, k, v and the mask, and the forward-mode tangents of q, k, v (zeros
    where one has none) and of a float mask (None if it has none), or None for the tangents
    if no input has one."""
    unpacked = [_unpack_dual(x, traced) for x in (q, k, v)]
    mask_primal, mask_tangent = mask, None
    if mask is not None and mask.is_floating_point():
        mask_primal, mask_tangent = _unpack_dual(mask, traced)
    primals = [primal for primal, _ in unpacked] + [mask_primal]
    if all(t is None for _, t in unpacked) and mask_tangent is None:
        return primals, None
    return primals, (*(_zeros_like(x) if t is None else t
                       for x, (_, t) in zip((q, k, v), unpacked, strict=True)), mask_tangent)


def _traced() -> bool:
    """Whether a tracer may be watching (torch.compile, or a torch function mode such as
    torch.export's): forward AD's public functions are then called as they are."""
    return torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()


def _unpack_dual(x: Tensor, traced: bool) -> tuple[Tensor, Tensor | None]:
    """(primal, tangent) of `x` at forward AD's current level: `forward_ad.unpack_dual`
    without its Python wrappers (a named tuple and a tracer's check, together dearer than the
    unpacking itself) unless a tracer may be watching (`traced`)."""
    level = forward_ad._current_level
    if level < 0:
        return x, None
    if traced:
        primal, tangent = forward_ad.unpack_dual(x, level=level)
        return primal, tangent
    return torch._unpack_dual(x, level)


def _make_dual(primal: Tensor, tangent: Tensor, traced: bool) -> Tensor:
    """`forward_ad.make_dual(primal, tangent)` at the current level, without its wrappers
    unless a tracer may be watching (`primal` and `tangent` are our outputs: floating point)."""
    if traced:
        return forward_ad.make_dual(primal, tangent)
    return torch._make_dual(primal, tangent, level=forward_ad._current_level)


# %% [markdown]
# ## The drop-in: `with jvp_attention.sdpa():`
#
# Two hooks catch SDPA calls, because models reach SDPA in two ways:
#
# * `F.scaled_dot_product_attention(...)` looked up at call time, also by PyTorch's own
#   `nn.MultiheadAttention` (inside `F.multi_head_attention_forward`). While the context is
#   active, that module attribute points to our router.
# * A reference bound before the context was entered (`from torch.nn.functional import
#   scaled_dot_product_attention`). That calls PyTorch's C++ function, which consults the
#   active `TorchFunctionMode`; ours routes it. (A mode alone would miss the first kind
#   when the call is nested inside another overridable function such as
#   `multi_head_attention_forward`: a mode is switched off while it handles a call.)
#
# The router answers the calls that `attention` supports and passes the `Unsupported` ones
# on: dropout during training, head dims above 256. SDPA's math path broadcasts the
# leading dims of $Q$, $K$ and $V$ as `matmul` does (a key and value of batch 1 for a batch
# of queries, a single key/value head for many query heads), which `attention` does not
# take: the router expands them to their common leading dims, views without copies whose
# gradients autograd sums back, and routes the call again. Other arguments outside
# `attention`'s contract go to PyTorch, which either raises as it would without the
# drop-in or takes them (a tensor `scale`). It warns once per reason and counts
# every call in the `SDPARouting` that `sdpa()` yields; with tangents present it passes them
# to PyTorch's math backend, the only one that takes forward-mode AD. The patch is
# process-wide while the block runs; enter it around the model call, not around threads
# that must see PyTorch's own SDPA.

# %% tags=["export"]
_TORCH_SDPA = F.scaled_dot_product_attention


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    return {"query": query, "key": key, "value": value, "attn_mask": attn_mask,
            "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
            "enable_gqa": enable_gqa}


@dataclass
class SDPARouting:
    """What `sdpa()` did with the calls it saw.

    Attributes:
        routed: Calls that ran on `attention`.
        fell_through: Calls passed on to PyTorch's SDPA, counted by reason.
    """

    routed: int = 0
    fell_through: Counter = field(default_factory=Counter)
    passing_on: bool = field(default=False, repr=False)  # inside a call handed to PyTorch


_warned_reasons: set[str] = set()


def _has_tangents(*tensors: Tensor | None) -> bool:
    return any(isinstance(x, Tensor) and forward_ad.unpack_dual(x).tangent is not None
               for x in tensors)


def _route(call: dict, strict: bool, routing: SDPARouting):
    """Run an SDPA call on `attention` if it takes it, else on PyTorch's SDPA (its math
    backend when forward-mode tangents are present: the fused backends raise on them).
    Leading dims that broadcast are expanded and routed again; other arguments outside
    `attention`'s contract go to PyTorch too, which raises as it would without the drop-in,
    or takes them."""
    autocast_dtype = _autocast_dtype(call["query"])
    checked = dict(call)
    if autocast_dtype is not None:
        for name in ("query", "key", "value", "attn_mask"):
            checked[name] = _autocast(call[name], autocast_dtype)
    try:
        check_arguments(**checked)
    except Unsupported as error:
        if strict:
            raise
        reason = error.reason
    except (TypeError, ValueError):
        broadcast = _broadcast_leading_dims(call)
        if broadcast is not None:  # SDPA's math path broadcasts them; expanded, they may fit
            return _route(broadcast, strict, routing)
        if strict:
            raise
        reason = OUTSIDE_CONTRACT
    else:
        routing.routed += 1
        return attention(**call)
    if routing.passing_on:  # our own call below, seen again by the mode: PyTorch's
        return _TORCH_SDPA(**call)
    math_only = _has_tangents(call["query"], call["key"], call["value"], call["attn_mask"])
    routing.passing_on = True
    try:
        with sdpa_kernel(SDPBackend.MATH) if math_only else contextlib.nullcontext():
            out = _TORCH_SDPA(**call)
    finally:
        routing.passing_on = False
    routing.fell_through[reason] += 1  # (counted once PyTorch has taken the call)
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        warnings.warn(f"jvp_attention.sdpa(): a call fell through to torch's SDPA ({reason}); "
                      "sdpa(strict=True) raises instead, and the object that sdpa() yields "
                      "counts the calls by reason", stacklevel=4)
    return out


OUTSIDE_CONTRACT = "arguments outside attention's contract that PyTorch's SDPA takes"


def _broadcast_leading_dims(call: dict) -> dict | None:
    """The call with query, key and value expanded (views, no copies) to the broadcast of
    their leading dims, as SDPA's math path broadcasts them in its matrix products; None if
    they are already equal or do not broadcast."""
    q, k, v = call["query"], call["key"], call["value"]
    if not all(isinstance(x, Tensor) and x.dim() >= 3 for x in (q, k, v)):
        return None
    try:
        leading = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        return None
    if q.shape[:-2] == k.shape[:-2] == v.shape[:-2] == leading:
        return None
    return {**call, **{name: x.expand(*leading, *x.shape[-2:])
                       for name, x in (("query", q), ("key", k), ("value", v))}}


class _RouteSDPA(TorchFunctionMode):
    def __init__(self, strict: bool, routing: SDPARouting):
        super().__init__()
        self.strict, self.routing = strict, routing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TORCH_SDPA:
            return _route(_sdpa_arguments(*args, **kwargs), self.strict, self.routing)
        return func(*args, **kwargs)


@contextlib.contextmanager
def sdpa(strict: bool = False):
    """Route `torch.nn.functional.scaled_dot_product_attention` to `attention` in this block.

    Calls that `attention` cannot take (dropout, head dims above 256, bfloat16 under Triton's
    interpreter) fall through to PyTorch's SDPA, to its math backend when they carry
    forward-mode tangents (its fused backends raise on those); each reason is warned about
    once per process and counted in the yielded `SDPARouting`. Leading dims that broadcast
    (which PyTorch's math path takes) are expanded, as views, and routed. Invalid calls (bad
    shapes) reach PyTorch, which raises as it would without this block.

    Args:
        strict: Raise on calls the library cannot take instead of falling through.

    Yields:
        SDPARouting: counts of the calls routed and fallen through (by reason) in the block.

    Example:
        >>> layer = torch.nn.TransformerEncoderLayer(64, 4, dropout=0.0, batch_first=True)
        >>> x, tx = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
        >>> with sdpa() as routing:
        ...     y, ty = torch.func.jvp(layer, (x,), (tx,))
        >>> routing.routed
        1
    """
    previous = F.scaled_dot_product_attention
    routing = SDPARouting()

    def routed(*args, **kwargs):
        return _route(_sdpa_arguments(*args, **kwargs), strict, routing)

    F.scaled_dot_product_attention = routed
    try:
        with _RouteSDPA(strict, routing):
            yield routing
    finally:
        F.scaled_dot_product_attention = previous


# %% [markdown]
# ## Every transform, checked
#
# The checks run on this machine's device; on CPU they go through Triton's interpreter, so
# the kernels themselves are exercised. The reference is PyTorch's SDPA in float64.

# %%
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


torch.manual_seed(0)
N = 512 if FULL_SIZE else 24
dtype = torch.float32
q, k, v = (torch.randn(2, 4, N, 64, device=DEVICE, dtype=dtype) for _ in range(3))
tq, tk, tv = (torch.randn_like(x) for x in (q, k, v))


def sdpa64(q, k, v, **options):
    """PyTorch's math attention in float64: the reference (its fused backends refuse jvp)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **options)


def report(name, got, want):
    """Print the error relative to the reference's largest entry; fail above 1e-5."""
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    print(f"{name:58} relative error {err:.1e}")
    assert err < 1e-5, name


# plain forward and backward
leaves = [x.clone().requires_grad_() for x in (q, k, v)]
attention(*leaves, is_causal=True).square().sum().backward()
ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
F.scaled_dot_product_attention(*ref_leaves, is_causal=True).square().sum().backward()
for name, a, b in zip("qkv", leaves, ref_leaves, strict=True):
    report(f"backward: d{name}", a.grad, b.grad)

# torch.func.jvp
out, tangent = torch.func.jvp(lambda a, b, c: attention(a, b, c, is_causal=True), (q, k, v),
                              (tq, tk, tv))
ref_out, ref_tangent = torch.func.jvp(lambda a, b, c: sdpa64(a, b, c, is_causal=True),
                                      (q.double(), k.double(), v.double()),
                                      (tq.double(), tk.double(), tv.double()))
report("torch.func.jvp: output", out, ref_out)
report("torch.func.jvp: tangent", tangent, ref_tangent)

# forward_ad dual tensors
with forward_ad.dual_level():
    duals = [forward_ad.make_dual(x, t) for x, t in zip((q, k, v), (tq, tk, tv), strict=True)]
    dual_out = attention(*duals, is_causal=True)
    report("forward_ad: tangent", forward_ad.unpack_dual(dual_out).tangent, ref_tangent)

# %% [markdown]
# The training pattern of consistency models and MeanFlow: the JVP inside the forward, a
# loss on the primal output (here also on the tangent, which needs chapter 6's kernels),
# `.backward()`. Gradients reach the inputs and the tangents.

# %%
def jvp_then_loss(fn, tensors, tangents):
    out, tangent = torch.func.jvp(fn, tuple(tensors), tuple(tangents))
    return out.square().mean() + tangent.square().mean()


leaves = [x.clone().requires_grad_() for x in (q, k, v, tq, tk, tv)]
jvp_then_loss(lambda a, b, c: attention(a, b, c, is_causal=True), leaves[:3], leaves[3:]).backward()
ref = [x.double().requires_grad_() for x in (q, k, v, tq, tk, tv)]
jvp_then_loss(lambda a, b, c: sdpa64(a, b, c, is_causal=True), ref[:3], ref[3:]).backward()
for name, a, b in zip(["q", "k", "v", "tq", "tk", "tv"], leaves, ref, strict=True):
    report(f"loss on (out, tangent) -> d{name}", a.grad, b.grad)

# %% [markdown]
# `vmap` over a leading dimension works because `attention` takes any leading dimensions:
# vmap's batch dimension becomes one of them. The Functions' vmap rules and the operators'
# fold it into the batch, so per-sample gradients (a vmap of `torch.func.grad`) and
# `jacrev` launch each kernel once, not once per sample; under a jvp of a vmapped function,
# where the tangents sit below vmap's level, the rule takes the fused pass there. A
# Hessian-vector product forward over reverse runs the reference, as said above.

# %%
batched = torch.func.vmap(attention)(q, k, v)
report("vmap over the batch", batched, sdpa64(q, k, v))


def per_sample_grads(attend, q, k, v):
    """d loss / d q for each sample of the batch: vmap of a gradient."""
    loss = lambda a, b, c: attend(a, b, c, is_causal=True).square().sum()  # noqa: E731
    return torch.func.vmap(torch.func.grad(loss))(q, k, v)


report("vmap(grad): per-sample gradients", per_sample_grads(attention, q, k, v),
       per_sample_grads(sdpa64, q.double(), k.double(), v.double()))
_, batched_tangent = torch.func.jvp(
    torch.func.vmap(lambda a, b, c: attention(a, b, c, is_causal=True)), (q, k, v),
    (tq, tk, tv))
report("jvp(vmap): tangent", batched_tangent, ref_tangent)


def hessian_vector(attend, q, tq):
    """Forward over reverse: the jvp of the gradient of a loss along tq."""
    grad_q = torch.func.grad(lambda x: attend(x, k, v).square().sum())
    return torch.func.jvp(grad_q, (q,), (tq,))[1]


report("jvp(grad): Hessian-vector product (reference)", hessian_vector(attention, q, tq),
       hessian_vector(sdpa64, q.double(), tq.double()))

for bad in [
    lambda: attention(q, k[:, :2], v[:, :2]),
    lambda: attention(q, k, v[..., :-1, :]),
    lambda: attention(q, k, v, attn_mask=torch.ones(3, N, device=DEVICE, dtype=torch.bool)),
    lambda: attention(q.half(), k, v),
    lambda: attention(q, k, v, dropout_p=0.1),
]:
    try:
        bad()
    except (TypeError, ValueError, NotImplementedError) as error:
        print(f"{type(error).__name__}: {error}")
    else:
        raise AssertionError("bad input accepted")

# %% [markdown]
# ## What real models pass: learnable biases, empty batches, float64, gradient penalties
#
# A relative-position bias shared by the batch, its tangent under `torch.func.jvp` and its
# gradient summed over the batch; a batch with no queries; float64 through `gradcheck`; a
# gradient penalty (double backward) through the jvp; and a Hessian-vector product as
# `torch.autograd.functional.hvp` takes it, by differentiating the double backward with
# respect to its cotangent; each against float64 PyTorch.

# %%
bias = torch.randn(1, 4, N, N, device=DEVICE, requires_grad=True)
t_bias = torch.randn_like(bias)
xs = [x.clone().requires_grad_() for x in (q, k, v)]
out, tangent = torch.func.jvp(lambda a, b, c, m: attention(a, b, c, attn_mask=m),
                              (*xs, bias), (tq, tk, tv, t_bias))
(out.square().sum() + tangent.square().sum()).backward()
ref_bias = bias.detach().double().requires_grad_()
ref_xs = [x.double().requires_grad_() for x in (q, k, v)]
ref_out, ref_tangent = torch.func.jvp(lambda a, b, c, m: sdpa64(a, b, c, attn_mask=m),
                                      (*ref_xs, ref_bias),
                                      (tq.double(), tk.double(), tv.double(), t_bias.double()))
(ref_out.square().sum() + ref_tangent.square().sum()).backward()
report("bias with a tangent: tangent_out", tangent, ref_tangent)
report("bias with a tangent: d bias (summed over the batch)", bias.grad, ref_bias.grad)

empty = attention(q[:, :, :0], k, v)
print("no queries:", tuple(empty.shape), "  no keys:",
      attention(q, k[:, :, :0], v[:, :, :0]).abs().max().item())

small = [torch.randn(1, 2, 6, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
         for _ in range(3)]
print("float64 gradcheck and gradgradcheck:",
      torch.autograd.gradcheck(lambda a, b, c: attention(a, b, c, is_causal=True), small),
      torch.autograd.gradgradcheck(lambda a, b, c: attention(a, b, c), small))


def penalty(attend, q, k, v, tangents):
    q = q.detach().requires_grad_()
    out, tangent = torch.func.jvp(attend, (q, k, v), tangents)
    (dq,) = torch.autograd.grad(out.square().sum() + tangent.square().sum(), q,
                                create_graph=True)
    return torch.autograd.grad(dq.square().sum(), q)[0]


report("gradient penalty through jvp (double backward)",
       penalty(attention, q, k, v, (tq, tk, tv)),
       penalty(lambda a, b, c: sdpa64(a, b, c), q.double(), k.double(), v.double(),
               (tq.double(), tk.double(), tv.double())))


def hessian_vector_product(attend, q, k, v, direction):
    return torch.autograd.functional.hvp(lambda a: attend(a, k, v).square().sum(), q,
                                         direction, strict=True)[1]


direction = torch.randn_like(q)
report("Hessian-vector product (torch.autograd.functional.hvp)",
       hessian_vector_product(attention, q, k, v, direction),
       hessian_vector_product(sdpa64, q.double(), k.double(), v.double(), direction.double()))

# %% [markdown]
# ## The drop-in on a stock PyTorch block
#
# `nn.TransformerEncoderLayer` calls SDPA through `nn.MultiheadAttention`. Under PyTorch's
# fused backends a JVP through it fails; under `jvp_attention.sdpa()` it runs on our kernels,
# and agrees with the math path.

# %%
from unittest import mock

layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0,
                                         batch_first=True, device=DEVICE)
x, tx = torch.randn(2, N, 64, device=DEVICE), torch.randn(2, N, 64, device=DEVICE)
unwrapped = attention
attention = spy = mock.Mock(wraps=unwrapped)  # the routing calls `attention` of this namespace
try:
    with sdpa():
        y, ty = torch.func.jvp(layer, (x,), (tx,))
finally:
    attention = unwrapped
with sdpa_kernel(SDPBackend.MATH):
    y_ref, ty_ref = torch.func.jvp(layer, (x,), (tx,))
print(f"routed {spy.call_count} SDPA call(s) to jvp_attention")
print(f"TransformerEncoderLayer under sdpa(): output {(y - y_ref).abs().max():.1e}, "
      f"tangent {(ty - ty_ref).abs().max():.1e}")
assert spy.call_count == 1 and torch.allclose(ty, ty_ref, atol=1e-4)

# %% [markdown]
# ## `torch.compile`
#
# The custom operators' fake implementations let Dynamo trace `attention` into one graph
# (`fullgraph=True`), forward and backward, also inside `torch.func.jvp` (the wrapper hands
# forward-mode AD an explicit dual there). `attention_jvp` takes the tangents explicitly and
# runs the same fused kernel. We time the compilation and a small model step with and
# without it, for the three ways to write it.
#
# One caution for training steps that stop the gradient of the tangent (MeanFlow, sCM): put
# the `detach()` inside the compiled function. A compiled output that requires grad but gets
# none in the backward gets a gradient of *zeros* from AOTAutograd, not `None`, so
# `_FusedTangent.backward` cannot tell it from a real one and runs the kernels of the backward
# through the tangent (chapter 6), about 2.5 times the first-order backward's GPU time.

# %%
import time


def block(x, w):
    """A toy attention block: projections around our attention."""
    b, n, _ = x.shape
    q, k, v = (x @ w).view(b, n, 3, 4, -1).permute(2, 0, 3, 1, 4)
    return attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1)


def block_jvp(x, tx, w):
    b, n, _ = x.shape
    q, k, v = (x @ w).view(b, n, 3, 4, -1).permute(2, 0, 3, 1, 4)
    tq, tk, tv = (tx @ w).view(b, n, 3, 4, -1).permute(2, 0, 3, 1, 4)
    return attention_jvp(q, k, v, (tq, tk, tv), is_causal=True)


def block_func_jvp(x, tx, w):
    """The same step written as users write it: torch.func.jvp around the block."""
    return torch.func.jvp(lambda x_: block(x_, w), (x,), (tx,))


width = 256 if FULL_SIZE else 64
x = torch.randn(4, N, width, device=DEVICE)
tx = torch.randn_like(x)
w = (torch.randn(width, 3 * width, device=DEVICE) / width**0.5).requires_grad_()


def step(fn, *args):
    outputs = fn(*args)
    loss = sum(o.float().square().mean() for o in (outputs if isinstance(outputs, tuple)
                                                    else (outputs,)))
    loss.backward()
    return loss


def timed(fn, *args, repeats=10 if FULL_SIZE else 1):
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step(fn, *args)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


for name, fn, args in [("forward+backward", block, (x, w)),
                       ("jvp+backward", block_jvp, (x, tx, w)),
                       ("func.jvp+backward", block_func_jvp, (x, tx, w))]:
    compiled = torch.compile(fn, fullgraph=True)
    start = time.perf_counter()
    step(compiled, *args)
    compile_s = time.perf_counter() - start
    eager_ms, compiled_ms = timed(fn, *args), timed(compiled, *args)
    eager_out, compiled_out = fn(*args), compiled(*args)
    same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(
        eager_out if isinstance(eager_out, tuple) else (eager_out,),
        compiled_out if isinstance(compiled_out, tuple) else (compiled_out,), strict=True))
    assert same, f"{name}: compiled differs from eager"
    print(f"{name:17} first compiled step {compile_s:6.1f} s   eager {eager_ms:8.2f} ms   "
          f"compiled {compiled_ms:8.2f} ms   same result: {same}")

# %% [markdown]
# ## What a call costs the host
#
# At DiT's shapes the fused kernel is short: 0.23 ms of GPU time for DiT-B/2 at 256 px
# (B64 H12 N256 d64, bf16) on the H200. Unless the host issues the next call within that
# time, the GPU waits, and the step is only as fast as the Python around the kernels.
# Inside `torch.func.jvp` most of that Python was not ours. `torch.func.jvp` pushes a
# functorch interpreter, and from then on every `autograd.Function.apply` is *lifted*:
# functorch generates a new Function class for the call, maps pytree functions over the
# inputs to unwrap them from the transform's level, runs the Function one level down, and
# wraps the outputs again. `Function.apply` also binds every call's arguments to
# `forward`'s signature with `inspect`, to fill in defaults.
#
# `_apply` does the same work directly. Inside exactly one eager `torch.func.jvp`, it
# unwraps the inputs, runs the Function with the interpreter set aside, and wraps the
# outputs. Outside the transforms, it calls the Function's C++ `apply` without binding the
# arguments again. This is safe because `attention` has already unpacked the duals. No
# input of the Function carries a tangent at the transform's level, so the lifted Function's
# `jvp` could never run. All that lifting does there is the unwrapping and wrapping.
# `attention` itself unpacks each dual once and makes the output's dual with
# `torch._unpack_dual` and `torch._make_dual`, the operations `forward_ad`'s public
# functions wrap (in a named tuple, and a check for torch.export's tracer that is dearer
# than the unpacking); while a tracer may be watching it calls the public functions. The
# launchers compute tile sizes with host versions of `triton.next_power_of_2` and
# `triton.cdiv`, which are constexpr functions and pass through a wrapper when called from
# the host. Anything else (`vmap`, `grad`, nested transforms, `torch.compile`) takes `Function.apply`
# as before. The cell below times both paths on the same inputs, and times
# `torch.func.jvp` of a one-multiplication function as a floor. It also checks that both
# paths give the same bits.
#
# `tests/library/test_autograd_call_cost.py` counts the Python calls of a call in CI, so
# that this cannot creep back: 1195 with the lifting, 185 without, 138 with the unpacking
# and the tile sizes above (torch 2.13, outside the Triton launch). `benchmarks/training_shapes.py` measures the whole step (chapter 8).

# %%
import sys
from collections import Counter
from unittest import mock


def python_calls(fn) -> int:
    """Python function calls (generator steps included) made while `fn()` runs."""
    calls = Counter()

    def count(frame, event, arg):
        if event == "call":
            calls[frame.f_code.co_name] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sum(calls.values())


def host_us_per_call(fn, repeats: int = 300 if FULL_SIZE else 2) -> float:
    """Wall time per call of a host-bound `fn` (the GPU waits for the host), in µs."""
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


shape = (64, 12, 256, 64) if FULL_SIZE else (1, 2, 32, 16)  # DiT-B/2 at 256 px on the GPU
dtype = torch.bfloat16 if FULL_SIZE else torch.float16
q_, k_, v_, tq_, tk_, tv_ = (torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(6))


def ours():
    return torch.func.jvp(attention, (q_, k_, v_), (tq_, tk_, tv_))


def floor():
    return torch.func.jvp(lambda a, b, c: a * 1, (q_, k_, v_), (tq_, tk_, tv_))


direct = ours()
direct_us, direct_calls = host_us_per_call(ours), python_calls(ours)


def lifted_by_functorch():
    """`ours` with `_apply` stepping aside (as under any other transform): functorch lifts."""
    with mock.patch.dict(globals(), {"_functorch_depth": lambda: -1}):
        return ours(), host_us_per_call(ours), python_calls(ours)


lifted, lifted_us, lifted_calls = lifted_by_functorch()
assert all(torch.equal(a, b) for a, b in zip(direct, lifted, strict=True))
floor_us = host_us_per_call(floor)
print(f"torch.func.jvp(attention), B{shape[0]} H{shape[1]} N{shape[2]} d{shape[3]} {dtype}:")
print(f"  functorch lifts the Function  {lifted_us:8.0f} µs per call  {lifted_calls:6d} Python calls")
print(f"  `_apply`                      {direct_us:8.0f} µs per call  {direct_calls:6d} Python calls")
print(f"  torch.func.jvp of a * 1       {floor_us:8.0f} µs per call")
if not FULL_SIZE:
    print("(CPU: the times and calls include Triton's interpreter running the kernel)")
