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
# library supports to it and lets everything else fall through to PyTorch unchanged.
#
# ## Three layers
#
# 1. **Custom operators** (`torch.library.custom_op`): `jvp_attention::forward`,
#    `::forward_jvp`, `::backward` and `::backward_tangent` wrap the launchers of chapters 2
#    and 5. Each has a *fake* implementation that only computes output shapes, so
#    `torch.compile` traces through them without running Triton or seeing Python it cannot
#    graph.
# 2. **Two autograd Functions**. `_Attention` takes (q, k, v) and returns O; its `backward`
#    runs the backward kernels. `_AttentionWithTangent` takes (q, k, v, tq, tk, tv) and
#    returns (O, tO) from the *one* fused pass; its `jvp` hands tO back to forward-mode AD as
#    the tangent of O, and its `backward` takes cotangents of both O and tO (chapter 6's
#    kernels run only when tO's cotangent exists).
# 3. **The wrapper** `attention`: validates arguments, flattens leading dimensions, and asks
#    forward-mode AD whether the inputs carry tangents. If they do, it calls the fused
#    Function with the tangents as explicit inputs, so the forward kernel sees them.
#
# Why the explicit tangents? An autograd Function's `forward` receives plain tensors, and
# its `jvp` is only called *after* `forward`. A Function that waited for `jvp` would have
# to run a second kernel. Unpacking the duals first (`forward_ad.unpack_dual`, which also
# works inside `torch.func.jvp`) lets one launch produce O and tO together.

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
import math

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.overrides import TorchFunctionMode

from jvp_attention.backward import flash_attention_backward
from jvp_attention.forward import accurate, flash_attention_forward, interpreting
from jvp_attention.reference import tiled_attention

Tensor = torch.Tensor
# The kernels take any strides, but Inductor must hand them the layouts it traced.
_FIXED_STRIDES = (torch.Tag.needs_fixed_stride_order,)


@torch.library.custom_op("jvp_attention::forward", mutates_args=(), tags=_FIXED_STRIDES)
def _forward_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                scale: float, residual: bool) -> tuple[Tensor, Tensor, Tensor]:
    if not residual:
        result = flash_attention_forward(q, k, v, attn_mask, is_causal, scale)
        return result.out, result.lse, _NO_RESIDUAL(q)
    result, (out_residual, _) = flash_attention_forward(q, k, v, attn_mask, is_causal, scale,
                                                        residuals=True)
    return result.out, result.lse, out_residual


@_forward_op.register_fake
def _(q, k, v, attn_mask, is_causal, scale, residual):
    return _empty_out(q, v), _empty_rows(q), _empty_out(q, v) if residual else _NO_RESIDUAL(q)


@torch.library.custom_op("jvp_attention::forward_jvp", mutates_args=(), tags=_FIXED_STRIDES)
def _forward_jvp_op(q: Tensor, k: Tensor, v: Tensor, tq: Tensor, tk: Tensor, tv: Tensor,
                    attn_mask: Tensor | None, is_causal: bool, scale: float,
                    residual: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    tangents = (tq, tk, tv)
    if not residual:
        result = flash_attention_forward(q, k, v, attn_mask, is_causal, scale, tangents)
        return (result.out, result.tangent_out, result.lse, result.mu, _NO_RESIDUAL(q),
                _NO_RESIDUAL(q))
    result, residuals = flash_attention_forward(q, k, v, attn_mask, is_causal, scale, tangents,
                                                residuals=True)
    return result.out, result.tangent_out, result.lse, result.mu, *residuals


@_forward_jvp_op.register_fake
def _(q, k, v, tq, tk, tv, attn_mask, is_causal, scale, residual):
    out_like = _empty_out(q, v) if residual else _NO_RESIDUAL(q)
    return (_empty_out(q, v), _empty_out(q, v), _empty_rows(q), _empty_rows(q), out_like,
            out_like.new_empty(out_like.shape))


@torch.library.custom_op("jvp_attention::backward", mutates_args=(), tags=_FIXED_STRIDES)
def _backward_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 out_residual: Tensor, grad_out: Tensor, attn_mask: Tensor | None,
                 is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return flash_attention_backward(q, k, v, out, lse, grad_out, attn_mask, is_causal, scale,
                                    out_residual=_residual_or_none(out_residual))


@_backward_op.register_fake
def _(q, k, v, out, lse, out_residual, grad_out, attn_mask, is_causal, scale):
    return tuple(x.new_empty(x.shape) for x in (q, k, v))  # contiguous, like the kernels'


@torch.library.custom_op("jvp_attention::backward_tangent", mutates_args=(), tags=_FIXED_STRIDES)
def _backward_tangent_op(q: Tensor, k: Tensor, v: Tensor, tq: Tensor, tk: Tensor, tv: Tensor,
                         out: Tensor, lse: Tensor, tangent_out: Tensor, mu: Tensor,
                         out_residual: Tensor, tangent_out_residual: Tensor,
                         grad_out: Tensor, grad_tangent_out: Tensor, attn_mask: Tensor | None,
                         is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor,
                                                                 Tensor, Tensor, Tensor]:
    return flash_attention_backward(
        q, k, v, out, lse, grad_out, attn_mask, is_causal, scale, (tq, tk, tv), tangent_out,
        mu, grad_tangent_out, _residual_or_none(out_residual),
        _residual_or_none(tangent_out_residual))


@_backward_tangent_op.register_fake
def _(q, k, v, tq, tk, tv, out, lse, tangent_out, mu, out_residual, tangent_out_residual,
      grad_out, grad_tangent_out, attn_mask, is_causal, scale):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, q, k, v))


def _NO_RESIDUAL(q: Tensor) -> Tensor:  # noqa: N802 - reads as a constant at the call sites
    """The placeholder for "no rounding residual": an empty tensor."""
    return q.new_empty((0,))


def _residual_or_none(residual: Tensor) -> Tensor | None:
    return residual if residual.numel() else None


def _wants_residual(*inputs: Tensor) -> bool:
    """Keep the outputs' rounding residuals for the backward: only if a backward can happen,
    for 16-bit inputs, in the accurate precision mode (inference pays nothing for them)."""
    differentiable = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    return differentiable and inputs[0].dtype != torch.float32 and accurate()


def _empty_out(q: Tensor, v: Tensor) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _empty_rows(q: Tensor) -> Tensor:
    return q.new_empty(q.shape[:-1], dtype=torch.float32)


# %% [markdown]
# ## The autograd Functions
#
# `_Attention` is the primal path: forward and backward kernels, nothing else.
#
# `_FusedTangent` takes the tangents as ordinary inputs and returns (O, tO, LSE, μ) from the
# one fused launch; its `backward` takes cotangents of O and tO. It is the explicit API
# `attention_jvp` below, and it is what `torch.compile` traces, since Dynamo does not trace
# Functions that define a custom `jvp`.
#
# `_AttentionWithTangent` adds that `jvp`: it hands tO to forward-mode AD as the tangent of
# O (LSE and μ are internal and not differentiable). The tangent *of tO* would be a
# second-order forward derivative, which this library does not compute: if forward-mode AD
# asks for it (a nested `jvp`), we raise rather than return a silently wrong zero.
# `set_materialize_grads(False)` lets `backward` see `None` when nothing uses tO, and then the
# plain backward runs at its plain cost.
#
# The backwards are `once_differentiable`: they run the kernels with autograd off, which is
# also what lets `torch.func.grad` call them, and a third derivative (a gradient of the
# backward) raises instead of silently returning zeros.

# %% tags=["export"]
def _zeros_like(x: Tensor) -> Tensor:
    # A stride-0 view: the tangent of an output nobody differentiates costs no memory.
    return x.new_zeros(()).expand_as(x)


class _RefuseDoubleBackward(torch.autograd.Function):
    """Passes gradients through; differentiating them again raises."""

    @staticmethod
    def forward(n_anchors, *tensors):
        return tuple(g.detach() for g in tensors[n_anchors:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            "jvp_attention has no derivative of its backward pass (double backward, e.g. "
            "create_graph=True for a gradient penalty, or a gradient of a gradient). The "
            "supported second-order case is the backward through the tangent output of jvp.")


def _differentiable_once(backward):
    """Run a Function's backward with autograd off (the kernels are not differentiable). If
    its result could be differentiated again (create_graph=True, nested torch.func.grad), tie
    the gradients to the saved inputs through a node that raises when that happens, instead
    of letting them pass as constants and give a silently wrong second derivative."""
    def run(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        anchors = [t for t in ctx.saved_tensors if t is not None and t.requires_grad]
        anchors += [g for g in grad_outputs if isinstance(g, Tensor) and g.requires_grad]
        if not torch.is_grad_enabled() or not anchors:
            return grads
        present = [g for g in grads if g is not None]
        tied = iter(_RefuseDoubleBackward.apply(len(anchors), *anchors, *present))
        return tuple(None if g is None else next(tied) for g in grads)
    return run


def _fold_vmap_dim(x: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """Merge vmap's batch dimension into the leading batch dimension of a (B, H, N, D) tensor."""
    if not isinstance(x, Tensor):
        return x
    x = x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.flatten(0, 1)


def _vmap_by_folding(function, info, in_dims, *args):
    """A vmap rule for functions of (B, H, N, D) tensors: vmap's dimension joins the batch."""
    folded = [_fold_vmap_dim(x, d, info.batch_size) for x, d in zip(args, in_dims, strict=True)]
    outputs = function.apply(*folded)
    return tuple(o.unflatten(0, (info.batch_size, -1)) for o in outputs), (0,) * len(outputs)


class _Attention(torch.autograd.Function):
    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_by_folding(_Attention, info, in_dims, *args)

    @staticmethod
    def forward(q, k, v, attn_mask, is_causal, scale, residual):
        return torch.ops.jvp_attention.forward(q, k, v, attn_mask, is_causal, scale, residual)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, attn_mask, is_causal, scale, _ = inputs
        out, lse, out_residual = output
        ctx.mark_non_differentiable(lse, out_residual)
        ctx.save_for_backward(q, k, v, out, lse, out_residual, attn_mask)
        ctx.is_causal, ctx.scale = is_causal, scale

    @staticmethod
    @_differentiable_once
    def backward(ctx, grad_out, grad_lse, grad_residual):
        q, k, v, out, lse, out_residual, attn_mask = ctx.saved_tensors
        dq, dk, dv = torch.ops.jvp_attention.backward(q, k, v, out, lse, out_residual, grad_out,
                                                      attn_mask, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None, None, None


class _FusedTangent(torch.autograd.Function):
    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_by_folding(_FusedTangent, info, in_dims, *args)

    @staticmethod
    def forward(q, k, v, tq, tk, tv, attn_mask, is_causal, scale, residual):
        return torch.ops.jvp_attention.forward_jvp(q, k, v, tq, tk, tv, attn_mask, is_causal,
                                                   scale, residual)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, tq, tk, tv, attn_mask, is_causal, scale, _ = inputs
        out, tangent_out, lse, mu, out_residual, tangent_out_residual = output
        ctx.mark_non_differentiable(lse, mu, out_residual, tangent_out_residual)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, tq, tk, tv, out, lse, tangent_out, mu, out_residual,
                              tangent_out_residual, attn_mask)
        ctx.save_for_forward(tangent_out)
        ctx.is_causal, ctx.scale = is_causal, scale

    @staticmethod
    @_differentiable_once
    def backward(ctx, grad_out, grad_tangent_out, *_):
        (q, k, v, tq, tk, tv, out, lse, tangent_out, mu, out_residual, tangent_out_residual,
         attn_mask) = ctx.saved_tensors
        if grad_out is None and grad_tangent_out is None:
            return (None,) * 10
        if grad_out is None:
            grad_out = _zeros_like(out)
        if grad_tangent_out is None:
            dq, dk, dv = torch.ops.jvp_attention.backward(q, k, v, out, lse, out_residual,
                                                          grad_out, attn_mask, ctx.is_causal,
                                                          ctx.scale)
            return dq, dk, dv, None, None, None, None, None, None, None
        grads = torch.ops.jvp_attention.backward_tangent(
            q, k, v, tq, tk, tv, out, lse, tangent_out, mu, out_residual, tangent_out_residual,
            grad_out, grad_tangent_out, attn_mask, ctx.is_causal, ctx.scale)
        return (*grads, None, None, None, None)


class _AttentionWithTangent(_FusedTangent):
    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_by_folding(_AttentionWithTangent, info, in_dims, *args)

    @staticmethod
    def jvp(ctx, gq, gk, gv, gtq, gtk, gtv, *_):
        if any(g is not None for g in (gtq, gtk, gtv)):
            raise NotImplementedError(
                "jvp_attention computes first-order forward derivatives only; a jvp of a jvp "
                "(forward-over-forward) is not supported. Use reverse-over-forward instead.")
        (tangent_out,) = ctx.saved_tensors
        # A copy, not the output itself: forward AD refuses a tangent that is also an output
        # with a tangent of its own, and the copy keeps tO's autograd history for chapter 6.
        return tangent_out.clone(), _zeros_like(tangent_out), None, None, None, None


# %% [markdown]
# ## Validation
#
# SDPA's contract, checked up front with messages that name the argument, its shape and what
# to change. `_check_arguments` raises; the drop-in of the last section reuses it to decide
# whether a call is ours or PyTorch's.

# %% tags=["export"]
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: jvp_attention has no attention dropout; pass dropout_p=0.0"
            " (or leave the model in eval mode) or use torch's SDPA for this call")
    if query.dim() < 3 or not query.dim() == key.dim() == value.dim():
        raise ValueError(
            "query, key and value must have the same rank >= 3, shaped (..., H, N, D); got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(
            "query, key and value must share their leading (batch) dimensions; got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key's head dim {key.shape[-1]} must equal query's {query.shape[-1]}")
    if key.shape[-3:-1] != value.shape[-3:-1]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the "
                         "same number of heads and the same length")
    _check_heads(query.shape[-3], key.shape[-3], enable_gqa)
    _check_dtypes_and_devices(query, key, value, attn_mask)
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported; got query "
                         f"{query.shape[-1]} and value {value.shape[-1]}")
    if attn_mask is not None:
        _check_mask(attn_mask, query, key)
    if scale is not None and not isinstance(scale, (float, int)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")


def _check_heads(n_q_heads: int, n_kv_heads: int, enable_gqa: bool) -> None:
    if enable_gqa and n_q_heads % n_kv_heads:
        raise ValueError(f"enable_gqa=True needs query heads ({n_q_heads}) to be a multiple "
                         f"of key/value heads ({n_kv_heads})")
    if not enable_gqa and n_q_heads != n_kv_heads:
        raise ValueError(f"query has {n_q_heads} heads but key/value have {n_kv_heads}; pass "
                         "enable_gqa=True for grouped-query attention")


def _check_dtypes_and_devices(query, key, value, attn_mask):
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share a dtype; got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    devices = {x.device for x in (query, key, value, attn_mask) if x is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
    if _uses_kernels(query) and query.dtype not in KERNEL_DTYPES:
        raise TypeError(f"dtype {query.dtype} is not supported by the kernels; use one of "
                        "float16, bfloat16, float32")


def _check_mask(attn_mask, query, key):
    if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
        raise TypeError(f"attn_mask must be bool or match query's dtype {query.dtype}; got "
                        f"{attn_mask.dtype}")
    target = (*query.shape[:-1], key.shape[-2])
    try:
        torch.broadcast_shapes(attn_mask.shape, target)
        ok = attn_mask.dim() <= len(target)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"(..., Hq, Nq, Nk) = {target}")


def _uses_kernels(query: Tensor) -> bool:
    """Triton kernels on CUDA tensors, and on CPU tensors under the interpreter; otherwise
    chapter 1's tiled PyTorch implementation (differentiated by PyTorch itself)."""
    return query.is_cuda or interpreting()


# %% [markdown]
# ## The wrapper
#
# Leading dimensions are flattened into one batch dimension with `reshape`, which is a view
# (no copy) whenever the layout allows, in particular for the usual 4-D inputs and for the
# `(B, N, H, D)` layout viewed as `(B, H, N, D)`. The mask is broadcast the same way; a mask
# with leading dimensions that are already broadcast stays a stride-0 view.
#
# On a CPU without the interpreter, `attention` calls `tiled_attention` from chapter 1 and
# lets PyTorch differentiate it: every transform works there too, at PyTorch speed.

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
        query: (..., Hq, Nq, D), float16, bfloat16 or float32, any strides.
        key: (..., Hkv, Nk, D); Hkv == Hq unless `enable_gqa`.
        value: (..., Hkv, Nk, Dv); Dv may differ from D. Head dims up to 256.
        attn_mask: None, a bool mask (True = attend) or an additive float mask of query's
            dtype, broadcastable to (..., Hq, Nq, Nk). Never expanded in memory.
        dropout_p: Must be 0.0 (dropout is not implemented).
        is_causal: Causal mask aligned top-left, as in PyTorch (query i sees keys j <= i).
            Unlike SDPA it may be combined with `attn_mask`.
        scale: Softmax scale; defaults to 1/sqrt(D).
        enable_gqa: Allow Hq to be a multiple of Hkv (grouped-query attention).

    Returns:
        The attention output, (..., Hq, Nq, Dv), in query's dtype. A row that sees no key
        gives zeros, as SDPA does.

    Raises:
        TypeError, ValueError: For arguments SDPA would reject or the kernels cannot take;
            the message names the argument and what was expected.
        NotImplementedError: For dropout_p > 0.

    Example:
        >>> q, k, v = (torch.randn(2, 8, 128, 64) for _ in range(3))
        >>> t = tuple(torch.randn_like(x) for x in (q, k, v))
        >>> out, tangent = torch.func.jvp(attention, (q, k, v), t)
    """
    _check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if not _uses_kernels(query):
        return tiled_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa).out
    q, k, v, mask = _as_4d(query, key, value, attn_mask)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    tangents = _tangents_of(q, k, v)
    if tangents is None:
        out, _, _ = _Attention.apply(q, k, v, mask, is_causal, scale,
                                     _wants_residual(q, k, v))
    else:
        out = _AttentionWithTangent.apply(q, k, v, *tangents, mask, is_causal, scale,
                                          _wants_residual(q, k, v, *tangents))[0]
    return out.reshape(*query.shape[:-1], value.shape[-1])


def attention_jvp(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    tangents: tuple[Tensor, Tensor, Tensor],
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor]:
    """Attention and its tangent with the tangents passed explicitly (no forward-mode AD).

    The same fused pass as `attention` under `torch.func.jvp`, as a plain differentiable
    function: gradients flow to the inputs and to the tangents, and `torch.compile` can
    trace it (Dynamo does not trace custom `jvp` rules).

    Args:
        query, key, value, attn_mask, is_causal, scale, enable_gqa: As in `attention`.
        tangents: (t_query, t_key, t_value), shaped like (query, key, value).

    Returns:
        (out, tangent_out), both (..., Hq, Nq, Dv).

    Example:
        >>> q, k, v = (torch.randn(1, 4, 64, 32) for _ in range(3))
        >>> out, t_out = attention_jvp(q, k, v, (q, k, v))  # tangent along the inputs
    """
    _check_arguments(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)
    for name, x, t in zip(("query", "key", "value"), (query, key, value), tangents,
                          strict=True):
        if not isinstance(t, Tensor) or t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(f"the tangent of {name} must be a tensor of shape "
                             f"{tuple(x.shape)} and dtype {x.dtype}")
    if not _uses_kernels(query):
        result = tiled_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                                 tangents=tuple(tangents))
        return result.out, result.tangent_out
    q, k, v, mask = _as_4d(query, key, value, attn_mask)
    tq, tk, tv = (t.reshape(x.shape) for t, x in zip(tangents, (q, k, v), strict=True))
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    out, tangent_out = _FusedTangent.apply(q, k, v, tq, tk, tv, mask, is_causal, scale,
                                           _wants_residual(q, k, v, tq, tk, tv))[:2]
    shape = (*query.shape[:-1], value.shape[-1])
    return out.reshape(shape), tangent_out.reshape(shape)


def _as_4d(query, key, value, attn_mask):
    """Flatten leading dims into one batch dim (a view whenever the layout allows); the mask
    is broadcast to (B, Hq, Nq, Nk) as a stride-0 view."""
    q, k, v = (x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
    if attn_mask is None:
        return q, k, v, None
    mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
    return q, k, v, mask.reshape(-1, *mask.shape[-3:])


def _forward_transforms() -> int:
    """How many torch.func.jvp transforms are active around this call."""
    return sum(interpreter.key() == TransformType.Jvp
               for interpreter in retrieve_all_functorch_interpreters())


def _tangents_of(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """The forward-mode tangents of q, k, v (zeros where one has none), or None if none has."""
    if torch.compiler.is_compiling():
        return None
    tangents = [forward_ad.unpack_dual(x).tangent for x in (q, k, v)]
    if all(t is None for t in tangents):
        return None
    if _forward_transforms() > 1:
        raise NotImplementedError(
            "jvp_attention computes first-order forward derivatives only; a jvp of a jvp "
            "(forward-over-forward) is not supported. Use reverse-over-forward instead.")
    return tuple(_zeros_like(x) if t is None else t for x, t in zip((q, k, v), tangents,
                                                                    strict=True))


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
# The router answers the calls that `attention` supports and passes everything else on,
# unchanged: dropout during training, float64 on the GPU, head dims above 256. The patch is
# process-wide while the block runs; enter it around the model call, not around threads
# that must see PyTorch's own SDPA.

# %% tags=["export"]
_TORCH_SDPA = F.scaled_dot_product_attention


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    return {"query": query, "key": key, "value": value, "attn_mask": attn_mask,
            "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
            "enable_gqa": enable_gqa}


def _route(call: dict, strict: bool):
    """Run an SDPA call on our kernels if `attention` takes it, else on PyTorch's SDPA."""
    try:
        _check_arguments(**call)
    except (TypeError, ValueError, NotImplementedError):
        if strict:
            raise
        return _TORCH_SDPA(**call)
    return attention(**call)


class _RouteSDPA(TorchFunctionMode):
    def __init__(self, strict: bool):
        super().__init__()
        self.strict = strict

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TORCH_SDPA:
            return _route(_sdpa_arguments(*args, **kwargs), self.strict)
        return func(*args, **kwargs)


@contextlib.contextmanager
def sdpa(strict: bool = False):
    """Route `torch.nn.functional.scaled_dot_product_attention` to `attention` in this block.

    Calls that `attention` cannot take (dropout, unsupported dtypes or head dims) fall
    through to PyTorch unchanged, unless `strict`, which raises instead.

    Args:
        strict: Raise on calls the library cannot take instead of falling through.

    Example:
        >>> layer = torch.nn.TransformerEncoderLayer(64, 4, dropout=0.0, batch_first=True)
        >>> x, tx = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
        >>> with sdpa():
        ...     y, ty = torch.func.jvp(layer, (x,), (tx,))
    """
    previous = F.scaled_dot_product_attention

    def routed(*args, **kwargs):
        return _route(_sdpa_arguments(*args, **kwargs), strict)

    F.scaled_dot_product_attention = routed
    try:
        with _RouteSDPA(strict):
            yield
    finally:
        F.scaled_dot_product_attention = previous


def sdpa_flops(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, value_dim: int,
               is_causal: bool = False) -> float:
    """FLOPs of one attention forward (two matrix products), halved for causal masking."""
    flops = 2.0 * batch * heads * n_q * n_k * (head_dim + value_dim)
    return flops / 2 if is_causal else flops


assert math.isclose(sdpa_flops(1, 1, 2, 2, 4, 4), 64)


# %% [markdown]
# ## Every transform, checked
#
# The checks run on this machine's device; on CPU they go through Triton's interpreter, so
# the kernels themselves are exercised. The reference is PyTorch's SDPA in float64.

# %%
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvp_attention
from jvp_attention.autograd import attention, attention_jvp, sdpa

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
# vmap's batch dimension becomes one of them. Bad arguments fail early, with messages:

# %%
batched = torch.func.vmap(attention)(q, k, v)
report("vmap over the batch", batched, sdpa64(q, k, v))

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
with sdpa(), mock.patch.object(jvp_attention.autograd, "attention",
                               wraps=jvp_attention.autograd.attention) as spy:
    y, ty = torch.func.jvp(layer, (x,), (tx,))
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
# (`fullgraph=True`), forward and backward. Dynamo does not trace autograd Functions with a
# custom `jvp`, so under `torch.compile` the tangent comes from `attention_jvp`, which takes
# the tangents explicitly and runs the same fused kernel. We time the compilation and a
# small model step with and without it.

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
                       ("jvp+backward", block_jvp, (x, tx, w))]:
    compiled = torch.compile(fn, fullgraph=True)
    start = time.perf_counter()
    step(compiled, *args)
    compile_s = time.perf_counter() - start
    eager_ms, compiled_ms = timed(fn, *args), timed(compiled, *args)
    same = torch.allclose(fn(*args)[0] if name.startswith("jvp") else fn(*args),
                          compiled(*args)[0] if name.startswith("jvp") else compiled(*args))
    print(f"{name:17} first compiled step {compile_s:6.1f} s   eager {eager_ms:8.2f} ms   "
          f"compiled {compiled_ms:8.2f} ms   same result: {same}")
