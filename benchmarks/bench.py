#!/usr/bin/env python3
"""Speed and memory of jvp_attention against PyTorch and the JVP peers, saved as JSON.

One command runs every implementation on a grid of shapes and writes one JSON file:

    python benchmarks/bench.py                 # the full grid (GPU), ~6 minutes on an H200
    python benchmarks/bench.py --quick         # the four headline cases only
    python benchmarks/bench.py --smoke         # a tiny size; on CPU through Triton's interpreter
    python benchmarks/bench.py --list          # print the planned cases and exit
    python benchmarks/bench.py --rcm-kernel .peers/rcm/flash_attention_jvp_triton.py  # + rcm
    python benchmarks/bench.py --impl ours --carry-min-keys 0  # bf16 accurate: carry at every N

Implementations and modes (see benchmarks/README.md for what each times):

    ours       fwd, fwd_jvp, bwd, bwd2   jvp_attention's kernels, called directly
    ours_fast  fwd_jvp, bwd, bwd2        the same under set_precision("fast")
    sdpa       fwd, bwd                  torch SDPA, PyTorch's default backend choice
    sdpa_math  fwd_jvp, bwd2             torch SDPA's math backend under torch.func.jvp
    jfa        fwd_jvp, fwd, bwd         jvp-flash-attention 0.14 (PyPI), when importable
    rcm        fwd_jvp, bwd              NVlabs rcm's Triton JVP kernel, from --rcm-kernel PATH

Every case is timed with `triton.testing.do_bench` (median, with an L2 flush before each
call) on CUDA, or with a wall clock on CPU (plumbing only: the interpreter is no speed test).
Failures are recorded per case, never fatal; cases that cannot fit the memory or the wall
budget are recorded as skipped, with the reason. The JSON is rewritten after every case, so an
interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import hashlib
import importlib.abc
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads this when a kernel module is imported: set it before importing triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jvp_attention  # noqa: E402
from jvp_attention.backward import flash_attention_backward  # noqa: E402
from jvp_attention.forward import flash_attention_forward  # noqa: E402
from jvp_attention.reference import FORWARDS_PER_CALL, sdpa_flops  # noqa: E402

SCHEMA = "jvp_attention.bench/1"
RESULTS = REPO / "benchmarks" / "results"

IMPLS: dict[str, tuple[str, ...]] = {
    "ours": ("fwd", "fwd_jvp", "bwd", "bwd2"),
    "ours_fast": ("fwd_jvp", "bwd", "bwd2"),  # the plain forward never splits: no fwd
    "sdpa": ("fwd", "bwd"),
    "sdpa_math": ("fwd_jvp", "bwd2"),
    "jfa": ("fwd_jvp", "fwd", "bwd"),
    "rcm": ("fwd_jvp", "bwd"),  # only with --rcm-kernel: its kernel always computes the tangent
}
IMPL_LABELS = {
    "ours": "jvp_attention (this project): the Triton kernels, called directly, in the "
            "precision mode in effect (settings.precision; default \"accurate\": fp32 "
            "operands of 16-bit products split hi + lo)",
    "ours_fast": "jvp_attention's kernels under set_precision(\"fast\"): one 16-bit rounding "
                 "per product, as FlashAttention and SDPA do",
    "sdpa": "PyTorch SDPA, default backend selection (flash / cuDNN / memory-efficient)",
    "sdpa_math": "PyTorch SDPA math backend under torch.func.jvp (forward-mode AD)",
    "jfa": "jvp-flash-attention 0.14 (PyPI jvp_flash_attention), JVPAttn",
    "rcm": "NVlabs rcm's Triton FlashAttention-2 JVP kernel (rcm/utils/"
           "flash_attention_jvp_triton.py, loaded from --rcm-kernel; path and sha256 in "
           "settings.rcm_kernel): attention(q, k, v, tq, tk, tv) -> (out, tangent_out) for "
           "fwd_jvp; bwd is autograd through it, flash_attn's FlashAttention-2 backward of the "
           "output (the tangent output gets no gradient). Not causal",
}
MODES = ("fwd", "fwd_jvp", "bwd", "bwd2")
MODE_LABELS = {
    "fwd": "forward (primal output only)",
    "fwd_jvp": "forward and its JVP (output and tangent output)",
    "bwd": "backward of the output: dq, dk, dv, given the forward's saved state",
    "bwd2": "backward through output and tangent: dq, dk, dv, dtq, dtk, dtv",
}
# The FLOP convention is the library's (chapter 1, jvp_attention.reference): a call is credited
# MODE_FORWARDS[mode] forwards, one forward being sdpa_flops (QK^T and PV, 2*Nq*Nk*d FLOPs each
# per head, halved when causal). Every implementation of a mode is credited the same FLOPs, so
# TFLOP/s compares times; MODE_FORWARDS_WHY says why each multiple.
MODE_FORWARDS = FORWARDS_PER_CALL
MODE_FORWARDS_WHY = {
    "fwd": "QK^T and PV",
    "fwd_jvp": "six matrix products per tile instead of two",
    "bwd": "five products",
    "bwd2": "2.5 x 3, the backward of the fused forward+tangent pass",
}
# A training step's attention call (training_shapes.py, context_parallel.py) runs several of
# the modes above and is credited their sum.
STEP_MODES = {"meanflow": ("fwd_jvp", "bwd"), "second_order": ("fwd_jvp", "bwd2")}
# Priority inside one sequence length: when the wall budget runs short, what comes last is
# what is dropped.
PRIORITY = [("ours", "fwd"), ("sdpa", "fwd"), ("ours", "fwd_jvp"), ("ours_fast", "fwd_jvp"),
            ("sdpa_math", "fwd_jvp"), ("jfa", "fwd_jvp"), ("rcm", "fwd_jvp"), ("ours", "bwd"),
            ("ours_fast", "bwd"), ("sdpa", "bwd"), ("ours", "bwd2"), ("ours_fast", "bwd2"),
            ("sdpa_math", "bwd2"), ("jfa", "fwd"), ("jfa", "bwd"), ("rcm", "bwd")]

GRID_TOKENS = 16384  # B * N (B = 1 above 16k)
GRID_WIDTH = 2048  # H * d
GRID_N = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
GRID_D = (64, 128)
HEADLINE = ((4, 16, 4096, 128), (1, 16, 16384, 128))  # (B, H, N, d), causal and not
SMOKE_SHAPE = (1, 2, 64, 32)

# Memory the math path needs, in bytes per element of the (B, H, Nq, Nk) score matrix: it
# computes in fp32 and keeps ~5.5 such matrices for fwd_jvp (measured on an H200: 6.1 GB at B16 H16 N1k,
# 21.5 GB at B4 H16 N4k, 83 GB at B1 H16 N16k), and ~10 saved for backward plus the
# backward's own temporaries for bwd2 (counted with saved-tensor hooks on CPU).
MATH_BYTES_PER_SCORE = {"fwd_jvp": 22.0, "bwd2": 64.0}
JFA_HEAD_DIMS = (16, 32, 64, 128, 256)
RCM_HEAD_DIMS = (16, 32, 64, 128, 256)  # its forward asserts these
RCM_MODULE = "rcm_flash_attention_jvp_triton"  # the name its file is loaded under
RCM_ENTRY = "attention"  # _attention.apply(q, k, v, tq, tk, tv, sm_scale=None) -> (o, to)
# Imports the rcm file names at the top but only its backward uses: placeholders stand in
# for them when they are not installed, so its forward+JVP can be measured without them.
RCM_BACKWARD_IMPORTS = ("flash_attn", "einops")
FATAL_CUDA = ("illegal memory access", "unspecified launch failure", "device-side assert",
              "CUDA error: misaligned address", "an illegal instruction")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Skip(Exception):
    """A case that is not run; the message is the recorded reason."""


@dataclass(frozen=True)
class Case:
    impl: str
    mode: str
    B: int
    H: int
    N: int
    d: int
    causal: bool
    dtype: str
    tier: int = 1

    @property
    def key(self) -> tuple:
        return (self.impl, self.mode, self.B, self.H, self.N, self.d, self.causal, self.dtype)

    @property
    def flops(self) -> float:
        return case_flops(self.B, self.H, self.N, self.N, self.d, self.causal, self.mode)

    @property
    def scores(self) -> int:
        """Entries of the (B, H, N, N) score matrix: the work and the math path's memory."""
        return self.B * self.H * self.N * self.N

    def label(self) -> str:
        causal = "causal" if self.causal else "full"
        return (f"{self.impl:9} {self.mode:7} B{self.B} H{self.H} N{self.N} d{self.d} "
                f"{causal:6}")


def forwards(mode: str) -> float:
    """Forwards credited to one call of `mode` (MODE_FORWARDS, summed over STEP_MODES)."""
    return sum(MODE_FORWARDS[part] for part in STEP_MODES.get(mode, (mode,)))


def case_flops(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, causal: bool,
               mode: str) -> float:
    """Credited FLOPs of one call: forwards(mode) times sdpa_flops (value dim = head dim)."""
    return forwards(mode) * sdpa_flops(batch, heads, n_q, n_k, head_dim, head_dim, causal)


def flop_convention(modes: Iterable[str] = MODES) -> str:
    """The convention in words, for a record's flop_convention: generated from MODE_FORWARDS."""
    def why(mode: str) -> str:
        if mode not in STEP_MODES:
            return MODE_FORWARDS_WHY[mode]
        return " + ".join(f"{part} {MODE_FORWARDS[part]:g}x" for part in STEP_MODES[mode])

    credits = ", ".join(f"{mode} {forwards(mode):g}x ({why(mode)})" for mode in modes)
    return ("4*B*H*Nq*Nk*d FLOPs per forward (QK^T and PV, 2*Nq*Nk*d each; "
            "jvp_attention.reference.sdpa_flops), halved when causal; a call is credited a "
            f"multiple of it: {credits}. The same count is credited to every implementation of a "
            "mode, so TFLOP/s compare times.")


FLOP_CONVENTION = flop_convention()


# --------------------------------------------------------------------------- the grid
def parse_length(text: str) -> int:
    """'4096', '4k' or '4K' -> 4096."""
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def grid_shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    """(B, H, N, d) of the grid: B*N = 16k tokens (B >= 1), H*d = 2048."""
    if quick:
        return list(HEADLINE)
    return [(max(1, GRID_TOKENS // n), GRID_WIDTH // d, n, d) for d in GRID_D for n in GRID_N]


def plan(args: argparse.Namespace) -> list[Case]:
    """Every case to run, in running order: the headline shapes first (tier 0), then the rest
    by increasing N and, within one N, by PRIORITY, so a wall budget drops the costliest."""
    dtype = args.dtype
    if args.smoke:
        shapes = [SMOKE_SHAPE]
    else:
        shapes = grid_shapes(args.quick)
    shapes = [s for s in shapes if (args.n is None or s[2] in args.n)
              and (args.d is None or s[3] in args.d)]
    causals = [c for c in (False, True) if args.causal in ("both", str(int(c)))]
    pairs = [(impl, mode) for impl, mode in PRIORITY
             if (args.impl is None or impl in args.impl)
             and (args.mode is None or mode in args.mode)
             and (impl != "rcm" or args.rcm_kernel is not None)]
    cases = []
    for b, h, n, d in shapes:
        for causal in causals:
            tier = 0 if (b, h, n, d) in HEADLINE or args.smoke else 1
            cases += [Case(impl, mode, b, h, n, d, causal, dtype, tier) for impl, mode in pairs]
    rank = {pair: i for i, pair in enumerate(PRIORITY)}
    headline = {shape: i for i, shape in enumerate(HEADLINE)}
    return sorted(cases, key=lambda c: (
        c.tier,
        headline.get((c.B, c.H, c.N, c.d), 0) if c.tier == 0 else c.N,
        c.causal if c.tier == 0 else 0,
        rank[(c.impl, c.mode)],
        c.d,
        c.causal,
    ))


# --------------------------------------------------------------------------- implementations
def _randn(case: Case, device: str, count: int, requires_grad: bool = False):
    shape = (case.B, case.H, case.N, case.d)
    dtype = DTYPES[case.dtype]
    return [torch.randn(shape, device=device, dtype=dtype, requires_grad=requires_grad)
            for _ in range(count)]


def prepare_ours(case: Case, device: str) -> Callable[[], object]:
    q, k, v, tq, tk, tv, do, dto = _randn(case, device, 8)
    causal = case.causal
    if case.mode == "fwd":
        return lambda: flash_attention_forward(q, k, v, is_causal=causal)
    if case.mode == "fwd_jvp":
        return lambda: flash_attention_forward(q, k, v, is_causal=causal, tangents=(tq, tk, tv))
    if case.mode == "bwd":
        saved = flash_attention_forward(q, k, v, is_causal=causal)
        return lambda: flash_attention_backward(q, k, v, saved.out, saved.lse, do,
                                                is_causal=causal)
    saved = flash_attention_forward(q, k, v, is_causal=causal, tangents=(tq, tk, tv))
    return lambda: flash_attention_backward(
        q, k, v, saved.out, saved.lse, do, is_causal=causal, tangents=(tq, tk, tv),
        tangent_out=saved.tangent_out, mu=saved.mu, grad_tangent_out=dto)


precision_mode = jvp_attention.get_precision
precision = jvp_attention.precision


def prepare_ours_fast(case: Case, device: str) -> Callable[[], object]:
    """`prepare_ours` with the "fast" precision in effect for the set-up and each timed call."""
    with precision("fast"):
        fn = prepare_ours(case, device)

    def call() -> object:
        with precision("fast"):
            return fn()

    return call


def prepare_sdpa(case: Case, device: str) -> Callable[[], object]:
    causal = case.causal
    if case.mode == "fwd":
        q, k, v = _randn(case, device, 3)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    q, k, v = _randn(case, device, 3, requires_grad=True)
    (do,) = _randn(case, device, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)


def math_memory_estimate(case: Case) -> float:
    """Bytes the math path is expected to hold for this case."""
    return MATH_BYTES_PER_SCORE[case.mode] * case.scores


def prepare_sdpa_math(case: Case, device: str, limit_bytes: float) -> Callable[[], object]:
    need = math_memory_estimate(case)
    if device == "cuda" and need > limit_bytes:
        raise Skip(f"math path needs ~{need / 1e9:.0f} GB (O(N^2)), above the "
                   f"{limit_bytes / 1e9:.0f} GB limit (--math-limit-gb)")
    causal = case.causal

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def forward_and_jvp(primals, tangents):
        with sdpa_kernel(SDPBackend.MATH):
            return torch.func.jvp(attention, primals, tangents)

    if case.mode == "fwd_jvp":
        q, k, v, tq, tk, tv = _randn(case, device, 6)
        return lambda: forward_and_jvp((q, k, v), (tq, tk, tv))
    leaves = _randn(case, device, 6, requires_grad=True)
    do, dto = _randn(case, device, 2)
    out, tangent_out = forward_and_jvp(tuple(leaves[:3]), tuple(leaves[3:]))
    return lambda: torch.autograd.grad((out, tangent_out), leaves, (do, dto),
                                       retain_graph=True)


def jfa_module():
    """jvp_flash_attention's JVPAttn, or a Skip saying why it cannot be used."""
    try:
        from jvp_flash_attention.jvp_attention import JVPAttn
    except Exception as error:  # ImportError, or anything its import-time probing raises
        raise Skip(f"jvp_flash_attention not importable: {type(error).__name__}: "
                   f"{str(error)[:200]}") from None
    return JVPAttn


def prepare_jfa(case: Case, device: str) -> Callable[[], object]:
    JVPAttn = jfa_module()
    if case.N % 32 or case.N < 32:
        raise Skip(f"jvp-flash-attention needs N divisible by 32 and >= 32 (N={case.N})")
    if case.d not in JFA_HEAD_DIMS:
        raise Skip(f"jvp-flash-attention needs d in {JFA_HEAD_DIMS} (d={case.d})")
    causal = case.causal
    if case.mode == "fwd":
        q, k, v = _randn(case, device, 3)
        return lambda: JVPAttn.fwd(q, k, v, causal=causal)
    if case.mode == "fwd_jvp":
        q, k, v, tq, tk, tv = _randn(case, device, 6)

        def attention(q_, k_, v_):
            return JVPAttn.fwd_dual(q_, k_, v_, causal=causal)  # its README's JVP entry

        return lambda: torch.func.jvp(attention, (q, k, v), (tq, tk, tv))
    q, k, v = _randn(case, device, 3, requires_grad=True)
    (do,) = _randn(case, device, 1)
    out = JVPAttn.fwd(q, k, v, causal=causal)
    return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)


class Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for imports that a peer file names but only its backward uses.

    Asked last, so an installed module always wins; anything taken from a placeholder raises
    when called. `served` lists the top-level names it stood in for.
    """

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots
        self.served: list[str] = []

    def find_spec(self, fullname: str, path=None,
                  target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in self.roots:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        root = module.__name__.partition(".")[0]
        if root not in self.served:
            self.served.append(root)
        module.__getattr__ = functools.partial(missing_attribute, module.__name__)


def missing_attribute(module: str, name: str) -> Callable[..., object]:
    """A placeholder module's attribute `name`: a function that raises when called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs) -> None:
        raise RuntimeError(f"{module}.{name}: {module.partition('.')[0]} is not installed")

    return missing


@contextlib.contextmanager
def placeholders_for(roots: tuple[str, ...]) -> Iterator[Placeholders]:
    """Serve placeholders for missing `roots` inside the block only: afterwards other code
    importing them gets the usual ImportError."""
    finder = Placeholders(roots)
    sys.meta_path.append(finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.partition(".")[0] in finder.served]:
            if isinstance(getattr(sys.modules[name], "__loader__", None), Placeholders):
                del sys.modules[name]


@dataclass(frozen=True)
class PeerKernel:
    """A peer's kernel file, loaded from a path given on the command line."""

    path: Path
    sha256: str
    module: ModuleType
    placeholders: tuple[str, ...]  # missing imports that placeholders stood in for

    def settings(self) -> dict:
        """What the run record says about it: exactly which file was measured."""
        return {"path": str(self.path), "sha256": self.sha256, "module": self.module.__name__,
                "entry": f"{RCM_ENTRY}(q, k, v, tq, tk, tv) -> (out, tangent_out)",
                "placeholders": list(self.placeholders),
                "flash_attn": package_version("flash_attn")}


def cpu_autotune_bench(kernel_call: Callable[[], object], quantiles=None):
    """A benchmarker for Triton's autotuner on CPU, where Triton has none: one timed call."""
    t0 = time.perf_counter()
    kernel_call()
    ms = (time.perf_counter() - t0) * 1e3
    return ms if quantiles is None else [ms] * len(quantiles)


def autotuners(module: ModuleType) -> dict[str, object]:
    """The module's autotuned kernels, by attribute name."""
    from triton.runtime.autotuner import Autotuner

    return {attr: value for attr, value in vars(module).items() if isinstance(value, Autotuner)}


@functools.cache
def load_rcm(path: Path) -> PeerKernel:
    """rcm's flash_attention_jvp_triton.py from `path`, loaded as module RCM_MODULE."""
    path = path.resolve()
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    spec = importlib.util.spec_from_file_location(RCM_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[RCM_MODULE] = module
    try:
        with placeholders_for(RCM_BACKWARD_IMPORTS) as finder:
            spec.loader.exec_module(module)
        if not callable(getattr(module, RCM_ENTRY, None)):
            raise AttributeError(f"{path} has no function {RCM_ENTRY!r}")
    except BaseException:
        sys.modules.pop(RCM_MODULE, None)
        raise
    if not HAS_CUDA:  # Triton's own autotuning benchmarker needs a GPU
        for tuner in autotuners(module).values():
            tuner.do_bench = cpu_autotune_bench
    return PeerKernel(path, sha256, module, tuple(finder.served))


def prepare_rcm(case: Case, device: str, path: Path | None) -> Callable[[], object]:
    """rcm's kernel as its training code calls it: one call returns the output and tangent."""
    if path is None:
        raise Skip("no --rcm-kernel given")
    kernel = load_rcm(path)
    if case.causal:
        raise Skip("rcm's kernel has no causal mask")
    if case.d not in RCM_HEAD_DIMS:
        raise Skip(f"rcm's kernel needs d in {RCM_HEAD_DIMS} (d={case.d})")
    attention = getattr(kernel.module, RCM_ENTRY)
    if case.mode == "fwd_jvp":
        q, k, v, tq, tk, tv = _randn(case, device, 6)
        return lambda: attention(q, k, v, tq, tk, tv)
    if "flash_attn" in kernel.placeholders:
        raise Skip("rcm's backward is flash_attn's (FlashAttention-2): flash_attn not installed")
    q, k, v = _randn(case, device, 3, requires_grad=True)
    tq, tk, tv, do = _randn(case, device, 4)
    out, _ = attention(q, k, v, tq, tk, tv)
    return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)


def prepare(case: Case, device: str, args: argparse.Namespace) -> Callable[[], object]:
    """Allocate a case's inputs (and saved forward state) and return the call to time."""
    if case.impl == "ours":
        return prepare_ours(case, device)
    if case.impl == "ours_fast":
        return prepare_ours_fast(case, device)
    if case.impl == "sdpa":
        return prepare_sdpa(case, device)
    if case.impl == "sdpa_math":
        return prepare_sdpa_math(case, device, math_limit_bytes(args))
    if case.impl == "jfa":
        return prepare_jfa(case, device)
    if case.impl == "rcm":
        return prepare_rcm(case, device, args.rcm_kernel)
    raise ValueError(f"unknown implementation {case.impl!r}")


def math_limit_bytes(args: argparse.Namespace) -> float:
    limit = args.math_limit_gb * 1e9
    if HAS_CUDA:
        limit = min(limit, 0.9 * torch.cuda.get_device_properties(0).total_memory)
    return limit


# --------------------------------------------------------------------------- timing
def synchronize() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


def quick_autotune_bench(rep_ms: float):
    """A benchmarker for Triton's autotuner: one warm-up call (it compiles), then as many timed
    calls as fit in `rep_ms` (at least one). Triton's default (do_bench, 25 ms warm-up and
    100 ms of calls, never fewer than 8 calls) costs minutes per tile at N = 64k."""

    def bench(kernel_call, quantiles=None):
        kernel_call()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel_call()
        end.record()
        torch.cuda.synchronize()
        first = start.elapsed_time(end)
        times = [first]
        for _ in range(max(0, min(100, int(rep_ms / max(first, 1e-3))) - 1)):
            start.record()
            kernel_call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        if quantiles is None:
            return statistics.median(times)
        ordered = torch.tensor(times, dtype=torch.float64)
        return [torch.quantile(ordered, q).item() for q in quantiles]

    return bench


def use_quick_autotune(rep_ms: float) -> list[str]:
    """Give every autotuned kernel of jvp_attention (and of the rcm file, when loaded) the
    quick benchmarker; returns their names."""
    bench = quick_autotune_bench(rep_ms)
    patched = []
    for name, module in sorted(sys.modules.items()):
        if not (name.startswith("jvp_attention") or name == RCM_MODULE):
            continue
        for attr, tuner in autotuners(module).items():
            tuner.do_bench = bench  # the constructor's `do_bench` argument, set afterwards
            patched.append(f"{name}.{attr}")
    return patched


def bytes_to_mb(n: float) -> float:
    return round(n / 2**20, 3)


def measure(fn: Callable[[], object], args: argparse.Namespace) -> dict:
    """First (cold) call, one call for peak memory, then the median time of many calls."""
    record: dict = {}
    synchronize()
    t0 = time.perf_counter()
    result = fn()
    synchronize()
    record["first_call_ms"] = round((time.perf_counter() - t0) * 1e3, 4)
    del result
    if HAS_CUDA:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        record["peak_memory_mb"] = bytes_to_mb(torch.cuda.max_memory_allocated() - base)
        del result
        record["warmup_ms"], record["rep_ms"] = args.warmup_ms, args.rep_ms
        ms = triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms,
                                     return_mode="median")
    else:
        times = []
        for _ in range(args.cpu_reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        record["peak_memory_mb"] = None
        ms = statistics.median(times)
    record["median_ms"] = round(float(ms), 5)
    return record


def free_memory(collect: bool = True) -> None:
    """Return cached blocks to the driver (and, when `collect`, break reference cycles first:
    gc.collect() costs ~0.1 s, so it runs only after errors and the math path)."""
    if collect:
        gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


def cuda_is_broken() -> str | None:
    """The error text if the CUDA context cannot be used any more, else None."""
    if not HAS_CUDA:
        return None
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
    except Exception as error:  # noqa: BLE001 - any failure here means the context is gone
        return f"{type(error).__name__}: {error}"
    return None


def run_case(case: Case, device: str, args: argparse.Namespace) -> dict:
    """Run one case; never raises (errors and skips are recorded in the returned dict)."""
    record: dict = {"error": None, "skipped": None}
    fn = None
    t0 = time.perf_counter()
    try:
        base = torch.cuda.memory_allocated() if HAS_CUDA else 0
        fn = prepare(case, device, args)
        synchronize()
        record["setup_memory_mb"] = (bytes_to_mb(torch.cuda.memory_allocated() - base)
                                     if HAS_CUDA else None)
        record.update(measure(fn, args))
        record["tflops"] = float(f"{case.flops / (record['median_ms'] * 1e-3) / 1e12:.6g}")
    except Skip as reason:
        record["skipped"] = str(reason)
    except torch.OutOfMemoryError as error:
        record["error"] = f"OutOfMemoryError: {str(error).splitlines()[0][:300]}"
    except Exception as error:  # noqa: BLE001 - recorded per case, the run goes on
        record["error"] = f"{type(error).__name__}: {str(error)[:1000]}"
    finally:
        fn = None
        held = (record.get("setup_memory_mb") or 0) + (record.get("peak_memory_mb") or 0)
        if record["error"] or case.impl == "sdpa_math" or held > 2048:
            free_memory(collect=bool(record["error"]) or case.impl == "sdpa_math")
    record["wall_s"] = round(time.perf_counter() - t0, 3)
    return record


# --------------------------------------------------------------------------- bookkeeping
def git_info() -> dict:
    def git(*cmd):
        out = subprocess.run(["git", "-C", str(REPO), *cmd], capture_output=True, text=True,
                             timeout=10, check=True)
        return out.stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except Exception:  # noqa: BLE001 - no git, or not a repository (a copied tree)
        return {"commit": os.environ.get("GIT_COMMIT"), "dirty": None}


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def device_info() -> dict:
    if not HAS_CUDA:
        return {"name": f"CPU ({platform.processor() or platform.machine()}), Triton "
                        "interpreter", "cuda": False}
    props = torch.cuda.get_device_properties(0)
    info = {"name": torch.cuda.get_device_name(0), "cuda": True,
            "capability": list(torch.cuda.get_device_capability(0)),
            "memory_gb": round(props.total_memory / 1e9, 1), "cuda_version": torch.version.cuda,
            "count": torch.cuda.device_count()}
    with contextlib.suppress(Exception):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True)
        info["driver"] = smi.stdout.strip().splitlines()[0]
    return info


def command_line() -> list[str]:
    """sys.argv with paths inside the repository relative to it: the results file names the
    command to run from a checkout, not the folder or the interpreter it ran from."""
    def relative(arg: str) -> str:
        path = Path(arg)
        return str(path.relative_to(REPO)) if path.is_absolute() and path.is_relative_to(REPO) \
            else arg
    return [relative(arg) for arg in sys.argv]


def run_record(schema: str, smoke: bool) -> dict:
    """What every results file opens with: its schema, when, the command, the machine, the
    versions and the commit."""
    device = device_info()
    return {
        "schema": schema,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *command_line()]),
        "argv": command_line(),
        "gpu": device["name"],
        "device": device,
        "smoke": bool(smoke),
        "interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "jvp_attention": getattr(jvp_attention, "__version__", None),
            "jvp_flash_attention": package_version("jvp_flash_attention"),
            "numpy": package_version("numpy"),
        },
        "git": git_info(),
    }


def header(args: argparse.Namespace) -> dict:
    sdpa_flags = {}
    if HAS_CUDA:
        b = torch.backends.cuda
        sdpa_flags = {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
                      "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled()}
    return {
        **run_record(SCHEMA, args.smoke),
        "settings": {
            "dtype": args.dtype, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "cpu_reps": args.cpu_reps, "max_seconds": args.max_seconds,
            "math_limit_gb": args.math_limit_gb, "autotune_rep_ms": args.autotune_rep_ms,
            "timer": ("triton.testing.do_bench(return_mode='median'), L2 flushed per call"
                      if HAS_CUDA else "time.perf_counter median (CPU plumbing check)"),
            "sdpa_backends_enabled": sdpa_flags,
            "precision": {"ours": precision_mode(), "ours_fast": "fast"},
            "carry_min_keys": jvp_attention.launch.CARRY_MIN_KEYS,
            "rcm_kernel": load_rcm(args.rcm_kernel).settings() if args.rcm_kernel else None,
        },
        "flop_convention": FLOP_CONVENTION,
        "impls": IMPL_LABELS,
        "modes": MODE_LABELS,
        "memory_note": ("peak_memory_mb: torch.cuda.max_memory_allocated() over one warm call, "
                        "minus what was allocated before it (outputs and workspace); "
                        "setup_memory_mb: the inputs and saved forward state the case holds "
                        "(for bwd2 of the math path this is its O(N^2) autograd graph)."),
        "cold_start_note": ("first_call_ms: the first call of a case, which pays Triton's "
                            "compilation (once per kernel specialisation) and autotuning (once "
                            "per shape key) for our kernels, compilation for "
                            "jvp-flash-attention, library set-up for SDPA. Not part of "
                            "median_ms. The precision is not an autotuning key: ours_fast "
                            "reuses the tile ours tuned at the same shape when ours ran "
                            "first, and pays compilation only."),
        "cases": [],
    }


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def default_out(args: argparse.Namespace) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    if args.smoke:  # plumbing numbers do not belong with the saved results
        return Path(tempfile.gettempdir()) / f"jvp_attention_bench_smoke_{stamp}.json"
    name = torch.cuda.get_device_name(0) if HAS_CUDA else "cpu"
    slug = "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")
    kind = "quick" if args.quick else "grid"
    return RESULTS / f"{slug}_{kind}_{stamp}.json"


def outside_plan(resumed: dict[tuple, dict], planned: Iterable[tuple]) -> list[dict]:
    """The resumed cases that this run does not plan (another selection of shapes, modes or
    implementations): written first, as they were, so that resuming into the same file with
    a narrower selection adds to it instead of dropping the rest."""
    keys = set(planned)
    return [record for key, record in resumed.items() if key not in keys]


def load_resume(paths: list[Path] | None) -> dict[tuple, dict]:
    """Measured (or failed) cases of earlier runs, by key (a later file wins a key both
    have); budget skips are run again."""
    done = {}
    for path in paths or []:
        old = json.loads(path.read_text())
        for rec in old.get("cases", []):
            if rec.get("median_ms") is not None or rec.get("error") or (
                    rec.get("skipped") and not rec["skipped"].startswith("wall budget")):
                key = (rec["impl"], rec["mode"], rec["B"], rec["H"], rec["N"], rec["d"],
                       rec["causal"], rec["dtype"])
                done[key] = {**rec, "resumed_from": rec.get("resumed_from", str(path))}
    return done


def predicted_seconds(case: Case, history: dict[tuple, tuple[int, float]]) -> float:
    """The wall time a case should take, scaled from the last case of the same series (impl,
    mode, d, causal) by the work ratio; twice the warm part, to leave room for autotuning."""
    last = history.get((case.impl, case.mode, case.d, case.causal))
    if last is None:
        return 0.0
    scores, warm_seconds = last
    return 2.0 * warm_seconds * case.scores / scores


def print_cold_starts(cases: list[dict]) -> None:
    """First-call times (compile + autotune) per implementation, mode and shape."""
    rows: dict[tuple, dict[int, float]] = {}
    lengths = sorted({c["N"] for c in cases if c.get("first_call_ms") is not None})
    for c in cases:
        if c.get("first_call_ms") is not None:
            key = (c["impl"], c["mode"], c["d"], c["causal"])
            rows.setdefault(key, {})[c["N"]] = c["first_call_ms"] / 1e3
    if not rows:
        return
    print("\nCold start: first call per case, seconds (compilation + autotuning, not in the "
          "medians)", flush=True)
    print(f"{'impl':10} {'mode':8} {'d':>4} {'causal':6} " + " ".join(f"{n:>7}" for n in lengths))
    for (impl, mode, d, causal), by_n in sorted(rows.items(), key=lambda kv: (
            PRIORITY.index(kv[0][:2]) if kv[0][:2] in PRIORITY else 99, kv[0][2:])):
        cells = " ".join(f"{by_n[n]:7.2f}" if n in by_n else f"{'-':>7}" for n in lengths)
        print(f"{impl:10} {mode:8} {d:>4} {str(causal):6} {cells}", flush=True)


# --------------------------------------------------------------------------- main
def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="only the headline shapes B4 H16 N4096 d128 and B1 H16 N16384 d128")
    parser.add_argument("--smoke", action="store_true",
                        help=f"one tiny shape {SMOKE_SHAPE} (B, H, N, d), causal and not; on CPU "
                             "it checks the plumbing through Triton's interpreter")
    parser.add_argument("--list", action="store_true", help="print the planned cases and exit")
    parser.add_argument("--impl", nargs="+", choices=list(IMPLS), help="only these implementations")
    parser.add_argument("--mode", nargs="+", choices=MODES, help="only these modes")
    parser.add_argument("--n", nargs="+", type=parse_length, help="only these N (e.g. 4096 16k)")
    parser.add_argument("--d", nargs="+", type=int, help="only these head dims")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="default bf16 on CUDA, fp32 on CPU (the interpreter's bf16 dot "
                             "is wrong)")
    parser.add_argument("--out", type=Path, help="the JSON file to write (default: "
                        "benchmarks/results/<gpu>_<grid|quick>_<date>.json; smoke: a temp file)")
    parser.add_argument("--max-seconds", type=float, default=330.0,
                        help="wall budget from start: no case is started that would end past it "
                             "(predicted from the previous N); skipped cases are recorded. "
                             "0 or less: no limit")
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up, ms")
    parser.add_argument("--rep-ms", type=float, default=100.0,
                        help="do_bench repetition window, ms (at least one call: large N get "
                             "fewer repetitions)")
    parser.add_argument("--cpu-reps", type=int, default=2, help="timed calls per case on CPU")
    parser.add_argument("--math-limit-gb", type=float, default=100.0,
                        help="skip the math path above this memory estimate")
    parser.add_argument("--autotune-rep-ms", type=float, default=20.0,
                        help="time each tile of our autotuned kernels for this long (one warm "
                             "call, then >= 1 timed); 0 keeps each autotuner's own (the library's: "
                             "jvp_attention.launch.time_candidate)")
    parser.add_argument("--rcm-kernel", type=Path, metavar="PATH",
                        help="NVlabs rcm's rcm/utils/flash_attention_jvp_triton.py: adds the "
                             "rcm column, loading that file at run time (never committed: "
                             "benchmarks/README.md says how to get it)")
    parser.add_argument("--carry-min-keys", type=int, metavar="N",
                        help="bf16 in the accurate precision: carry exact fp16 copies from N "
                             "keys per row and split below (the library's CARRY_MIN_KEYS, "
                             "default 1024); 0 carries at every length, a huge N never: two "
                             "runs locate the crossover")
    parser.add_argument("--resume", type=Path, nargs="+",
                        help="copy cases already measured in these earlier results files (a "
                             "later file wins; those outside this selection too); run only "
                             "the rest")
    args = parser.parse_args(argv)
    if args.rcm_kernel is not None:
        if not args.rcm_kernel.is_file():
            parser.error(f"--rcm-kernel {args.rcm_kernel}: no such file")
        args.rcm_kernel = args.rcm_kernel.resolve()
    elif args.impl and "rcm" in args.impl:
        parser.error("--impl rcm needs --rcm-kernel PATH")
    if args.dtype is None:
        args.dtype = "bf16" if HAS_CUDA else "fp32"
    if args.max_seconds is not None and args.max_seconds <= 0:
        args.max_seconds = None
    return args


def main(argv: Iterable[str] | None = None) -> dict:
    start = time.perf_counter()  # the wall budget counts from here, not from the import
    args = parse_args(argv)
    cases = plan(args)
    if args.list:
        for i, case in enumerate(cases, 1):
            print(f"{i:4} tier {case.tier} {case.label()} {case.flops / 1e12:9.3f} TFLOP")
        return {}
    if not args.smoke and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--smoke runs a tiny case on the CPU")
    device = "cuda" if HAS_CUDA else "cpu"
    if HAS_CUDA:  # initialise the context and cuBLAS before anything is timed
        x = torch.randn(256, 256, device=device)
        (x @ x).sum().item()
    out_path = args.out or default_out(args)
    if args.rcm_kernel is not None:
        try:
            load_rcm(args.rcm_kernel)
        except Exception as error:
            raise SystemExit(f"--rcm-kernel {args.rcm_kernel}: cannot load it: "
                             f"{type(error).__name__}: {error}") from error
    if args.carry_min_keys is not None:
        jvp_attention.launch.CARRY_MIN_KEYS = args.carry_min_keys
    data = header(args)
    if HAS_CUDA and args.autotune_rep_ms > 0:
        data["settings"]["quick_autotune"] = use_quick_autotune(args.autotune_rep_ms)
    resumed = load_resume(args.resume)
    data["cases"] = outside_plan(resumed, (case.key for case in cases))
    if data["cases"]:
        print(f"{len(data['cases'])} resumed cases outside this selection: kept", flush=True)
    print(f"jvp_attention bench: {data['gpu']} | torch {torch.__version__} | triton "
          f"{triton.__version__} | jvp_attention {data['versions']['jvp_attention']} | "
          f"jvp_flash_attention {data['versions']['jvp_flash_attention']} | {rcm_note(data)}"
          f"{len(cases)} cases | budget {args.max_seconds} s | -> {out_path}", flush=True)
    history: dict[tuple, tuple[int, float]] = {}
    broken = None
    for i, case in enumerate(cases, 1):
        elapsed = time.perf_counter() - start
        base = {**asdict(case), "flops": case.flops}
        if case.key in resumed:
            record = {**base, **resumed[case.key]}
        elif broken is not None:
            record = {**base, "error": None, "skipped": f"CUDA context lost earlier: {broken}"}
        else:
            guess = predicted_seconds(case, history)
            if args.max_seconds is not None and elapsed + guess > args.max_seconds:
                record = {**base, "error": None, "skipped": (
                    f"wall budget: {elapsed:.0f} s elapsed, ~{guess:.0f} s predicted, "
                    f"--max-seconds {args.max_seconds:.0f}")}
            else:
                record = {**base, **run_case(case, device, args)}
                if record.get("median_ms") is not None:
                    warm = record["wall_s"] - record["first_call_ms"] / 1e3
                    history[(case.impl, case.mode, case.d, case.causal)] = (case.scores, warm)
                if record["error"] and (HAS_CUDA and (
                        any(s in record["error"] for s in FATAL_CUDA) or cuda_is_broken())):
                    broken = record["error"][:200]
        data["cases"].append(record)
        data["wall_seconds"] = round(time.perf_counter() - start, 2)
        write_json(out_path, data)
        print(f"[{i:3}/{len(cases)} {time.perf_counter() - start:6.1f}s] {case.label()} "
              f"{describe(record)}", flush=True)
    data["complete"] = all(c.get("median_ms") is not None or c.get("error")
                           or (c.get("skipped") and not c["skipped"].startswith("wall budget"))
                           for c in data["cases"])
    data["wall_seconds"] = round(time.perf_counter() - start, 2)
    write_json(out_path, data)
    print_cold_starts(data["cases"])
    measured = sum(c.get("median_ms") is not None for c in data["cases"])
    errors = sum(bool(c.get("error")) for c in data["cases"])
    skipped = sum(bool(c.get("skipped")) for c in data["cases"])
    print(f"\n{measured} measured, {errors} errors, {skipped} skipped in "
          f"{data['wall_seconds']:.0f} s -> {out_path}", flush=True)
    return data


def rcm_note(data: dict) -> str:
    """The banner's word on the rcm file: its sha256's head and what stood in for its imports."""
    rcm = data["settings"]["rcm_kernel"]
    if rcm is None:
        return ""
    missing = f", placeholders for {', '.join(rcm['placeholders'])}" if rcm["placeholders"] else ""
    return f"rcm {rcm['sha256'][:12]}{missing} | "


def describe(record: dict) -> str:
    if record.get("skipped"):
        return f"skipped: {record['skipped']}"
    if record.get("error"):
        return f"ERROR {record['error'][:160]}"
    memory = record.get("peak_memory_mb")
    memory = f"peak {memory:9.1f} MB" if memory is not None else ""
    return (f"{record['median_ms']:10.3f} ms {record['tflops']:8.2f} TFLOP/s {memory} "
            f"first {record['first_call_ms'] / 1e3:6.2f} s"
            + (" (resumed)" if record.get("resumed_from") else ""))


if __name__ == "__main__":
    main()
    sys.exit(0)
