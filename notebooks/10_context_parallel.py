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
# # Chapter 10: context parallelism, one sequence over several GPUs
#
# A video diffusion transformer attends over tens of thousands of tokens: Wan 2.1 at 720p
# and 81 frames sees about 75,000. One GPU then holds every query, key and value of a
# layer, their tangents under `torch.func.jvp`, and does all of the $O(N^2)$ work. *Context
# parallelism* shards the sequence: each of $W$ processes holds $1/W$ of the tokens (the
# rest of the model works token by token, so nothing else has to change) and the attention
# layers exchange what they need through `torch.distributed`.
#
# ```python
# out = jvp_attention.context_parallel_attention(
#     query, key, value, group=None, attn_mask=None, is_causal=False, scale=None,
#     enable_gqa=False, method="ulysses", layout="contiguous")
# ```
#
# takes this rank's shard of `query`, `key`, `value` (shape `(..., H, N/W, D)`) and returns
# this rank's shard of the output, under `torch.func.jvp`, `torch.autograd.forward_ad`,
# backward and backward through the tangent, like `attention`. Two methods:
#
# * **Ulysses** (`method="ulysses"`): an all-to-all turns sequence shards into head shards,
#   each rank runs the fused `attention` of chapter 7 on the whole sequence for $H/W$ of
#   the heads, and a second all-to-all turns the output back. Simple and fast on one
#   machine; it needs the heads to be a multiple of $W$.
# * **Ring** (`method="ring"`): the queries stay; key/value blocks (and their tangents)
#   travel around a ring of ranks, and each rank merges the partial results of its queries
#   against every block, *exactly*, through the log-sum-exp and its tangent $\mu$. No rule
#   on heads; communication overlaps the next block's compute.
#
# The chapter derives the merge and checks it in float64, builds both methods with their
# derivative rules, and checks them on several processes against `attention` on one.

# %%
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Two GPUs run the multi-process checks over NCCL at realistic sizes; otherwise two CPU
# processes over gloo at tiny ones.
GPUS = torch.cuda.device_count()
FULL_SIZE = GPUS >= 2

# %% [markdown]
# ## Shards of the sequence
#
# With the *contiguous* layout rank $r$ of $W$ holds tokens $[rN/W, (r+1)N/W)$. Causal
# attention makes that unfair: the last rank's queries see every key, the first rank's
# only their own. The *zig-zag* layout cuts the sequence into $2W$ chunks and gives rank
# $r$ chunks $r$ and $2W - 1 - r$, an early one and a late one, so that every rank does the
# same causal work. `shard_sequence` cuts a whole tensor either way; a model that shards
# its tokens once at the input (and gathers them at the output) keeps one layout
# throughout, and passes the same `layout` to every attention call.

# %% tags=["export"]
"""Chapter 10: context-parallel attention and its JVP over `torch.distributed`: each rank
holds a shard of the sequence, and Ulysses all-to-alls or a ring of key/value blocks
(merged exactly through the log-sum-exp and its tangent) compute its shard of the output.

`notebooks/10_context_parallel.py` derives the merge and checks both methods.
"""

import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
import torch.distributed as dist

from jvp_attention.autograd import Unsupported, attention
from jvp_attention.launch import get_precision
from jvp_attention.reference import AttentionOutputs

Tensor = torch.Tensor
METHODS = ("ulysses", "ring")
LAYOUTS = ("contiguous", "zigzag")


def shard_sequence(x: Tensor, rank: int, world_size: int, layout: str = "contiguous",
                   dim: int = -2) -> Tensor:
    """This rank's shard of a whole sequence, as `context_parallel_attention` expects it.

    Args:
        x: The whole tensor, e.g. (..., H, N, D) queries, or a (B, 1, 1, N) key-padding mask
            with `dim=-1`.
        rank: This process's rank in the group.
        world_size: The number of ranks W.
        layout: "contiguous": the rank-th of W equal chunks; "zigzag": chunks `rank` and
            `2W - 1 - rank` of 2W equal chunks, which balances causal attention's work.
        dim: The sequence dimension.

    Returns:
        A view (contiguous layout) or a copy (zigzag) of N/W entries along `dim`.

    Raises:
        ValueError: For an unknown layout, or a length that does not split evenly.

    Example:
        >>> x = torch.arange(8.0).view(1, 1, 8, 1)
        >>> shard_sequence(x, 0, 2, "zigzag").flatten().tolist()
        [0.0, 1.0, 6.0, 7.0]
    """
    _check_layout(layout)
    chunks = world_size if layout == "contiguous" else 2 * world_size
    if x.shape[dim] % chunks:
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not split into {chunks} "
                         f"equal chunks ({layout} layout over {world_size} ranks); pad it")
    parts = x.chunk(chunks, dim)
    if layout == "contiguous":
        return parts[rank]
    return torch.cat([parts[rank], parts[chunks - 1 - rank]], dim)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def sequence_positions(n_local: int, world_size: int, layout: str,
                       device: torch.device | str = "cpu") -> Tensor:
    """The position in the whole sequence of each token of the ranks' shards laid end to end
    (rank 0's first): the identity for the contiguous layout, a permutation for zig-zag."""
    index = torch.arange(world_size * n_local, device=device)
    if layout == "contiguous":
        return index
    half = n_local // 2
    rank, offset = index // n_local, index % n_local
    chunk = torch.where(offset < half, rank, 2 * world_size - 1 - rank)
    return chunk * half + offset % half


# %%
from jvp_attention.context_parallel import sequence_positions, shard_sequence

whole = torch.arange(16)
for layout in ("contiguous", "zigzag"):
    shards = [shard_sequence(whole, r, 4, layout, dim=0).tolist() for r in range(4)]
    print(f"{layout:>10}: {shards}")
    assert torch.equal(sequence_positions(4, 4, layout), torch.cat([torch.tensor(s) for s in shards]))

# %% [markdown]
# ## Merging partial attention, exactly
#
# Split the keys of one query row into disjoint blocks $b = 1, \dots, B$ (the ring's blocks,
# or chapter 2's tiles). Attention over block $b$ alone gives
#
# $$\mathrm{LSE}_b = \log \sum_{j \in b} e^{S_j},\qquad
# O_b = \sum_{j \in b} e^{S_j - \mathrm{LSE}_b}\, V_j ,$$
#
# and over all keys $\mathrm{LSE} = \log \sum_b e^{\mathrm{LSE}_b}$. Writing
# $e^{S_j - \mathrm{LSE}} = e^{\mathrm{LSE}_b - \mathrm{LSE}}\, e^{S_j - \mathrm{LSE}_b}$,
#
# $$O = \sum_b w_b\, O_b,\qquad w_b = e^{\mathrm{LSE}_b - \mathrm{LSE}},\qquad \sum_b w_b = 1 .$$
#
# **The tangent.** Differentiate along the inputs' tangents, writing $\mu_b$ for the
# tangent of $\mathrm{LSE}_b$ (chapter 1's $\mu$, for block $b$) and $t_{O,b}$ for that of
# $O_b$. From $e^{\mathrm{LSE}} = \sum_b e^{\mathrm{LSE}_b}$,
#
# $$\mu = \frac{\sum_b e^{\mathrm{LSE}_b} \mu_b}{e^{\mathrm{LSE}}} = \sum_b w_b\, \mu_b,
# \qquad t_{w_b} = w_b\,(\mu_b - \mu),$$
#
# and by the product rule on $O = \sum_b w_b O_b$,
#
# $$t_O = \sum_b w_b \left( t_{O,b} + (\mu_b - \mu)\, O_b \right).$$
#
# A row that sees no key of block $b$ has $\mathrm{LSE}_b = -\infty$, so $w_b = 0$; a row
# that sees no key at all has $\mathrm{LSE} = -\infty$ and, by the library's convention,
# $O = t_O = 0$, $\mu = 0$. Merging two at a time, $(\mathrm{LSE}_a, O_a, t_{O,a}, \mu_a)$
# with $(\mathrm{LSE}_b, \dots)$ by the same formulas for two blocks, is the same sum
# grouped differently, which is what a ring does as blocks arrive. The weights are computed
# against a shift that is $0$ where $\mathrm{LSE} = -\infty$, so nothing becomes NaN.

# %% tags=["export"]
def merge_attention(parts: list[AttentionOutputs]) -> AttentionOutputs:
    """Attention over the union of disjoint key blocks, from each block's results.

    Args:
        parts: Per block, `AttentionOutputs(out, lse, tangent_out, mu)` of the same queries
            against that block's keys (tangent_out and mu all None, or all given), in the
            accumulation dtype.

    Returns:
        AttentionOutputs over all the blocks' keys: out = sum_b w_b out_b with
        w_b = exp(lse_b - lse), lse = logsumexp_b lse_b, and with tangents
        mu = sum_b w_b mu_b, tangent_out = sum_b w_b (tangent_out_b + (mu_b - mu) out_b).
    """
    merged = parts[0]
    for part in parts[1:]:
        merged = _merge_two(merged, part)
    return merged


def _merge_two(a: AttentionOutputs, b: AttentionOutputs) -> AttentionOutputs:
    lse = torch.logaddexp(a.lse, b.lse)
    shift = torch.where(lse == -math.inf, 0.0, lse)  # rows that see no key: both weights 0
    w_a, w_b = torch.exp(a.lse - shift), torch.exp(b.lse - shift)
    out = w_a[..., None] * a.out + w_b[..., None] * b.out
    if a.mu is None:
        return AttentionOutputs(out, lse)
    mu = w_a * a.mu + w_b * b.mu
    tangent_out = (w_a[..., None] * (a.tangent_out + (a.mu - mu)[..., None] * a.out)
                   + w_b[..., None] * (b.tangent_out + (b.mu - mu)[..., None] * b.out))
    return AttentionOutputs(out, lse, tangent_out, mu)


# %% [markdown]
# The check, in float64 against chapter 1's `reference_attention` (which returns LSE and
# $\mu$ as well): split the keys into uneven blocks, one of them hidden from some rows by a
# key-padding mask and one hidden from *every* row, attend to each block, merge, and compare
# with attention over all the keys at once. Then the tangent formula against forward-mode AD
# of the merge of the primal results alone: PyTorch differentiates
# $\log\sum e^{\mathrm{LSE}_b}$ and $\sum_b w_b O_b$ itself.

# %%
from jvp_attention.context_parallel import merge_attention
from jvp_attention.reference import AttentionOutputs, reference_attention

torch.manual_seed(0)
f64 = {"dtype": torch.float64, "device": DEVICE}
q, k, v, tq, tk, tv = (torch.randn(2, 3, 12, 8, **f64) for _ in range(6))
keep = torch.ones(2, 1, 1, 12, dtype=torch.bool, device=DEVICE)
keep[1, ..., 3:5] = False  # sequence 1: keys 3 and 4 are padding
keep[..., 9:12] = False    # the last block is padding everywhere


def check(name, got, want, tol=1e-12):
    """Print the largest absolute difference; fail above `tol`."""
    diff = (got - want).abs().max().item()
    print(f"{name:<44} max |diff| = {diff:.1e}")
    assert diff <= tol, f"{name}: {diff:.2e}"


whole = reference_attention(q, k, v, keep, tangents=(tq, tk, tv))
blocks = [slice(0, 5), slice(5, 9), slice(9, 12)]
parts = [reference_attention(q, k[..., b, :], v[..., b, :], keep[..., b],
                             tangents=(tq, tk[..., b, :], tv[..., b, :])) for b in blocks]
merged = merge_attention(parts)
for name in ("out", "lse", "tangent_out", "mu"):
    check(f"merged {name} vs attention over all keys", getattr(merged, name),
          getattr(whole, name))


def merged_primal(q, k, v):
    """(out, lse) of the merge of the blocks' primal results: no tangent formula involved."""
    primal = merge_attention([reference_attention(q, k[..., b, :], v[..., b, :], keep[..., b])
                              for b in blocks])
    return primal.out, primal.lse


(_, _), (t_out, t_lse) = torch.func.jvp(merged_primal, (q, k, v), (tq, tk, tv))
check("tangent formula vs forward AD of the merge: tO", merged.tangent_out, t_out)
check("tangent formula vs forward AD of the merge: mu", merged.mu, t_lse)

# %% [markdown]
# ## The library's internals, in one place
#
# Both methods call chapter 7's public `attention` where they can. The ring needs more: the
# row statistics of each block (LSE and $\mu$, which `attention` keeps to itself) in the
# forward, and a backward that takes the *global* statistics. The cell below is the only
# code of this chapter that reaches into the library's internals: chapter 7's argument check
# and its choice between kernels and PyTorch operations, its precision mode, and the custom
# operators `jvp_attention::forward`, `::forward_jvp`, `::backward` and `::backward_tangent`
# (chapter 1's `reference_*` functions where the kernels do not run: float64, CPU tensors
# without Triton's interpreter). If those signatures change, this cell is what changes.
#
# For 16-bit inputs the forward operators also return each output's rounding residual (the
# part of its fp32 value that the 16-bit output dropped): added back, the blocks are merged
# from their fp32 values, and the backward gets the residual of the merged output, as
# chapter 7's accurate mode does for one call.

# %% tags=["export"]
from jvp_attention import autograd as _library  # noqa: E402  (the adapter's own import)
from jvp_attention.reference import (  # noqa: E402
    reference_attention,
    reference_backward,
    reference_backward_tangent,
)


def _check_local_arguments(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                           is_causal: bool, scale: float | None, enable_gqa: bool) -> None:
    """`attention`'s own validation, applied to this rank's shards."""
    _library.check_arguments(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)


def _precision() -> str:
    return get_precision()


def _jvp_nesting() -> int:
    """How many `torch.func.jvp` are active around this call."""
    return _library.jvp_nesting()


def _block_forward(q: Tensor, k: Tensor, v: Tensor, tangents: tuple[Tensor, ...] | None,
                   mask: Tensor | None, is_causal: bool, scale: float,
                   precision: str) -> AttentionOutputs:
    """(out, lse[, tangent_out, mu]) of (B, H, n, D) queries against one block of keys; out,
    tangent_out and mu in the accumulation dtype (fp32, or float64 for float64 inputs), lse
    as the kernels give it (fp64 with an additive mask, chapter 2's `lse_dtype`)."""
    if not _library.uses_kernels(q, k, v):
        result = reference_attention(q, k, v, mask, is_causal, scale, True, tangents)
        return AttentionOutputs(*(None if x is None else x.to(result.lse.dtype)
                                  for x in result))
    mask = _scores_mask(mask, q, k)
    residual = q.dtype != torch.float32
    if tangents is None:
        out, lse, out_res = torch.ops.jvp_attention.forward(q, k, v, mask, is_causal, scale,
                                                            residual, precision)
        return AttentionOutputs(_unrounded(out, out_res), lse)
    out, t_out, lse, mu, out_res, t_res = torch.ops.jvp_attention.forward_jvp(
        q, k, v, *tangents, mask, None, is_causal, scale, residual, precision)
    return AttentionOutputs(_unrounded(out, out_res), lse, _unrounded(t_out, t_res), mu)


def _block_backward(q: Tensor, k: Tensor, v: Tensor, tangents: tuple[Tensor, ...] | None,
                    mask: Tensor | None, is_causal: bool, scale: float, precision: str,
                    saved: tuple[Tensor, ...], grad_out: Tensor,
                    grad_tangent_out: Tensor | None) -> tuple[Tensor, ...]:
    """One block's share of the gradients, from the merged (global) row statistics `saved` =
    (out, lse, tangent_out, mu, out_residual, tangent_out_residual): (dq, dk, dv), and with
    `grad_tangent_out` also (dtq, dtk, dtv)."""
    out, lse, t_out, mu, out_res, t_res = saved
    if not _library.uses_kernels(q, k, v):
        if grad_tangent_out is None:
            return reference_backward(q, k, v, out, lse, grad_out, mask, is_causal, scale, True)
        return reference_backward_tangent(q, k, v, tangents, out, lse, t_out, mu, grad_out,
                                          grad_tangent_out, mask, is_causal, scale, True)
    mask = _scores_mask(mask, q, k)
    if grad_tangent_out is None:
        return torch.ops.jvp_attention.backward(q, k, v, out, lse, out_res, grad_out, mask,
                                                is_causal, scale, False, precision)[:3]
    return torch.ops.jvp_attention.backward_tangent(
        q, k, v, *tangents, out, lse, t_out, mu, out_res, t_res, grad_out, grad_tangent_out,
        mask, None, is_causal, scale, False, precision)[:6]


def _scores_mask(mask: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    """A (B, 1, 1, n_k) key-padding mask as the operators take masks: (B, Hq, n_q, n_k),
    a stride-0 view."""
    return None if mask is None else mask.expand(*q.shape[:-1], k.shape[-2])


def _unrounded(x: Tensor, residual: Tensor) -> Tensor:
    """An output in fp32, with its rounding residual added back when there is one."""
    return x.float() + residual.float() if residual.numel() else x.float()


# %% [markdown]
# ## Ulysses: from sequence shards to head shards and back
#
# Attention is independent across heads. With $H$ heads over $W$ ranks, an all-to-all sends
# rank $w$ the heads $[wH/W, (w+1)H/W)$ of every rank's tokens: afterwards each rank holds
# *all* $N$ tokens of $H/W$ heads, runs the fused `attention` on them (the JVP, the
# backward, the backward through the tangent, all of chapter 7), and the reverse all-to-all
# hands every rank its tokens of every head again.
#
# The all-to-all is a linear map $A$ that only moves entries, so its derivative rules are
# itself: the tangent of $A(x)$ is $A(t_x)$, and the gradient of $x$ is the reverse map
# applied to the output's gradient, $A^\top = A^{-1}$ (a permutation's transpose is its
# inverse). `_AllToAll` is an `autograd.Function` with exactly these rules, written with
# `_AllToAll.apply` inside `jvp` and `backward`, so that they are themselves differentiable:
# the backward through the tangent (a loss on $t_O$) and double backward go through the
# same communication. A `vmap` rule moves vmap's dimension to the front, where the all-to-all
# treats it as one more batch dimension.
#
# **Heads and GQA.** Query heads must be a multiple of $W$. With grouped-query attention
# (`enable_gqa`) the key/value heads are split the same way, which keeps every query head
# with its key/value head as long as $H_{kv}$ is also a multiple of $W$; when it is not
# (e.g. one key/value head), each key/value head is repeated $W / \gcd(H_{kv}, W)$ times
# first, which is always enough, at that much more communication.
#
# **Zig-zag and causal.** After the all-to-all the tokens are in the ranks' order; with the
# zig-zag layout that is not the sequence's order, which causal attention needs. The
# tokens are permuted into order for the call (and the output back), a local copy.

# %% tags=["export"]
def _all_to_all(x: Tensor, group: Any, to_heads: bool) -> Tensor:
    """(..., H, n, D) sequence shards -> (..., H/W, W n, D) head shards (`to_heads`), or back."""
    world = dist.get_world_size(group)
    *lead, heads, n, d = x.shape
    x = x.reshape(-1, heads, n, d)
    b = x.shape[0]
    if to_heads:  # send[w] = my tokens of rank w's heads
        send = x.reshape(b, world, heads // world, n, d).transpose(0, 1)
    else:  # send[w] = rank w's tokens of my heads
        send = x.reshape(b, heads, world, n // world, d).permute(2, 0, 1, 3, 4)
    send = send.contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    if to_heads:  # received[w] = rank w's tokens of my heads: lay them end to end
        out = received.permute(1, 2, 0, 3, 4).reshape(b, heads // world, world * n, d)
    else:  # received[w] = my tokens of rank w's heads: stack the heads
        out = received.transpose(0, 1).reshape(b, world * heads, n // world, d)
    return out.reshape(*lead, *out.shape[1:])


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` whose tangent is the same all-to-all of the input's tangent and whose
    gradient is the reverse all-to-all, each itself differentiable."""

    @staticmethod
    def forward(x, group, to_heads):
        return _all_to_all(x, group, to_heads)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.to_heads = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group, not ctx.to_heads), None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _AllToAll.apply(tangent, ctx.group, ctx.to_heads)

    @staticmethod
    def vmap(info, in_dims, x, group, to_heads):
        x = x.expand(info.batch_size, *x.shape) if in_dims[0] is None else x.movedim(in_dims[0], 0)
        return _AllToAll.apply(x, group, to_heads), 0


def _spread_kv_heads(key: Tensor, value: Tensor, world: int) -> tuple[Tensor, Tensor]:
    """Repeat each key/value head W / gcd(Hkv, W) times when Hkv is not a multiple of W
    (GQA), so that every rank gets the key/value heads of its query heads."""
    repeat = world // math.gcd(key.shape[-3], world)
    if repeat == 1:
        return key, value
    return key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)


def _ulysses(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool,
             scale: float, enable_gqa: bool, layout: str, group: Any, world: int) -> Tensor:
    key, value = _spread_kv_heads(key, value, world)
    q, k, v = (_AllToAll.apply(x, group, True) for x in (query, key, value))
    positions = None
    if is_causal and layout == "zigzag":  # into the sequence's order, for the causal band
        positions = sequence_positions(query.shape[-2], world, layout, query.device)
        order = torch.argsort(positions)
        q, k, v = (x.index_select(-2, order) for x in (q, k, v))
        mask = None if mask is None else mask.index_select(-1, order)
    out = attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    if positions is not None:
        out = out.index_select(-2, positions)
    return _AllToAll.apply(out, group, False)


# %% [markdown]
# ## Ring: the queries stay, the keys and values travel
#
# Rank $r$ keeps its queries (and their tangents). At step $s = 0, \dots, W-1$ it holds the
# key/value block of rank $r - s \pmod W$ (with $t_K, t_V$ in the same buffer), attends its
# queries to that block, and merges the result into its running $(O, \mathrm{LSE}, t_O,
# \mu)$ by the formulas above. While it computes, the block is already on its way to rank
# $r + 1$ and the next one is arriving from $r - 1$ (`batch_isend_irecv`, posted before the
# compute, waited for after). After $W$ steps every query has met every key.
#
# **Causal.** Whether query chunk $i$ sees key chunk $j$ of the whole sequence: all of it
# for $j < i$, the causal band for $j = i$, none of it for $j > i$. With the contiguous
# layout, rank $r$'s block from source $s$ is therefore full ($s < r$), causal ($s = r$) or
# skipped ($s > r$): rank $W-1$ works $W$ times as long as rank 0. With the zig-zag layout
# (chunks $r$ and $2W-1-r$ on rank $r$, chunks $s$ and $2W-1-s$ in the block), working out
# the four pairs of chunks gives:
#
# * $s = r$: causal over the two chunks laid end to end (their order is the sequence's);
# * $s < r$: all of rank $r$'s queries see the block's *first* chunk, none its second;
# * $s > r$: rank $r$'s *second* chunk sees the whole block, its first chunk nothing.
#
# Every off-diagonal step is half a block's work, and the diagonal one about half too, on
# every rank. A row that sees none of a block's keys gets $\mathrm{LSE}_b = -\infty$ from the
# kernel, weight 0 in the merge.
#
# **The backward** uses the *merged* $O$ and $\mathrm{LSE}$ (and $t_O$, $\mu$). Chapter 1's
# gradients are sums over keys of terms that involve key $j$ and row statistics only:
# $P_{ij} = e^{S_{ij} - \mathrm{LSE}_i}$ is the global probability when the LSE is the global
# one, and $\Delta_i = \mathrm{rowsum}(dO \circ O)$ (through the tangent also $c_i$ and
# $\Delta_{2,i}$ of chapter 6) comes from the global outputs. So the backward kernels run
# on one block at a time with the global statistics, and their results add up: $dQ$ over
# the blocks, $dK, dV$ (and $dt_K, dt_V$) over the ranks' queries. The key/value blocks go
# around the ring once more, and the fp32 sums of their gradients travel with them, one
# step behind, until they arrive at their owners.
#
# **Derivatives.** `_RingAttention` is one `autograd.Function` over the whole ring, used as
# chapter 7's `attention` uses `_FusedTangent`: the wrapper unpacks the forward-mode duals
# of the inputs, runs the Function on primals and tangents as plain inputs (so that one pass
# merges $O$ and $t_O$), and hands forward-mode AD `make_dual(O, tO)`; the Function's
# `backward` takes cotangents of $O$ and $t_O$. Two things it does not do, and says so
# rather than return a wrong number: its gradients are not differentiable again (a gradient
# penalty raises when it differentiates them), and it raises under `torch.func.jvp` nested
# in `torch.func.jvp`, a second-order tangent that the fused pass does not compute.
# `method="ulysses"`, whose pieces are `attention` and a linear map, does both.

# %% tags=["export"]
@dataclass(frozen=True)
class _Ring:
    """Where this rank sits in the ring, and what the call computes."""

    group: Any
    rank: int
    world: int
    next: int  # global ranks of the neighbours, as torch.distributed's p2p calls take them
    previous: int
    is_causal: bool
    zigzag: bool
    scale: float
    precision: str
    length: int  # this rank's number of queries (and keys, when causal)

    def part(self, source: int) -> tuple[slice, slice, bool] | None:
        """Which of this rank's query rows see which keys of `source`'s block, and whether
        through the causal band; None when no row sees any."""
        every = slice(None)
        if not self.is_causal:
            return every, every, False
        if source == self.rank:
            return every, every, True
        half = self.length // 2
        if not self.zigzag:
            return (every, every, False) if source < self.rank else None
        if source < self.rank:
            return every, slice(0, half), False
        return slice(half, self.length), every, False


def _make_ring(group: Any, world: int, is_causal: bool, layout: str, scale: float,
               length: int) -> _Ring:
    rank = dist.get_rank(group)

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    return _Ring(group, rank, world, global_rank((rank + 1) % world),
                 global_rank((rank - 1) % world), is_causal, layout == "zigzag", scale,
                 _precision(), length)


def _pack(tensors: tuple[Tensor, ...], dtype: torch.dtype | None = None) -> Tensor:
    """One flat buffer holding `tensors`, so that a ring step is one send and one receive."""
    return torch.cat([t.reshape(-1).to(dtype or t.dtype) for t in tensors])


def _unpack(buffer: Tensor, like: tuple[Tensor, ...]) -> list[Tensor]:
    """Views of `buffer` shaped like `like` (the inverse of `_pack`)."""
    sizes = [t.numel() for t in like]
    return [part.view(t.shape) for part, t in zip(buffer.split(sizes), like, strict=True)]


def _exchange(send: Tensor, receive: Tensor, ring: _Ring, tag: int) -> list:
    """Send `send` to the next rank and receive `receive` from the previous, asynchronously
    (batched, so that NCCL pairs them without deadlock)."""
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, ring.next, ring.group, tag),
        dist.P2POp(dist.irecv, receive, ring.previous, ring.group, tag),
    ])


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _around_the_ring(buffer: Tensor, ring: _Ring):
    """Yield (source rank, its block) for every rank's block, this rank's own first. The
    next block is already on its way while the caller computes on the one yielded."""
    for step in range(ring.world):
        last = step == ring.world - 1
        if not last:
            incoming = torch.empty_like(buffer)
            pending = _exchange(buffer, incoming, ring, tag=0)
        yield (ring.rank - step) % ring.world, buffer
        if not last:
            _wait(pending)
            buffer = incoming


def _row_view(x: Tensor, rows: slice) -> Tensor:
    """Rows of a (B, H, n) row statistic or a (B, H, n, D) tensor."""
    return x[..., rows] if x.dim() == 3 else x[..., rows, :]


def _rows(x: Tensor | None, rows: slice) -> Tensor | None:
    """`_row_view`, contiguous as the backward operators read them (empty placeholders and
    None pass through)."""
    return x if x is None or not x.numel() else _row_view(x, rows).contiguous()


def _key_block(mask: Tensor | None, source: int, n_k: int, cols: slice) -> Tensor | None:
    """The gathered key-padding mask's columns for `source`'s block."""
    return None if mask is None else mask[..., source * n_k:(source + 1) * n_k][..., cols]


# %% [markdown]
# The forward: the running merge lives in the accumulation dtype; each block's result goes
# into the rows that saw it.

# %% tags=["export"]
def _ring_forward(q: Tensor, k: Tensor, v: Tensor, tangents: tuple[Tensor, ...] | None,
                  mask: Tensor | None, ring: _Ring) -> tuple[Tensor, ...]:
    """(out, tangent_out, lse, mu, out_residual, tangent_out_residual); tangent_out and mu
    empty without tangents, the residuals empty unless 16-bit and accurate."""
    travelling = (k, v) if tangents is None else (k, v, *tangents[1:])
    merged = None
    for source, block in _around_the_ring(_pack(travelling), ring):
        part = ring.part(source)
        if part is None:
            continue
        rows, cols, causal = part
        k_b, v_b, *t_kv = (x[..., cols, :] for x in _unpack(block, travelling))
        block_tangents = None if tangents is None else (tangents[0][..., rows, :], *t_kv)
        result = _block_forward(q[..., rows, :], k_b, v_b, block_tangents,
                                _key_block(mask, source, k.shape[-2], cols), causal,
                                ring.scale, ring.precision)
        merged = _merge_rows(merged, result, rows, q, v)
    return _ring_outputs(merged, q.dtype, ring.precision)


def _merge_rows(merged: AttentionOutputs | None, block: AttentionOutputs, rows: slice,
                q: Tensor, v: Tensor) -> AttentionOutputs:
    """Merge `block` (results for `rows` of the queries) into the running results."""
    if merged is None:  # no key seen yet: LSE = -inf, everything else 0
        acc = block.out.dtype  # the LSE keeps its own (fp64 with an additive mask)
        zeros = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=acc)
        merged = AttentionOutputs(zeros, q.new_full(q.shape[:-1], -math.inf,
                                                    dtype=block.lse.dtype),
                                  None if block.mu is None else zeros.clone(),
                                  None if block.mu is None else q.new_zeros(q.shape[:-1],
                                                                            dtype=acc))
    seen = AttentionOutputs(*(None if x is None else _row_view(x, rows) for x in merged))
    for into, value in zip(merged, _merge_two(seen, block), strict=True):
        if into is not None:
            _row_view(into, rows).copy_(value)
    return merged


def _ring_outputs(merged: AttentionOutputs, dtype: torch.dtype,
                  precision: str) -> tuple[Tensor, ...]:
    """The merged results in the inputs' dtype, and for 16-bit inputs in the accurate mode
    the rounding residuals the backward's row statistics use."""
    keep = dtype in (torch.float16, torch.bfloat16) and precision == "accurate"

    def empty(like: torch.dtype = dtype) -> Tensor:  # a fresh placeholder for each output
        return merged.out.new_empty((0,), dtype=like)

    def rounded(x: Tensor | None) -> tuple[Tensor, Tensor]:
        if x is None:
            return empty(), empty()
        y = x.to(dtype)
        return y, (x - y.to(x.dtype)).to(dtype) if keep else empty()

    (out, out_res), (t_out, t_res) = rounded(merged.out), rounded(merged.tangent_out)
    mu = empty(merged.out.dtype) if merged.mu is None else merged.mu
    return out, t_out, merged.lse, mu, out_res, t_res


# %% [markdown]
# The backward: the key/value blocks go around again; this rank adds its queries' share of
# each block's gradients to the fp32 sums that arrive from the previous rank, and sends
# them on while it computes the next block.

# %% tags=["export"]
def _ring_backward(saved: tuple[Tensor | None, ...], grad_out: Tensor | None,
                   grad_tangent_out: Tensor | None, ring: _Ring) -> tuple[Tensor | None, ...]:
    """(dq, dk, dv, dtq, dtk, dtv); the last three None without `grad_tangent_out`."""
    q, k, v, tq, tk, tv, mask, out, t_out, lse, mu, out_res, t_res = saved
    second = grad_tangent_out is not None
    if grad_out is None:
        grad_out = out.new_zeros(()).expand_as(out)
    travelling = (k, v, tk, tv) if second else (k, v)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros_like(q, dtype=acc)
    dtq = torch.zeros_like(q, dtype=acc) if second else None
    stats = (out, lse, t_out, mu, out_res, t_res)
    sending = None  # (requests, buffer being sent, buffer being received)
    for source, block in _around_the_ring(_pack(travelling), ring):
        mine = torch.zeros(block.numel(), dtype=acc, device=block.device)
        part = ring.part(source)
        if part is not None:
            rows, cols, causal = part
            blocks = [x[..., cols, :] for x in _unpack(block, travelling)]
            tangents = (tq[..., rows, :], *blocks[2:]) if second else None
            grads = _block_backward(
                q[..., rows, :], *blocks[:2], tangents,
                _key_block(mask, source, k.shape[-2], cols), causal, ring.scale,
                ring.precision, tuple(_rows(x, rows) for x in stats), grad_out[..., rows, :],
                None if not second else grad_tangent_out[..., rows, :])
            dq[..., rows, :] += grads[0]
            if second:
                dtq[..., rows, :] += grads[3]
            key_side = grads[1:3] if not second else (*grads[1:3], *grads[4:6])
            for total, g in zip(_unpack(mine, travelling), key_side, strict=True):
                total[..., cols, :] += g
        if sending is not None:  # the sums of this block so far, from the previous rank
            _wait(sending[0])
            mine += sending[2]
        received = torch.empty_like(mine)
        sending = (_exchange(mine, received, ring, tag=1), mine, received)
    _wait(sending[0])  # each block's complete sums, back at its owner
    key_grads = [g.to(x.dtype) for g, x in zip(_unpack(sending[2], travelling), travelling,
                                                strict=True)]
    dk, dv, *dt_kv = key_grads
    if not second:
        return dq.to(q.dtype), dk, dv, None, None, None
    return dq.to(q.dtype), dk, dv, dtq.to(tq.dtype), *dt_kv


# %% [markdown]
# The `autograd.Function` and the wrapper. `set_materialize_grads(False)` lets `backward`
# see `None` when nothing uses $t_O$ (the MeanFlow step), and then only the first-order
# kernels run. A `vmap` rule folds vmap's dimension into the batch, as chapter 7's Functions
# do.

# %% tags=["export"]
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, tq, tk, tv, mask, ring):
        tangents = None if tq is None else (tq, tk, tv)
        with torch.no_grad():
            return _ring_forward(q, k, v, tangents, mask, ring)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, tq, tk, tv, mask, ring = inputs
        out, t_out, lse, mu, out_res, t_res = output
        fixed = (lse, mu, out_res, t_res) if tq is not None else (t_out, lse, mu, out_res, t_res)
        ctx.mark_non_differentiable(*fixed)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, tq, tk, tv, mask, out, t_out, lse, mu, out_res, t_res)
        ctx.ring = ring

    @staticmethod
    def backward(ctx, grad_out, grad_tangent_out, *_):
        if grad_out is None and grad_tangent_out is None:
            return (None,) * 8
        with torch.no_grad():
            grads = _ring_backward(ctx.saved_tensors, grad_out, grad_tangent_out, ctx.ring)
        if _may_be_differentiated(ctx, (grad_out, grad_tangent_out)):
            grads = _refuse_double_backward(grads, [*ctx.saved_tensors, grad_out,
                                                    grad_tangent_out])
        return (*grads, None, None)

    @staticmethod
    def vmap(info, in_dims, *args):
        folded = [_fold_vmap_dim(x, d, info.batch_size) for x, d in zip(args, in_dims,
                                                                         strict=True)]
        outputs = _RingAttention.apply(*folded)
        return (tuple(o.unflatten(0, (info.batch_size, -1)) if o.numel() else o
                      for o in outputs),
                tuple(0 if o.numel() else None for o in outputs))


def _fold_vmap_dim(x: Any, dim: int | None, size: int) -> Any:
    """Merge vmap's dimension into the batch dimension of a (B, ...) tensor."""
    if not isinstance(x, Tensor):
        return x
    x = x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.flatten(0, 1)


def _may_be_differentiated(ctx, grad_outputs) -> bool:
    """Whether the backward's results may be differentiated again (create_graph=True)."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, Tensor) and t.requires_grad
               for t in (*ctx.saved_tensors, *grad_outputs))


class _NoDoubleBackward(torch.autograd.Function):
    """Passes gradients through; differentiating them raises instead of returning zeros."""

    @staticmethod
    def forward(n_anchors, *tensors):
        return tuple(t.detach() for t in tensors[n_anchors:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise Unsupported(
            "ring double backward",
            "context_parallel_attention(method='ring') differentiates once (also through the "
            "tangent) but its gradients cannot be differentiated again (a gradient penalty); "
            "use method='ulysses', whose gradients are differentiable")


def _refuse_double_backward(grads, anchors) -> tuple:
    anchors = [a for a in anchors if isinstance(a, Tensor) and a.requires_grad]
    present = [g for g in grads if g is not None]
    tied = iter(_NoDoubleBackward.apply(len(anchors), *anchors, *present))
    return tuple(None if g is None else next(tied) for g in grads)


def _ring(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool,
          scale: float, enable_gqa: bool, layout: str, group: Any, world: int) -> Tensor:
    # (B, H, N, D); only reshaped when needed (a reshape of a dual tensor is not free)
    q, k, v = (x if x.dim() == 4 else x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
    if mask is not None:  # (B, 1, 1, N), B matching the flattened batch
        mask = mask.expand(*query.shape[:-3], 1, 1, mask.shape[-1]).reshape(
            -1, 1, 1, mask.shape[-1])
    if _jvp_nesting() > 1:  # the fused tangent would be taken for the outer one's
        raise Unsupported(
            "ring forward over forward",
            "context_parallel_attention(method='ring') computes the tangent of its output but "
            "not the tangent of that tangent (torch.func.jvp nested in torch.func.jvp); use "
            "method='ulysses'")
    ring = _make_ring(group, world, is_causal, layout, scale, q.shape[-2])
    tangents = _tangents_of(q, k, v)
    if tangents is None:
        out = _RingAttention.apply(q, k, v, None, None, None, mask, ring)[0]
    else:  # one pass for O and tO; tO goes back to forward-mode AD as it is
        primals = [forward_ad.unpack_dual(x).primal for x in (q, k, v)]
        out, t_out = _RingAttention.apply(*primals, *tangents, mask, ring)[:2]
        out = forward_ad.make_dual(out, t_out)
    return out if query.dim() == 4 else out.reshape(*query.shape[:-1], value.shape[-1])


def _tangents_of(*tensors: Tensor) -> tuple[Tensor, ...] | None:
    """The forward-mode tangents of `tensors` (zeros where one has none), or None if none
    has one."""
    tangents = [forward_ad.unpack_dual(x).tangent for x in tensors]
    if all(t is None for t in tangents):
        return None
    return tuple(x.new_zeros(()).expand(x.shape) if t is None else t
                 for x, t in zip(tensors, tangents, strict=True))


# %% [markdown]
# How the work is spread over the ranks, from `_Ring.part` itself: the fraction of a full
# block's score matrix each rank computes at each step (causal, 4 ranks).

# %%
from jvp_attention.context_parallel import _Ring


def work(layout, world=4, n=8):
    """Per rank, the fraction of a block's scores computed at each step, and their sum."""
    table = {}
    for rank in range(world):
        ring = _Ring(None, rank, world, 0, 0, True, layout == "zigzag", 1.0, "accurate", n)
        steps = []
        for step in range(world):
            part = ring.part((rank - step) % world)
            if part is None:
                steps.append(0.0)
                continue
            rows, cols, causal = part
            n_rows, n_cols = len(range(n)[rows]), len(range(n)[cols])
            steps.append(n_rows * (n_cols + 1) / 2 / n**2 if causal else n_rows * n_cols / n**2)
        table[rank] = steps
    return table


for layout in ("contiguous", "zigzag"):
    print(f"{layout}:")
    for rank, steps in work(layout).items():
        print(f"  rank {rank}: " + "  ".join(f"{s:4.2f}" for s in steps) + f"   total {sum(steps):4.2f}")

# %% [markdown]
# ## The entry point, and what it refuses
#
# `context_parallel_attention` validates the call on every rank, then makes sure that the
# ranks agree: one small all-gather of each rank's shapes and dtype, and of whether its
# own checks passed. A bad call therefore raises on *every* rank, with a message that says
# what to change, instead of leaving the others waiting in a collective that never comes:
#
# * no initialized process group (`RuntimeError`: call `init_process_group`, or use
#   `attention` on one process);
# * shards of different lengths on different ranks (`ValueError`: pad the sequence to a
#   multiple of $W$, or $2W$ for zig-zag, and hide the padding with a key-padding mask);
# * Ulysses with query heads that are not a multiple of $W$ (`ValueError`: use the ring);
# * a mask that is not a key-padding mask, e.g. one that varies along the queries: it cannot
#   be sharded along the sequence with the keys (`Unsupported`); a differentiable mask
#   (`ValueError`: the mask is a constant here);
# * causal attention between shards of different lengths, an odd shard with zig-zag;
# * anything `attention` itself refuses (its own message), checked on the shards.
#
# The key-padding mask, shape `(..., 1, 1, N/W)`, holds this rank's keys; it is all-gathered
# (it is $W$ times smaller than one head of keys) and every block takes its columns from it.
# Under `torch.autocast` the inputs are cast as SDPA casts them, before anything travels.
# With $W = 1$ the call is `attention` itself.

# %% tags=["export"]
def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: Any = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    method: str = "ulysses",
    layout: str = "contiguous",
) -> Tensor:
    """Attention over a sequence sharded across the ranks of a process group, with its JVP.

    Every rank of `group` calls it at the same time with its own shard of the sequence
    (dim -2) of query, key and value, and gets its shard of the output. It works like
    `attention` under `torch.func.jvp`, `torch.autograd.forward_ad`, backward and backward
    through the tangent output; communication goes through `torch.distributed` (NCCL on
    GPUs, gloo on CPUs).

    Args:
        query: This rank's (..., Hq, N/W, D) shard of the queries.
        key: This rank's (..., Hkv, N_k/W, D) shard of the keys.
        value: This rank's (..., Hkv, N_k/W, Dv) shard of the values.
        group: The process group (None: the default group). Its W ranks hold the shards
            in rank order.
        attn_mask: None, or this rank's shard of a key-padding mask, shape (..., 1, 1, N_k/W),
            bool (True = attend) or additive float, a constant (no gradient, no tangent).
        is_causal: Causal attention over the whole sequence (query i sees keys j <= i);
            needs query and key shards of the same length.
        scale: Softmax scale; defaults to 1/sqrt(D).
        enable_gqa: Allow Hq to be a multiple of Hkv (grouped-query attention).
        method: "ulysses": all-to-all to head shards, `attention` on the whole sequence,
            all-to-all back; needs Hq to be a multiple of W (with GQA, key/value heads that
            are not are repeated). "ring": key/value blocks travel around the ranks and the
            partial results are merged exactly; no rule on heads; differentiable once.
        layout: "contiguous": rank r holds the r-th of W equal chunks of the sequence;
            "zigzag": chunks r and 2W-1-r of 2W, which balances causal work (see
            `shard_sequence`).

    Returns:
        This rank's shard of the attention output, (..., Hq, N/W, Dv), in query's dtype.

    Raises:
        RuntimeError: When no process group is initialized.
        ValueError: When the ranks' shards differ in length or shape, heads do not split
            over the ranks (Ulysses), or for arguments `attention` rejects; every rank raises.
        Unsupported: (a NotImplementedError) for a mask that is not a key-padding mask, and
            for what `attention` cannot take; a gradient of the ring's gradients.

    Example:
        >>> # on every rank, after torch.distributed.init_process_group(...)
        >>> q, k, v = (shard_sequence(x, rank, world) for x in (q_all, k_all, v_all))
        >>> out, t_out = torch.func.jvp(
        ...     lambda a, b, c: context_parallel_attention(a, b, c, method="ring"),
        ...     (q, k, v), (tq, tk, tv))
    """
    world = _world_size(group)
    if isinstance(query, Tensor) and torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value, attn_mask = (_autocast(x, dtype)
                                        for x in (query, key, value, attn_mask))
    error = _local_error(query, key, value, attn_mask, is_causal, scale, enable_gqa, method,
                         layout, world)
    _agree(query, key, value, attn_mask, error, group, world, method, layout, is_causal)
    mask = None if attn_mask is None else _gather_keys(attn_mask.detach(), group, world)
    if world == 1:
        return attention(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    run = _ulysses if method == "ulysses" else _ring
    return run(query, key, value, mask, is_causal, scale, enable_gqa, layout, group, world)


def _world_size(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "context_parallel_attention needs an initialized torch.distributed process group: "
            "call torch.distributed.init_process_group(...) on every rank first (torchrun "
            "sets up its environment), or call jvp_attention.attention on one process")
    return dist.get_world_size(group)


def _autocast(x: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """SDPA's autocast rule: floating tensors other than float64 are cast."""
    if x is None or not x.is_floating_point() or x.dtype == torch.float64:
        return x
    return x.to(dtype)


# %% [markdown]
# The checks of one rank's shards return the error instead of raising it, so that the ranks
# can first tell each other whether they are about to raise.

# %% tags=["export"]
def _local_error(query, key, value, attn_mask, is_causal, scale, enable_gqa, method, layout,
                 world) -> Exception | None:
    """What is wrong with this rank's call, or None."""
    try:
        _check_local_call(query, key, value, attn_mask, is_causal, scale, enable_gqa, method,
                          layout, world)
    except (TypeError, ValueError, NotImplementedError) as error:
        return error
    return None


def _check_local_call(query, key, value, attn_mask, is_causal, scale, enable_gqa, method,
                      layout, world) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_layout(layout)
    _check_local_arguments(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    n_q, n_k = query.shape[-2], key.shape[-2]
    if not n_q or not n_k:
        raise ValueError(f"every rank needs a non-empty shard; got {n_q} queries, {n_k} keys")
    if attn_mask is not None:
        _check_key_padding(attn_mask, n_k)
    if is_causal and n_q != n_k:
        raise ValueError(f"is_causal needs query and key shards of the same length (causal "
                         f"self-attention); got {n_q} queries and {n_k} keys per rank")
    if layout == "zigzag" and (n_q % 2 or n_k % 2):
        raise ValueError(f"layout='zigzag' gives every rank two equal chunks, so shards have "
                         f"an even length; got {n_q} queries and {n_k} keys per rank")
    if method == "ulysses" and query.shape[-3] % world:
        raise ValueError(
            f"method='ulysses' splits the heads over the {world} ranks: query's "
            f"{query.shape[-3]} heads must be a multiple of {world}; use method='ring', which "
            "has no rule on heads, or a group whose size divides the heads")


def _check_key_padding(mask: Tensor, n_k: int) -> None:
    if mask.dim() == 0 or mask.shape[-1] != n_k or any(s != 1 for s in mask.shape[-3:-1]):
        raise Unsupported(
            "mask not a key-padding mask",
            f"context_parallel_attention shards attn_mask with the keys, so it must be a "
            f"key-padding mask shaped (..., 1, 1, {n_k}) holding this rank's {n_k} keys; got "
            f"{tuple(mask.shape)}. A mask that varies along the queries or the heads cannot "
            "be sharded that way: express it as a key-padding mask (plus is_causal), or use "
            "jvp_attention.attention on one process")
    if mask.requires_grad or (mask.is_floating_point()
                              and forward_ad.unpack_dual(mask).tangent is not None):
        raise ValueError("context_parallel_attention takes attn_mask as a constant (no "
                         "gradient, no tangent); detach it, or use jvp_attention.attention on "
                         "one process for a learnable mask")


# One row per rank: failed, query length, key length, heads, key/value heads, head dims,
# batch entries, dtype, mask entries, method, layout, causal. Ranks that disagree on any
# would run different collectives and wait for each other forever.
_SIGNATURE = "failed, n_q, n_k, Hq, Hkv, D, Dv, batch, dtype, mask entries, method, layout, causal"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _signature(query, key, value, attn_mask, method, layout, is_causal,
               failed: bool) -> list[int]:
    if failed:
        return [1] + [0] * 12
    dtype = _DTYPES.index(query.dtype) if query.dtype in _DTYPES else -1
    return [0, query.shape[-2], key.shape[-2], query.shape[-3], key.shape[-3],
            query.shape[-1], value.shape[-1], math.prod(query.shape[:-3]), dtype,
            -1 if attn_mask is None else attn_mask.numel(), METHODS.index(method),
            LAYOUTS.index(layout), int(is_causal)]


def _agree(query, key, value, attn_mask, error: Exception | None, group: Any, world: int,
           method: str, layout: str, is_causal: bool) -> None:
    """Raise on every rank if any rank's call is bad or the ranks' calls differ."""
    device = query.device if isinstance(query, Tensor) else torch.device("cpu")
    mine = torch.tensor(_signature(query, key, value, attn_mask, method, layout, is_causal,
                                   error is not None), device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    rows = [row.tolist() for row in rows]
    if error is not None:
        raise error
    failed = [rank for rank, row in enumerate(rows) if row[0]]
    if failed:
        raise ValueError(f"context_parallel_attention: rank(s) {failed} of the group rejected "
                         "their arguments (their error says why); every rank must make the "
                         "same call on its own shard")
    if len({tuple(row[1:3]) for row in rows}) > 1:
        chunks = world if layout == "contiguous" else 2 * world
        raise ValueError(
            "context_parallel_attention needs equal shards of the sequence on every rank; the "
            f"ranks hold {[row[1] for row in rows]} queries and {[row[2] for row in rows]} "
            f"keys. Pad the sequence to a multiple of {chunks} ({layout} layout over {world} "
            "ranks) and hide the padded keys with a key-padding attn_mask")
    if len({tuple(row) for row in rows}) > 1:
        raise ValueError("context_parallel_attention: the ranks' calls differ (every rank "
                         f"must make the same call on its own shard); per rank ({_SIGNATURE}): "
                         f"{rows}")


def _gather_keys(mask: Tensor, group: Any, world: int) -> Tensor:
    """All ranks' key-padding masks, end to end in rank order along the last dim."""
    wire = (mask.to(torch.uint8) if mask.dtype == torch.bool else mask).contiguous()
    parts = [torch.empty_like(wire) for _ in range(world)]  # gloo has no bool
    dist.all_gather(parts, wire, group=group)
    return torch.cat(parts, -1).to(mask.dtype)


# %% [markdown]
# ## Checking on several processes
#
# Context parallelism only means something with several processes, so the checks start
# them: `run_on_processes` launches $W$ fresh Python processes (not `multiprocessing`'s
# spawn, which re-imports the caller's main script: a notebook or a script without a
# main guard would start over), forms a group through a file-based rendezvous (NCCL, one GPU
# each, when there are enough GPUs; else gloo on the CPU) and runs a function on every rank.
# The function must be importable by the new processes, so `compare_with_one_process` lives
# in the package: for a `CheckCase` it
# draws the whole sequence's inputs from one seed on every rank, shards them, and runs
#
# * the plain forward and backward (`dq, dk, dv` of $\langle G, O\rangle$);
# * `torch.func.jvp` (`jvp_out`, `tangent_out`), then the MeanFlow step: the backward
#   through the primal output only (`meanflow_dq, ...`);
# * `torch.func.jvp`, then the backward through both outputs, $\langle G, O\rangle +
#   \langle G_t, t_O\rangle$: `second_dq, ..., second_dtv`;
#
# through `context_parallel_attention` on the shards and through `attention` on the whole
# sequence (on rank 0, which broadcasts the results), each rank comparing its shard. The
# truth is `attention` on the inputs in
# float64 (PyTorch operations). Every quantity reports the context-parallel error against
# the truth, `attention`'s own error on one process (the floor), and the truth's largest
# entry, each the maximum over the ranks.

# %% tags=["export"]
def run_on_processes(fn: Callable[..., Any], world_size: int, *args: Any,
                     backend: str | None = None, timeout_s: float = 600.0) -> Any:
    """Run `fn(*args)` on `world_size` new processes that form a process group.

    Args:
        fn: An importable (module-level) function; it runs on every rank with the group as
            the default group.
        world_size: The number of processes.
        *args: Picklable arguments of `fn`.
        backend: "nccl" (process r uses GPU r) or "gloo"; None picks NCCL when there are
            at least `world_size` GPUs, else gloo.
        timeout_s: Give up (and stop the processes) after this many seconds.

    Returns:
        What `fn` returned on rank 0.

    Raises:
        RuntimeError: If a process fails (with the end of its output) or time runs out.
    """
    if getattr(fn, "__module__", "__main__") == "__main__":
        raise ValueError(f"run_on_processes runs {getattr(fn, '__name__', fn)!r} in new "
                         "processes, which import it by name: define it in a module, not in "
                         "a script or notebook")
    backend = backend or ("nccl" if torch.cuda.device_count() >= world_size else "gloo")
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "job.pkl"), "wb") as file:
            pickle.dump((fn, args), file)
        # The parent's import path, so that `fn`'s module is found as it was found here.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = ("import sys; from jvp_attention.context_parallel import _process_main; "
                "_process_main(*sys.argv[1:])")
        logs = [os.path.join(folder, f"rank{rank}.log") for rank in range(world_size)]
        processes = []
        for rank, log in enumerate(logs):
            with open(log, "w") as out:
                processes.append(subprocess.Popen(
                    [sys.executable, "-c", code, str(rank), str(world_size), backend, folder],
                    env=env, stdout=out, stderr=subprocess.STDOUT))
        _wait_for(processes, logs, timeout_s)
        with open(os.path.join(folder, "result.pkl"), "rb") as file:
            return pickle.load(file)


def _wait_for(processes: list, logs: list[str], timeout_s: float) -> None:
    """Wait for every process; on the first failure (or at the deadline) stop the others,
    which may be waiting for it in a collective, and raise with its output."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in processes):
        failed = [r for r, p in enumerate(processes) if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in processes:
                p.kill()
            rank = failed[0] if failed else 0
            with open(logs[rank]) as file:
                tail = file.read()[-6000:]
            what = f"rank {rank} failed" if failed else f"timed out after {timeout_s:.0f} s"
            raise RuntimeError(f"run_on_processes: {what}; its output ends with:\n{tail}")
        time.sleep(0.05)
    for rank, p in enumerate(processes):
        if p.returncode:
            with open(logs[rank]) as file:
                raise RuntimeError(f"run_on_processes: rank {rank} failed:\n"
                                   f"{file.read()[-6000:]}")


def _process_main(rank: str, world: str, backend: str, folder: str) -> None:
    """One process of `run_on_processes`: join the group, run the job, rank 0 saves the
    result."""
    rank, world = int(rank), int(world)
    init = f"file://{os.path.join(folder, 'rendezvous')}"
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast: not needed,
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # fails on some hosts
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    with open(os.path.join(folder, "job.pkl"), "rb") as file:
        fn, args = pickle.load(file)
    try:
        result = fn(*args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(folder, "result.pkl"), "wb") as file:
            pickle.dump(result, file)


@dataclass(frozen=True)
class CheckCase:
    """One problem for `compare_with_one_process`: the whole sequence and the call's options."""

    method: str = "ulysses"
    dtype: torch.dtype = torch.float32
    batch: int = 1
    heads: int = 4
    kv_heads: int = 4
    length: int = 16  # the whole sequence's, queries and keys
    head_dim: int = 16
    is_causal: bool = False
    layout: str = "contiguous"
    key_padding: bool = False
    # With key_padding: an additive mask with this bias on the padding (else a bool mask),
    # and the last sequence padding throughout, so its rows see no key at all.
    pad_value: float | None = None

    @property
    def label(self) -> str:
        parts = [self.method, str(self.dtype).removeprefix("torch."),
                 f"B{self.batch} H{self.heads}:{self.kv_heads} N{self.length} d{self.head_dim}",
                 "causal" if self.is_causal else "full"]
        if self.layout != "contiguous":
            parts.append(self.layout)
        if self.key_padding:
            parts.append("keypad" if self.pad_value is None else f"keypad {self.pad_value:g}")
        return " ".join(parts)


def compare_with_one_process(cases: list[CheckCase], seed: int = 0,
                             truth_dtype: torch.dtype = torch.float64) -> dict[str, dict]:
    """On every rank of the default group: each case through `context_parallel_attention`
    on the shards, against `attention` on the whole sequence and against the truth
    (`attention` in `truth_dtype`).

    Returns:
        {case label: {quantity: {"error", "floor", "scale"}}}, maxima over the ranks: the
        context-parallel error against the truth, `attention`'s own, the truth's largest
        entry.
    """
    return {case.label: _compare_case(case, seed, truth_dtype) for case in cases}


def _compare_case(case: CheckCase, seed: int, truth_dtype: torch.dtype) -> dict[str, dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    inputs, mask, cotangents = _case_tensors(case, seed, device)
    options = {"is_causal": case.is_causal, "enable_gqa": case.heads != case.kv_heads}

    def shard(x: Tensor, dim: int = -2) -> Tensor:
        return shard_sequence(x, rank, world, case.layout, dim)

    def sharded(q, k, v):
        return context_parallel_attention(
            q, k, v, attn_mask=None if mask is None else shard(mask, -1), method=case.method,
            layout=case.layout, **options)

    def whole(q, k, v):
        return attention(q, k, v, attn_mask=mask, **options)

    ours = _derivatives(sharded, [shard(x) for x in inputs], [shard(g) for g in cotangents])
    one = _from_rank_zero(lambda: _derivatives(whole, inputs, cotangents), ours, case.dtype)
    truth = one if case.dtype == truth_dtype else _from_rank_zero(
        lambda: _derivatives(whole, [x.to(truth_dtype) for x in inputs],
                             [g.to(truth_dtype) for g in cotangents]), ours, truth_dtype)
    report = {}
    for name, value in ours.items():
        want = shard(truth[name])
        numbers = torch.stack([(value.to(want.dtype) - want).abs().max(),
                               (shard(one[name]).to(want.dtype) - want).abs().max(),
                               want.abs().max()]).double()
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
        report[name] = dict(zip(("error", "floor", "scale"), numbers.tolist(), strict=True))
    return report


def _from_rank_zero(compute: Callable[[], dict[str, Tensor]], shards: dict[str, Tensor],
                    dtype: torch.dtype) -> dict[str, Tensor]:
    """`compute()` (results on the whole sequence) on rank 0 only, broadcast to the ranks,
    which know each result's shape from their `shards` of it."""
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        results = {name: x.contiguous() for name, x in compute().items()}
    else:
        results = {name: x.new_empty((*x.shape[:-2], x.shape[-2] * world, x.shape[-1]),
                                     dtype=dtype) for name, x in shards.items()}
    for name in shards:
        dist.broadcast(results[name], 0)
    return results


def _case_tensors(case: CheckCase, seed: int, device: torch.device):
    """The whole sequence's q, k, v, tq, tk, tv, key-padding mask and cotangents (of out
    and of its tangent), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    b, n, d = case.batch, case.length, case.head_dim
    shapes = [(b, case.heads, n, d), (b, case.kv_heads, n, d), (b, case.kv_heads, n, d)] * 2
    shapes += [(b, case.heads, n, d)] * 2
    tensors = [torch.randn(s, generator=gen).to(device, case.dtype) for s in shapes]
    mask = None
    if case.key_padding:  # sequence i keeps its first n / (i + 1) keys: in sequence 1 the
        # last half, so whole key blocks, are padding (rows that see nothing of a block)
        lengths = torch.tensor([n // (i + 1) for i in range(b)])
        if case.pad_value is not None:
            lengths[-1] = 0
        keep = (torch.arange(n) < lengths[:, None])[:, None, None, :]
        mask = keep if case.pad_value is None else torch.zeros(keep.shape).masked_fill(
            ~keep, case.pad_value)
        mask = mask.to(device)
    return tensors[:6], mask, tensors[6:]


def _derivatives(attend: Callable[..., Tensor], inputs: list[Tensor],
                 cotangents: list[Tensor]) -> dict[str, Tensor]:
    """out and dq, dk, dv (plain); jvp_out, tangent_out and the MeanFlow step's gradients;
    the gradients of the inputs and tangents through both outputs (second_*)."""
    primals, tangents = inputs[:3], inputs[3:]
    grad, grad_tangent = cotangents

    def leaves(xs):
        return [x.detach().requires_grad_() for x in xs]

    results = {}
    xs = leaves(primals)
    out = attend(*xs)
    results["out"] = out
    results.update(zip(("dq", "dk", "dv"), torch.autograd.grad(out, xs, grad), strict=True))
    xs = leaves(primals)
    out, t_out = torch.func.jvp(attend, tuple(xs), tuple(tangents))
    results.update(jvp_out=out, tangent_out=t_out)
    results.update(zip(("meanflow_dq", "meanflow_dk", "meanflow_dv"),
                       torch.autograd.grad(out, xs, grad), strict=True))
    xs, ts = leaves(primals), leaves(tangents)
    out, t_out = torch.func.jvp(attend, tuple(xs), tuple(ts))
    names = [f"second_{n}" for n in ("dq", "dk", "dv", "dtq", "dtk", "dtv")]
    results.update(zip(names, torch.autograd.grad((out, t_out), xs + ts, (grad, grad_tangent)),
                       strict=True))
    return {name: x.detach() for name, x in results.items()}


# The accuracy rule of tests/helpers.py, with its constants: at most FLOOR_FACTOR times the
# error of `attention` on one process, plus a few roundings of the dtype at the problem's
# scale; and for a gradient one rounding per rank more, because each block's gradient is
# rounded to the dtype before the fp32 sums over blocks and ranks. float64: 1e-12.
FLOOR_FACTOR = 2.0
EPS_ROUNDINGS = {"cpu": {torch.float32: 8.0, torch.float16: 3.0},
                 "cuda": {torch.float32: 16.0, torch.float16: 0.05, torch.bfloat16: 0.05}}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def allowed_error(dtype: torch.dtype, quantity: str, numbers: dict, world: int,
                  device_type: str = "cpu") -> float:
    """The largest error `compare_with_one_process` may report for `quantity`."""
    scale = max(1.0, numbers["scale"])
    if dtype == torch.float64:
        return 1e-12 * scale
    roundings = EPS_ROUNDINGS[device_type][dtype]
    if quantity.split("_")[-1].startswith("d"):  # dq, meanflow_dk, second_dtv, ...
        roundings += world
    return FLOOR_FACTOR * numbers["floor"] + roundings * UNIT_ROUNDOFF[dtype] * scale


# %% [markdown]
# The check, here on two processes: both methods, causal and not (causal ring in both
# layouts), GQA with fewer key/value heads than ranks, a key-padding mask, float64 and
# float32 (the kernels; on a CPU through Triton's interpreter), and bfloat16 on GPUs. The
# allowance for the kernels' dtypes (`allowed_error`) is the test suite's rule: at most twice
# `attention`'s own error on one process, plus a few roundings at the problem's scale, plus
# for gradients one rounding per rank (each block's gradient is rounded to the dtype before
# the sums); float64 must agree to $10^{-12}$. A block's LSE keeps the kernels' dtype, fp64
# with an additive mask (chapter 2's `lse_dtype`): padding masked with the dtype's lowest
# number puts a padded row's LSE near $-1.5 \cdot 10^{9}$, where an fp32 merge loses the
# log of its sum (the test suite's `pad_value` case: 0.59 off in the output with it).

# %%
from jvp_attention.context_parallel import (CheckCase, allowed_error, compare_with_one_process,
                                             run_on_processes)

WORLD = 2
if FULL_SIZE:  # one GPU per process, Wan-like heads
    SHAPE = {"batch": 1, "heads": 12, "kv_heads": 12, "length": 4096, "head_dim": 128}
else:  # tiny: the kernels run in Triton's interpreter
    SHAPE = {"batch": 1, "heads": 2, "kv_heads": 2, "length": 16, "head_dim": 8}
gqa = dict(SHAPE, kv_heads=1)
# float64 runs PyTorch operations, not the kernels: the exact merge needs no long sequence.
exact = dict(gqa, batch=2, length=min(SHAPE["length"], 256))
cases = [CheckCase(method="ring", dtype=torch.float64, is_causal=True, layout="zigzag",
                   key_padding=True, **exact),
         CheckCase(method="ulysses", dtype=torch.float64, is_causal=True, key_padding=True,
                   **exact)]
for dtype in (torch.float32, torch.bfloat16) if FULL_SIZE else (torch.float32,):
    cases += [CheckCase(method="ulysses", dtype=dtype, is_causal=True, layout="zigzag", **gqa),
              CheckCase(method="ring", dtype=dtype, is_causal=True, layout="zigzag",
                        key_padding=True, **SHAPE)]
    if FULL_SIZE:
        cases += [CheckCase(method="ulysses", dtype=dtype, **SHAPE),
                  CheckCase(method="ring", dtype=dtype, key_padding=True, **SHAPE),
                  CheckCase(method="ring", dtype=dtype, is_causal=True, **gqa)]
report = run_on_processes(compare_with_one_process, WORLD, cases)

print(f"{WORLD} processes ({'NCCL' if FULL_SIZE else 'gloo'}); error of context parallelism "
      f"against the truth, and in brackets that of attention on one process")
for case in cases:
    rows = report[case.label]
    print(f"{case.label:<48} out {rows['out']['error']:.1e} ({rows['out']['floor']:.1e})  "
          f"tangent {rows['tangent_out']['error']:.1e} ({rows['tangent_out']['floor']:.1e})  "
          f"second_dtq {rows['second_dtq']['error']:.1e} ({rows['second_dtq']['floor']:.1e})")
    for name, r in rows.items():
        allowed = allowed_error(case.dtype, name, r, WORLD, "cuda" if FULL_SIZE else "cpu")
        assert r["error"] <= allowed, f"{case.label} {name}: {r['error']:.2e} > {allowed:.2e}"

# %% [markdown]
# ## What it costs
#
# Per attention call with tangents, on $W$ ranks, with $n = N/W$ tokens per rank, counting
# the bytes each rank sends:
#
# * **Ulysses** moves $q, k, v, t_q, t_k, t_v$ to head shards and $O, t_O$ back: eight
#   all-to-alls, each sending $(W-1)/W$ of a shard. The backward moves the gradients the same
#   way. The attention itself is chapter 7's kernel on the whole sequence for $H/W$ heads: the
#   same work per rank as one process would do for all heads, divided by $W$.
# * **Ring** sends $k, v, t_k, t_v$ of one shard $W - 1$ times, overlapped with the blocks'
#   compute; the backward sends the block and its fp32 gradient sums. The work is split into
#   $W$ block calls per rank, and the merge adds a few element-wise passes over $O$ and $t_O$.
#
# Both hold the running merge (ring) or the head shards (Ulysses) beside the inputs, a few
# shards' worth of memory, nothing of size $N \times N$. Every call also all-gathers the
# ranks' shapes (a dozen integers) and reads them on the host, which waits for the GPU to
# get there: one synchronisation per call, small next to attention over these lengths.
#
# Within one machine (NVLink) Ulysses' all-to-alls are cheap and it keeps one kernel call
# per layer; the ring needs no rule on heads and its traffic hides behind compute when a
# block is large. `benchmarks/context_parallel.py` measures both against one GPU at Wan-like
# shapes (12 heads of 128, bf16, 32k to 128k tokens): time and peak memory per GPU for the
# forward+JVP and for the MeanFlow step (benchmarks/README.md has the command).

# %% [markdown]
# ## Measured: two H200s against one
#
# The saved run of `benchmarks/context_parallel.py` on a machine with two H200s (NVLink),
# bf16, batch 1, 12 heads of 128, full attention: time per call of the slowest GPU, the
# speed-up over `attention` on the whole sequence on one GPU, the peak memory per GPU
# (inputs included), and the communication from the profiler: the time the NCCL kernels
# run and the part of it that no other kernel hides ("exposed").

# %%
import json
from pathlib import Path

import jvp_attention

RESULTS = Path(jvp_attention.__file__).resolve().parent.parent / "benchmarks" / "results"
SAVED = RESULTS / "context_parallel_h200x2.json"
record = json.loads(SAVED.read_text())
measured = [c for c in record["cases"] if c["status"] == "ok"]
by_key = {(c["impl"], c["mode"], c["N"]): c for c in measured}
lengths = sorted({c["N"] for c in measured})
print(f"{record['device']['name']}, {record['world_size']} GPUs, {record['date'][:10]}; "
      f"{record['settings']['dtype']}, B{record['settings']['batch']} "
      f"H{record['settings']['heads']} d{record['settings']['head_dim']}")
print(f"{'N':>7} {'mode':<9} {'one GPU':>9} {'ulysses':>19} {'ring':>19}   "
      f"{'GB/GPU (one, ulysses, ring)':<28} comm share (exposed ms)")
for n in lengths:
    for mode in ("fwd_jvp", "meanflow"):
        one = by_key.get(("one", mode, n))
        cells, memory, comm = [], [], []
        for impl in ("ulysses", "ring"):
            case = by_key.get((impl, mode, n))
            speed = f"({one['ms'] / case['ms']:.2f}x)" if case and one else ""
            cells.append(f"{case['ms']:8.1f} ms {speed:>7}" if case else f"{'-':>19}")
            comm.append(f"{impl} {100 * case['comm_share']:.0f}% ({case['comm_exposed_ms']:.1f})"
                        if case else "")
        for impl in ("one", "ulysses", "ring"):
            case = by_key.get((impl, mode, n))
            memory.append(f"{(case['peak_memory_mb'] + case['held_memory_mb']) / 1024:.1f}"
                          if case else "-")
        one_ms = f"{one['ms']:6.1f} ms" if one else f"{'-':>9}"
        print(f"{n:>7} {mode:<9} {one_ms:>9} {cells[0]} {cells[1]}   "
              f"{', '.join(memory):<28} {', '.join(comm)}")
failed = [f"{label} {name}" for label, rows in record["checks"].items()
          for name, numbers in rows.items() if not numbers["passed"]]
if record["checks"]:
    print(f"{record['settings']['dtype']} checks at N = {record['settings']['check_n']} against "
          f"one GPU: {'FAILED ' + ', '.join(failed) if failed else 'all passed'} "
          f"({sum(len(rows) for rows in record['checks'].values())} quantities)")
else:
    print("this run checked no results (--check-n 0): the checks above and the test suite's "
          "NCCL test do")

# %%
import matplotlib.pyplot as plt

fig, (speed_ax, memory_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
for impl, style in (("ulysses", "o-"), ("ring", "s--")):
    for mode in ("fwd_jvp", "meanflow"):
        points = [(n, by_key[("one", mode, n)]["ms"] / by_key[(impl, mode, n)]["ms"])
                  for n in lengths if ("one", mode, n) in by_key and (impl, mode, n) in by_key]
        if points:
            speed_ax.plot(*zip(*points, strict=True), style, label=f"{impl}, {mode}")
for impl, style in (("one", "k^-"), ("ulysses", "o-"), ("ring", "s--")):
    points = [(n, (by_key[(impl, "meanflow", n)]["peak_memory_mb"]
                   + by_key[(impl, "meanflow", n)]["held_memory_mb"]) / 1024)
              for n in lengths if (impl, "meanflow", n) in by_key]
    if points:
        memory_ax.plot(*zip(*points, strict=True), style, label=impl)
speed_ax.axhline(record["world_size"], color="gray", lw=0.8, ls=":")
speed_ax.set(xscale="log", xlabel="tokens N", ylabel="speed-up over one GPU",
             title=f"{record['world_size']} GPUs vs one")
memory_ax.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="GB per GPU",
              title="peak memory per GPU, MeanFlow step")
for ax in (speed_ax, memory_ax):
    ax.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# In the saved run (two H200s, bf16, B = 1, 12 heads of 128, full attention) both methods
# come close to the ideal 2x once the sequence is long: at N = 131072 Ulysses takes 419 ms
# for the forward+JVP and 1376 ms for the MeanFlow step against 826 and 2718 ms on one GPU
# (1.97x and 1.98x), the ring 433 and 1392 ms (1.91x, 1.95x). At N = 32768 the speed-up is
# 1.6 to 1.9x: the all-to-alls (Ulysses) and the per-block merges (ring) are a larger share
# of a shorter call. The NCCL kernels run for 1 to 13% of a call, and what no kernel hides
# is a few milliseconds. Ulysses needs less memory per GPU than one GPU on the whole
# sequence (4.7 against 6.0 GB in the MeanFlow step at 131072); the ring needs more
# (7.0 GB): besides its shard, each rank holds two packed copies of a block of keys and
# values with their tangents (the one it computes on and the one arriving), the fp32 running
# merge, and in the backward the blocks' fp32 gradient sums.
#
# Where one GPU runs out: the kernels' memory is linear in $N$ (nothing of size
# $N \times N$), so the bytes per token of the MeanFlow step at the longest measured length
# say how long a sequence one GPU can hold at all, and the $N^2$ work says what a step
# there would cost.

# %%
longest = max(n for n in lengths if ("one", "meanflow", n) in by_key)
one = by_key[("one", "meanflow", longest)]
per_token = (one["peak_memory_mb"] + one["held_memory_mb"]) * 2**20 / longest
capacity = record["settings"].get("gpu_memory_mb")
if capacity:
    fits = capacity * 2**20 / per_token
    print(f"one GPU: {per_token / 1024:.1f} KiB per token in the MeanFlow step at N = {longest}; "
          f"{capacity / 1024:.0f} GiB hold about {fits / 1e6:.1f} M tokens of this layer, where "
          f"one step would take about {one['ms'] * (fits / longest) ** 2 / 3.6e6:.1f} hours")
    for impl in ("ulysses", "ring"):
        case = by_key.get((impl, "meanflow", longest))
        if case:
            print(f"{impl}: {(case['peak_memory_mb'] + case['held_memory_mb']) / 1024:.2f} GB "
                  f"per GPU at N = {longest} "
                  f"({per_token * longest / 2**20 / (case['peak_memory_mb'] + case['held_memory_mb']):.2f}x "
                  "less than one GPU)")
