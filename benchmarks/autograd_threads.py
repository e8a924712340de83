#!/usr/bin/env python3
"""Host time of a training step with PyTorch's autograd engine running the backward on its
own CUDA device thread (the default) or on the calling thread
(`torch.autograd.set_multithreading_enabled(False)`). Saved as JSON.

    python benchmarks/autograd_threads.py --out benchmarks/results/autograd_threads_h200.json
    python benchmarks/autograd_threads.py --smoke   # CPU: the tiny shape, Triton's interpreter

On CUDA the engine hands every backward to a thread of its own per device and waits for it;
a backward written in Python (ours: an autograd.Function) then runs there. This measures
what that costs per call, for our MeanFlow step (`torch.func.jvp` of the attention, then the
primal backward; `training_shapes.py`'s step) and for two floors in its place: `v.clone()`
(PyTorch's own backward, in C++) and the same multiply as an autograd.Function whose
backward is Python. The two settings alternate group by group in one process, so that the
host's speed, which drifts between runs, cancels: each group is `--steps` steps enqueued
behind a GPU sleep (no call waits for the GPU), host time per step; min and median over
`--groups` groups per setting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import training_shapes as ts  # noqa: E402  (sets TRITON_INTERPRET on CPU before triton)

bench = ts.bench
torch = ts.torch
SCHEMA = "jvp_attention.autograd_threads/1"
IMPLS = {"ours": "jvp_attention.attention",
         "floor": "v.clone() (PyTorch's backward, C++)",
         "python_floor": "v.clone() as an autograd.Function with a Python backward"}


class PythonFloor(torch.autograd.Function):
    """v.clone() with its backward (and tangent) in Python, as any custom attention has."""

    @staticmethod
    def forward(v):
        return v.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad

    @staticmethod
    def jvp(ctx, tangent):
        return tangent


def make_step(shape: str, impl: str, args: argparse.Namespace):
    b, h, n, d = (ts.SMOKE_SHAPES if args.smoke else ts.SHAPES)[shape]
    case = ts.Case(shape, "floor" if impl == "python_floor" else impl, "meanflow", b, h, n, d,
                   args.dtype)
    if impl != "python_floor":
        return ts.make_step(case, "cuda" if ts.HAS_CUDA else "cpu", args)
    chosen = ts.attention_function
    ts.attention_function = lambda case, args: lambda q, k, v: PythonFloor.apply(v)
    try:
        return ts.make_step(case, "cuda" if ts.HAS_CUDA else "cpu", args)
    finally:
        ts.attention_function = chosen


def host_ms(step, steps: int, cycles_per_ms: float | None) -> float:
    """Host time per step of one group, the GPU kept busy by a sleep enqueued first."""
    if cycles_per_ms:
        torch.cuda._sleep(int(cycles_per_ms * 15 * steps))
    start = time.perf_counter()
    for _ in range(steps):
        step()
    spent = (time.perf_counter() - start) / steps * 1e3
    ts.synchronize()
    return spent


def measure(shape: str, impl: str, args: argparse.Namespace, cycles: float | None) -> dict:
    step = make_step(shape, impl, args)
    for threaded in (True, False, True):  # compile, tune, warm both settings
        with torch.autograd.set_multithreading_enabled(threaded):
            for _ in range(args.warmup_steps):
                step()
    ts.synchronize()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.groups):
        for threaded in (True, False):
            with torch.autograd.set_multithreading_enabled(threaded):
                times[threaded].append(host_ms(step, args.steps, cycles))
    ts.clear_grads(step)

    def summary(values):
        return {"min_ms": round(min(values), 4), "median_ms": round(statistics.median(values), 4)}

    return {"shape": shape, "impl": impl, "mode": "meanflow", "dtype": args.dtype,
            "device_thread": summary(times[True]), "calling_thread": summary(times[False])}


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny shape on CPU through Triton's interpreter (plumbing)")
    parser.add_argument("--shape", nargs="+", choices=list(ts.SHAPES),
                        default=["dit-b2-256", "dit-b2-512"])
    parser.add_argument("--impl", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    parser.add_argument("--steps", type=int, default=None, help="steps per group (30; smoke 2)")
    parser.add_argument("--groups", type=int, default=None, help="groups per setting (8; smoke 2)")
    parser.add_argument("--out", type=Path, help="the JSON file to write")
    args = parser.parse_args(argv)
    args.dtype = "bf16" if ts.HAS_CUDA else "fp16"
    args.steps = args.steps or (2 if args.smoke else 30)
    args.groups = args.groups or (2 if args.smoke else 8)
    args.warmup_steps = 1 if args.smoke else 3
    args.layout = "contiguous"
    if args.smoke:
        args.shape = list(ts.SMOKE_SHAPES)
    return args


def main(argv: Iterable[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--smoke runs a tiny case on the CPU")
    cycles = ts.sleep_cycles_per_ms()
    data = {**bench.run_record(SCHEMA, args.smoke),
            "settings": {"dtype": args.dtype, "precision": bench.precision_mode(),
                         "steps_per_group": args.steps, "groups": args.groups,
                         "warmup_steps": args.warmup_steps},
            "impls": IMPLS,
            "definitions": {
                "device_thread": "torch.autograd.set_multithreading_enabled(True), PyTorch's "
                                 "default: on CUDA the backward runs on the engine's device "
                                 "thread",
                "calling_thread": "set_multithreading_enabled(False): the backward runs on "
                                  "the thread that called .backward()",
                "min_ms, median_ms": "host time per step over the groups (GPU kept busy)"},
            "rows": []}
    for shape in args.shape:
        for impl in args.impl:
            row = measure(shape, impl, args, cycles)
            data["rows"].append(row)
            print(f"{shape:11} {impl:13} device thread {row['device_thread']['min_ms']:7.3f} "
                  f"ms (median {row['device_thread']['median_ms']:7.3f}), calling thread "
                  f"{row['calling_thread']['min_ms']:7.3f} ms (median "
                  f"{row['calling_thread']['median_ms']:7.3f})", flush=True)
    if args.out:
        bench.write_json(args.out, data)
        print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    main()
