#!/usr/bin/env python3
"""The calls users make at DiT training shapes: forward+JVP, MeanFlow's step and the
second-order step, eager, compiled and under CUDA graphs, against PyTorch's math path and
jvp-flash-attention. Saved as JSON.

    python benchmarks/training_shapes.py --out benchmarks/results/training_shapes_h200.json
    python benchmarks/training_shapes.py --smoke   # CPU: tiny shapes through Triton's interpreter
    python benchmarks/training_shapes.py --list    # print the planned cases and exit

Modes (one training step's attention call; see MODE_LABELS):

    fwd_jvp       out, t_out = torch.func.jvp(attention, (q, k, v), (tq, tk, tv))
    meanflow      the same, then out.backward(grad): the loss sees the tangent only through a
                  stop-gradient (MeanFlow, sCM), so only the primal output is differentiated
    second_order  the same, then a backward through both outputs (grads of q, k, v, tq, tk, tv)

Implementations (columns; see IMPL_LABELS): ours (eager jvp_attention.attention, in the
default "accurate" precision), ours_fast (the same in "fast" precision), ours_compiled
(torch.compile, default mode), ours_cudagraphs (mode="reduce-overhead"), math
(SDPA's math backend under torch.func.jvp), jfa (jvp-flash-attention 0.14, when installed),
floor (`v.clone()` in place of attention: PyTorch's own cost of the same calls, which no
attention called this way can go below; `settings.floor_op` in the JSON), floor_compiled
(the floor under torch.compile, default mode: what a compiled call costs with no attention
in it).

Per case: GPU time, wall time and host time per call, kernels per call, TFLOP/s, peak memory
beyond the inputs, first-call (compile) time; the definitions are written into the JSON's
`definitions`. A case that fails is recorded with its error and the run goes on; the JSON is
rewritten after every case, and `--resume OLD.json` finishes a cut run.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path


def use_fresh_inductor_cache() -> None:
    """A fresh Inductor cache for this run (unless TORCHINDUCTOR_CACHE_DIR is set), so that
    compile_s is a cold compile in this process, not a hit in a cache an earlier run left on
    the machine. Inductor reads the variable when it first compiles."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        cache = tempfile.mkdtemp(prefix="jvp_training_shapes_inductor_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        atexit.register(shutil.rmtree, cache, ignore_errors=True)


if __name__ == "__main__":
    use_fresh_inductor_cache()

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads this when a kernel module is imported: set it before importing triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(REPO), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import bench  # noqa: E402  (benchmarks/bench.py: device, versions, git, jfa, autotuning)

import jvp_attention  # noqa: E402
import jvp_attention.backward  # noqa: E402

SCHEMA = "jvp_attention.training_shapes/1"
Skip = bench.Skip

# name: (B, H, N, d) -- bf16, no mask, not causal (DiT attends over all patches).
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "dit-b2-256": (64, 12, 256, 64),
    "dit-xl2-256": (32, 16, 256, 72),
    "dit-xl2-512": (16, 16, 1024, 72),
    "dit-b2-512": (32, 12, 1024, 64),
    "n1k-d128": (16, 16, 1024, 128),
    "video-32k": (1, 12, 32760, 128),
}
SHAPE_LABELS = {
    "dit-b2-256": "DiT-B/2 at 256 px: 16x16 latent patches, 12 heads of 64, batch 64",
    "dit-xl2-256": "DiT-XL/2 at 256 px: 256 tokens, 16 heads of 72, batch 32",
    "dit-xl2-512": "DiT-XL/2 at 512 px: 1024 tokens, 16 heads of 72, batch 16",
    "dit-b2-512": "DiT-B/2 at 512 px: 1024 tokens, 12 heads of 64, batch 32",
    "n1k-d128": "1024 tokens, 16 heads of 128, batch 16 (the d=128 kernels at DiT length)",
    "video-32k": "video DiT: 32760 tokens (e.g. 21 latent frames x 1560), 12 heads of 128",
}
# Tiny shapes for --smoke (the interpreter runs every program in Python).
SMOKE_SHAPES = {"smoke": (1, 1, 16, 16)}

MODES = ("fwd_jvp", "meanflow", "second_order")
MODE_LABELS = {
    "fwd_jvp": "out, t_out = torch.func.jvp(attention, (q, k, v), (tq, tk, tv)); inputs do "
               "not require grad",
    "meanflow": "fwd_jvp with q, k, v requiring grad, then out.backward(grad): the backward "
                "through the primal output only (the loss uses t_out through a stop-gradient, "
                "as MeanFlow and sCM do); grads of q, k, v",
    "second_order": "fwd_jvp with q, k, v, tq, tk, tv requiring grad, then "
                    "torch.autograd.backward((out, t_out), (grad, t_grad)): the backward "
                    "through both outputs; grads of all six",
}
IMPLS = ("ours", "ours_fast", "ours_compiled", "ours_cudagraphs", "math", "jfa", "floor",
         "floor_compiled")
IMPL_LABELS = {
    "ours": "jvp_attention.attention under torch.func.jvp, eager, in the precision mode in "
            "effect (settings.precision; by default \"accurate\")",
    "ours_fast": "the same inside jvp_attention.precision(\"fast\") (one 16-bit rounding per "
                 "product, as FlashAttention does; the backward runs in its forward's mode), "
                 "eager: with ours, what accurate precision costs at these shapes",
    "ours_compiled": "the same forward+JVP function under torch.compile (default mode, "
                     "dynamic=False, Dynamo reset per case); the backward is AOTAutograd's "
                     "compiled backward, run by .backward() as in a compiled training step",
    "ours_cudagraphs": "the same under torch.compile(mode=\"reduce-overhead\") (Inductor's "
                       "CUDA graph trees), torch.compiler.cudagraph_mark_step_begin() before "
                       "each step; the call's inputs and incoming gradients marked static "
                       "(torch._dynamo.mark_static_address), so that a replay copies none of "
                       "them, as inside a model's graph",
    "math": "F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.MATH) and "
            "torch.func.jvp (what forward-mode AD through SDPA runs), eager",
    "jfa": "jvp-flash-attention 0.14 (PyPI jvp_flash_attention): JVPAttn.fwd_dual under "
           "torch.func.jvp (its README's JVP entry point), eager",
    "floor": "v.clone() in place of attention, eager, under the same torch.func.jvp and "
             "backward: PyTorch's own cost per call of the transform, its dual tensors and the "
             "autograd engine, with one copy where attention's kernels would be. The floor of "
             "any attention called this way; no FLOPs are credited (tflops None). Files "
             "without settings.floor_op timed v * 1, whose tangent meets a zero tangent for "
             "the number (chapter 13: about 0.1 to 0.3 ms more host time per call)",
    "floor_compiled": "the floor's function under torch.compile (default mode, as "
                      "ours_compiled): the host time of a compiled call and its compiled "
                      "backward with no attention in them, against which ours_compiled's is "
                      "read; no FLOPs are credited",
}
COMPILE_MODES = {"ours_compiled": "default", "ours_cudagraphs": "reduce-overhead",
                 "floor_compiled": "default"}
# The columns with a copy of v in place of attention: no FLOPs to credit. Not `v * 1`: the
# number has no tangent, and the zero tangent PyTorch stands in for it costs more host time
# than the rest of the call (chapter 13).
FLOOR_IMPLS = ("floor", "floor_compiled")
FLOOR_OP = "v.clone()"
# The math path's memory per entry of the (B, H, N, N) score matrix (fp32 scores):
# bench.py's measured 22 bytes for the forward+JVP; the backward modes hold the autograd graph
# of the forward+JVP (and the backward's temporaries): bench.py's 64 for its bwd2, used as an
# upper bound for meanflow too.
MATH_BYTES_PER_SCORE = {"fwd_jvp": bench.MATH_BYTES_PER_SCORE["fwd_jvp"],
                        "meanflow": bench.MATH_BYTES_PER_SCORE["bwd2"],
                        "second_order": bench.MATH_BYTES_PER_SCORE["bwd2"]}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAUNCH_API = re.compile(r"^(cuda|cu)(LaunchKernel|LaunchKernelEx|LaunchKernelExC|"
                        r"LaunchCooperativeKernel|GraphLaunch)(_v\d+)?$")

# Every case carries these fields (None where not measured; the reason in `notes`).
CASE_FIELDS = (
    "shape", "impl", "mode", "B", "H", "N", "d", "dtype", "causal", "flops",
    "status", "error", "skipped", "notes",
    "first_call_s", "compile_s", "warmup_step_ms",
    "gpu_ms", "wall_ms", "host_ms", "host_overlapped", "tflops", "tflops_wall",
    "kernels_per_call", "memcpy_memset_per_call", "launch_api_calls_per_call", "kernel_names",
    "kernel_ms", "setup_memory_mb", "peak_memory_mb", "peak_reserved_mb",
    "reps", "case_wall_s",
)

DEFINITIONS = {
    "gpu_ms": "device time per call: CUDA events recorded before and after N back-to-back "
              "steps, divided by N, median of --groups groups, after warm-up. Each group is "
              "enqueued behind a torch.cuda._sleep long enough to cover the host's enqueueing "
              "of the N steps, so the GPU runs them back to back and launch gaps are not "
              "counted (when host_overlapped is false the sleep did not cover them). "
              "null on CPU.",
    "wall_ms": "what a training loop sees per call: time.perf_counter around N back-to-back "
               "steps followed by torch.cuda.synchronize(), divided by N, median of --groups "
               "groups (about max(host, GPU) per call when they overlap). On CPU, the same "
               "without synchronize (the interpreter: plumbing, not speed).",
    "host_ms": "host (CPU) time per call, the time for the Python step to return while the "
               "GPU is not the bottleneck: time.perf_counter around the N steps of a gpu_ms "
               "group, divided by N, measured while the GPU is still busy with the "
               "torch.cuda._sleep kernel enqueued just before them (so no call waits for the "
               "GPU). Median of --groups groups. "
               "Includes everything the step does in Python and in the CUDA driver: autograd "
               "bookkeeping, Dynamo guards, kernel launches, a CUDA graph replay. "
               "host_overlapped: true when, in every group, the sleep was still running when "
               "the last call returned (the sleep doubles and the group is retried up to 4 "
               "times otherwise); false means a call blocked on the GPU (a synchronisation "
               "inside the step, or a full launch queue) and host_ms then includes GPU time. "
               "null on CPU.",
    "kernels_per_call": "CUDA kernels one warm step runs: torch.profiler.profile("
                        "activities=[ProfilerActivity.CUDA]) around one step (synchronised), "
                        "counting the profiler's device-side events of activity type "
                        "\"kernel\" (kineto's; device_type CUDA where the profiler gives no "
                        "type), i.e. excluding memcpy and memset (counted in "
                        "memcpy_memset_per_call) and synchronisation records. Kernels replayed from a CUDA graph count "
                        "one each. kernel_names: those kernels' names (80 characters) with "
                        "their counts. kernel_ms: the GPU time of each of those kernels in "
                        "that one profiled step (ms, summed over its launches; a split of the "
                        "call, gpu_ms is the timing). null on CPU (no CUDA profiler).",
    "launch_api_calls_per_call": "host-side CUDA runtime/driver launch calls the profiler "
                                 "recorded in the same step (cudaLaunchKernel, "
                                 "cuLaunchKernel(Ex), cudaGraphLaunch, ...): one per launch, "
                                 "one per graph replay. null when the profiler reported none "
                                 "(some versions record no driver-API calls, which Triton "
                                 "uses): read kernels_per_call then.",
    "tflops": "credited FLOPs (flop_convention) / gpu_ms; tflops_wall: the same / wall_ms. "
              "On CPU tflops uses wall_ms.",
    "peak_memory_mb": "torch.cuda.max_memory_allocated() during one warm step minus the "
                      "memory allocated before it (the inputs q, k, v, tq, tk, tv and the "
                      "output gradients; the previous step's .grad set to None): outputs, "
                      "saved state, gradients and workspace. Under CUDA graphs the graph's "
                      "private pool is allocated at capture, so a replay shows little here: "
                      "read peak_reserved_mb.",
    "peak_reserved_mb": "torch.cuda.max_memory_reserved() over the whole case (warm-up, "
                        "capture, steps) minus the memory reserved right after the inputs "
                        "were made (the cache is emptied before each case): what the case "
                        "made PyTorch hold from the driver, CUDA graph pools included.",
    "setup_memory_mb": "the inputs and output gradients the case allocates before its first "
                       "step.",
    "first_call_s": "wall time of the first step (synchronised): Triton compilation and "
                    "autotuning of our kernels (once per shape and mode) for ours, "
                    "torch.compile's tracing and compilation for the compiled columns (see "
                    "compile_s), set-up and library compilation for the rest.",
    "compile_s": "compiled columns only: first_call_s, the step in which Dynamo traces and "
                 "Inductor compiles the forward and (at the first .backward()) the backward, "
                 "in a fresh Inductor cache (settings.inductor_cache_dir) and after "
                 "torch._dynamo.reset(). One uncompiled step runs just before it (its wall "
                 "time in eager_warmup_s), so Triton's compilation and autotuning of our "
                 "kernels are not in compile_s. warmup_step_ms lists every warm-up step's wall time: "
                 "under CUDA graphs the next steps record the graphs before replays begin.",
    "reps": "steps per group and groups for wall_ms and for gpu_ms/host_ms.",
    "status": "ok (measured), error (the exception, in `error`; the run goes on), or skipped "
              "(the reason, in `skipped`: not supported, over the memory limit, the wall "
              "budget, no CUDA).",
}


@dataclass(frozen=True)
class Case:
    shape: str
    impl: str
    mode: str
    B: int
    H: int
    N: int
    d: int
    dtype: str
    causal: bool = False

    @property
    def key(self) -> tuple:
        return (self.shape, self.impl, self.mode, self.B, self.H, self.N, self.d, self.dtype)

    @property
    def flops(self) -> float:
        """Credited FLOPs (bench.py's convention: MODE_FORWARDS and STEP_MODES)."""
        return bench.case_flops(self.B, self.H, self.N, self.N, self.d, self.causal, self.mode)

    @property
    def scores(self) -> int:
        return self.B * self.H * self.N * self.N

    def label(self) -> str:
        return (f"{self.shape:11} {self.impl:15} {self.mode:12} B{self.B} H{self.H} N{self.N} "
                f"d{self.d}")


def plan(args: argparse.Namespace) -> list[Case]:
    """Every case in running order: shape by shape; within a shape, implementation by
    implementation (ours first: it autotunes the kernels the compiled columns reuse), and the
    three modes of each."""
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    cases = []
    for name, (b, h, n, d) in shapes.items():
        if args.shape and name not in args.shape and not args.smoke:
            continue
        for impl in IMPLS:
            if args.impl and impl not in args.impl:
                continue
            for mode in MODES:
                if args.mode and mode not in args.mode:
                    continue
                cases.append(Case(name, impl, mode, b, h, n, d, args.dtype))
    return cases


# --------------------------------------------------------------------------- the step
def math_memory_estimate(case: Case) -> float:
    """Bytes the math path is expected to hold for this case."""
    return MATH_BYTES_PER_SCORE[case.mode] * case.scores


def math_limit_bytes(args: argparse.Namespace) -> float:
    limit = args.math_limit_gb * 1e9
    if HAS_CUDA:
        limit = min(limit, 0.9 * torch.cuda.get_device_properties(0).total_memory)
    return limit


def check_supported(case: Case, args: argparse.Namespace) -> None:
    """Raise Skip for a case that cannot run here (before anything is allocated)."""
    if case.impl == "ours_cudagraphs" and not HAS_CUDA:
        raise Skip("CUDA graphs need CUDA")
    if case.impl in ("ours_compiled", "floor_compiled") and not HAS_CUDA and not args.cpu_compile:
        raise Skip("compiled on CUDA only (on CPU: --cpu-compile, the aot_eager backend)")


def attention_function(case: Case, args: argparse.Namespace) -> Callable:
    """The attention (q, k, v) -> out of the case's implementation, or a Skip."""
    if case.impl in ("ours", "ours_compiled", "ours_cudagraphs"):
        return jvp_attention.attention
    if case.impl == "ours_fast":
        def fast(q, k, v):
            with jvp_attention.precision("fast"):
                return jvp_attention.attention(q, k, v)

        return fast
    if case.impl == "math":
        need = math_memory_estimate(case)
        limit = math_limit_bytes(args)
        if need > limit:
            raise Skip(f"math path needs ~{need / 1e9:.0f} GB (O(N^2) fp32 scores, "
                       f"{MATH_BYTES_PER_SCORE[case.mode]:.0f} bytes per score), above the "
                       f"{limit / 1e9:.0f} GB limit (--math-limit-gb)")

        def math(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v)

        return math
    if case.impl in FLOOR_IMPLS:
        def floor(q, k, v):
            return v.clone()

        return floor
    if case.impl == "jfa":
        if case.d not in bench.JFA_HEAD_DIMS:
            raise Skip(f"unsupported (d={case.d}): jvp-flash-attention takes d in "
                       f"{bench.JFA_HEAD_DIMS}")
        if case.N % 32 or case.N < 32:
            raise Skip(f"unsupported (N={case.N}): jvp-flash-attention needs N divisible by "
                       "32")
        if not HAS_CUDA:
            raise Skip("jvp-flash-attention needs CUDA")
        JVPAttn = bench.jfa_module()

        def jfa(q, k, v):
            return JVPAttn.fwd_dual(q, k, v, causal=False)

        return jfa
    raise ValueError(f"unknown implementation {case.impl!r}")


LAYOUTS = {
    "contiguous": "q, k, v and their tangents as contiguous (B, H, N, d) tensors",
    "qkv": "q, k, v as views of one (B, N, 3, H, d) projection output, permuted to (B, H, N, d)"
           " inside the step as DiT's attention does (heads d elements apart), and the tangents"
           " likewise; cotangents as (B, N, H, d) transposed",
}


def layout_tensors(case: Case, layout: str, device: str, dtype: torch.dtype, grads_of: int):
    """The step's input tensors in `layout` (the first `grads_of` of q, k, v, tq, tk, tv
    requiring grad), and the two cotangents."""
    b, h, n, d = case.B, case.H, case.N, case.d
    if layout == "contiguous":
        inputs = [torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=i < grads_of)
                  for i in range(6)]
        cotangents = [torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(2)]
        return inputs, *cotangents
    packs = [torch.randn(b, n, 3, h, d, device=device, dtype=dtype,
                         requires_grad=3 * i < grads_of) for i in range(2)]
    cotangents = [torch.randn(b, n, h, d, device=device, dtype=dtype).transpose(1, 2)
                  for _ in range(2)]
    return packs, *cotangents


def attention_operands(inputs, layout: str) -> tuple:
    """q, k, v, tq, tk, tv from the step's inputs (`layout_tensors`)."""
    if layout == "contiguous":
        return tuple(inputs)
    return tuple(t for pack in inputs for t in pack.permute(2, 0, 3, 1, 4).unbind(0))


def with_parameter_bias(attention: Callable, case: Case, device: str, dtype: torch.dtype,
                        trained: bool) -> tuple[Callable, torch.Tensor]:
    """`attention` with a learnable (1, H, N, N) additive bias closed over (a parameter, as
    a relative-position bias is: no tangent under `torch.func.jvp`, a gradient in the
    backward where the step trains), and the bias. The floor ignores it."""
    if case.impl not in (*FLOOR_IMPLS, "ours", "ours_fast", "ours_compiled", "ours_cudagraphs",
                         "math"):
        raise Skip(f"{case.impl}: no attn_mask (--parameter-bias)")
    bias = (0.1 * torch.randn(1, case.H, case.N, case.N, device=device, dtype=dtype)
            ).requires_grad_(trained)
    if case.impl in FLOOR_IMPLS:
        return attention, bias

    def biased(q, k, v):
        if case.impl == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        with (jvp_attention.precision("fast") if case.impl == "ours_fast"
              else contextlib.nullcontext()):
            return jvp_attention.attention(q, k, v, attn_mask=bias)

    return biased, bias


def make_step(case: Case, device: str, args: argparse.Namespace) -> Callable[[], None]:
    """Allocate the case's inputs and return one training step's attention call."""
    check_supported(case, args)
    attention = attention_function(case, args)
    dtype = DTYPES[case.dtype]
    grads_of = {"fwd_jvp": 0, "meanflow": 3, "second_order": 6}[case.mode]
    inputs, grad, t_grad = layout_tensors(case, args.layout, device, dtype, grads_of)
    leaves = [x for x in inputs if x.requires_grad]
    if getattr(args, "parameter_bias", False):
        attention, bias = with_parameter_bias(attention, case, device, dtype, grads_of > 0)
        leaves += [bias] if bias.requires_grad else []

    def forward(*inputs):
        q, k, v, tq, tk, tv = attention_operands(inputs, args.layout)
        out, t_out = torch.func.jvp(attention, (q, k, v), (tq, tk, tv))
        # MeanFlow's stop-gradient, inside the (compiled) function: a compiled graph output
        # that requires grad but gets none has its gradient materialised as zeros, which
        # would run the backward through the tangent (the second-order kernels).
        return (out, t_out.detach()) if case.mode == "meanflow" else (out, t_out)

    def make(forward, mark_step=None) -> Callable[[], None]:
        mode = case.mode

        def step() -> None:
            if mark_step is not None:
                mark_step()
            for x in leaves:  # optimizer.zero_grad(set_to_none=True)
                x.grad = None
            out, t_out = forward(*inputs)
            if mode == "meanflow":
                out.backward(grad)
            elif mode == "second_order":
                torch.autograd.backward((out, t_out), (grad, t_grad))

        step.leaves = leaves  # type: ignore[attr-defined]
        step.eager = None  # type: ignore[attr-defined]
        return step

    if case.impl not in COMPILE_MODES:
        return make(forward)
    torch._dynamo.reset()
    if case.impl == "ours_cudagraphs":
        # Inside a model the attention's inputs are the graph's own activations, which a
        # replay does not copy; CUDA graph trees copy every other input on each replay
        # (4 to 11 copy kernels per call unmarked, one marked: chapter 8).
        for x in (*inputs, grad, t_grad):
            torch._dynamo.mark_static_address(x)
    if HAS_CUDA:
        compiled = torch.compile(forward, mode=COMPILE_MODES[case.impl], dynamic=False)
    else:
        compiled = torch.compile(forward, backend="aot_eager", dynamic=False)
    step = make(compiled, torch.compiler.cudagraph_mark_step_begin
                if case.impl == "ours_cudagraphs" else None)
    # The same step uncompiled, run once before the first compiled step: Triton compiles and
    # autotunes our kernels for this shape there, so compile_s is torch.compile's own time.
    step.eager = make(forward)  # type: ignore[attr-defined]
    return step


# --------------------------------------------------------------------------- measurements
def synchronize() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


def clear_grads(step) -> None:
    for x in step.leaves:
        x.grad = None


def sleep_cycles_per_ms() -> float | None:
    """GPU clock cycles of torch.cuda._sleep per millisecond, measured once."""
    if not HAS_CUDA:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm the kernel
    torch.cuda.synchronize()
    rates = []
    for _ in range(3):
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        torch.cuda.synchronize()
        rates.append(50_000_000 / start.elapsed_time(end))
    return statistics.median(rates)


def kernel_counts(events: Iterable[tuple]) -> dict:
    """From (name, device_type, activity_type[, duration in µs]) of profiler events: kernels
    (with their GPU time where durations are given), memcpy/memset, and host-side launch API
    calls. The activity type (kineto's "kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime",
    "cuda_driver", "cuda_sync", ...) decides; where the profiler gives none, a device-side
    (CUDA) event is a kernel unless its name says memcpy, memset or sync."""
    kernels: Counter = Counter()
    kernel_us: Counter = Counter()
    timed = True
    copies = 0
    launches: Counter = Counter()
    for name, device_type, activity, *duration in events:
        if activity:
            is_kernel = activity == "kernel"
            is_copy = activity in ("gpu_memcpy", "gpu_memset")
            host_api = activity in ("cuda_runtime", "cuda_driver")
        else:
            on_device = device_type.upper().endswith("CUDA")
            is_copy = on_device and name.lower().startswith(("memcpy", "memset"))
            is_kernel = on_device and not is_copy and "sync" not in name.lower()
            host_api = not on_device
        if is_kernel:
            kernels[name[:80]] += 1
            if duration and duration[0] is not None:
                kernel_us[name[:80]] += duration[0]
            else:
                timed = False
        elif is_copy:
            copies += 1
        elif host_api and LAUNCH_API.match(name):
            launches[name] += 1
    return {"kernels_per_call": sum(kernels.values()), "memcpy_memset_per_call": copies,
            "launch_api_calls_per_call": sum(launches.values()) or None,
            "kernel_names": dict(kernels.most_common()),
            "kernel_ms": ({name: round(us / 1e3, 5) for name, us in kernel_us.most_common()}
                          if timed and kernels else None),
            "launch_apis": dict(launches)}


def _activity(event) -> str | None:
    try:
        return str(event.activity_type()) or None
    except Exception:  # noqa: BLE001 - a profiler without activity types
        return None


def _duration_us(event) -> float | None:
    try:
        return event.duration_ns() / 1e3
    except Exception:  # noqa: BLE001 - a profiler without durations
        return None


def profile_step(step) -> dict:
    """kernel_counts of one warm step, through torch.profiler (CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    clear_grads(step)
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    try:  # kineto's raw events: every kernel and runtime call, as recorded
        events = [(event.name(), str(event.device_type()), _activity(event),
                   _duration_us(event)) for event in prof.profiler.kineto_results.events()]
    except Exception:  # noqa: BLE001 - an older/newer profiler: its parsed events instead
        events = [(event.name, str(event.device_type), None,
                   getattr(event, "device_time", None)) for event in prof.events()]
    return kernel_counts(events)


def group_size(per_call_ms: float, rep_ms: float, cap: int) -> int:
    """Steps per timed group: about rep_ms of work, at least 1, at most cap."""
    return max(1, min(cap, int(rep_ms / max(per_call_ms, 1e-3))))


def time_wall(step, n: int, groups: int) -> float:
    times = []
    for _ in range(groups):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / n)
    return statistics.median(times)


def time_gpu_and_host(step, n: int, groups: int, host_guess_ms: float,
                      cycles_per_ms: float) -> tuple[float, float, bool]:
    """(gpu_ms, host_ms, overlapped): each group of n steps is enqueued behind a GPU sleep
    that should outlast the host's enqueueing (see DEFINITIONS)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu, host, covered_all = [], [], True
    sleep_ms = 2.0 * n * host_guess_ms + 1.0
    for _ in range(groups):
        # Retry with a longer sleep; once a group never got covered (a call that waits for
        # the GPU), the others take one attempt each.
        for _attempt in range(4 if covered_all else 1):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
            start.record()
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            t1 = time.perf_counter()
            covered = not start.query()  # the sleep was still running: no call waited
            end.record()
            torch.cuda.synchronize()
            if covered:
                break
            sleep_ms *= 2
        covered_all &= covered
        gpu.append(start.elapsed_time(end) / n)
        host.append((t1 - t0) * 1e3 / n)
    return statistics.median(gpu), statistics.median(host), covered_all


def tflops(flops: float, ms: float) -> float:
    return float(f"{flops / (ms * 1e-3) / 1e12:.6g}")


def bytes_to_mb(n: float) -> float:
    return round(n / 2**20, 3)


def measure(case: Case, step, args: argparse.Namespace, cycles_per_ms: float | None) -> dict:
    record: dict = {"notes": {}}
    notes = record["notes"]
    base_reserved = torch.cuda.memory_reserved() if HAS_CUDA else 0
    if HAS_CUDA:
        torch.cuda.reset_peak_memory_stats()
    if step.eager is not None:
        synchronize()
        t0 = time.perf_counter()
        step.eager()
        synchronize()
        record["eager_warmup_s"] = round(time.perf_counter() - t0, 4)
    # Warm-up: the first step compiles (and autotunes); CUDA graphs record in the next ones.
    warm = []
    for i in range(max(1, args.warmup_steps)):
        synchronize()
        t0 = time.perf_counter()
        step()
        synchronize()
        warm.append((time.perf_counter() - t0) * 1e3)
        if i == 0:
            record["first_call_s"] = round(warm[0] / 1e3, 4)
    record["warmup_step_ms"] = [round(t, 4) for t in warm]
    record["compile_s"] = record["first_call_s"] if case.impl in COMPILE_MODES else None
    if case.impl not in COMPILE_MODES:
        notes["compile_s"] = "not a compiled column"
    per_call = statistics.median(warm[1:]) if len(warm) > 1 else warm[0]
    cap = args.max_group
    if HAS_CUDA:
        peak_reserved = torch.cuda.max_memory_reserved()
        clear_grads(step)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        record["peak_memory_mb"] = bytes_to_mb(torch.cuda.max_memory_allocated() - base)
        peak_reserved = max(peak_reserved, torch.cuda.max_memory_reserved())
        record.update(profile_step(step))
        if not record.pop("launch_apis"):
            notes["launch_api_calls_per_call"] = "the profiler recorded no launch API calls"
        # The pending-launch queue holds ~1000 entries: a group must not fill it.
        cap = min(cap, max(1, 512 // max(1, record["kernels_per_call"])))
        # The host's enqueue time of one step from an idle GPU: the sleep's first guess.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host_guess = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        n = group_size(per_call, args.rep_ms, cap)
        record["wall_ms"] = round(time_wall(step, n, args.groups), 5)
        gpu, host, covered = time_gpu_and_host(step, n, args.groups, host_guess, cycles_per_ms)
        record["gpu_ms"], record["host_ms"] = round(gpu, 5), round(host, 5)
        record["host_overlapped"] = covered
        record["reps"] = {"steps_per_group": n, "groups": args.groups}
        record["peak_reserved_mb"] = bytes_to_mb(
            max(peak_reserved, torch.cuda.max_memory_reserved()) - base_reserved)
        record["tflops"] = tflops(case.flops, gpu)
    else:
        n = group_size(per_call, args.rep_ms, min(cap, args.cpu_reps))
        record["wall_ms"] = round(time_wall(step, n, 1), 5)
        record["reps"] = {"steps_per_group": n, "groups": 1}
        for key, why in (("gpu_ms", "no CUDA"), ("host_ms", "no CUDA (no GPU to overlap)"),
                         ("host_overlapped", "no CUDA"), ("peak_memory_mb", "no CUDA"),
                         ("peak_reserved_mb", "no CUDA"),
                         ("kernels_per_call", "no CUDA profiler on CPU"),
                         ("memcpy_memset_per_call", "no CUDA profiler on CPU"),
                         ("launch_api_calls_per_call", "no CUDA profiler on CPU"),
                         ("kernel_names", "no CUDA profiler on CPU"),
                         ("kernel_ms", "no CUDA profiler on CPU")):
            record[key] = None
            notes[key] = why
        record["tflops"] = tflops(case.flops, record["wall_ms"])
        notes["tflops"] = "from wall_ms (CPU, Triton's interpreter: plumbing, not speed)"
    record["tflops_wall"] = tflops(case.flops, record["wall_ms"])
    if case.impl in FLOOR_IMPLS:
        record["tflops"] = record["tflops_wall"] = None
        notes["tflops"] = notes["tflops_wall"] = "the floor column does no attention"
    clear_grads(step)
    return record


def run_case(case: Case, device: str, args: argparse.Namespace,
             cycles_per_ms: float | None) -> dict:
    """Run one case; never raises (errors and skips are recorded)."""
    record: dict = {"status": "ok", "error": None, "skipped": None}
    step = None
    t0 = time.perf_counter()
    try:
        check_supported(case, args)
        attention_function(case, args)  # its Skip (unsupported, memory) before any allocation
        bench.free_memory(collect=HAS_CUDA)  # gc.collect: ~1 s on CPU, memory matters on GPU
        base = torch.cuda.memory_allocated() if HAS_CUDA else 0
        step = make_step(case, device, args)
        synchronize()
        record["setup_memory_mb"] = (bytes_to_mb(torch.cuda.memory_allocated() - base)
                                     if HAS_CUDA else None)
        record.update(measure(case, step, args, cycles_per_ms))
    except Skip as reason:
        record.update(status="skipped", skipped=str(reason))
    except torch.OutOfMemoryError as error:
        record.update(status="error",
                      error=f"OutOfMemoryError: {str(error).splitlines()[0][:300]}")
    except Exception as error:  # noqa: BLE001 - recorded per case, the run goes on
        record.update(status="error", error=f"{type(error).__name__}: {str(error)[:1000]}")
    finally:
        if step is not None or record["status"] == "error":
            step = None
            if case.impl in COMPILE_MODES:
                with contextlib.suppress(Exception):
                    torch._dynamo.reset()  # drops the compiled code and CUDA graph pools
            bench.free_memory(collect=HAS_CUDA or record["status"] == "error")
    record["case_wall_s"] = round(time.perf_counter() - t0, 3)
    return record


def complete_record(case: Case, record: dict) -> dict:
    """The case's fields first, then the record; every CASE_FIELDS key present."""
    full = {**asdict(case), "flops": case.flops, **record}
    full.setdefault("notes", {})
    for key in CASE_FIELDS:
        if key not in full:
            full[key] = None
            if full["status"] == "ok":
                full["notes"].setdefault(key, "not measured")
    return {key: full[key] for key in CASE_FIELDS} | {
        k: v for k, v in full.items() if k not in CASE_FIELDS}


# --------------------------------------------------------------------------- bookkeeping
def header(args: argparse.Namespace, cycles_per_ms: float | None) -> dict:
    return {
        **bench.run_record(SCHEMA, args.smoke),
        "settings": {
            "dtype": args.dtype, "precision": bench.precision_mode(),
            "warmup_steps": args.warmup_steps, "rep_ms": args.rep_ms, "groups": args.groups,
            "max_group": args.max_group, "max_seconds": args.max_seconds,
            "math_limit_gb": args.math_limit_gb, "autotune_rep_ms": args.autotune_rep_ms,
            "compile_backend": "inductor" if HAS_CUDA else (
                "aot_eager" if args.cpu_compile else None),
            "compile_modes": COMPILE_MODES,
            "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            "sleep_cycles_per_ms": cycles_per_ms,
            "causal": False, "mask": None, "layout": args.layout,
            "padded_max_scores": jvp_attention.launch.PADDED_MAX_SCORES,
            "key_side_passes": 2 if jvp_attention.backward.SPLIT_KEY_SIDE else 1,
            "floor_op": FLOOR_OP,
        },
        "shapes": {name: {"B": b, "H": h, "N": n, "d": d, "label": SHAPE_LABELS.get(name, name)}
                   for name, (b, h, n, d) in (SMOKE_SHAPES if args.smoke else SHAPES).items()},
        "modes": MODE_LABELS,
        "impls": IMPL_LABELS,
        "flop_convention": bench.flop_convention(MODES),
        "definitions": DEFINITIONS,
        "case_fields": list(CASE_FIELDS),
        "cases": [],
    }


def default_out(args: argparse.Namespace) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    if args.smoke:  # plumbing numbers do not belong with the saved results
        return Path(tempfile.gettempdir()) / f"jvp_training_shapes_smoke_{stamp}.json"
    return bench.RESULTS / f"training_shapes_{stamp}.json"


def load_resume(paths: list[Path] | None, layout: str = "contiguous") -> dict[tuple, dict]:
    """Cases of earlier runs that were measured, failed, or skipped for a reason other than the
    wall budget, by key; a later file wins a key both have. Raises ValueError for a file of
    another `--layout` (files from before the option are "contiguous")."""
    done = {}
    for path in paths or []:
        data = json.loads(path.read_text())
        theirs = data.get("settings", {}).get("layout", "contiguous")
        if theirs != layout:
            raise ValueError(f"--resume {path}: its cases were measured with --layout {theirs}, "
                             f"this run uses --layout {layout}; resume from runs of one layout")
        for rec in data.get("cases", []):
            if rec["status"] == "skipped" and (rec.get("skipped") or "").startswith("wall budget"):
                continue
            key = (rec["shape"], rec["impl"], rec["mode"], rec["B"], rec["H"], rec["N"],
                   rec["d"], rec["dtype"])
            done[key] = {**rec, "resumed_from": rec.get("resumed_from", str(path))}
    return done


def describe(record: dict) -> str:
    if record["status"] == "skipped":
        return f"skipped: {record['skipped']}"
    if record["status"] == "error":
        return f"ERROR {record['error'][:160]}"
    parts = [f"wall {record['wall_ms']:9.3f} ms"]
    if record.get("gpu_ms") is not None:
        parts += [f"gpu {record['gpu_ms']:9.3f} ms", f"host {record['host_ms']:7.3f} ms"
                  + ("" if record["host_overlapped"] else "*"),
                  ("  no FLOPs" if record["tflops"] is None else f"{record['tflops']:7.1f} TFLOP/s"),
                  f"{record['kernels_per_call']} kernels",
                  f"peak {record['peak_memory_mb']:8.1f} MB"]
    parts.append(f"first {record['first_call_s']:.2f} s")
    return " | ".join(parts) + (" (resumed)" if record.get("resumed_from") else "")


def print_table(cases: list[dict]) -> None:
    """GPU (or wall) ms per shape and mode, one column per implementation."""
    key = "gpu_ms" if HAS_CUDA else "wall_ms"
    rows: dict[tuple, dict[str, str]] = {}
    for c in cases:
        cell = {"ok": lambda c=c: f"{c[key]:.3f}", "error": lambda: "error",
                "skipped": lambda: "-"}[c["status"]]()
        rows.setdefault((c["shape"], c["mode"]), {})[c["impl"]] = cell
    print(f"\n{key} per call ('-' skipped)", flush=True)
    print(f"{'shape':12} {'mode':13} " + " ".join(f"{i:>15}" for i in IMPLS), flush=True)
    for (shape, mode), cells in rows.items():
        print(f"{shape:12} {mode:13} " + " ".join(f"{cells.get(i, ''):>15}" for i in IMPLS),
              flush=True)


# --------------------------------------------------------------------------- main
def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help=f"the tiny shape {SMOKE_SHAPES['smoke']} (B, H, N, d); on CPU "
                             "through Triton's interpreter, fp16: checks the plumbing")
    parser.add_argument("--list", action="store_true", help="print the planned cases and exit")
    parser.add_argument("--shape", nargs="+", choices=list(SHAPES), help="only these shapes")
    parser.add_argument("--impl", nargs="+", choices=IMPLS, help="only these implementations")
    parser.add_argument("--mode", nargs="+", choices=MODES, help="only these modes")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="default bf16 on CUDA, fp16 on CPU (the interpreter's bf16 dot "
                             "is wrong)")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="contiguous",
                        help="how q, k, v and the tangents are laid out in memory: "
                             + "; ".join(f"{k}: {v}" for k, v in LAYOUTS.items()))
    parser.add_argument("--precision", choices=("accurate", "fast"), default=None,
                        help="jvp_attention.set_precision for the run (default: the library's)")
    parser.add_argument("--padded-max-scores", type=int, default=None,
                        help="jvp_attention.launch.PADDED_MAX_SCORES for the run: compiled "
                             "calls of at most this many scores pad head dims cut in two "
                             "(d = 40, 72) to one column tile, larger ones keep the opaque "
                             "operators; 0 never pads (default: the library's)")
    parser.add_argument("--key-side-passes", type=int, choices=(1, 2), default=None,
                        help="the second-order backward's key side in one pass or two "
                             "(jvp_attention.backward.SPLIT_KEY_SIDE; default: the library's)")
    parser.add_argument("--out", type=Path, help="the JSON file to write (default: "
                        "benchmarks/results/training_shapes_<date>.json; smoke: a temp file)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="untimed steps first (compile, autotune, CUDA graph capture); "
                             "default 3 on CUDA, 1 on CPU")
    parser.add_argument("--rep-ms", type=float, default=100.0,
                        help="about this much work per timed group (at least one step)")
    parser.add_argument("--groups", type=int, default=5, help="timed groups; medians over them")
    parser.add_argument("--max-group", type=int, default=200, help="at most this many steps per "
                        "group")
    parser.add_argument("--cpu-reps", type=int, default=2, help="timed steps per case on CPU")
    parser.add_argument("--cpu-compile", action="store_true",
                        help="on CPU, run ours_compiled and floor_compiled with the aot_eager "
                             "backend (slow: ~10 s per case through the interpreter)")
    parser.add_argument("--math-limit-gb", type=float, default=100.0,
                        help="skip the math path above this memory estimate")
    parser.add_argument("--autotune-rep-ms", type=float, default=20.0,
                        help="bench.py's quick autotuning timer for our kernels; 0 keeps the "
                             "library's (jvp_attention.launch.time_candidate)")
    parser.add_argument("--max-seconds", type=float, default=540.0,
                        help="wall budget from start: later cases are recorded as skipped "
                             "(finish with --resume); 0 or less: no limit")
    parser.add_argument("--resume", type=Path, nargs="+",
                        help="copy the cases these earlier results measured (those outside this "
                             "selection too); run the rest")
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bf16" if HAS_CUDA else "fp16"
    if args.warmup_steps is None:
        args.warmup_steps = 3 if HAS_CUDA else 1
    if args.max_seconds is not None and args.max_seconds <= 0:
        args.max_seconds = None
    return args


def configure_library(args: argparse.Namespace) -> None:
    """The library's switches that the command line sets for the run."""
    if args.precision:
        jvp_attention.set_precision(args.precision)
    if args.padded_max_scores is not None:
        jvp_attention.launch.PADDED_MAX_SCORES = args.padded_max_scores
    if args.key_side_passes is not None:
        jvp_attention.backward.SPLIT_KEY_SIDE = args.key_side_passes == 2


def main(argv: Iterable[str] | None = None) -> dict:
    start = time.perf_counter()  # the wall budget counts from here, not from the import
    args = parse_args(argv)
    if not args.smoke and not args.list and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--smoke runs a tiny case on the CPU")
    cases = plan(args)
    if args.list:
        for i, case in enumerate(cases, 1):
            print(f"{i:4} {case.label()} {case.flops / 1e12:9.3f} TFLOP", flush=True)
        return {}
    configure_library(args)
    device = "cuda" if HAS_CUDA else "cpu"
    if HAS_CUDA:  # initialise the context and cuBLAS before anything is timed
        x = torch.randn(256, 256, device=device)
        (x @ x).sum().item()
    cycles_per_ms = sleep_cycles_per_ms()
    out_path = args.out or default_out(args)
    data = header(args, cycles_per_ms)
    if HAS_CUDA and args.autotune_rep_ms > 0:
        data["settings"]["quick_autotune"] = bench.use_quick_autotune(args.autotune_rep_ms)
    resumed = load_resume(args.resume, args.layout)
    data["cases"] = bench.outside_plan(resumed, (case.key for case in cases))
    if data["cases"]:
        print(f"{len(data['cases'])} resumed cases outside this selection: kept", flush=True)
    print(f"jvp_attention training shapes: {data['gpu']} | torch {torch.__version__} | triton "
          f"{triton.__version__} | jvp_flash_attention "
          f"{data['versions']['jvp_flash_attention']} | {len(cases)} cases | budget "
          f"{args.max_seconds} s | -> {out_path}", flush=True)
    broken = None
    for i, case in enumerate(cases, 1):
        elapsed = time.perf_counter() - start
        if case.key in resumed:
            record = resumed[case.key]
        elif broken is not None:
            record = {"status": "skipped", "skipped": f"CUDA context lost earlier: {broken}"}
        elif args.max_seconds is not None and elapsed > args.max_seconds:
            record = {"status": "skipped", "skipped": (
                f"wall budget: {elapsed:.0f} s elapsed, --max-seconds {args.max_seconds:.0f}")}
        else:
            record = run_case(case, device, args, cycles_per_ms)
            if record["error"] and HAS_CUDA and (
                    any(s in record["error"] for s in bench.FATAL_CUDA)
                    or bench.cuda_is_broken()):
                broken = record["error"][:200]
        record = complete_record(case, record)
        data["cases"].append(record)
        data["wall_seconds"] = round(time.perf_counter() - start, 2)
        bench.write_json(out_path, data)
        print(f"[{i:3}/{len(cases)} {time.perf_counter() - start:6.1f}s] {case.label()} "
              f"{describe(record)}", flush=True)
    data["complete"] = not any(c["status"] == "skipped" and c["skipped"].startswith(
        ("wall budget", "CUDA context lost")) for c in data["cases"])
    data["wall_seconds"] = round(time.perf_counter() - start, 2)
    bench.write_json(out_path, data)
    print_table(data["cases"])
    counts = Counter(c["status"] for c in data["cases"])
    print(f"\n{counts['ok']} measured, {counts['error']} errors, {counts['skipped']} skipped "
          f"in {data['wall_seconds']:.0f} s -> {out_path}", flush=True)
    return data


if __name__ == "__main__":
    main()
    sys.exit(0)
