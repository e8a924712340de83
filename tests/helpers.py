"""Shared helpers of the kernel tests (tests/library/: test_forward, test_backward,
test_backward_second_order, test_autograd and others).

* `Spec` names one attention problem (shape, heads, mask kind, causal, layout, cotangents) and
  `make_problem` builds its tensors reproducibly, on any device, in any dtype.
* `kernel_forward`, `kernel_backward`, `kernel_second_order` run the Triton launchers with their
  outputs *poisoned*: every `torch.empty` / `torch.empty_like` the launcher allocates starts as
  NaN (or another value), so an entry a kernel forgets to write cannot pass as a number.
* `expected_forward`, `expected_backward`, `expected_second_order` give the float64 truth and
  the *floor*: PyTorch's math path in the inputs' dtype (`jvp_attention.accuracy.math_path`);
  for LSE and mu, which PyTorch does not return, the same math accumulated in float32.
* `assert_accurate` is the accuracy rule of every test: for each quantity,

      max |ours - truth|  <=  FLOOR_FACTOR * floor + eps,
      eps = EPS_ROUNDINGS[device][dtype] * unit_roundoff(dtype) * max(1, scale)
            + CANCELLATION_ROUNDINGS * unit_roundoff(fp32) * cancellation_scale   (grads of
              problems of few rows: every CPU problem, the GPU's small ones)

  that is, at most twice PyTorch's own error plus a few roundings at the problem's scale, where
  `scale` is the largest entry among the true tensors checked together (out and tangent_out;
  or all the gradients) and, for the fp32 row statistics lse and mu, their own largest entry.
  The failure message names the quantity, dtype and shape and by how much the allowance was
  missed. Two tests prove that the rule can fail: library/test_forward.py's
  `test_the_accuracy_rule_catches_a_small_error` and library/test_backward_second_order.py's
  `test_the_accuracy_rule_catches_a_one_percent_gradient_error`.

Why eps:
* On CPU, PyTorch's math path upcasts fp16/bf16 inputs to fp32 and rounds only its outputs
  (measured: its fp16 error equals the rounding of the float64 truth, entry for entry), so the
  CPU floor of a 16-bit result is half an ulp, which no kernel that rounds P (and P * tS) to 16
  bits before its matrix products can reach; on the GPU the math path rounds S, P, tS and tP
  between its kernels and the floor is honest.
* A row that sees a single key (causal row 0, Nk = 1) has P = 1 and an exactly zero score
  gradient: dQ, dK (and dtQ, dtK) are 0 in float64 and in PyTorch, whose softmax backward
  computes p * (g - p * g) = 0 exactly, while the kernels subtract two differently rounded
  fp32 sums (dP - Delta) and leave one rounding of them. Where every row is like that (Nk = 1;
  or Nq = 1 and causal) the floor is ~0 and those roundings can outgrow every result (seen:
  second-order dK 3.8e-6 at d = 2 and dQ 1.9e-6 at d = 13, d_v = 76, where the truth is 0 and
  results and operands are all below 4): `cancellation_scale` measures those terms.
* The GPU's floor is honest but, like any maximum, noisy over few rows: the CPU grid's problems
  run on a GPU (17 to 40 rows a head) put a 16-bit dQ or dK of the other paths at up to 2.6x
  PyTorch's error (H200, fp16), against 1.72x at most over the GPU tests' thousands of rows. A
  quantity of fewer than FEW_ROWS rows gets at least FEW_ROWS_ROUNDINGS, the CPU's roundings.
* Where PyTorch's math path is NaN throughout (second-order dK on problems with a row that sees
  no key) there is no floor; it is taken as 0.

Numbers behind the constants (2026-11-30, after f9e7ea0's fp32 output residuals). CPU grid
and fuzz: the largest error was 0.83 of its allowance (fp16 dK at d = 1), the median 0.1;
the kernels' error is at PyTorch's (median ratio 0.6 to 1.3). H200 (the gpu-marked tests,
before f9e7ea0): every 16-bit output and gradient was within 1.72x of PyTorch's error (median
1.0), so eps is nearly 0 there; fp32 reached 2.08x (second-order dK, at 86 % of an allowance
with 8 roundings, so the GPU fp32 eps is 16); the row statistics against the fp32 floor
reached 8.5x (mu at N = 16384: 8.5e-7 absolute), hence ROW_STATISTICS_ROUNDINGS.

Set `JVP_ACCURACY_LOG=/path/file.jsonl` to append one JSON line per checked quantity (test,
device, dtype, shape, quantity, error, floor, ratio, allowed).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, replace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvp_attention
from jvp_attention.accuracy import accuracy_table, float64_truth, math_path
from jvp_attention.backward import flash_attention_backward
from jvp_attention.forward import flash_attention_forward
from jvp_attention.reference import reference_attention

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# bf16 `tl.dot` is wrong in Triton's interpreter (it multiplies the raw bits): GPU only.
CPU_DTYPES = (torch.float32, torch.float16)
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

FLOOR_FACTOR = 2.0
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# eps in roundings of the dtype at max(1, scale); see the module docstring.
EPS_ROUNDINGS = {
    "cpu": {torch.float32: 8.0, torch.float16: 3.0},
    "cuda": {torch.float32: 16.0, torch.float16: 0.05, torch.bfloat16: 0.05},
}
# The GPU's 16-bit eps trusts a floor measured over thousands of rows; a quantity of fewer rows
# (the CPU grid's problems, when the suite runs on a GPU) gets at least the CPU's roundings.
FEW_ROWS = 1024
FEW_ROWS_ROUNDINGS = {torch.float32: 8.0, torch.float16: 3.0, torch.bfloat16: 3.0}
# lse and mu (fp32) against a dense fp32 reference whose matrix products sum pairwise, while
# the kernel accumulates them online over Nk keys: at Nk = 16384 mu needed 12 roundings.
ROW_STATISTICS_ROUNDINGS = 32.0
# fp32 roundings of `cancellation_scale` added to the gradients' eps (on the GPU only for
# problems of fewer than FEW_ROWS rows, the fuzz tests' among them: a larger problem's floor
# is measured over thousands of rows and already holds such roundings).
CANCELLATION_ROUNDINGS = 8.0
FORWARD_NAMES = ("out", "lse", "tangent_out", "mu")
ROW_STATISTICS = ("lse", "mu")
GRAD_NAMES = ("dq", "dk", "dv")
SECOND_ORDER_NAMES = ("dq", "dk", "dv", "dtq", "dtk", "dtv")
# Gradients of an additive mask and of its tangent: fp32 (B, Hq, Nq, Nk) from the launchers.
MASK_GRAD_NAMES = ("dmask", "dmask_tangent")
MASK_KINDS = ("none", "keypad", "bool", "additive", "additive4d", "head_bias",
              "empty_rows", "empty_rows_additive", "empty_batch", "bool_transposed")


# --- problems -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One attention problem, before it has tensors.

    layout: "contiguous" (B, H, N, D) tensors, or "bnhd": (B, N, H, D) storage viewed through
        `.transpose(1, 2)`, the layout a projection followed by `.view(B, N, H, D)` gives, or
        "padded": the first D columns of (B, H, N, D + 3) storage, an odd row stride, or
        "batch_offset": (B, H, N, D) rows whose batches start one element apart from where
        contiguous ones would (an odd batch stride, aligned rows).
    cotangent: how dO (and dtO) look: "random", "expanded" (a stride-0 tensor of ones, what
        autograd passes for `out.sum()`), "bnhd" (random, transposed storage), or
        "tangent_only" (dO is stride-0 zeros: a loss on the tangent output alone).
    """

    batch: int = 1
    hq: int = 2
    hkv: int = 2
    nq: int = 17
    nk: int = 17
    d: int = 16
    dv: int | None = None
    mask: str = "none"
    causal: bool = False
    scale: float | None = None
    layout: str = "contiguous"
    cotangent: str = "random"

    @property
    def value_dim(self) -> int:
        return self.d if self.dv is None else self.dv

    @property
    def id(self) -> str:
        parts = [f"B{self.batch}", f"H{self.hq}:{self.hkv}", f"{self.nq}x{self.nk}", f"d{self.d}"]
        if self.dv is not None:
            parts.append(f"dv{self.dv}")
        if self.mask != "none":
            parts.append(self.mask)
        parts.append("causal" if self.causal else "full")
        if self.scale is not None:
            parts.append(f"scale{self.scale}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        if self.cotangent != "random":
            parts.append(f"dO-{self.cotangent}")
        return "-".join(parts)

    def with_(self, **changes) -> Spec:
        return replace(self, **changes)


@dataclass
class Problem:
    """Tensors of a `Spec`: inputs, their tangents, the mask, and the cotangents."""

    spec: Spec
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tangents: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    attn_mask: torch.Tensor | None
    grad_out: torch.Tensor
    grad_tangent_out: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def options(self) -> dict:
        """The keyword arguments of the launchers (attn_mask, is_causal, scale)."""
        return {"attn_mask": self.attn_mask, "is_causal": self.spec.causal,
                "scale": self.spec.scale}

    @property
    def reference_options(self) -> dict:
        return {**self.options, "enable_gqa": self.spec.hq != self.spec.hkv}

    @property
    def label(self) -> str:
        return f"{dtype_name(self.dtype)} {self.spec.id}"

    def visible(self) -> torch.Tensor:
        """(B, Hq, Nq, Nk) bool: which key each query row sees (mask and causal band)."""
        s = self.spec
        seen = torch.ones(s.batch, s.hq, s.nq, s.nk, dtype=torch.bool, device=self.q.device)
        if self.attn_mask is not None:
            mask = self.attn_mask
            seen = seen & (mask if mask.dtype == torch.bool else mask != -math.inf)
        if s.causal:
            seen = seen & torch.ones(s.nq, s.nk, dtype=torch.bool, device=seen.device).tril()
        return seen

    def empty_rows(self) -> torch.Tensor:
        """(B, Hq, Nq) bool: the query rows that see no key."""
        return ~self.visible().any(-1)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _make_mask(spec: Spec, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask of each kind, built on CPU. Kinds without "empty" keep key 0 visible on every
    row (so only the causal band, never the mask, can hide everything from a row)."""
    b, h, nq, nk = spec.batch, spec.hq, spec.nq, spec.nk

    def rand(*shape):
        return torch.rand(*shape, generator=gen)

    if spec.mask == "none":
        return None
    if spec.mask == "keypad":  # (B, 1, 1, Nk): sequence b has length nk - b * nk // (B + 1)
        lengths = torch.tensor([max(1, nk - i * nk // (b + 1)) for i in range(b)])
        return (torch.arange(nk) < lengths[:, None])[:, None, None, :]
    if spec.mask == "empty_batch":  # (B, 1, 1, Nk): the last sequence has no key at all
        lengths = torch.tensor([nk] * (b - 1) + [0])
        return (torch.arange(nk) < lengths[:, None])[:, None, None, :]
    if spec.mask in ("bool", "bool_transposed"):  # (Nq, Nk), 70 % visible
        keep = rand(nq, nk) < 0.7
        keep[:, 0] = True
        # The same values, stored (Nk, Nq) and viewed transposed: a non-contiguous mask.
        return keep.mT.contiguous().mT if spec.mask == "bool_transposed" else keep
    if spec.mask == "additive":  # (Nq, Nk): random biases, a quarter of them -inf
        bias = torch.randn(nq, nk, generator=gen).masked_fill(rand(nq, nk) < 0.25, -math.inf)
        bias[:, 0] = 0.5
        return bias.to(dtype)
    if spec.mask == "additive4d":  # (B, Hq, Nq, Nk): a bias per batch and head
        bias = 2 * torch.randn(b, h, nq, nk, generator=gen)
        bias = bias.masked_fill(rand(b, h, nq, nk) < 0.2, -math.inf)
        bias[..., 0] = -1.0
        return bias.to(dtype)
    if spec.mask == "head_bias":  # (1, Hq, Nq, Nk): a bias per head, shared by the batch
        bias = torch.randn(1, h, nq, nk, generator=gen)
        bias = bias.masked_fill(rand(1, h, nq, nk) < 0.2, -math.inf)
        bias[..., 0] = 0.25
        return bias.to(dtype)
    if spec.mask == "empty_rows":  # (B, Hq, Nq, Nk) bool: rows 0, nq // 2 of head 0 see nothing
        keep = rand(b, h, nq, nk) < 0.6
        keep[..., 0] = True
        keep[:, 0, [0, nq // 2]] = False
        return keep
    if spec.mask == "empty_rows_additive":  # (Nq, Nk) float: the last row is all -inf
        bias = torch.randn(nq, nk, generator=gen)
        bias[-1] = -math.inf
        return bias.to(dtype)
    raise ValueError(f"unknown mask kind {spec.mask!r}")


def make_problem(spec: Spec, dtype: torch.dtype = torch.float32, seed: int = 0,
                 device: str | torch.device = DEVICE) -> Problem:
    """Random inputs, tangents, mask and cotangents of `spec`, the same for a given seed."""
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    mask_gen = torch.Generator().manual_seed(seed + 1)
    s = spec

    def randn(b, h, n, d, layout):
        if layout == "bnhd":
            x = torch.randn(b, n, h, d, generator=gen, device=device, dtype=torch.float32)
            return x.to(dtype).transpose(1, 2)
        if layout == "padded":
            x = torch.randn(b, h, n, d + 3, generator=gen, device=device, dtype=torch.float32)
            return x.to(dtype)[..., :d]
        if layout == "batch_offset":
            x = torch.randn(b, h * n * d + 1, generator=gen, device=device, dtype=torch.float32)
            return x.to(dtype)[:, :h * n * d].unflatten(1, (h, n, d))
        return torch.randn(b, h, n, d, generator=gen, device=device,
                           dtype=torch.float32).to(dtype)

    shapes = [(s.batch, s.hq, s.nq, s.d), (s.batch, s.hkv, s.nk, s.d),
              (s.batch, s.hkv, s.nk, s.value_dim)]
    q, k, v = (randn(*shape, s.layout) for shape in shapes)
    tangents = tuple(randn(*shape, s.layout) for shape in shapes)
    out_shape = (s.batch, s.hq, s.nq, s.value_dim)
    if s.cotangent == "expanded":
        grad_out = torch.ones((), device=device, dtype=dtype).expand(out_shape)
        grad_tangent_out = torch.full((), 0.5, device=device, dtype=dtype).expand(out_shape)
    else:
        layout = "bnhd" if s.cotangent == "bnhd" else "contiguous"
        grad_out = randn(*out_shape, layout)
        grad_tangent_out = randn(*out_shape, layout)
        if s.cotangent == "tangent_only":
            grad_out = torch.zeros((), device=device, dtype=dtype).expand(out_shape)
    mask = _make_mask(spec, mask_gen, dtype)
    mask = None if mask is None else mask.to(device)
    return Problem(spec, q, k, v, tangents, mask, grad_out, grad_tangent_out)


# --- poisoned launches --------------------------------------------------------------------


@contextlib.contextmanager
def poisoned_allocations(value: float = math.nan) -> Iterator[None]:
    """Make every floating `torch.empty` / `torch.empty_like` start filled with `value`.

    The launchers allocate their outputs with these; the contents of an empty tensor are
    undefined, so filling them is always legal, and a kernel that skips an entry then leaves a
    NaN (or, for a determinism check, a different value) behind."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(x):
        return x.fill_(value) if x.is_floating_point() else x

    def poisoned_empty(*args, **kwargs):
        return poison(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):
        return poison(empty_like(*args, **kwargs))

    with mock.patch.object(torch, "empty", poisoned_empty), \
            mock.patch.object(torch, "empty_like", poisoned_empty_like):
        yield


def kernel_forward(p: Problem, with_tangents: bool = True,
                   poison: float = math.nan) -> dict[str, torch.Tensor]:
    """The fused forward on `p`: out, lse (and tangent_out, mu)."""
    with poisoned_allocations(poison):
        result = flash_attention_forward(p.q, p.k, p.v, **p.options,
                                         tangents=p.tangents if with_tangents else None)
    names = FORWARD_NAMES if with_tangents else FORWARD_NAMES[:2]
    return {name: getattr(result, name) for name in names}


def _kernel_forward_for_backward(p: Problem, tangents, residuals: bool):
    """The forward whose saved outputs a backward uses, with its rounding residuals (the
    autograd layer's path: the row statistics then use the fp32 outputs) or without."""
    if residuals:
        return flash_attention_forward(p.q, p.k, p.v, **p.options, tangents=tangents,
                                       residuals=True)
    return flash_attention_forward(p.q, p.k, p.v, **p.options, tangents=tangents), (None, None)


def kernel_backward(p: Problem, poison: float = math.nan,
                    residuals: bool = True) -> dict[str, torch.Tensor]:
    """dq, dk, dv of `p` from the kernels' own forward (saved out and lse)."""
    fwd, (out_residual, _) = _kernel_forward_for_backward(p, None, residuals)
    with poisoned_allocations(poison):
        grads = flash_attention_backward(p.q, p.k, p.v, fwd.out, fwd.lse, p.grad_out,
                                         p.attn_mask, p.spec.causal, p.spec.scale,
                                         out_residual=out_residual)
    return dict(zip(GRAD_NAMES, grads, strict=True))


def kernel_second_order(p: Problem, poison: float = math.nan,
                        residuals: bool = True) -> dict[str, torch.Tensor]:
    """dq, dk, dv, dtq, dtk, dtv of the loss <dO, out> + <dtO, tangent_out>, from the
    kernels' own forward with tangents."""
    fwd, (out_residual, tangent_out_residual) = _kernel_forward_for_backward(p, p.tangents,
                                                                             residuals)
    with poisoned_allocations(poison):
        grads = flash_attention_backward(
            p.q, p.k, p.v, fwd.out, fwd.lse, p.grad_out, p.attn_mask, p.spec.causal,
            p.spec.scale, tangents=p.tangents, tangent_out=fwd.tangent_out, mu=fwd.mu,
            grad_tangent_out=p.grad_tangent_out, out_residual=out_residual,
            tangent_out_residual=tangent_out_residual)
    return dict(zip(SECOND_ORDER_NAMES, grads, strict=True))


precision = jvp_attention.precision  # the library's own context manager


# Problems for the checks of the other paths (precision "fast", no residuals): GQA with a
# key-padding mask and causal; a per-head additive mask on the (B, N, H, D) layout; rows that
# see no key.
OTHER_PATH_CASES = [
    Spec(batch=2, hq=4, hkv=2, nq=33, nk=17, d=40, mask="keypad", causal=True),
    Spec(batch=2, nq=17, nk=40, d=64, dv=32, mask="additive4d", layout="bnhd"),
    Spec(hq=2, hkv=1, nq=40, nk=33, d=16, mask="empty_rows", causal=True,
         cotangent="expanded"),
]
OTHER_BACKWARD_PATHS = ("fast-precision", "no-residuals")


def other_backward_paths(test):
    """Parametrize a backward test over OTHER_PATH_CASES, fp32/fp16 and OTHER_BACKWARD_PATHS."""
    import pytest

    # Applied innermost first, as stacked decorators would be: ids read spec-dtype-path.
    test = pytest.mark.parametrize("spec", OTHER_PATH_CASES, ids=lambda s: s.id)(test)
    test = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)(test)
    return pytest.mark.parametrize("path", OTHER_BACKWARD_PATHS)(test)


def check_other_backward_path(check, spec: Spec, dtype: torch.dtype, path: str) -> None:
    """`check(spec, dtype, residuals=...)` on one of the launchers' other paths: precision
    "fast" (one 16-bit rounding per product), or row statistics from the 16-bit outputs (no
    rounding residuals from the forward)."""
    with precision("fast" if path == "fast-precision" else "accurate"):
        check(spec, dtype, residuals=path != "no-residuals")


# --- truth and floor ----------------------------------------------------------------------


def _chunks(p: Problem, max_scores: int) -> list[tuple[int, int]]:
    """(batch, kv_head) blocks small enough that the references' (Nq, Nk) score matrices of
    one block hold at most `max_scores` entries; [(-1, -1)] means: all at once."""
    s = p.spec
    if s.batch * s.hq * s.nq * s.nk <= max_scores:
        return [(-1, -1)]
    return [(b, g) for b in range(s.batch) for g in range(s.hkv)]


def _slice(p: Problem, b: int, g: int) -> dict:
    """The inputs of batch b and kv head g (with its query heads) as reference arguments."""
    if b < 0:
        return {"q": p.q, "k": p.k, "v": p.v, "tangents": p.tangents,
                "grad_out": p.grad_out, "grad_tangent_out": p.grad_tangent_out,
                "attn_mask": p.attn_mask}
    group = p.spec.hq // p.spec.hkv
    heads_q, heads_kv = slice(g * group, (g + 1) * group), slice(g, g + 1)

    def pick(x, heads):
        return x[b:b + 1, heads]

    tq, tk, tv = p.tangents
    mask = p.attn_mask
    if mask is not None:
        mask = mask.expand(p.spec.batch, p.spec.hq, p.spec.nq, p.spec.nk)[b:b + 1, heads_q]
    return {"q": pick(p.q, heads_q), "k": pick(p.k, heads_kv), "v": pick(p.v, heads_kv),
            "tangents": (pick(tq, heads_q), pick(tk, heads_kv), pick(tv, heads_kv)),
            "grad_out": pick(p.grad_out, heads_q),
            "grad_tangent_out": pick(p.grad_tangent_out, heads_q), "attn_mask": mask}


def _assemble(p: Problem, parts: dict, names) -> dict[str, torch.Tensor]:
    """Put per-(batch, kv head) results back into full tensors."""
    if list(parts) == [(-1, -1)]:
        return parts[(-1, -1)]
    s = p.spec
    return {name: torch.cat([torch.cat([parts[(b, g)][name] for g in range(s.hkv)], dim=1)
                             for b in range(s.batch)], dim=0)
            for name in names if name in parts[(0, 0)]}


def _run_chunked(p: Problem, compute, names, max_scores: int) -> dict[str, torch.Tensor]:
    parts = {}
    for b, g in _chunks(p, max_scores):
        parts[(b, g)] = {n: x for n, x in compute(_slice(p, b, g)).items() if n in names}
    return _assemble(p, parts, names)


MAX_SCORES = 2**27  # entries of (B, Hq, Nq, Nk) the references materialise at once


def float64_options(options: dict) -> dict:
    """`options` for float64 inputs: a float mask in float64 too (SDPA's contract takes a
    mask of the query's dtype, float32 or bool)."""
    mask = options.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        return {**options, "attn_mask": mask.double()}
    return options


def _options(p: Problem, chunk: dict) -> dict:
    return {"attn_mask": chunk["attn_mask"], "is_causal": p.spec.causal,
            "scale": p.spec.scale, "enable_gqa": p.spec.hq != p.spec.hkv}


def expected_forward(p: Problem, with_tangents: bool = True,
                     max_scores: int = MAX_SCORES) -> tuple[dict, dict]:
    """(truth, floor) of out, lse (and tangent_out, mu)."""
    names = FORWARD_NAMES if with_tangents else FORWARD_NAMES[:2]

    def truth(c):
        t = None if not with_tangents else tuple(x.double() for x in c["tangents"])
        ref = reference_attention(c["q"].double(), c["k"].double(), c["v"].double(),
                                  tangents=t, **float64_options(_options(p, c)))
        return {n: getattr(ref, n) for n in names}

    def floor(c):
        t = c["tangents"] if with_tangents else None
        low = math_path(c["q"], c["k"], c["v"], tangents=t, **_options(p, c))
        ref32 = reference_attention(c["q"], c["k"], c["v"], tangents=t, **_options(p, c))
        return {**low, "lse": ref32.lse, "mu": ref32.mu}

    return (_run_chunked(p, truth, names, max_scores),
            _run_chunked(p, floor, names, max_scores))


def expected_backward(p: Problem, max_scores: int = MAX_SCORES) -> tuple[dict, dict]:
    """(truth, floor) of dq, dk, dv for the cotangent p.grad_out."""
    def truth(c):
        return float64_truth(c["q"], c["k"], c["v"], grad_out=c["grad_out"], **_options(p, c))

    def floor(c):
        return math_path(c["q"], c["k"], c["v"], grad_out=c["grad_out"], **_options(p, c))

    return (_run_chunked(p, truth, GRAD_NAMES, max_scores),
            _run_chunked(p, floor, GRAD_NAMES, max_scores))


def expected_second_order(p: Problem, max_scores: int = MAX_SCORES) -> tuple[dict, dict]:
    """(truth, floor) of the six gradients for the cotangents (p.grad_out, p.grad_tangent_out)."""
    def run(c, fn):
        return fn(c["q"], c["k"], c["v"], tangents=c["tangents"], grad_out=c["grad_out"],
                  grad_tangent_out=c["grad_tangent_out"], **_options(p, c))

    return (_run_chunked(p, lambda c: run(c, float64_truth), SECOND_ORDER_NAMES, max_scores),
            _run_chunked(p, lambda c: run(c, math_path), SECOND_ORDER_NAMES, max_scores))


# --- the accuracy rule --------------------------------------------------------------------


def cancellation_scale(p: Problem, second_order: bool = False) -> float:
    """The size of what cancels in a score gradient, carried to dQ and dK.

    The kernels form dS = P * (dP - Delta) from Delta_i = dO_i . O_i (for the backward through
    the tangent, Delta_i + dtO_i . tO_i - mu_i c_i with c_i = dtO_i . O_i). On a row that sees
    a single key P = 1 and dP - Delta is exactly 0 (so are dQ, dK, dtQ, dtK there, in float64
    and in PyTorch), but the kernels subtract two differently rounded sums and leave one
    rounding of those terms, times s |K| in dQ (s |Q| in dK). Returns
    s * max_i T_i * max |q, k, tq, tk| with T_i the sum of the terms' magnitudes; 0 on the
    GPU for problems of FEW_ROWS query rows or more (see CANCELLATION_ROUNDINGS), where its
    dense float64 reference would also cost."""
    if p.q.device.type != "cpu" and p.q.numel() // p.q.shape[-1] >= FEW_ROWS:
        return 0.0
    q, k, v = p.q.double(), p.k.double(), p.v.double()
    tangents = tuple(t.double() for t in p.tangents)
    ref = reference_attention(q, k, v, tangents=tangents if second_order else None,
                              **float64_options(p.reference_options))
    grad_out = p.grad_out.double()
    terms = (grad_out * ref.out).sum(-1).abs()
    if second_order:
        grad_t_out = p.grad_tangent_out.double()
        c = (grad_t_out * ref.out).sum(-1)
        terms = terms + (grad_t_out * ref.tangent_out).sum(-1).abs() + (ref.mu * c).abs()
    s = p.spec.scale if p.spec.scale is not None else p.spec.d**-0.5
    entries = max(_max_abs(x) for x in (q, k, *tangents[:2]))
    return s * _max_abs(terms) * entries


def allowed_error(dtype: torch.dtype, floor: float, scale: float, device: str = DEVICE,
                  row_statistic: bool = False, cancellation: float = 0.0,
                  rows: int | None = None) -> float:
    """FLOOR_FACTOR * floor + eps for a result of `dtype` (of `rows` rows, if known); see the
    module docstring."""
    roundings = ROW_STATISTICS_ROUNDINGS if row_statistic else EPS_ROUNDINGS[device][dtype]
    if not row_statistic and rows is not None and rows < FEW_ROWS:
        roundings = max(roundings, FEW_ROWS_ROUNDINGS[dtype])
    eps = roundings * UNIT_ROUNDOFF[dtype] * max(1.0, scale)
    eps += CANCELLATION_ROUNDINGS * UNIT_ROUNDOFF[torch.float32] * cancellation
    return FLOOR_FACTOR * floor + eps


def _without_matching_infinities(ours: torch.Tensor, truth: torch.Tensor, name: str,
                                 label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE is -inf on rows that see no key: demand the same -inf entries, then compare the
    rest (as zeros there)."""
    inf_ours, inf_truth = ours == -math.inf, truth == -math.inf
    if not torch.equal(inf_ours, inf_truth):
        raise AssertionError(
            f"{name} [{label}]: -inf (rows that see no key) at {int(inf_ours.sum())} entries, "
            f"the truth has {int(inf_truth.sum())}; first mismatch at "
            f"{tuple((inf_ours != inf_truth).nonzero()[0].tolist())}")
    return ours.masked_fill(inf_ours, 0.0), truth.masked_fill(inf_truth, 0.0)


def assert_deterministic(run, p: Problem) -> None:
    """`run(p, poison=...)` twice, its outputs first filled with NaN, then with 7.0: the two
    results must agree bit for bit (every entry written, and written the same way)."""
    first, second = run(p, poison=math.nan), run(p, poison=7.0)
    for name in first:
        assert torch.equal(first[name], second[name]), f"{name} [{p.label}] differs between runs"


def force_tile(monkeypatch, tuner, config) -> None:
    """Make the library's autotuner `tuner` tune over `config` alone, forgetting what it
    tuned and the launches remembered with its tiles (restored after the test)."""
    monkeypatch.setattr(tuner, "configs", [config])
    for cache in ("tuned", "cache", "launches"):
        monkeypatch.setattr(tuner, cache, {})


def assert_every_tile_reproducible(tuner, run, monkeypatch, calls: int = 5) -> None:
    """Force each tile of `tuner`'s list in turn (`force_tile`) and ask `run()` (a dict of
    tensors) for bitwise the same results in `calls` calls: a tile whose compiled form races
    (chapter 6's dK tile at d = 128 returned a wrong dtK in one call of eight) gives itself
    away where one call's error may not. Tiles over the GPU's shared memory, which the
    autotuner times as infinite, are passed over; at least one tile must launch."""
    from triton.runtime.errors import OutOfResources

    launched = 0
    for config in list(tuner.configs):
        force_tile(monkeypatch, tuner, config)
        try:
            first = run()
        except OutOfResources:
            continue
        launched += 1
        for _ in range(calls - 1):
            again = run()
            for name in first:
                assert torch.equal(first[name], again[name]), (str(config), name)
    assert launched, f"no tile of {tuner.fn.__name__} launched"


# GPU cases every kernel's tests start from: N = 1000, d = 64, plain and causal, all dtypes.
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
COMMON_GPU_CASES = [
    (Spec(batch=2, hq=8, hkv=8, nq=1000, nk=1000, d=64), F16),
    (Spec(batch=2, hq=8, hkv=8, nq=1000, nk=1000, d=64, causal=True), BF16),
    (Spec(batch=2, hq=8, hkv=8, nq=1000, nk=1000, d=64, causal=True), F32),
    (Spec(batch=3, hq=4, hkv=2, nq=1100, nk=1100, d=72, mask="head_bias"), BF16),
]


def gpu_params(cases) -> list:
    """pytest params named dtype-spec for (Spec, dtype) pairs."""
    return [pytest.param(spec, dtype, id=f"{dtype_name(dtype)}-{spec.id}")
            for spec, dtype in cases]


def assert_accurate(ours: dict[str, torch.Tensor], truth: dict[str, torch.Tensor],
                    floor: dict[str, torch.Tensor], dtype: torch.dtype, label: str,
                    what: str = "", cancellation: float = 0.0) -> dict:
    """Every quantity of `ours` is finite and within `allowed_error` of the float64 truth.

    `cancellation`: `cancellation_scale` of the problem, for the gradients' eps.

    Returns the accuracy table; logs it when JVP_ACCURACY_LOG is set."""
    ours, truth, floor = dict(ours), dict(truth), dict(floor)
    for name in ("lse",):
        if name in ours:
            ours[name], truth[name] = _without_matching_infinities(ours[name], truth[name],
                                                                   name, label)
            floor[name] = floor[name].masked_fill(floor[name] == -math.inf, 0.0)
    for name, x in ours.items():
        assert x.shape == truth[name].shape, (
            f"{name} [{label}]: shape {tuple(x.shape)}, expected {tuple(truth[name].shape)}")
        # (lse is fp64 with an additive mask: `test_lse_dtype_follows_the_mask` pins that)
        expected = ((torch.float32, torch.float64) if name == "lse"
                    else (torch.float32,) if name in ("mu", *MASK_GRAD_NAMES) else (dtype,))
        assert x.dtype in expected, f"{name} [{label}]: dtype {x.dtype}"
    table = accuracy_table(ours, floor, truth)
    # The scale of eps: the largest true entry among the check's tensors (the gradients
    # together, out and tangent_out together); lse and mu, row statistics, have their own.
    scale = {name: _max_abs(truth[name]) for name in ours}
    shared = max([0.0] + [v for n, v in scale.items() if n not in ROW_STATISTICS])
    failures = []
    for name, acc in table.items():
        x = ours[name]
        floor_error = acc.floor
        note = ""
        if not math.isfinite(floor_error):  # PyTorch gave NaN everywhere: no floor to use
            floor_error, note = 0.0, " (PyTorch's math path is NaN throughout: floor taken as 0)"
        # The mask's gradients are fp32 but computed from `dtype` inputs: its roundings.
        allowed = allowed_error(dtype if name in MASK_GRAD_NAMES else _result_dtype(x), floor_error,
                                scale[name] if name in ROW_STATISTICS else shared,
                                x.device.type, row_statistic=name in ROW_STATISTICS,
                                cancellation=0.0 if name in ROW_STATISTICS else cancellation,
                                rows=x.numel() // max(1, x.shape[-1]) if x.dim() else 1)
        _log(label, what, dtype, name, acc, allowed)
        bad = (~x.isfinite()).sum().item()
        if bad:
            where = tuple((~x.isfinite()).nonzero()[0].tolist())
            failures.append(f"{name}: {bad} of {x.numel()} entries are not finite "
                            f"(first at {where}: {x[where].item()})")
        elif not acc.error <= allowed:
            eps = allowed - FLOOR_FACTOR * floor_error
            failures.append(
                f"{name}: max error {acc.error:.3e} > allowed {allowed:.3e} = "
                f"{FLOOR_FACTOR:g} x floor {floor_error:.3e} + eps {eps:.2e}{note}; "
                f"{acc.error / allowed:.2f}x the allowance, {acc.ratio:.2f}x PyTorch's error")
    assert not failures, f"{what} [{label}]:\n  " + "\n  ".join(failures)
    return table


def _result_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a result was computed in: an fp64 LSE (additive masks) holds fp32 sums."""
    return torch.float32 if x.dtype == torch.float64 else x.dtype


def _max_abs(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def _log(label: str, what: str, dtype: torch.dtype, name: str, acc, allowed: float) -> None:
    path = os.environ.get("JVP_ACCURACY_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    record = {"test": test, "what": what, "device": DEVICE, "dtype": dtype_name(dtype),
              "shape": label.split(" ", 1)[-1], "quantity": name, "error": acc.error,
              "floor": acc.floor, "ratio": acc.ratio, "allowed": allowed}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def assert_empty_rows_are_zero(p: Problem, results: dict[str, torch.Tensor]) -> None:
    """Rows that see no key: zero out/tangent_out/mu/dq/dtq and lse = -inf, never NaN."""
    empty = p.empty_rows()
    if not empty.any():
        return
    for name, x in results.items():
        if name in ("out", "tangent_out", "dq", "dtq"):
            rows = x[empty]
            assert not rows.isnan().any() and not rows.any(), (
                f"{name} [{p.label}]: rows that see no key must be 0, got max "
                f"|{name}| = {rows.abs().max().item():.3e} there")
        elif name == "mu":
            assert not x[empty].any(), f"mu [{p.label}]: must be 0 on rows that see no key"
        elif name == "lse":
            assert (x[empty] == -math.inf).all(), f"lse [{p.label}]: must be -inf there"


# Hypothesis: tiny problems (one example is ~0.1 to 1 s in the interpreter), derandomized so CI
# sees the same examples every run, and no shrinking: shrinking one slow failing example ran
# past five minutes; a failure prints its (unshrunk) arguments, which reproduce it exactly.
FUZZ_STRATEGIES = {
    "batch": st.integers(1, 2), "hkv": st.integers(1, 2), "group": st.sampled_from([1, 2]),
    "nq": st.integers(1, 40), "nk": st.integers(1, 40), "d": st.integers(1, 80),
    "dv": st.integers(1, 80), "causal": st.booleans(), "mask": st.sampled_from(MASK_KINDS),
    "dtype": st.sampled_from(CPU_DTYPES), "seed": st.integers(0, 2**16),
}


def fuzz_settings(variable: str, default: int) -> settings:
    """Settings of a fuzz test; the number of examples can be raised with `variable`."""
    return settings(max_examples=int(os.environ.get(variable, default)), derandomize=True,
                    deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz_spec(batch, hkv, group, nq, nk, d, dv, causal, mask) -> Spec:
    """A Spec from fuzzed numbers; masks that need more than one batch fall back to keypad."""
    if mask == "empty_batch" and batch < 2:
        mask = "keypad"
    return Spec(batch=batch, hq=hkv * group, hkv=hkv, nq=nq, nk=nk, d=d,
                dv=None if dv == d else dv, mask=mask, causal=causal)


# --- the CPU grid -------------------------------------------------------------------------

# Lengths 1, 17, 33, 40 are not multiples of the interpreter's 32 x 16 tile; Nq > Nk appears
# with and without causal (top-left causal: rows past Nk see every key). Each case runs
# causal and not, in fp32 and fp16, so every mask is also combined with causal.
CPU_CASES = [
    Spec(hq=1, hkv=1, nq=1, nk=1, d=16),
    Spec(nq=1, nk=17, d=16, mask="keypad", batch=2),
    Spec(nq=17, nk=33, d=64),
    Spec(nq=33, nk=17, d=40),
    Spec(hq=2, hkv=1, nq=40, nk=1, d=16),
    Spec(hq=4, hkv=2, nq=40, nk=40, d=64),
    Spec(hq=4, hkv=1, nq=17, nk=40, d=72),
    Spec(batch=2, nq=33, nk=40, d=64, mask="keypad"),
    Spec(nq=40, nk=33, d=80, mask="bool"),
    Spec(hq=2, hkv=1, nq=33, nk=33, d=64, mask="additive"),
    Spec(batch=2, nq=17, nk=40, d=16, mask="additive4d"),
    Spec(batch=3, hq=4, hkv=2, nq=33, nk=40, d=16, mask="head_bias"),
    Spec(hq=4, hkv=2, nq=33, nk=17, d=40, mask="empty_rows"),
    Spec(nq=17, nk=33, d=64, mask="empty_rows_additive"),
    Spec(batch=2, hq=1, hkv=1, nq=17, nk=17, d=16, mask="empty_batch"),
    Spec(nq=33, nk=33, d=72, mask="bool_transposed"),
    Spec(hq=2, hkv=1, nq=40, nk=17, d=80, dv=48),
    Spec(nq=17, nk=33, d=40, dv=72),
    Spec(hq=2, hkv=1, nq=33, nk=17, d=40, mask="keypad", layout="padded"),
    Spec(batch=2, hq=2, hkv=1, nq=17, nk=33, d=72, layout="batch_offset"),
    Spec(nq=33, nk=40, d=64, dv=32, scale=0.3),
    Spec(batch=2, hq=1, hkv=1, nq=33, nk=33, d=64, layout="bnhd", cotangent="bnhd"),
    Spec(batch=2, hq=2, hkv=1, nq=17, nk=40, d=40, mask="keypad", layout="bnhd",
         scale=0.25, cotangent="expanded"),
    Spec(nq=40, nk=40, d=16, scale=1.5, cotangent="expanded"),
    Spec(hq=4, hkv=2, nq=33, nk=17, d=64, mask="bool", cotangent="tangent_only"),
]


def cpu_grid(cases=CPU_CASES, dtypes=CPU_DTYPES):
    """pytest params: every case, causal and not, in every dtype; ids read like the Spec."""
    import pytest

    return [pytest.param(case.with_(causal=causal), dtype,
                         id=f"{dtype_name(dtype)}-{case.with_(causal=causal).id}")
            for case in cases for causal in (False, True) for dtype in dtypes]


# --- additive masks with a tangent or a gradient (learnable biases) -------------------------
# Shapes of the bias as the user passes it: a bias per batch and head, one per head shared by
# the batch, one (Nq, Nk) shared by all; the launchers read each broadcast to (B, Hq, Nq, Nk).
BIAS_SHAPES = ("full", "head", "2d", "batch")


def make_bias(spec: Spec, shape: str, dtype: torch.dtype = torch.float32, seed: int = 0,
              device: str | torch.device = DEVICE, empty_rows: bool = False,
              tangent_shape: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random additive mask of one of BIAS_SHAPES (about 15 % -inf, key 0 always finite)
    and a random tangent for it (of `tangent_shape`, by default the same shape). With
    `empty_rows`, query rows 0 and nq // 2 see no key (all -inf)."""
    gen = torch.Generator().manual_seed(seed + 2)
    full = (spec.batch, spec.hq, spec.nq, spec.nk)
    shapes = {"full": full, "head": (1, *full[1:]), "2d": full[2:],
              "batch": (full[0], 1, *full[2:])}
    bias = torch.randn(shapes[shape], generator=gen)
    bias = bias.masked_fill(torch.rand(bias.shape, generator=gen) < 0.15, -math.inf)
    bias[..., 0] = 0.5
    if empty_rows:
        bias[..., [0, spec.nq // 2], :] = -math.inf
    t_bias = torch.randn(shapes[tangent_shape or shape], generator=gen)
    return bias.to(device=device, dtype=dtype), t_bias.to(device=device, dtype=dtype)


def _explicit_attention(q, k, v, bias, is_causal, scale, enable_gqa):
    """(out, lse) of softmax attention written out, the bias an ordinary input of autograd and
    forward-mode AD; rows that see no key give out = 0, lse = -inf (no NaN)."""
    if enable_gqa:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * q @ k.mT + bias
    if is_causal:
        band = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~band, -math.inf)
    m = s.amax(-1, keepdim=True).detach()  # the softmax does not depend on the shift
    m = m.masked_fill(m == -math.inf, 0.0)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    safe = torch.where(total == 0, 1.0, total)
    lse = torch.where(total == 0, -math.inf, torch.log(safe) + m).squeeze(-1)
    return e / safe @ v, lse


def _math_path_attention(q, k, v, bias, is_causal, scale, enable_gqa):
    """PyTorch's SDPA math path in q's dtype, the bias cast to it (the floor)."""
    bias = bias.to(q.dtype)
    if is_causal:
        band = torch.ones(bias.shape[-2:], dtype=torch.bool, device=bias.device).tril()
        bias = bias.masked_fill(~band, -math.inf)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
                                              enable_gqa=enable_gqa)


def _bias_derivatives(attend, q, k, v, bias, tangents, t_bias, grad_out, grad_tangent_out,
                      wide: bool) -> dict[str, torch.Tensor]:
    """out (and lse), tangent_out (and mu) along (tangents, t_bias), and the gradients of
    <grad_out, out> (+ <grad_tangent_out, tangent_out>) w.r.t. q, k, v, the bias (and the
    tangents, the bias's tangent), from `attend(q, k, v, bias)` by torch.func.jvp and autograd.
    The bias and its tangent are first broadcast to their common shape (forward-mode AD
    needs a tangent of its primal's shape): the bias gradients have that shape."""
    def cast(x):
        return None if x is None else (x.double() if wide else x)

    if t_bias is not None:
        bias, t_bias = (x.contiguous() for x in torch.broadcast_tensors(bias, t_bias))
    wants_grad = grad_out is not None
    primals = [cast(x).detach().requires_grad_(wants_grad) for x in (q, k, v, bias)]
    inputs, results = list(primals), {}
    if tangents is None:
        outputs = attend(*primals)
    else:
        tans = [cast(x).detach().requires_grad_(wants_grad) for x in (*tangents, t_bias)]
        inputs += tans
        outputs, t_outputs = torch.func.jvp(attend, tuple(primals), tuple(tans))
    if isinstance(outputs, tuple):
        results.update(out=outputs[0], lse=outputs[1])
        if tangents is not None:
            results.update(tangent_out=t_outputs[0], mu=t_outputs[1])
    else:
        results["out"] = outputs
        if tangents is not None:
            results["tangent_out"] = t_outputs
    if wants_grad:
        outs, cotangents = [results["out"]], [cast(grad_out)]
        names = ("dq", "dk", "dv", "dmask")
        if grad_tangent_out is not None:
            outs.append(results["tangent_out"])
            cotangents.append(cast(grad_tangent_out))
            names += ("dtq", "dtk", "dtv", "dmask_tangent")
        grads = torch.autograd.grad(outs, inputs, cotangents, allow_unused=True)
        results.update((n, g) for n, g in zip(names, grads, strict=False) if g is not None)
    return {name: x.detach() for name, x in results.items()}


def expected_with_bias(p: Problem, bias: torch.Tensor, t_bias: torch.Tensor | None,
                       grad: bool = False, second_order: bool = False) -> tuple[dict, dict]:
    """(truth, floor) of attention on `p` with the additive mask `bias` (replacing
    p.attn_mask) and its tangent `t_bias`: out, lse, tangent_out, mu when not `grad`; the
    gradients (dq, dk, dv, dmask; with `second_order` also dtq, dtk, dtv, dmask_tangent) of
    the loss <dO, out> (+ <dtO, tangent_out>) when `grad`. The truth is the written-out
    softmax in float64; the floor PyTorch's math path in the inputs' dtype (for lse and mu,
    the written-out softmax in float32, as `expected_forward`)."""
    s = p.spec
    options = (s.causal, s.scale, s.hq != s.hkv)
    tangents = p.tangents if (second_order or not grad) else None
    grad_out = p.grad_out if grad else None
    grad_tangent_out = p.grad_tangent_out if second_order else None
    t_bias = t_bias if tangents is not None else None

    def run(fn, wide, q=p.q, k=p.k, v=p.v, tangents=tangents):
        return _bias_derivatives(lambda *x: fn(*x, *options), q, k, v, bias, tangents, t_bias,
                                 grad_out, grad_tangent_out, wide)

    truth = run(_explicit_attention, True)
    floor = run(_math_path_attention, False)
    if not grad:
        single = [x.float() for x in (p.q, p.k, p.v)]
        row_stats = run(_explicit_attention, False, *single,
                        tangents=tuple(x.float() for x in tangents))
        floor.update(lse=row_stats["lse"], mu=row_stats["mu"])
    else:
        truth.pop("out", None), floor.pop("out", None)
        truth.pop("tangent_out", None), floor.pop("tangent_out", None)
    return truth, floor


def kernel_with_bias(p: Problem, bias: torch.Tensor, t_bias: torch.Tensor | None,
                     grad: bool = False, second_order: bool = False, poison: float = math.nan,
                     precision: str | None = None) -> dict[str, torch.Tensor]:
    """The launchers on `p` with the additive mask `bias` and its tangent `t_bias`: the
    forward (out, lse, tangent_out, mu) when not `grad`; else the gradients with
    `mask_grad=True`, each mask gradient (in its mask's dtype) summed over the dimensions
    `bias` broadcasts over in that dtype (what autograd of `expand` does), so that it
    compares with the truth's, and returned in fp32."""
    s = p.spec
    options = {"attn_mask": bias, "is_causal": s.causal, "scale": s.scale,
               "precision": precision}
    tangents = p.tangents if (second_order or not grad) else None
    m_tangent = t_bias if tangents is not None else None
    if not grad:
        with poisoned_allocations(poison):
            result = flash_attention_forward(p.q, p.k, p.v, **options, tangents=tangents,
                                             mask_tangent=m_tangent)
        return {name: getattr(result, name) for name in FORWARD_NAMES}
    fwd, (out_res, t_out_res) = flash_attention_forward(
        p.q, p.k, p.v, **options, tangents=tangents, mask_tangent=m_tangent, residuals=True)
    second = {} if not second_order else {
        "tangents": tangents, "tangent_out": fwd.tangent_out, "mu": fwd.mu,
        "grad_tangent_out": p.grad_tangent_out, "tangent_out_residual": t_out_res}
    with poisoned_allocations(poison):
        grads = flash_attention_backward(p.q, p.k, p.v, fwd.out, fwd.lse, p.grad_out,
                                         **options, out_residual=out_res, **second,
                                         mask_tangent=m_tangent, mask_grad=True)
    names = (*SECOND_ORDER_NAMES, *MASK_GRAD_NAMES) if second_order else (*GRAD_NAMES, "dmask")
    results = dict(zip(names, grads, strict=True))
    shape = (bias.shape if m_tangent is None
             else torch.broadcast_shapes(bias.shape, m_tangent.shape))
    for name in MASK_GRAD_NAMES:
        if name in results:  # in its mask's dtype; summed there, as autograd does, then fp32
            mask = bias if name == "dmask" or m_tangent is None else m_tangent
            assert results[name].dtype == mask.dtype, (name, results[name].dtype, mask.dtype)
            results[name] = results[name].sum_to_size(shape).float()
    return results


def check_with_bias(spec: Spec, shape: str, dtype: torch.dtype, grad: bool = False,
                    second_order: bool = False, seed: int = 0, device: str = DEVICE,
                    mask_dtype: torch.dtype | None = None, empty_rows: bool = False,
                    tangent_shape: str | None = None) -> dict[str, torch.Tensor]:
    """The contract of a learnable additive mask on one problem: with `make_bias`'s mask of
    `shape` (in `mask_dtype`, by default the inputs') and its tangent, the forward's outputs
    (not `grad`), or the gradients including the mask's (`grad`; through the tangent with
    `second_order`), accurate against the float64 truth, and zero on rows that see no key.
    Returns the kernels' results (mask gradients summed to the mask's shape)."""
    p = make_problem(spec, dtype, seed, device)
    bias, t_bias = make_bias(spec, shape, mask_dtype or dtype, seed, device, empty_rows,
                             tangent_shape)
    p.attn_mask = bias
    truth, floor = expected_with_bias(p, bias, t_bias, grad, second_order)
    ours = kernel_with_bias(p, bias, t_bias, grad, second_order)
    what = ("second order" if second_order else "backward") if grad else "forward"
    cancellation = cancellation_scale(p, second_order) if grad else 0.0
    assert_accurate(ours, truth, floor, dtype, f"{p.label} bias {shape}",
                    f"{what} with a learnable mask", cancellation=cancellation)
    assert_empty_rows_are_zero(p, ours)
    return ours


# (spec, shape of the bias) for the learnable-mask tests of the launchers: a per-head bias
# shared by the batch, an (Nq, Nk) bias with causal, a bias per batch and head with GQA.
BIAS_CASES = [
    (Spec(hq=2, hkv=2, nq=17, nk=33, d=16), "head"),
    (Spec(batch=2, hq=2, hkv=2, nq=33, nk=17, d=16, causal=True), "2d"),
    (Spec(batch=2, hq=4, hkv=2, nq=40, nk=40, d=16, causal=True), "full"),
]
GPU_BIAS_CASES = [
    (Spec(batch=2, hq=8, hkv=2, nq=1000, nk=1000, d=64, causal=True), "head"),
    (Spec(batch=1, hq=4, hkv=4, nq=4250, nk=1000, d=128), "2d"),
    (Spec(batch=2, hq=4, hkv=4, nq=1000, nk=1100, d=64, dv=128), "full"),  # bf16 carries
]


def bias_params(cases=BIAS_CASES, dtypes=(torch.float32, torch.float16)) -> list:
    """pytest parameters (spec, bias shape, dtype) with readable ids."""
    return [pytest.param(spec, shape, dtype, id=f"{dtype_name(dtype)}-{spec.id}-bias_{shape}")
            for spec, shape in cases for dtype in dtypes]


# --- subprocesses that start several processes (torchrun, gloo, a Jupyter kernel) --------
# Failures of the machine rather than of the code under test: a port found free and then
# taken by another process before it was bound (torchrun's rendezvous, a Jupyter kernel's
# sockets), or gloo aborting in one of its C++ threads. Each was seen in CI on two cores.
MACHINE_FAILURES = ("Address already in use", "EADDRINUSE",
                    "terminate called without an active exception")


def run_with_one_retry(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)`,
    started once more if it failed with one of MACHINE_FAILURES; any other outcome, and a
    second failure, is returned as it is."""
    result = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    if result.returncode != 0 and any(word in result.stdout + result.stderr
                                      for word in MACHINE_FAILURES):
        result = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    return result


class CompiledStandIn:
    """A compiled kernel's stand-in for the launch tests: records its C launcher's calls."""

    function, packed_metadata = "function-handle", "packed-metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)
