#!/usr/bin/env python3
"""Context parallelism on several GPUs against one: `jvp_attention.context_parallel_attention`
(Ulysses and ring) at Wan-like shapes, time and peak memory per GPU, saved as JSON.

    JVP_ATTENTION_AUTOTUNE=0 python benchmarks/context_parallel.py     # all visible GPUs
    python benchmarks/context_parallel.py --heads 40    # Wan 14B's 40 heads, not 1.3B's 12
    python benchmarks/context_parallel.py --smoke       # CPU: 2 gloo processes, tiny shapes

The script starts itself again under torchrun (`python -m torch.distributed.run --standalone`),
one process per visible GPU, over NCCL (NVLink multicast off, as examples/meanflow_dit.py
does). For each length N (32768, 65536, 131072 tokens; batch 1, 12 heads of 128, bf16, full
attention as in a video DiT; `--causal` adds causal attention in the zig-zag layout):

* `one`: `jvp_attention.attention` on the whole sequence on GPU 0 alone (the others wait);
* `ulysses`, `ring`: `context_parallel_attention` over all the GPUs, N / W tokens each;

each in two modes, the attention calls of a MeanFlow-style training step:

    fwd_jvp    out, t_out = torch.func.jvp(attend, (q, k, v), (tq, tk, tv))
    meanflow   the same with q, k, v requiring grad, then out.backward(grad): the backward
               through the primal output only (MeanFlow, sCM)

Time: the median over --reps calls (after --warmup calls, which pay Triton's compilation and
any autotuning) of the slowest GPU's wall time per call, synchronised before and after.
Memory: the largest over the GPUs of the peak allocated during a call beyond what the GPU held
before it (`peak_memory_mb`), and of what it held (`held_memory_mb`: the inputs). At N = 32768
(`--check-n`) each method's bf16 results are first checked against one GPU with chapter 10's
`compare_with_one_process`: the output, the tangent and the gradients of the plain, MeanFlow
and second-order backwards, against `attention` in bf16 on one GPU and in fp32 (the truth).
The JSON (benchmarks/results/context_parallel_<gpu>_<date>.json, or --out) is rewritten after
every case; a table is printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import bench  # noqa: E402  (benchmarks/bench.py: run_record, write_json, the FLOP convention)

from jvp_attention import attention, context_parallel_attention  # noqa: E402
from jvp_attention.context_parallel import (  # noqa: E402
    CheckCase,
    allowed_error,
    compare_with_one_process,
)

SCHEMA = "jvp_attention.context_parallel/1"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPLS = ("one", "ulysses", "ring")
MODES = ("fwd_jvp", "meanflow")
SMOKE = {"lengths": [32], "heads": 4, "head_dim": 16, "dtype": "fp32", "reps": 1, "warmup": 1,
         "check_n": 32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # Option names that torchrun does not take for a prefix of its own (it reads this script's
    # arguments too, and `--n` or `--nproc` would be ambiguous there).
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072],
                        help="sequence lengths (whole sequence)")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--causal", action="store_true",
                        help="also causal attention (zig-zag layout for the methods)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--check-n", type=int, default=32768,
                        help="check both methods against one GPU at this N (0: no check)")
    parser.add_argument("--processes", type=int, default=None,
                        help="processes (default: the visible GPUs; 2 with --smoke)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, gloo, 2 processes, tiny shapes: the plumbing, in seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    return args


# --------------------------------------------------------------------------- processes
def launch(argv: list[str], args: argparse.Namespace) -> int:
    """Run this script under torchrun, one process per GPU (two CPU processes for --smoke)."""
    gpus = 0 if args.smoke else torch.cuda.device_count()
    nproc = args.processes or (gpus if gpus else 2)
    if nproc < 2 or (not args.smoke and gpus < nproc):
        print(f"context parallelism needs at least 2 GPUs (found {gpus}); --smoke runs two CPU "
              "processes", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast: not needed, fails on some hosts
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.smoke:  # PyTorch operations on the CPU: the interpreter would take minutes
        env.update(TRITON_INTERPRET="0", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(Path(__file__).resolve()), *argv]
    return subprocess.run(command, env=env, check=False).returncode


def join_group(smoke: bool) -> torch.device:
    """This torchrun process's device, after joining the group (NCCL on GPUs, else gloo)."""
    timeout = timedelta(minutes=10)  # a rank that fails must not leave the others forever
    if smoke or not torch.cuda.is_available():
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timeout)
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    numbers = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
    return numbers.tolist()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- one case
def make_call(impl: str, mode: str, n: int, causal: bool, args: argparse.Namespace,
              device: torch.device):
    """The timed call of one case on this rank, with its inputs (None where this rank idles)."""
    world = dist.get_world_size()
    if impl == "one" and dist.get_rank() != 0:
        return None
    length = n if impl == "one" else n // world
    gen = torch.Generator(device).manual_seed(dist.get_rank())
    shape = (args.batch, args.heads, length, args.head_dim)
    q, k, v, tq, tk, tv, grad = (
        torch.randn(shape, generator=gen, device=device, dtype=DTYPES[args.dtype])
        for _ in range(7))
    if impl == "one":
        def attend(a, b, c):
            return attention(a, b, c, is_causal=causal)
    else:
        def attend(a, b, c):
            return context_parallel_attention(a, b, c, is_causal=causal, method=impl,
                                              layout="zigzag" if causal else "contiguous")

    if mode == "fwd_jvp":
        def call():
            return torch.func.jvp(attend, (q, k, v), (tq, tk, tv))
        return call
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step():
        out, _ = torch.func.jvp(attend, tuple(leaves), (tq, tk, tv))
        out.backward(grad)
        for x in leaves:  # the gradients count in the call's peak, not in what is held
            x.grad = None
    return step


def timed(call, device: torch.device) -> tuple[float, float]:
    """(seconds of the slowest rank, peak bytes allocated beyond what it held) of one call."""
    synchronize(device)
    dist.barrier()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    if call is not None:
        call()
    synchronize(device)
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    return elapsed, peak


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping intervals covering the same time as `intervals`."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def communication(call, device: torch.device) -> tuple[float, float]:
    """(busy, exposed) milliseconds of communication in one profiled call on this rank.

    Busy: the time the collectives' kernels run (NCCL kernels on a GPU; gloo's operations on
    a CPU). Exposed: the part of it during which no other kernel runs, i.e. the time the
    communication adds to the call if nothing else could hide it.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    for _ in range(2):  # the profiler's first use pays its own set-up: keep the second
        synchronize(device)
        dist.barrier()
        with profile(activities=activities) as prof:
            if call is not None:
                call()
            synchronize(device)
    comm, compute = [], []
    for event in prof.events():
        name = event.name.lower()
        if on_gpu and event.device_type == DeviceType.CUDA:
            span = (event.time_range.start, event.time_range.end)
            (comm if "nccl" in name else compute).append(span)
        elif not on_gpu and name.startswith("gloo:"):
            comm.append((event.time_range.start, event.time_range.end))
    comm, compute = _merged(comm), _merged(compute)
    hidden = _covered(_merged([(max(a, c), min(b, d)) for a, b in comm for c, d in compute
                               if min(b, d) > max(a, c)]))
    busy = _covered(comm)
    return busy / 1e3, (busy - hidden) / 1e3


def measure(impl: str, mode: str, n: int, causal: bool, args: argparse.Namespace,
            device: torch.device) -> dict:
    """One case on every rank; the record (maxima over the ranks) on every rank."""
    record = {"impl": impl, "mode": mode, "B": args.batch, "H": args.heads, "N": n,
              "d": args.head_dim, "dtype": args.dtype, "causal": causal,
              "layout": "zigzag" if causal and impl != "one" else "contiguous",
              "gpus": 1 if impl == "one" else dist.get_world_size(), "status": "ok",
              "error": None}
    call, error = None, None
    free_memory(device)
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        call = make_call(impl, mode, n, causal, args, device)
        start = time.perf_counter()
        for _ in range(args.warmup):
            timed(call, device)
        record["first_calls_s"] = round(time.perf_counter() - start, 3)
        held = (torch.cuda.memory_allocated(device) if device.type == "cuda" else 0) - held
        samples = [timed(call, device) for _ in range(args.reps)]
        comm = communication(call, device) if impl != "one" else (0.0, 0.0)
    except Exception as failure:  # noqa: BLE001 - recorded per case, the run goes on
        error = f"{type(failure).__name__}: {str(failure).splitlines()[0][:300]}"
        samples = []
    failed = max_over_ranks([float(error is not None)], device)[0]
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if failed:
        record.update(status="error", error=next(e for e in errors if e))
        return record
    seconds = max_over_ranks([s for s, _ in samples], device)
    peak, held, comm_ms, exposed_ms = max_over_ranks(
        [max(p for _, p in samples), held, *comm], device)
    ms = statistics.median(seconds) * 1e3
    flops = bench.case_flops(args.batch, args.heads, n, n, args.head_dim, causal, mode)
    record.update(ms=round(ms, 3), ms_each=[round(s * 1e3, 3) for s in seconds],
                  tflops=round(flops / ms / 1e9, 1),
                  peak_memory_mb=round(peak / 2**20, 1), held_memory_mb=round(held / 2**20, 1),
                  comm_ms=round(comm_ms, 3), comm_exposed_ms=round(exposed_ms, 3),
                  comm_share=round(comm_ms / ms, 3))
    return record


def check(n: int, causal: bool, args: argparse.Namespace, device: torch.device) -> dict:
    """Both methods' results at length n against one process (maxima over the ranks), each
    quantity judged by chapter 10's `allowed_error`."""
    dtype = DTYPES[args.dtype]
    truth = torch.float64 if dtype == torch.float32 else torch.float32
    cases = [CheckCase(method, dtype, args.batch, args.heads, args.heads, n, args.head_dim,
                       causal, "zigzag" if causal else "contiguous")
             for method in ("ulysses", "ring") if method in args.impls]
    report = {}
    for case in cases:  # one at a time, each announced: a check at long N takes minutes
        start = time.perf_counter()
        report.update(compare_with_one_process([case], truth_dtype=truth))
        if dist.get_rank() == 0:
            print(f"checked {case.label} in {time.perf_counter() - start:.0f} s", flush=True)
    for rows in report.values():
        for name, numbers in rows.items():
            allowed = allowed_error(dtype, name, numbers, dist.get_world_size(), device.type)
            numbers.update(allowed=allowed, passed=numbers["error"] <= allowed)
    return report


# --------------------------------------------------------------------------- the run
def default_out(args: argparse.Namespace) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    if args.smoke:  # plumbing numbers do not belong with the saved results
        return Path(tempfile.gettempdir()) / f"jvp_context_parallel_smoke_{stamp}.json"
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    slug = "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")
    return bench.RESULTS / f"context_parallel_{slug}_{stamp}.json"


def header(args: argparse.Namespace, device: torch.device) -> dict:
    return {
        **bench.run_record(SCHEMA, args.smoke),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "settings": {"dtype": args.dtype, "batch": args.batch, "heads": args.heads,
                     "head_dim": args.head_dim, "lengths": args.lengths, "impls": args.impls,
                     "modes": args.modes, "causal": args.causal, "reps": args.reps,
                     "warmup": args.warmup, "check_n": args.check_n,
                     "autotune": os.environ.get("JVP_ATTENTION_AUTOTUNE", "1") != "0",
                     "device": str(device),
                     "gpu_memory_mb": (round(torch.cuda.get_device_properties(device)
                                             .total_memory / 2**20) if device.type == "cuda"
                                       else None)},
        "definitions": {
            "ms": "median over reps of the slowest rank's wall time per call (synchronised)",
            "tflops": "the whole problem's FLOPs (bench.py's convention: "
                      f"{bench.flop_convention(MODES)}) per second, all GPUs together",
            "peak_memory_mb": "largest over the GPUs of the peak allocated during a call "
                              "beyond what the GPU held before it",
            "held_memory_mb": "largest over the GPUs of what the case's inputs hold",
            "comm_ms": "largest over the ranks of the time the collectives' kernels run in "
                       "one call profiled after the timed ones (torch.profiler; NCCL kernels "
                       "on GPUs, gloo operations on CPUs)",
            "comm_exposed_ms": "the part of comm_ms during which no other kernel runs",
            "comm_share": "comm_ms / ms",
            "checks": "error: max |method - truth| over the ranks; floor: the same for "
                      "attention on one process; passed: error <= allowed "
                      "(jvp_attention.context_parallel.allowed_error)",
        },
        "checks": {},
        "cases": [],
    }


def table(cases: list[dict]) -> str:
    """Per (N, causal, mode): each implementation's ms (speed-up over one GPU), peak GB and
    communication (share of the call, and the part no kernel hides)."""
    rows: dict[tuple, dict[str, dict]] = {}
    for case in cases:
        rows.setdefault((case["N"], case["causal"], case["mode"]), {})[case["impl"]] = case
    lines = ["| N | causal | mode | " + " | ".join(IMPLS) + " |", "|---" * (3 + len(IMPLS)) + "|"]
    for (n, causal, mode), by_impl in rows.items():
        one = by_impl.get("one", {}).get("ms")
        cells = []
        for impl in IMPLS:
            case = by_impl.get(impl)
            if case is None:
                cells.append("")
            elif case["status"] != "ok":
                cells.append("error")
            else:
                speed = f" ({one / case['ms']:.2f}x)" if one and impl != "one" else ""
                gb = (case["peak_memory_mb"] + case["held_memory_mb"]) / 1024
                comm = (f", comm {100 * case['comm_share']:.0f}%"
                        f" ({case['comm_exposed_ms']:.1f} ms exposed)" if impl != "one" else "")
                cells.append(f"{case['ms']:.1f} ms{speed}, {gb:.2f} GB{comm}")
        lines.append(f"| {n} | {causal} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    device = join_group(args.smoke)
    rank = dist.get_rank()
    out = args.out or default_out(args)
    record = header(args, device)
    start = time.perf_counter()
    try:
        for n in args.lengths:
            for causal in (False, True) if args.causal else (False,):
                if n == args.check_n:
                    record["checks"].update(check(n, causal, args, device))
                    free_memory(device)
                for impl in args.impls:
                    for mode in args.modes:
                        case = measure(impl, mode, n, causal, args, device)
                        record["cases"].append(case)
                        if rank == 0:
                            print(json.dumps(case), flush=True)
                            record["wall_seconds"] = round(time.perf_counter() - start, 1)
                            bench.write_json(out, record)
        record["complete"] = True
    finally:
        if rank == 0:
            record.setdefault("complete", False)
            record["wall_seconds"] = round(time.perf_counter() - start, 1)
            bench.write_json(out, record)
            print(table(record["cases"]))
            failed = [f"{label} {name}" for label, rows in record["checks"].items()
                      for name, numbers in rows.items() if not numbers["passed"]]
            print(f"checks: {'FAILED ' + ', '.join(failed) if failed else 'all passed'}")
            print(f"wrote {out}")
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:  # not under torchrun yet
        return launch(argv, args)
    return run(args)


if __name__ == "__main__":
    code = main()
    if "LOCAL_RANK" in os.environ:
        # A torchrun worker whose results are written: it leaves without the interpreter's
        # teardown, where a thread of the profiler or of gloo at times aborts the process
        # ("terminate called without an active exception") after the work is done.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
