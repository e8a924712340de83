#!/usr/bin/env python3
"""The first call at a new shape in a new process: how long a user waits before the first
training step runs, with nothing cached, with Triton's compiled kernels cached, and with the
tuned tiles cached as well (`jvp_attention.launch.KeyedAutotuner` stores them in Triton's
cache directory). Saved as JSON.

    python benchmarks/first_call.py --out benchmarks/results/first_call_h200.json
    python benchmarks/first_call.py --smoke   # CPU: a tiny shape through Triton's interpreter

Python's bytecode is compiled once first, as an installed package has it: one process runs
the step on a tiny shape (on the GPU, with a Triton cache of its own that is then thrown
away; through Triton's interpreter with --smoke) with `PYTHONPYCACHEPREFIX` set to a
folder of this run, and every timed process reads that folder (on a machine whose
site-packages were never imported, compiling torch's modules from source alone took 8 s of
a first step). Each measurement is then a fresh Python process (`--child`) that imports
jvp_attention, runs one
MeanFlow-style step at the shape (`torch.func.jvp(attention)`, then `loss.backward()` on a
scalar loss of the primal output, as a training loop calls it: the forward+JVP kernel and
the kernels of the backward) and times the jvp and the backward of that first step, then
of a second step. (Runs before 2026-12-05 called `torch.autograd.grad(out, ..., grad)`,
whose first call imports sympy to check the gradient's shape: about a second that a
scalar loss does not pay.) Its `TRITON_CACHE_DIR` is a
folder of this run, in three states, in this order:

    cold      empty: Triton compiles every candidate tile and times them
    compiled  the compiled kernels the cold process left, its tuned tiles deleted: the
              tiles are timed again, without compiling
    tuned     everything the earlier processes left: the tuned tiles are read back
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCHEMA = "jvp_attention.first_call/1"
# name: (B, H, N, d), bf16 on the GPU (DiT shapes of benchmarks/training_shapes.py)
SHAPES = {"dit-b2-256": (64, 12, 256, 64), "dit-b2-512": (32, 12, 1024, 64),
          "dit-xl2-256": (32, 16, 256, 72)}
SMOKE_SHAPES = {"smoke": (1, 2, 32, 16)}
STATES = ("cold", "compiled", "tuned")
STATE_LABELS = {
    "cold": "empty TRITON_CACHE_DIR: compile every candidate tile and time them",
    "compiled": "the compiled kernels of the cold process, its tuned tiles (*.autotune.json) "
                "deleted: time the tiles again without compiling",
    "tuned": "the compiled kernels and the tuned tiles of the earlier processes",
}


def child(shape: str) -> dict:
    """One fresh process's first and second MeanFlow-style steps at `shape` (seconds)."""
    start = time.perf_counter()
    import torch

    import jvp_attention

    attention = jvp_attention.attention  # the package loads its modules on first use
    imported = time.perf_counter() - start
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    b, h, n, d = {**SHAPES, **SMOKE_SHAPES}[shape]
    generator = torch.Generator(device).manual_seed(0)
    primals = [torch.randn(b, h, n, d, device=device, dtype=dtype, generator=generator)
               .requires_grad_() for _ in range(3)]
    tangents = [torch.randn(b, h, n, d, device=device, dtype=dtype, generator=generator)
                for _ in range(3)]
    grad = torch.randn(b, h, n, d, device=device, dtype=dtype, generator=generator)

    def sync() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    steps = []
    for _ in range(2):
        t0 = sync()
        out, _ = torch.func.jvp(attention, tuple(primals), tuple(tangents))
        t1 = sync()
        (out.float() * grad).sum().backward()
        t2 = sync()
        for x in primals:
            x.grad = None
        steps.append({"jvp_s": round(t1 - t0, 4), "backward_s": round(t2 - t1, 4)})
    return {"import_s": round(imported, 3), "first": steps[0], "second": steps[1]}


def run_child(shape: str, cache: Path, smoke: bool, bytecode: Path) -> dict:
    """The child's result at `shape` with Triton's cache `cache` and Python's bytecode in
    `bytecode` (through Triton's interpreter with `smoke`); `process_s` is the whole
    process's wall time."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONPYCACHEPREFIX=str(bytecode))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", shape]
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{shape}: the child process failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = round(time.perf_counter() - start, 3)
    return result


def forget_tuned_tiles(cache: Path) -> int:
    """Delete the tuned tiles in `cache`, keep the compiled kernels; returns how many."""
    files = list(cache.rglob("*.autotune.json"))
    for path in files:
        path.unlink()
    return len(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the JSON file to write (default: "
                        "benchmarks/results/first_call_<cpu|gpu>.json)")
    parser.add_argument("--shape", nargs="+", choices=list(SHAPES), help="only these shapes")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU plumbing check: a tiny shape through Triton's interpreter")
    parser.add_argument("--child", metavar="SHAPE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    import torch  # (the children time their own imports)

    if not args.smoke and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--smoke runs a tiny case on the CPU")

    sys.path.insert(0, str(HERE))
    import bench  # the run record: device, versions, commit

    shapes = list(SMOKE_SHAPES) if args.smoke else (args.shape or list(SHAPES))
    data = bench.run_record(SCHEMA, args.smoke)
    data.update({"shapes": {name: dict(zip("BHNd", (SMOKE_SHAPES if args.smoke else SHAPES)[name],
                                           strict=True)) for name in shapes},
                 "dtype": "fp16 (interpreter)" if args.smoke else "bf16",
                 "states": STATE_LABELS,
                 "step": "out, _ = torch.func.jvp(attention, (q, k, v), (tq, tk, tv)); "
                         "(out.float() * grad).sum().backward(); q, k, v require grad",
                 "cases": []})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jvp_first_call_bytecode_") as bytecode_dir:
        bytecode = Path(bytecode_dir)
        with tempfile.TemporaryDirectory(prefix="jvp_first_call_warmup_") as folder:
            warmed = run_child(next(iter(SMOKE_SHAPES)), Path(folder), args.smoke, bytecode)
        data["bytecode_warmup_s"] = warmed["process_s"]
        print(f"Python bytecode compiled in {warmed['process_s']:.1f} s", flush=True)
        for shape in shapes:
            with tempfile.TemporaryDirectory(prefix="jvp_first_call_") as folder:
                cache = Path(folder)
                for state in STATES:
                    deleted = forget_tuned_tiles(cache) if state == "compiled" else 0
                    result = run_child(shape, cache, args.smoke, bytecode)
                    case = {"shape": shape, "state": state, "tuned_tiles_deleted": deleted, **result}
                    data["cases"].append(case)
                    first = result["first"]
                    print(f"{shape:12s} {state:9s} first step: jvp {first['jvp_s']:7.3f} s, "
                          f"backward {first['backward_s']:7.3f} s | second step "
                          f"{result['second']['jvp_s'] + result['second']['backward_s']:.4f} s | "
                          f"import {result['import_s']:.2f} s", flush=True)
    data["wall_seconds"] = round(time.perf_counter() - started, 1)
    out = args.out or REPO / "benchmarks" / "results" / (
        f"first_call_{'gpu' if data['device'].get('cuda') else 'cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
