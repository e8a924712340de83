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
# # Chapter 1: the math of attention and its JVP, checked in float64
#
# Consistency models, MeanFlow and their relatives differentiate a transformer *forward*:
# they call `torch.func.jvp` through it. PyTorch's fused attention backends refuse forward-mode
# AD, and its math path materialises every $N_q \times N_k$ score. The rest of this book writes
# one fused kernel that computes the output and its tangent together, then its backward.
#
# Kernels are hard to debug, so this chapter settles the numbers first. It derives every
# formula the kernels will compute, checks each one in float64 against PyTorch's own autograd
# and `torch.func.jvp`, and exports two references to `jvp_attention.reference`:
#
# * `reference_attention`: exact, materialises the scores, the ground truth of every test;
# * `tiled_attention`: the kernels' algorithm in plain PyTorch (the same loop over key blocks,
#   the same accumulators, the same epilogue), and the library's CPU fallback;
#
# plus `reference_backward` and `reference_backward_tangent`, the gradients the backward
# kernels must reproduce.

# %% [markdown]
# ## Set-up
#
# Everything runs in float64 on small shapes, so a correct formula agrees with autograd to
# about $10^{-15}$ and a wrong one is off by $10^{-1}$: `check` fails at $10^{-12}$.

# %%
import torch
import torch.nn.functional as F

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
f64 = {"dtype": torch.float64, "device": device}


def check(name, got, want, tol=1e-12):
    """Print the largest absolute difference between `got` and `want`; fail above `tol`."""
    diff = (got - want).abs().max().item()
    print(f"{name:<52} max |diff| = {diff:.1e}")
    assert diff <= tol, f"{name}: {diff:.3e} > {tol:.0e}"


# %% [markdown]
# The yardstick is softmax attention as a textbook writes it. It is independent of everything
# below, and autograd and `torch.func.jvp` differentiate it for us.

# %%
def plain_attention(q, k, v, bias=None, scale=None):
    """softmax(scale * q k^T + bias) v, in as few lines as possible."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = scale * q @ k.mT + (0.0 if bias is None else bias)
    return torch.softmax(scores, dim=-1) @ v


# %% [markdown]
# ## The forward
#
# For one head: queries $Q \in \mathbb{R}^{N_q \times d}$, keys $K \in \mathbb{R}^{N_k \times d}$,
# values $V \in \mathbb{R}^{N_k \times d_v}$, a scale $s$ (by default $1/\sqrt d$) and an
# additive mask $B$, $-\infty$ where query $i$ may not see key $j$. Row by row,
#
# $$S = s\,QK^\top + B,\qquad m_i = \max_j S_{ij},\qquad \tilde P_{ij} = e^{S_{ij} - m_i},
# \qquad \ell_i = \sum_j \tilde P_{ij},$$
#
# $$P = \tilde P / \ell,\qquad O = PV,\qquad \mathrm{LSE}_i = m_i + \log \ell_i .$$
#
# Subtracting the row max $m_i$ changes nothing (softmax ignores a shift of its row) but keeps
# every exponent $\le 0$, so nothing overflows in low precision. $\mathrm{LSE}_i =
# \log\sum_j e^{S_{ij}}$ is the one number per row that lets a backward pass rebuild
# $P = e^{S - \mathrm{LSE}}$ instead of storing it.
#
# The shapes below are deliberately awkward: $N_q \ne N_k$, $d_v \ne d$.

# %%
batch, heads, n_q, n_k, d_qk, d_v = 2, 3, 7, 13, 16, 8
q = torch.randn(batch, heads, n_q, d_qk, **f64)
k = torch.randn(batch, heads, n_k, d_qk, **f64)
v = torch.randn(batch, heads, n_k, d_v, **f64)
s = d_qk**-0.5

scores = s * q @ k.mT
row_max = scores.amax(-1, keepdim=True)
p_tilde = torch.exp(scores - row_max)
row_sum = p_tilde.sum(-1, keepdim=True)
probs = p_tilde / row_sum
out = probs @ v
lse = (row_max + torch.log(row_sum)).squeeze(-1)

check("O = P V vs plain softmax attention", out, plain_attention(q, k, v))
check("O vs F.scaled_dot_product_attention", out, F.scaled_dot_product_attention(q, k, v))
check("LSE = m + log l vs torch.logsumexp", lse, torch.logsumexp(scores, -1))

# %% [markdown]
# ## The JVP
#
# Give each input a tangent, $t_Q, t_K, t_V$ (shaped like $Q, K, V$), and differentiate along
# it. The mask is a constant. The scores move by
#
# $$t_S = s\,(t_Q K^\top + Q\, t_K^\top).$$
#
# Softmax moves by $t_{P_{ij}} = P_{ij}\big(t_{S_{ij}} - \sum_k P_{ik} t_{S_{ik}}\big)$. The sum
# is one number per row; since $\partial\,\mathrm{LSE}_i / \partial S_{ij} = P_{ij}$, it is the
# tangent of $\mathrm{LSE}$, and we call it $\mu$:
#
# $$\mu_i = \sum_j P_{ij}\, t_{S_{ij}},\qquad t_P = P \circ (t_S - \mu),\qquad
# t_O = t_P\, V + P\, t_V .$$
#
# The kernels store $\mu$ next to $\mathrm{LSE}$: the backward through the tangent needs it.

# %%
t_q, t_k, t_v = (torch.randn_like(x) for x in (q, k, v))

tangent_scores = s * (t_q @ k.mT + q @ t_k.mT)
mu = (probs * tangent_scores).sum(-1)
tangent_probs = probs * (tangent_scores - mu[..., None])
tangent_out = tangent_probs @ v + probs @ t_v

_, jvp_out = torch.func.jvp(plain_attention, (q, k, v), (t_q, t_k, t_v))
_, jvp_lse = torch.func.jvp(lambda q, k: torch.logsumexp(s * q @ k.mT, -1), (q, k), (t_q, t_k))
check("tO = tP V + P tV vs torch.func.jvp", tangent_out, jvp_out)
check("mu = rowsum(P * tS) vs jvp of logsumexp", mu, jvp_lse)

# %% [markdown]
# ## The module
#
# What the chapter exports starts here. Shapes and conventions follow
# `torch.nn.functional.scaled_dot_product_attention`: `(..., heads, length, dim)`, the leading
# dims equal. Work happens in float64 for float64 inputs and in float32 otherwise, as the
# kernels accumulate; `out` and `tangent_out` come back in the query's dtype, while `lse` and
# `mu` stay in the accumulation dtype (a kernel stores them in float32 too).

# %% tags=["export"]
"""Attention and its forward-mode derivative (JVP) in plain PyTorch: the ground truth.

Chapter 1 (`notebooks/01_reference.py`) derives, and checks in float64 against autograd and
`torch.func.jvp`, every formula the Triton kernels compute:

* the forward `O = softmax(s QKᵀ + B) V` and its row statistic `LSE`;
* the JVP `tO = (P∘(tS - μ)) V + P tV`, where `μ = rowsum(P∘tS)` is the tangent of `LSE`;
* the online form of both, one block of keys at a time in log2 units, as the kernels run it;
* the backward `dQ, dK, dV` from `O` and `LSE` alone;
* the backward through the tangent, `dQ, dK, dV, dtQ, dtK, dtV` from `O, tO, LSE, μ`.

`reference_attention` materialises the scores; `tiled_attention` is the kernels' blueprint and
the library's CPU fallback. A query row that sees no key gives `out = 0`, `tangent_out = 0`,
`mu = 0`, `lse = -inf` and zero gradients, never NaN.
"""

import math
import numbers
from typing import NamedTuple

import torch

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# The lowest log2-unit score an fp32 bias gives, as chapter 2's kernels fold it (`log2_bias`).
LOWEST_SCORE = -(2.0**31)


class AttentionOutputs(NamedTuple):
    """What the attention functions return.

    Attributes:
        out: The output O, shape (..., Hq, Nq, Dv), in the query's dtype.
        lse: Log-sum-exp of each row of scores (natural log), shape (..., Hq, Nq), in the
            accumulation dtype; -inf for a row that sees no key.
        tangent_out: The JVP tO, shaped and typed like `out`; None without tangents.
        mu: The tangent of `lse`, shape (..., Hq, Nq), in the accumulation dtype; None
            without tangents.
    """

    out: torch.Tensor
    lse: torch.Tensor
    tangent_out: torch.Tensor | None = None
    mu: torch.Tensor | None = None


# %%
AttentionOutputs._fields

# %% [markdown]
# ### Masks
#
# Every mask becomes the additive $B$. A bool `attn_mask` means True = attend (as in SDPA), a
# float one is added to the scores. `is_causal` is PyTorch's top-left alignment: query $i$ sees
# key $j$ iff $j \le i$, also when $N_q \ne N_k$. SDPA refuses a mask together with
# `is_causal`; we add both, since a padded causal batch needs exactly that. The bias keeps the
# mask's own broadcast shape, so a `(B, 1, 1, N_k)` key-padding mask stays that small.

# %% tags=["export"]
def attention_bias(
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    n_q: int,
    n_k: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor | None:
    """The additive mask B of the scores, -inf where a query may not see a key.

    Args:
        attn_mask: None, a bool mask (True = attend) or a float mask (added to the scores),
            broadcastable to (..., Hq, Nq, Nk).
        is_causal: Whether query i sees only keys j <= i (top-left alignment, as in PyTorch).
        n_q: Number of queries Nq.
        n_k: Number of keys Nk.
        dtype: Floating dtype of the result.
        device: Device of the result.

    Returns:
        A tensor of at least two dims, broadcastable to (..., Nq, Nk), or None when nothing is
        masked.

    Raises:
        ValueError: If `attn_mask` is neither bool nor floating point.
    """
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=dtype, device=device)
            bias = bias.masked_fill(~attn_mask.to(device), -math.inf)
        elif attn_mask.is_floating_point():
            bias = attn_mask.to(dtype=dtype, device=device)
        else:
            raise ValueError(
                "attn_mask must be bool (True = attend) or floating point (added to the "
                f"scores), got {attn_mask.dtype}"
            )
        while bias.dim() < 2:
            bias = bias.unsqueeze(0)
    if is_causal:
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()
        causal = torch.zeros(n_q, n_k, dtype=dtype, device=device).masked_fill(~visible, -math.inf)
        bias = causal if bias is None else bias + causal
    return bias


# %% [markdown]
# A causal mask with more keys than queries, a key-padding mask, and both at once:

# %%
print(attention_bias(None, True, 3, 5, torch.float64, device))
key_padding = torch.tensor([True, True, True, False, False], device=device)[None, None, None]
print(attention_bias(key_padding, False, 3, 5, torch.float64, device).shape)
print(attention_bias(key_padding, True, 3, 5, torch.float64, device)[0, 0])
assert attention_bias(None, False, 3, 5, torch.float64, device) is None

# %% [markdown]
# ### Grouped-query attention
#
# With `enable_gqa`, $H_q$ query heads share $H_{kv}$ key/value heads, $H_q / H_{kv}$ query heads
# per group; query head $h$ reads key/value head $\lfloor h H_{kv} / H_q \rfloor$, which is what
# `repeat_interleave` produces. The references simply expand; the kernels will instead let
# the query heads of a group read the same key/value tiles.

# %% tags=["export"]
def expand_kv_heads(x: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    """Repeat each key/value head for the query heads of its group (GQA).

    Args:
        x: Keys or values, shape (..., Hkv, Nk, D).
        n_q_heads: Number of query heads Hq, a multiple of Hkv.

    Returns:
        `x` itself when Hq == Hkv, else a tensor of shape (..., Hq, Nk, D) whose head h is
        head h // (Hq // Hkv) of `x`.

    Raises:
        ValueError: If Hq is not a multiple of Hkv.
    """
    n_kv_heads = x.shape[-3]
    if n_q_heads % n_kv_heads:
        raise ValueError(
            f"grouped-query attention needs the number of query heads ({n_q_heads}) to be a "
            f"multiple of the number of key/value heads ({n_kv_heads})"
        )
    if n_q_heads == n_kv_heads:
        return x
    return x.repeat_interleave(n_q_heads // n_kv_heads, dim=-3)


# %%
kv = torch.arange(2.0, device=device)[:, None, None].expand(2, 1, 1)  # two heads: 0 and 1
print(expand_kv_heads(kv, 4).flatten())

# %% [markdown]
# ### Checking inputs once
#
# All four functions take the same arguments as SDPA, and so will the library's entry points
# in chapter 7. One public validator, `check_sdpa_arguments`, holds that contract for all of
# them: a wrong type or dtype raises `TypeError`, shapes that do not fit raise `ValueError`,
# and every message names the argument and shows the shapes. As for SDPA, `scale` is any real
# number (a Python or NumPy scalar, or a 0-d tensor that does not require grad). A private helper then upcasts to
# the accumulation dtype, expands the key/value heads and builds the bias. Helpers for the
# scores and a row-safe softmax follow.
#
# The softmax is where a row with no visible key bites: its max is $-\infty$ and
# $S - m = -\infty - (-\infty)$ is NaN. Shifting such a row by 0 instead gives $\tilde P = 0$,
# $\ell = 0$; dividing only where $\ell > 0$ then gives $P = 0$. The row max is detached:
# $m + \log\sum_j e^{S_{ij} - m}$ equals $\mathrm{LSE}_i$ for *any* constant $m$, so autograd
# and forward AD need not differentiate through the max, and every op on the path has a finite
# derivative. That is what lets autograd and `torch.func.jvp` run through `reference_attention`.

# %% tags=["export"]
class _Inputs(NamedTuple):
    """Arguments checked, upcast to the accumulation dtype, key/value heads expanded."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tangents: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    bias: torch.Tensor | None
    scale: float
    bias_tangent: torch.Tensor | None = None


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_sdpa_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    tangents: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    mask_tangent: torch.Tensor | None = None,
) -> None:
    """Raise unless the arguments keep the contract of PyTorch's SDPA.

    The one validator of every entry point: these references, `attention`, `attention_jvp`,
    the SDPA drop-in and context parallelism (which add only their own limits, such as
    dropout or the head dims the kernels take).

    Args:
        query, key, value, attn_mask, is_causal, scale, enable_gqa: As in
            `reference_attention`. A mask is bool, float32 or the query's dtype.
        tangents: None, or (t_query, t_key, t_value) of the inputs' shapes and dtype.
        mask_tangent: None, or the tangent of a float `attn_mask`, of its shape and dtype;
            it needs `tangents`.

    Raises:
        TypeError: For an argument of the wrong type or dtype.
        ValueError: For shapes that do not fit (the message shows them) or tensors on
            different devices.
    """
    _check_types(query, key, value, is_causal, scale, enable_gqa)
    _check_shapes(query, key, value, enable_gqa)
    _check_dtypes_and_devices(query, key, value, attn_mask, tangents)
    if attn_mask is not None:
        _check_mask(attn_mask, query, key)
    if tangents is not None:
        _check_tangents(tangents, (query, key, value))
    if mask_tangent is not None:
        _check_mask_tangent(mask_tangent, attn_mask, tangents)


def _check_types(query, key, value, is_causal, scale, enable_gqa) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(x)}")
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, (bool, torch.SymBool)):  # (SymBool: a traced shape test)
            raise TypeError(f"{name} must be a bool, got {_type_name(flag)}")
    if scale is not None and not isinstance(scale, (float, int)):
        _check_scale(scale)


def _check_scale(scale) -> None:
    """SDPA takes any real number as `scale`: a NumPy scalar, or a 0-d tensor that does not
    require grad (read as a number: its gradient would be lost, so SDPA refuses that)."""
    if isinstance(scale, torch.Tensor):
        if scale.requires_grad:
            raise TypeError("scale must be a number, got a tensor that requires grad (SDPA's "
                            "scale takes no gradient: multiply the query by it instead)")
        if scale.dim() == 0 and not scale.is_complex():
            return
    elif isinstance(scale, numbers.Real):
        return
    raise TypeError(f"scale must be a float or None, got {_type_name(scale)}")


def _type_name(x) -> str:
    """A type's name as an error message needs it: `numpy.bool`, not `bool`."""
    kind = type(x)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def _check_shapes(query, key, value, enable_gqa: bool) -> None:
    q, k, v = query.shape, key.shape, value.shape  # (the message is formatted on failure only:
    if min(len(q), len(k), len(v)) < 3:            # it costs more than the checks)
        raise ValueError(f"query, key and value must have rank >= 3, (..., heads, length, "
                         f"dim); got {_shapes(q, k, v)}")
    if not q[:-3] == k[:-3] == v[:-3]:
        raise ValueError(f"query, key and value must share their leading dims; got "
                         f"{_shapes(q, k, v)}")
    if k[-1] != q[-1]:
        raise ValueError(f"key must have the query's head dim; got {_shapes(q, k, v)}")
    if k[-3:-1] != v[-3:-1]:
        raise ValueError(f"key and value must have the same heads and length; got "
                         f"{_shapes(q, k, v)}")
    n_q_heads, n_kv_heads = q[-3], k[-3]
    if enable_gqa and n_kv_heads and n_q_heads % n_kv_heads:
        raise ValueError(f"enable_gqa=True needs query heads ({n_q_heads}) to be a multiple "
                         f"of key/value heads ({n_kv_heads}); got {_shapes(q, k, v)}")
    if not enable_gqa and n_q_heads != n_kv_heads:
        raise ValueError(f"query has {n_q_heads} heads but key/value have {n_kv_heads}; got "
                         f"{_shapes(q, k, v)}; pass enable_gqa=True for grouped-query "
                         f"attention")


def _shapes(q: torch.Size, k: torch.Size, v: torch.Size) -> str:
    return f"query {tuple(q)}, key {tuple(k)}, value {tuple(v)}"


def _check_dtypes_and_devices(query, key, value, attn_mask, tangents) -> None:
    if not (query.is_floating_point() and query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share one floating dtype (outside "
                        f"autocast, which casts them); got {query.dtype}, {key.dtype}, "
                        f"{value.dtype}")
    others = [x for x in (attn_mask, *(tangents or ())) if isinstance(x, torch.Tensor)]
    devices = {x.device for x in (query, key, value, *others)}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def _check_mask(attn_mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise TypeError(f"attn_mask must be bool, float32 or query's dtype {query.dtype}, as "
                        f"for torch's SDPA; got {attn_mask.dtype}")
    scores = torch.Size((*query.shape[:-1], key.shape[-2]))
    try:
        fits = torch.broadcast_shapes(attn_mask.shape, scores) == scores
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"the scores' shape (..., Hq, Nq, Nk) = {tuple(scores)}")


def _check_tangents(tangents, inputs) -> None:
    if not isinstance(tangents, (tuple, list)) or len(tangents) != 3:
        count = len(tangents) if isinstance(tangents, (tuple, list)) else type(tangents).__name__
        raise ValueError(f"tangents must be (t_query, t_key, t_value); got {count} items")
    for name, x, t in zip(("query", "key", "value"), inputs, tangents, strict=True):
        if not (isinstance(t, torch.Tensor) and t.shape == x.shape and t.dtype == x.dtype):
            got = (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"the tangent of {name} (t_{name}) must have its shape "
                             f"{tuple(x.shape)} and dtype {x.dtype}; got {got}")


def _check_mask_tangent(mask_tangent, attn_mask, tangents) -> None:
    if attn_mask is None or not attn_mask.is_floating_point():
        kind = "no attn_mask" if attn_mask is None else f"a {attn_mask.dtype} attn_mask"
        raise ValueError(f"mask_tangent is the tangent of an additive (float) attn_mask; got "
                         f"{kind}")
    if tangents is None:
        raise ValueError("mask_tangent is part of the tangent: pass tangents too")
    if mask_tangent.shape != attn_mask.shape or mask_tangent.dtype != attn_mask.dtype:
        raise ValueError(f"mask_tangent must have attn_mask's shape {tuple(attn_mask.shape)} "
                         f"and dtype {attn_mask.dtype}; got {tuple(mask_tangent.shape)} "
                         f"{mask_tangent.dtype}")


def _prepare(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    tangents: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    mask_tangent: torch.Tensor | None = None,
) -> _Inputs:
    check_sdpa_arguments(query, key, value, attn_mask, is_causal, scale, enable_gqa, tangents,
                         mask_tangent)
    acc = _accumulation_dtype(query.dtype)
    n_q_heads = query.shape[-3]

    def upcast(x: torch.Tensor, is_key_or_value: bool) -> torch.Tensor:
        x = x.to(acc)
        return expand_kv_heads(x, n_q_heads) if is_key_or_value else x

    q, k, v = upcast(query, False), upcast(key, True), upcast(value, True)
    if tangents is not None:
        tangents = tuple(upcast(t, i > 0) for i, t in enumerate(tangents))
    bias = attention_bias(attn_mask, is_causal, query.shape[-2], key.shape[-2], acc, query.device)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    bias_tangent = None
    if mask_tangent is not None:
        bias_tangent = attention_bias(mask_tangent, False, query.shape[-2], key.shape[-2], acc,
                                      query.device)
    return _Inputs(q, k, v, tangents, bias, scale, bias_tangent)


def _scores(x: _Inputs) -> torch.Tensor:
    """S = s Q Kᵀ + B."""
    scores = x.scale * (x.q @ x.k.mT)
    return scores if x.bias is None else scores + x.bias


def _tangent_scores(x: _Inputs) -> torch.Tensor:
    """tS = s (tQ Kᵀ + Q tKᵀ) + tB; tB, the tangent of a float mask, is usually absent."""
    t_q, t_k, _ = x.tangents
    tangent_scores = x.scale * (t_q @ x.k.mT + x.q @ t_k.mT)
    return tangent_scores if x.bias_tangent is None else tangent_scores + x.bias_tangent


def _safe_softmax(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P and LSE of each row; a row with no finite score gives P = 0 and LSE = -inf."""
    row_max = scores.detach().amax(-1, keepdim=True)
    row_max = torch.where(row_max == -math.inf, 0.0, row_max)
    p_tilde = torch.exp(scores - row_max)
    row_sum = p_tilde.sum(-1, keepdim=True)
    visible = row_sum > 0
    row_sum = torch.where(visible, row_sum, 1.0)
    lse = torch.where(visible, row_max + torch.log(row_sum), -math.inf)
    return p_tilde / row_sum, lse.squeeze(-1)


def _probs_from_lse(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """P = exp(S - LSE), and 0 on rows with LSE = -inf (their scores are all -inf). A row
    whose LSE is too large for the scores' dtype to hold log of the row's sum beside it (a
    bias near the lowest score, `_log2_bias`) takes its own softmax instead."""
    lse = lse.to(scores.dtype)
    probs = torch.exp(scores - torch.where(lse == -math.inf, 0.0, lse)[..., None])
    far = lse.abs() * torch.finfo(lse.dtype).eps > 2.0**-10
    return torch.where(far[..., None], _safe_softmax(scores)[0], probs)


def _sum_kv_groups(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Add up the gradients of the query heads that share a key/value head; cast like `like`."""
    return grad.unflatten(-3, (like.shape[-3], -1)).sum(-3).to(like.dtype)


# %% [markdown]
# The helpers at work: a GQA call without `enable_gqa` is refused with the shapes, and the
# safe softmax of a row with no visible key is a row of zeros with $\mathrm{LSE} = -\infty$.

# %%
try:
    check_sdpa_arguments(q, k[:, :1], v[:, :1])
except ValueError as error:
    print("ValueError:", error)
    assert "enable_gqa=True" in str(error) and str(tuple(q.shape)) in str(error)
else:
    raise AssertionError("a GQA call without enable_gqa must be refused")
print(_safe_softmax(torch.tensor([[0.0, 1.0], [-torch.inf, -torch.inf]], **f64)))

# %% [markdown]
# ### The exact reference
#
# `reference_attention` is the forward and the JVP above, formula by formula.

# %% tags=["export"]
def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    tangents: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    mask_tangent: torch.Tensor | None = None,
) -> AttentionOutputs:
    """Exact softmax attention and, given tangents, its JVP; materialises the scores.

    Differentiable with autograd and forward AD, with finite derivatives also on rows that
    see no key.

    Args:
        query: Shape (..., Hq, Nq, Dqk).
        key: Shape (..., Hkv, Nk, Dqk), the same leading dims as `query`.
        value: Shape (..., Hkv, Nk, Dv).
        attn_mask: None, bool (True = attend) or float (added to the scores), broadcastable to
            (..., Hq, Nq, Nk).
        is_causal: Query i sees key j only if j <= i (top-left); combines with `attn_mask`.
        scale: Factor of Q Kᵀ; defaults to 1 / sqrt(Dqk).
        enable_gqa: Allow Hq to be a multiple of Hkv (grouped-query attention).
        tangents: None, or (t_query, t_key, t_value) shaped like the inputs.
        mask_tangent: None, or the tangent of a float `attn_mask`, shaped like it.

    Returns:
        AttentionOutputs(out, lse, tangent_out, mu); the last two are None without tangents.

    Raises:
        ValueError: If shapes, dtypes, the mask or the tangents do not fit.
    """
    x = _prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa, tangents,
                 mask_tangent)
    probs, lse = _safe_softmax(_scores(x))
    out = (probs @ x.v).to(query.dtype)
    if x.tangents is None:
        return AttentionOutputs(out, lse)
    tangent_scores = _tangent_scores(x)
    mu = (probs * tangent_scores).sum(-1)
    tangent_probs = probs * (tangent_scores - mu[..., None])
    tangent_out = tangent_probs @ x.v + probs @ x.tangents[2]
    return AttentionOutputs(out, lse, tangent_out.to(query.dtype), mu)


# %% [markdown]
# In use, on the shapes of the derivation:

# %%
result = reference_attention(q, k, v, tangents=(t_q, t_k, t_v))
check("reference_attention: out", result.out, out)
check("reference_attention: lse", result.lse, lse)
check("reference_attention: tangent_out", result.tangent_out, jvp_out)
check("reference_attention: mu", result.mu, jvp_lse)

# %% [markdown]
# ### What a call costs
#
# One forward runs two matrix products per head, $S = QK^\top$ and $O = PV$: $2 N_q N_k D$
# and $2 N_q N_k D_v$ FLOPs, half of them when a causal mask hides half the scores. Every
# TFLOP/s in this book credits a call a multiple of that: the forward with its JVP three
# forwards (six products per tile instead of two), the backward 2.5 (five products), the
# backward through output and tangent $2.5 \times 3 = 7.5$. The same credit goes to every
# implementation of a call, so TFLOP/s compare times.

# %% tags=["export"]
FORWARDS_PER_CALL = {"fwd": 1.0, "fwd_jvp": 3.0, "bwd": 2.5, "bwd2": 7.5}


def sdpa_flops(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, value_dim: int,
               is_causal: bool = False) -> float:
    """FLOPs of one attention forward (QKᵀ and PV), halved for causal masking.

    Multiply by `FORWARDS_PER_CALL[mode]` for a call of another kind ("fwd_jvp", "bwd",
    "bwd2").
    """
    flops = 2.0 * batch * heads * n_q * n_k * (head_dim + value_dim)
    return flops / 2 if is_causal else flops


# %% [markdown]
# PyTorch's own FLOP counter agrees on the textbook attention (its softmax and scaling count
# nothing, as here):

# %%
from torch.utils.flop_counter import FlopCounterMode

with FlopCounterMode(display=False) as counter:
    plain_attention(q, k, v)
counted = float(counter.get_total_flops())
check("sdpa_flops vs torch's FlopCounterMode", torch.tensor(counted),
      torch.tensor(sdpa_flops(batch, heads, n_q, n_k, d_qk, d_v)), tol=0)

# %% [markdown]
# With masks and grouped-query attention, against SDPA for the output and against
# `torch.func.jvp` of the plain attention for the tangent. The key-padding mask hides the last
# keys of the second sequence; the additive mask is random, with a few $-\infty$.

# %%
q_heads, kv_heads = 4, 2
q = torch.randn(batch, q_heads, n_q, d_qk, **f64)
k = torch.randn(batch, kv_heads, n_k, d_qk, **f64)
v = torch.randn(batch, kv_heads, n_k, d_v, **f64)
tangents = tuple(torch.randn_like(x) for x in (q, k, v))
k_full, v_full = expand_kv_heads(k, q_heads), expand_kv_heads(v, q_heads)
tk_full, tv_full = (expand_kv_heads(t, q_heads) for t in tangents[1:])

lengths = torch.tensor([n_k, 9], device=device)
key_padding = (torch.arange(n_k, device=device) < lengths[:, None])[:, None, None, :]
additive = torch.randn(n_q, n_k, **f64).masked_fill(torch.rand(n_q, n_k, device=device) < 0.2, -torch.inf)
additive[:, 0] = 0.0  # every query keeps at least key 0

for name, mask, causal in [
    ("no mask", None, False),
    ("causal", None, True),
    ("key padding", key_padding, False),
    ("additive", additive, False),
    ("key padding + causal", key_padding, True),
]:
    result = reference_attention(q, k, v, mask, causal, enable_gqa=True, tangents=tangents)
    bias = attention_bias(mask, causal, n_q, n_k, torch.float64, device)
    if not (causal and mask is not None):  # SDPA refuses a mask together with is_causal
        sdpa = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=True)
        check(f"{name}: out vs SDPA", result.out, sdpa)
    _, want = torch.func.jvp(
        lambda q, k, v, bias=bias: plain_attention(q, k, v, bias),
        (q, k_full, v_full),
        (tangents[0], tk_full, tv_full),
    )
    check(f"{name}: tangent_out vs torch.func.jvp", result.tangent_out, want)

# %% [markdown]
# ### A mask with a tangent
#
# A learnable additive mask (a relative-position bias, ALiBi slopes) is an input like the
# others, and under `torch.func.jvp` it may carry a tangent $t_B$. It enters the scores
# additively, so it enters their tangent the same way:
# $t_S = s\,(t_Q K^\top + Q\,t_K^\top) + t_B$, and nothing else in the derivation changes.
# `reference_attention(..., mask_tangent=tB)` adds it; forward-mode AD through the plain
# formula, with the bias as an input, agrees:

# %%
t_additive = torch.randn_like(additive).masked_fill(additive == -torch.inf, 0.0)
result = reference_attention(q, k, v, additive, enable_gqa=True, tangents=tangents,
                             mask_tangent=t_additive)
_, want = torch.func.jvp(plain_attention, (q, k_full, v_full, additive),
                         (tangents[0], tk_full, tv_full, t_additive))
check("mask tangent: tangent_out vs torch.func.jvp", result.tangent_out, want)

# %% [markdown]
# ### A row that sees no key
#
# Mask every key of a row and softmax has nothing to normalise: the textbook formula gives
# $0/0$, NaN. What such a row *should* give is a convention, and ours is: `out = 0`,
# `tangent_out = 0`, `mu = 0`, `lse = -inf`, and zero gradient into the row. It is what a
# zero-length sequence contributes, it keeps every derivative finite, and a flash kernel gets
# it for free by dividing only where $\ell > 0$. PyTorch's SDPA has returned zeros there too
# since version 2.5; the plain formula has not.

# %%
empty_row = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
empty_row[2] = False  # query 2 sees nothing
bias = attention_bias(empty_row, False, n_q, n_k, torch.float64, device)

textbook = plain_attention(q, k_full, v_full, bias)
sdpa = F.scaled_dot_product_attention(q, k, v, empty_row, enable_gqa=True)
result = reference_attention(q, k, v, empty_row, enable_gqa=True, tangents=tangents)
print("textbook softmax, row 2:", textbook[0, 0, 2, :4])
print("SDPA,             row 2:", sdpa[0, 0, 2, :4])
print("ours,             row 2:", result.out[0, 0, 2, :4])
assert textbook[..., 2, :].isnan().all() and not textbook[..., :2, :].isnan().any()
check("empty row: out == 0", result.out[..., 2, :], 0.0, tol=0.0)
check("empty row: tangent_out == 0", result.tangent_out[..., 2, :], 0.0, tol=0.0)
check("empty row: mu == 0", result.mu[..., 2], 0.0, tol=0.0)
assert (result.lse[..., 2] == -torch.inf).all()
check("other rows: out vs SDPA", result.out, sdpa)

# %% [markdown]
# The safe softmax is made of differentiable ops, so autograd and `torch.func.jvp` run through
# `reference_attention` itself and stay finite; the forward-mode derivative agrees with the
# explicit tangent formulas on every row, the empty one included.

# %%
query = q.clone().requires_grad_()
reference_attention(query, k, v, empty_row, enable_gqa=True).out.sum().backward()
assert query.grad.isfinite().all()
check("empty row: autograd dQ == 0", query.grad[..., 2, :], 0.0, tol=0.0)

_, forward_ad = torch.func.jvp(
    lambda q, k, v: reference_attention(q, k, v, empty_row, enable_gqa=True).out, (q, k, v), tangents
)
check("torch.func.jvp through reference vs explicit tO", forward_ad, result.tangent_out)

# %% [markdown]
# ## Online softmax: one block of keys at a time
#
# A kernel never holds a whole row of $S$. It walks over blocks $j$ of $b$ keys and keeps per
# row a running max $m$, a running sum $\ell$ and an unnormalised output $A$ (`acc_o`), starting
# from $m = -\infty$, $\ell = 0$, $A = 0$:
#
# $$m' = \max\big(m, \max_{c \in j} S_{ic}\big),\quad \alpha = e^{m - m'},\quad
# \tilde P_j = e^{S_j - m'},$$
#
# $$\ell \leftarrow \alpha\,\ell + \operatorname{rowsum} \tilde P_j,\qquad
# A \leftarrow \alpha A + \tilde P_j V_j,\qquad m \leftarrow m'.$$
#
# After each block, $\ell = \sum_c e^{S_{ic} - m}$ and $A = \sum_c e^{S_{ic} - m} V_c$ over the
# keys seen so far, with $m$ their max: $\alpha$ re-bases the old sums on the new max. At the
# end $O = A/\ell$ and $\mathrm{LSE} = m + \log \ell$. Two blocks by hand:

# %%
scores = s * q @ k_full.mT
blocks = [slice(0, 6), slice(6, n_k)]
row_max = torch.full((batch, q_heads, n_q, 1), -torch.inf, **f64)
row_sum = torch.zeros_like(row_max)
acc_o = torch.zeros(batch, q_heads, n_q, d_v, **f64)
for cols in blocks:
    new_max = torch.maximum(row_max, scores[..., cols].amax(-1, keepdim=True))
    alpha = torch.exp(row_max - new_max)
    p_tilde = torch.exp(scores[..., cols] - new_max)
    row_sum = alpha * row_sum + p_tilde.sum(-1, keepdim=True)
    acc_o = alpha * acc_o + p_tilde @ v_full[..., cols, :]
    row_max = new_max
check("online: A / l vs O", acc_o / row_sum, plain_attention(q, k_full, v_full))
check("online: m + log l vs LSE", (row_max + row_sum.log()).squeeze(-1), torch.logsumexp(scores, -1))

# %% [markdown]
# Nothing in this loop mixes two rows, so a kernel cuts the queries too: into tiles of $B_M$
# rows, while a block holds $B_N$ keys (the $b$ above). The scores become a grid of
# $B_M \times B_N$ tiles, and one program owns one row of it: it loads its tile of $Q$ once,
# walks the key blocks $j = 0, 1, \dots$ from left to right, and writes its tile of $O$ once at
# the end. Programs share only the $K$ and $V$ they read, so they all run at once, and no tile
# of scores ever reaches memory. The chapter's three figures share three small helpers and
# draw inside functions, which keeps their sizes out of the chapter's variables.

# %% tags=["hide_input"]
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

# Okabe-Ito colours, distinct under the common colour-vision deficiencies. Orange = tangent.
SKY, ORANGE, BLUE, GREY = "#56B4E9", "#E69F00", "#0072B2", "#999999"


def tex(source):
    """Matplotlib mathtext. The dollar signs are spelt out: the site typesets literal ones."""
    return f"\N{DOLLAR SIGN}{source}\N{DOLLAR SIGN}"


def box(ax, x, y, width, height, label="", color="white", **style):
    """A rectangle from its top-left corner (y points down), with `label` in its middle."""
    style = {"facecolor": color, "edgecolor": "black", "linewidth": 0.8, **style}
    ax.add_patch(Rectangle((x, y), width, height, **style))
    ax.text(x + width / 2, y + height / 2, label, ha="center", va="center")


def tiles(ax, n_q, n_k, block_m, block_n, style):
    """The N_q x N_k scores as B_M x B_N tiles; `style(top, left)` gives each tile's `box` args."""
    for top in range(0, n_q, block_m):
        for left in range(0, n_k, block_n):
            box(ax, left, top, block_n, block_m, **style(top, left))


def canvas(ax, x_range, y_range, title=""):
    """Equal data units on both axes, y pointing down, no frame."""
    ax.set(xlim=x_range, ylim=y_range[::-1], aspect="equal", title=title)
    ax.axis("off")


def draw_tiling(n_q=12, n_k=16, d=4, d_v=3, block_m=4, block_n=2, mine=4):
    """The grid of tiles; the program whose tile starts at query `mine` walks its row."""
    _, ax = plt.subplots(figsize=(9, 5.5))
    canvas(ax, (-9, n_k + d_v + 1.5), (-d - d_v - 1.5, n_q + 1))
    for top in range(0, n_q, block_m):
        ours, color = top == mine, SKY if top == mine else "white"
        box(ax, -d - 1, top, d, block_m, "loaded\nonce" if ours else "", color)
        box(ax, n_k + 1, top, d_v, block_m, "written\nonce" if ours else "", color)
        ax.text(-d - 1.5, top + block_m / 2, f"program {top // block_m}", ha="right", va="center",
                weight="bold" if ours else "normal")
    for j, left in enumerate(range(0, n_k, block_n)):
        box(ax, left, -d - d_v - 1, block_n, d_v, tex(rf"V_{j}^\top"), "#DDDDDD")
        box(ax, left, -d - 1, block_n, d, tex(rf"K_{j}^\top"), "#DDDDDD")
    for x, y, name in [(-d / 2 - 1, -0.6, "Q"), (n_k + 1 + d_v / 2, -0.6, "O"),
                       (-1.5, -d / 2 - 1, r"K^\top"), (-1.5, -d - d_v / 2 - 1, r"V^\top")]:
        ax.text(x, y, tex(name), ha="center", va="center", fontsize=12)
    tiles(ax, n_q, n_k, block_m, block_n, lambda top, left: {
        "label": str(left // block_n) if top == mine else "",
        "color": SKY if top == mine else "white"})
    ax.annotate("", (n_k - 0.3, mine + block_m - 0.7), (0.3, mine + block_m - 0.7),
                arrowprops={"arrowstyle": "-|>", "color": BLUE, "linewidth": 2})
    ax.text(n_k / 2, n_q + 0.4, f"scores {tex('S')}: {n_q // block_m} tiles of {tex('B_M')} "
            f"queries × {n_k // block_n} blocks of {tex('B_N')} keys; program {mine // block_m} "
            "walks " + tex(r"j = 0, 1, \dots"), ha="center", va="top")
    plt.show()


draw_tiling()

# %% [markdown]
# Two details make this the kernels' loop.
#
# **Log2 units.** GPUs compute $2^x$ in one instruction and $e^x$ as $2^{x \log_2 e}$. Folding
# $\log_2 e$ into the scale and the bias once, $S^{(2)} = (s \log_2 e)\, QK^\top + \log_2 e
# \cdot B$, the loop uses `exp2` throughout ($\alpha = 2^{m - m'}$,
# $\tilde P_j = 2^{S^{(2)}_j - m'}$, with $m$ now a max of $S^{(2)}$), and the epilogue converts back:
# $\mathrm{LSE} = \ln 2 \cdot (m + \log_2 \ell)$.
#
# **Masks and the $-\infty$-safe max.** Masked scores are set to $-\infty$ *before* the max.
# A row whose keys so far are all masked has $m' = -\infty$, and $S - m'$ would be NaN; such a
# row is shifted by 0 instead, which gives $\tilde P = 0$ and $\alpha = 0$, and keeps
# $\ell = 0$ until a visible key arrives. At the end, a row with $\ell = 0$ saw nothing and
# gets our zeros.
#
# ## The JVP, online
#
# The tangent needs no second running max. Write $t_O$ over the blocks with $P_j =
# \tilde P_j / \ell$ (all $\tilde P_j$ taken against the final max):
#
# $$t_O = \sum_j \big(P_j \circ (t_{S_j} - \mu)\big) V_j + P_j\, t_{V_j}
# = \frac{1}{\ell} \sum_j \Big( (\tilde P_j \circ t_{S_j}) V_j + \tilde P_j\, t_{V_j} \Big)
# - \mu\, O,\qquad \mu = \frac{1}{\ell} \sum_j \operatorname{rowsum}(\tilde P_j \circ t_{S_j}).$$
#
# $\mu$ is unknown until the last block, but it only enters through $-\mu O$. So three more
# accumulators, rescaled by the same $\alpha$, suffice:
#
# $$G \leftarrow \alpha G + (\tilde P_j \circ t_{S_j}) V_j,\qquad
# r \leftarrow \alpha r + \operatorname{rowsum}(\tilde P_j \circ t_{S_j}),\qquad
# H \leftarrow \alpha H + \tilde P_j\, t_{V_j},$$
#
# $$\mu = r / \ell,\qquad t_O = (G + H)/\ell - \mu\, O .$$
#
# $G$ and $H$ are rescaled alike and only their sum is used, so the code keeps one
# accumulator, `acc_tangent` $= G + H$, and `acc_mu` $= r$. Per tile the forward does two
# matrix products ($QK_j^\top$, $\tilde P_j V_j$); the tangent adds four ($t_Q K_j^\top$,
# $Q t_{K_j}^\top$, $(\tilde P_j \circ t_{S_j}) V_j$, $\tilde P_j t_{V_j}$): three times the
# FLOPs of the forward, in one pass over $K$ and $V$.

# %%
t_q, t_k_full, t_v_full = tangents[0], tk_full, tv_full
tangent_scores = s * (t_q @ k_full.mT + q @ t_k_full.mT)
row_max = torch.full((batch, q_heads, n_q, 1), -torch.inf, **f64)
row_sum, acc_mu = torch.zeros_like(row_max), torch.zeros_like(row_max)
acc_o, acc_tangent = torch.zeros_like(acc_o), torch.zeros_like(acc_o)
for cols in blocks:
    new_max = torch.maximum(row_max, scores[..., cols].amax(-1, keepdim=True))
    alpha = torch.exp(row_max - new_max)
    p_tilde = torch.exp(scores[..., cols] - new_max)
    p_tangent = p_tilde * tangent_scores[..., cols]
    row_sum = alpha * row_sum + p_tilde.sum(-1, keepdim=True)
    acc_o = alpha * acc_o + p_tilde @ v_full[..., cols, :]
    acc_mu = alpha * acc_mu + p_tangent.sum(-1, keepdim=True)
    acc_tangent = alpha * acc_tangent + p_tangent @ v_full[..., cols, :] + p_tilde @ t_v_full[..., cols, :]
    row_max = new_max
online_out, online_mu = acc_o / row_sum, acc_mu / row_sum
_, want = torch.func.jvp(plain_attention, (q, k_full, v_full), (t_q, t_k_full, t_v_full))
check("online: mu = r / l vs reference mu", online_mu.squeeze(-1), reference_attention(q, k, v, enable_gqa=True, tangents=tangents).mu)
check("online: tO = (G + H) / l - mu O vs torch.func.jvp", acc_tangent / row_sum - online_mu * online_out, want)

# %% [markdown]
# So a program keeps, for its whole loop, its tiles of $Q$ and $t_Q$ and a small running
# state: $m$, $\ell$ and $r$ per query row, and the $B_M \times d_v$ accumulators $A$ and $G + H$
# (`row_max`, `row_sum`, `acc_mu`, `acc_o`, `acc_tangent` in `tiled_attention` below). Keys and
# values only stream past: each step reads $K_j, V_j$ (and $t_{K_j}, t_{V_j}$) from memory,
# makes one $B_M \times B_N$ tile of $\tilde P_j$ and $t_{S_j}$, folds it into the state and
# drops it. The state does not grow with $N_k$.

# %% tags=["hide_input"]
def draw_state(d=4, d_v=3, block_m=8, block_n=3):
    """What one program streams in from memory and what it keeps in registers."""
    _, ax = plt.subplots(figsize=(10, 4.6))
    canvas(ax, (-1, 40), (-3, block_m + 4))
    for x, y, width, name, color in [(0, 0.5, d, "K_j", SKY), (4.8, 0.5, d_v, "V_j", SKY),
                                     (0, 4.5, d, "t_{K_j}", ORANGE),
                                     (4.8, 4.5, d_v, "t_{V_j}", ORANGE)]:
        box(ax, x, y, width, block_n, tex(name), color)
    ax.annotate("", (10.6, block_m / 2), (8.2, block_m / 2),
                arrowprops={"arrowstyle": "-|>", "linewidth": 2})
    groups = [
        ("loaded once", {}, [(d, "Q", SKY, "d"), (d, "t_Q", ORANGE, "d")]),
        (f"block {tex('j')}'s tile, then dropped", {"linestyle": "--"},
         [(block_n, r"\tilde P_j", SKY, "B_N"), (block_n, "t_{S_j}", ORANGE, "B_N")]),
        ("running state", {}, [(1, "m", SKY, "1"), (1, r"\ell", SKY, "1"), (d_v, "A", SKY, "d_v"),
                               (1, "r", ORANGE, "1"), (d_v, "G{+}H", ORANGE, "d_v")]),
    ]
    x = 11
    for title, style, items in groups:
        start = x
        for width, name, color, columns in items:
            box(ax, x, 0, width, block_m, tex(name), color, **style)
            ax.text(x + width / 2, block_m + 0.3, tex(columns), ha="center", va="top", fontsize=8)
            x += width + 0.4
        ax.text((start + x - 0.4) / 2, block_m + 1.3, title, ha="center", va="top")
        x += 1
    ax.annotate("", (x - 0.6, 0), (x - 0.6, block_m), arrowprops={"arrowstyle": "<->"})
    ax.text(x - 0.4, block_m / 2, tex("B_M"), va="center")
    for left, width, title in [(-0.5, 9, "memory: streamed,\none key block per step"),
                               (10.5, x - 10, "registers of one program, for its whole loop")]:
        box(ax, left, -1.6, width, block_m + 3.6, color="#F2F2F2", linewidth=0, zorder=0)
        ax.text(left + width / 2, -1.9, title, ha="center", va="bottom", fontsize=11)
    legend = {"primal": SKY, "tangent (with tangents only)": ORANGE}
    ax.legend(handles=[Patch(facecolor=c, edgecolor="black", label=k) for k, c in legend.items()],
              loc="upper left", bbox_to_anchor=(0, 0.02), ncol=2, frameon=False)
    epilogue = [r"O = A/\ell", r"\mathrm{LSE}", r"\mu = r/\ell", r"t_O = (G{+}H)/\ell - \mu O"]
    ax.text(x + 0.5, block_m + 2.7, f"after the last block: {', '.join(map(tex, epilogue))} "
            "go to memory", ha="right", va="top")
    plt.show()


draw_state()

# %% [markdown]
# ### The blueprint
#
# `tiled_attention` is that loop with both details, over blocks of `block_n` keys: it never
# holds more than a `(..., Nq, block_n)` slab of scores, and it applies the causal mask per
# block from indices, as a kernel does, instead of reading an $N_q \times N_k$ bias.
# An fp32 bias is folded into log2 units as the kernels fold it (`_log2_bias`, chapter 2's
# `log2_bias`): no lower than $-2^{31}$, so that the dtype's lowest number, which Hugging
# Face masks with, stays a finite and equally low score rather than overflowing to
# $-\infty$, and a row masked entirely by it averages the values as SDPA's fp32 math path
# does. `reference_backward` rebuilds $P$ from the LSE; a row whose LSE is too large for its
# dtype to hold $\log \ell$ beside it (such a row) takes its own softmax instead.

# %% tags=["export"]
def _online_epilogue(
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    acc_o: torch.Tensor,
    acc_mu: torch.Tensor | None,
    acc_tangent: torch.Tensor | None,
    dtype: torch.dtype,
) -> AttentionOutputs:
    """O = A/ℓ, LSE = ln2 (m + log2 ℓ), μ = r/ℓ, tO = (G + H)/ℓ - μ O; zeros where ℓ = 0."""
    visible = row_sum > 0
    row_sum = torch.where(visible, row_sum, 1.0)
    out = acc_o / row_sum[..., None]
    lse = torch.where(visible, (row_max + torch.log2(row_sum)) * LN_2, -math.inf)
    if acc_tangent is None:
        return AttentionOutputs(out.to(dtype), lse)
    mu = acc_mu / row_sum
    tangent_out = acc_tangent / row_sum[..., None] - mu[..., None] * out
    return AttentionOutputs(out.to(dtype), lse, tangent_out.to(dtype), mu)


def _log2_bias(bias: torch.Tensor) -> torch.Tensor:
    """An fp32 bias in log2 units no lower than LOWEST_SCORE (but -inf), as the kernels fold
    it: the dtype's lowest number times log2(e) would overflow to -inf and hide a key that
    SDPA counts. Its derivative is log2(e) everywhere, as the kernels' backward takes it."""
    if bias.dtype != torch.float32:
        return bias * LOG2_E
    lowest = torch.where(bias == -math.inf, bias, LOWEST_SCORE)
    folded = torch.where(bias < LOWEST_SCORE / LOG2_E, lowest, bias * LOG2_E)
    moved = torch.where(bias == -math.inf, 0.0, bias - bias.detach())  # zero, with a gradient
    return folded.detach() + moved * LOG2_E


def tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    tangents: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    block_n: int = 64,
    mask_tangent: torch.Tensor | None = None,
) -> AttentionOutputs:
    """Attention and its JVP by online softmax over key blocks, as the kernels compute them.

    Same arguments, results and conventions as `reference_attention`, plus `block_n`. Holds
    at most a (..., Nq, block_n) slab of scores; the running max is kept in log2 units.

    Args:
        query: Shape (..., Hq, Nq, Dqk).
        key: Shape (..., Hkv, Nk, Dqk).
        value: Shape (..., Hkv, Nk, Dv).
        attn_mask: None, bool (True = attend) or float (added), broadcastable to
            (..., Hq, Nq, Nk).
        is_causal: Query i sees key j only if j <= i (top-left); combines with `attn_mask`.
        scale: Factor of Q Kᵀ; defaults to 1 / sqrt(Dqk).
        enable_gqa: Allow Hq to be a multiple of Hkv (grouped-query attention).
        tangents: None, or (t_query, t_key, t_value) shaped like the inputs.
        block_n: Number of keys per block.
        mask_tangent: None, or the tangent of a float `attn_mask`, shaped like it.

    Returns:
        AttentionOutputs(out, lse, tangent_out, mu); the last two are None without tangents.

    Raises:
        ValueError: If the inputs do not fit, or `block_n` is not positive.
    """
    if block_n < 1:
        raise ValueError(f"block_n must be a positive number of keys, got {block_n}")
    x = _prepare(query, key, value, attn_mask, False, scale, enable_gqa, tangents,
                 mask_tangent)
    n_q, n_k = x.q.shape[-2], x.k.shape[-2]
    q_log2 = x.q * (x.scale * LOG2_E)  # exp2(q_log2 kᵀ) == exp(s q kᵀ)
    bias = None if x.bias is None else x.bias.expand(*x.bias.shape[:-1], n_k)
    rows = torch.arange(n_q, device=x.q.device)[:, None]
    row_max = torch.full(x.q.shape[:-1], -math.inf, dtype=x.q.dtype, device=x.q.device)
    row_sum = torch.zeros_like(row_max)
    acc_o = x.q.new_zeros(*x.q.shape[:-1], x.v.shape[-1])
    acc_mu = None if x.tangents is None else torch.zeros_like(row_sum)
    acc_tangent = None if x.tangents is None else torch.zeros_like(acc_o)
    for start in range(0, n_k, block_n):
        cols = slice(start, min(start + block_n, n_k))
        k_j, v_j = x.k[..., cols, :], x.v[..., cols, :]
        scores = q_log2 @ k_j.mT
        if bias is not None:
            scores = scores + _log2_bias(bias[..., cols])
        if is_causal:
            hidden = torch.arange(start, cols.stop, device=rows.device) > rows  # key j > query i
            scores = scores.masked_fill(hidden, -math.inf)
        new_max = torch.maximum(row_max, scores.amax(-1))
        shift = torch.where(new_max == -math.inf, 0.0, new_max)  # the -inf-safe max
        alpha = torch.exp2(row_max - shift)
        p_tilde = torch.exp2(scores - shift[..., None])
        row_sum = alpha * row_sum + p_tilde.sum(-1)
        acc_o = alpha[..., None] * acc_o + p_tilde @ v_j
        if x.tangents is not None:
            t_q, t_k, t_v = x.tangents
            tangent_scores = x.scale * (t_q @ k_j.mT + x.q @ t_k[..., cols, :].mT)
            if x.bias_tangent is not None:
                tangent_scores = tangent_scores + x.bias_tangent.expand(
                    *x.bias_tangent.shape[:-1], n_k)[..., cols]
            p_tangent = p_tilde * tangent_scores
            acc_mu = alpha * acc_mu + p_tangent.sum(-1)
            acc_tangent = alpha[..., None] * acc_tangent + p_tangent @ v_j
            acc_tangent = acc_tangent + p_tilde @ t_v[..., cols, :]
        row_max = new_max
    return _online_epilogue(row_max, row_sum, acc_o, acc_mu, acc_tangent, query.dtype)


# %% [markdown]
# In use: with every mask above, block sizes that do and do not divide $N_k = 13$, and the
# row that sees no key. All four outputs (`out`, `tangent_out`, `mu`, finite `lse`) match the
# exact reference to rounding.

# %%
for name, mask, causal in [
    ("no mask", None, False),
    ("key padding + causal", key_padding, True),
    ("additive + causal", additive, True),
    ("empty row", empty_row, False),
]:
    want = reference_attention(q, k, v, mask, causal, enable_gqa=True, tangents=tangents)
    finite = want.lse > -torch.inf
    for block_n in (1, 4, 13, 64):
        got = tiled_attention(q, k, v, mask, causal, enable_gqa=True, tangents=tangents, block_n=block_n)
        assert torch.equal(got.lse > -torch.inf, finite)
        got = torch.cat([got.out.flatten(), got.tangent_out.flatten(), got.mu.flatten(), got.lse[finite]])
        expected = torch.cat([want.out.flatten(), want.tangent_out.flatten(), want.mu.flatten(), want.lse[finite]])
        check(f"tiled vs reference, {name}, block_n={block_n}", got, expected)

# %% [markdown]
# ### Causal tiles
#
# `tiled_attention` masks every block it visits. With `is_causal` a kernel does better, tile by
# tile: a tile wholly above the diagonal $j = i$ is all $-\infty$ and is skipped, a tile wholly
# below it is all visible and needs no mask, and only the tiles that the diagonal crosses are
# masked, here two per query tile ($B_M = 2 B_N$). For $N_q = N_k$ about half the tiles are
# skipped, so a causal forward costs about half a full one. Top-left alignment pins the
# diagonal to the top-left corner whatever the shapes: with $N_q < N_k$ the last keys are seen
# by no query, with $N_q > N_k$ the last queries see every key. The tiles below are sorted by
# `attention_bias`'s own causal mask; chapter 2's `key_block_ranges` computes the same split
# from indices alone.

# %% tags=["hide_input"]
def draw_causal_tiles(shapes=((16, 16), (12, 20), (20, 12)), block_m=4, block_n=2):
    """The causal tiles of each (N_q, N_k) in `shapes`: skipped, full, or on the diagonal."""
    kinds = {
        "skipped": {"facecolor": "white", "edgecolor": GREY, "hatch": "///"},
        "full: no mask": {"facecolor": SKY},
        "on the diagonal: masked": {"facecolor": ORANGE},
    }
    fig, axes = plt.subplots(1, len(shapes), figsize=(11, 4.8),
                             width_ratios=[n_k + 1 for _, n_k in shapes])
    for ax, (n_q, n_k) in zip(axes, shapes, strict=True):
        visible = attention_bias(None, True, n_q, n_k, torch.float64, "cpu") == 0

        def kind(top, left, visible=visible):
            seen = visible[top : top + block_m, left : left + block_n]
            if seen.all():
                return kinds["full: no mask"]
            return kinds["on the diagonal: masked" if seen.any() else "skipped"]

        tiles(ax, n_q, n_k, block_m, block_n, kind)
        ax.stairs([min(i + 1, n_k) for i in range(n_q)], range(n_q + 1), baseline=None,
                  orientation="horizontal", color="black", linewidth=1.5)
        tallest = max(n for n, _ in shapes)
        canvas(ax, (-0.5, n_k + 0.5), (-0.5, tallest + 0.5), tex(f"N_q = {n_q},\\ N_k = {n_k}"))
    handles = [Patch(label=k, **{"edgecolor": "black", **style}) for k, style in kinds.items()]
    label = f"query {tex('i')} sees the keys left of the line"
    handles.append(Line2D([], [], color="black", label=label))
    fig.legend(handles=handles, loc="lower center", ncol=4, frameon=False)
    plt.show()


draw_causal_tiles()

# %% [markdown]
# ## The backward
#
# A loss $L$ reaches attention through $dO = \partial L / \partial O$. From $O = PV$,
#
# $$dV = P^\top dO,\qquad dP = dO\, V^\top.$$
#
# Softmax's backward is $dS_{ij} = P_{ij}\big(dP_{ij} - \sum_k P_{ik}\, dP_{ik}\big)$, and the
# row sum needs no $P$ at all: $\sum_k P_{ik} \sum_e dO_{ie} V_{ke} = \sum_e dO_{ie} O_{ie}$. So
#
# $$\Delta = \operatorname{rowsum}(dO \circ O),\qquad dS = P \circ (dP - \Delta),\qquad
# dQ = s\, dS\, K,\qquad dK = s\, dS^\top Q,$$
#
# with $P = e^{S - \mathrm{LSE}}$ rebuilt from the stored $\mathrm{LSE}$. With GQA, the
# gradients that the query heads of a group send to their shared key/value head add up.

# %% tags=["export"]
def reference_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention from its stored output and log-sum-exp, by the explicit formulas.

    Args:
        query: Shape (..., Hq, Nq, Dqk).
        key: Shape (..., Hkv, Nk, Dqk).
        value: Shape (..., Hkv, Nk, Dv).
        out: The forward's output O, shape (..., Hq, Nq, Dv).
        lse: The forward's log-sum-exp, shape (..., Hq, Nq).
        grad_out: The cotangent dO, shaped like `out`.
        attn_mask: As in `reference_attention`.
        is_causal: As in `reference_attention`.
        scale: As in `reference_attention`.
        enable_gqa: As in `reference_attention`.

    Returns:
        (dq, dk, dv), shaped and typed like (query, key, value); zero on rows that see no key.

    Raises:
        ValueError: If the inputs do not fit.
    """
    x = _prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa, None)
    probs = _probs_from_lse(_scores(x), lse.to(x.q.dtype))
    out, grad_out = out.to(x.q.dtype), grad_out.to(x.q.dtype)
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_v = probs.mT @ grad_out
    grad_probs = grad_out @ x.v.mT
    grad_scores = probs * (grad_probs - delta)
    grad_q = x.scale * grad_scores @ x.k
    grad_k = x.scale * grad_scores.mT @ x.q
    return grad_q.to(query.dtype), _sum_kv_groups(grad_k, key), _sum_kv_groups(grad_v, value)


# %% [markdown]
# In use, against autograd through the plain attention, with GQA, padding and causality:

# %%
grad_out = torch.randn(batch, q_heads, n_q, d_v, **f64)
result = reference_attention(q, k, v, key_padding, True, enable_gqa=True)
grads = reference_backward(q, k, v, result.out, result.lse, grad_out, key_padding, True, enable_gqa=True)

bias = attention_bias(key_padding, True, n_q, n_k, torch.float64, device)
primals = [x.clone().requires_grad_() for x in (q, k, v)]
plain = plain_attention(primals[0], expand_kv_heads(primals[1], q_heads), expand_kv_heads(primals[2], q_heads), bias)
want = torch.autograd.grad(plain, primals, grad_out)
for name, got, expected in zip(("dQ", "dK", "dV"), grads, want, strict=True):
    check(f"reference_backward {name} vs autograd", got, expected)

# %% [markdown]
# ## The backward through the tangent
#
# When the loss also uses the tangent, say $L(O, t_O)$, cotangents $dO$ and $dt_O$ arrive, and
# we need gradients for all six inputs $Q, K, V, t_Q, t_K, t_V$. Write $dt_P = dt_O V^\top$ for
# the cotangent that reaches $t_P$, and let
#
# $$c = \operatorname{rowsum}(P \circ dt_P) = \operatorname{rowsum}(dt_O \circ O).$$
#
# $t_O = t_P V + P t_V$ gives $dt_V = P^\top dt_O$ and adds $t_P^\top dt_O$ to $dV$. Through
# $t_P = P \circ (t_S - \mu)$ with $\mu = \operatorname{rowsum}(P \circ t_S)$:
#
# $$dt_S = P \circ (dt_P - c),$$
#
# $$dP = dO\, V^\top + dt_O\, t_V^\top + dt_P \circ (t_S - \mu) - c \circ t_S .$$
#
# The softmax backward needs $\Delta_2 = \operatorname{rowsum}(P \circ dP)$. Term by term,
# $\operatorname{rowsum}(P \circ dO V^\top) = \operatorname{rowsum}(dO \circ O)$, the next two
# add up to $\operatorname{rowsum}(dt_O \circ (P t_V + t_P V)) = \operatorname{rowsum}(dt_O
# \circ t_O)$, and the last is $-c\mu$:
#
# $$\Delta_2 = \operatorname{rowsum}(dO \circ O) + \operatorname{rowsum}(dt_O \circ t_O)
# - \mu\, c,\qquad dS = P \circ (dP - \Delta_2).$$
#
# Every row statistic comes from the stored $O$, $t_O$, $\mu$, so one flash-style pass suffices.
# Finally $S = s QK^\top$ and $t_S = s(t_Q K^\top + Q t_K^\top)$ give
#
# $$dQ = s\,(dS\, K + dt_S\, t_K),\quad dK = s\,(dS^\top Q + dt_S^\top t_Q),\quad
# dt_Q = s\, dt_S\, K,\quad dt_K = s\, dt_S^\top Q,$$
#
# $$dV = P^\top dO + t_P^\top dt_O,\qquad dt_V = P^\top dt_O .$$

# %% tags=["export"]
def reference_backward_tangent(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tangents: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    tangent_out: torch.Tensor,
    mu: torch.Tensor,
    grad_out: torch.Tensor | None,
    grad_tangent_out: torch.Tensor | None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of (out, tangent_out) with respect to the inputs and their tangents.

    Args:
        query: Shape (..., Hq, Nq, Dqk).
        key: Shape (..., Hkv, Nk, Dqk).
        value: Shape (..., Hkv, Nk, Dv).
        tangents: (t_query, t_key, t_value), shaped like the inputs.
        out: The forward's output O.
        lse: The forward's log-sum-exp, shape (..., Hq, Nq).
        tangent_out: The forward's tangent output tO.
        mu: The forward's tangent of lse, shape (..., Hq, Nq).
        grad_out: The cotangent dO, or None for zeros.
        grad_tangent_out: The cotangent dtO, or None for zeros.
        attn_mask: As in `reference_attention`.
        is_causal: As in `reference_attention`.
        scale: As in `reference_attention`.
        enable_gqa: As in `reference_attention`.

    Returns:
        (dq, dk, dv, dt_query, dt_key, dt_value), shaped and typed like the inputs and their
        tangents; zero on rows that see no key.

    Raises:
        ValueError: If the inputs do not fit.
    """
    x = _prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa, tangents)
    t_q, t_k, t_v = x.tangents
    acc = x.q.dtype
    probs = _probs_from_lse(_scores(x), lse.to(acc))
    tangent_scores = _tangent_scores(x)
    out, tangent_out, mu = out.to(acc), tangent_out.to(acc), mu.to(acc)[..., None]
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(acc)
    grad_t_out = torch.zeros_like(out) if grad_tangent_out is None else grad_tangent_out.to(acc)

    c = (grad_t_out * out).sum(-1, keepdim=True)
    delta_2 = (grad_out * out + grad_t_out * tangent_out).sum(-1, keepdim=True) - mu * c
    centered = tangent_scores - mu  # tS - μ
    tangent_probs = probs * centered
    grad_tangent_probs = grad_t_out @ x.v.mT
    grad_probs = grad_out @ x.v.mT + grad_t_out @ t_v.mT
    grad_probs = grad_probs + grad_tangent_probs * centered - c * tangent_scores
    grad_tangent_scores = probs * (grad_tangent_probs - c)
    grad_scores = probs * (grad_probs - delta_2)

    grad_q = x.scale * (grad_scores @ x.k + grad_tangent_scores @ t_k)
    grad_k = x.scale * (grad_scores.mT @ x.q + grad_tangent_scores.mT @ t_q)
    grad_v = probs.mT @ grad_out + tangent_probs.mT @ grad_t_out
    grad_t_q = x.scale * grad_tangent_scores @ x.k
    grad_t_k = x.scale * grad_tangent_scores.mT @ x.q
    grad_t_v = probs.mT @ grad_t_out
    return (
        grad_q.to(query.dtype),
        _sum_kv_groups(grad_k, key),
        _sum_kv_groups(grad_v, value),
        grad_t_q.to(tangents[0].dtype),
        _sum_kv_groups(grad_t_k, tangents[1]),
        _sum_kv_groups(grad_t_v, tangents[2]),
    )


# %% [markdown]
# In use, against autograd differentiating *through* `torch.func.jvp` of the plain attention:
# a double derivative that PyTorch computes for us, and that we now have in closed form.

# %%
grad_tangent_out = torch.randn_like(grad_out)
result = reference_attention(q, k, v, key_padding, True, enable_gqa=True, tangents=tangents)
grads = reference_backward_tangent(
    q, k, v, tangents, result.out, result.lse, result.tangent_out, result.mu,
    grad_out, grad_tangent_out, key_padding, True, enable_gqa=True,
)  # fmt: skip

inputs = [x.clone().requires_grad_() for x in (q, k, v, *tangents)]


def plain_gqa(q, k, v):
    return plain_attention(q, expand_kv_heads(k, q_heads), expand_kv_heads(v, q_heads), bias)


plain_out, plain_tangent_out = torch.func.jvp(plain_gqa, tuple(inputs[:3]), tuple(inputs[3:]))
want = torch.autograd.grad((plain_out, plain_tangent_out), inputs, (grad_out, grad_tangent_out))
for name, got, expected in zip(("dQ", "dK", "dV", "dtQ", "dtK", "dtV"), grads, want, strict=True):
    check(f"reference_backward_tangent {name} vs autograd of jvp", got, expected)

# %% [markdown]
# And on a row that sees no key: zeros, never NaN.

# %%
result = reference_attention(q, k, v, empty_row, enable_gqa=True, tangents=tangents)
grads = reference_backward_tangent(
    q, k, v, tangents, result.out, result.lse, result.tangent_out, result.mu,
    grad_out, grad_tangent_out, empty_row, enable_gqa=True,
)  # fmt: skip
assert all(g.isfinite().all() for g in grads)
check("empty row: dQ == 0", grads[0][..., 2, :], 0.0, tol=0.0)
check("empty row: dtQ == 0", grads[3][..., 2, :], 0.0, tol=0.0)

# %% [markdown]
# ## What this chapter proved
#
# | quantity | formula | checked against |
# |---|---|---|
# | $O$, $\mathrm{LSE}$ | $P V$, $m + \log \ell$ | SDPA, `torch.logsumexp` |
# | $t_O$, $\mu$ | $P \circ (t_S - \mu)\,V + P t_V$, $\operatorname{rowsum}(P \circ t_S)$ | `torch.func.jvp` |
# | online form | $\alpha$-rescaled $\ell, A, r, G + H$ in log2 units | the exact reference |
# | $dQ, dK, dV$ | $\Delta$, $dS = P \circ (dP - \Delta)$ | autograd |
# | through $t_O$ | $c$, $\Delta_2$, $dt_S = P \circ (dt_P - c)$ | autograd of `torch.func.jvp` |
#
# with masks (causal, bool key padding, additive), GQA, $N_q \ne N_k$, $d_v \ne d$, and the
# row that sees no key. The next chapter moves `tiled_attention`'s loop into a Triton kernel
# and tests it against `reference_attention`.
