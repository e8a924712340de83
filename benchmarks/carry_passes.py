#!/usr/bin/env python3
"""The bf16 carry's passes alone (chapter 2's `value_operands`) against PyTorch's own
streaming kernels on the same tensors: GPU time per call and the bandwidth it implies, for
several settings of the range pass. Saved as JSON.

    python benchmarks/carry_passes.py --out benchmarks/results/carry_passes_h100.json
    python benchmarks/carry_passes.py --smoke --out /tmp/carry_passes.json  # CPU, interpreter

Each shape's v and tv are random bf16 (B, H, N, d) tensors (tv at 0.3 times v's scale:
both inside the copies' window, so the copy launch rewrites nothing). Variants:

- "copies made first": `value_operands(v, tv)` as the library runs it, and as
  "programs P, warps W" with the range pass's programs per tensor and warps set to each of
  PROGRAMS x WARPS;
- "range pass, then copies": the same two launches without copies made first (the range pass
  reads, the copy launch reads again and writes);
- "torch to float16": `v.to(torch.float16)` and `tv.to(torch.float16)`;
- "torch max |x|": `torch.linalg.vector_norm(x, inf)` of both, a reduction that only reads.

`kernels` is each CUDA kernel's GPU time per call (the profiler's mean of 20 calls after
one warm-up call), `ms` their sum, `gb_moved` the bytes the variant has to read and write
and `tb_per_s` their ratio. Without CUDA (`--smoke`) a tiny case runs through Triton's
interpreter, checks that every variant of ours makes the same copies, and the times are
None.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # Triton's interpreter: set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench  # noqa: E402  (run_record: device, versions, git)
from carry_cost import gpu_times  # noqa: E402

import jvp_attention  # noqa: E402
from jvp_attention.forward import value_operands, value_shifts  # noqa: E402
from jvp_attention.launch import carried_operands  # noqa: E402

SCHEMA = "jvp_attention.carry_passes/1"
SHAPES = [(16, 16, 1024, 72), (32, 12, 1024, 64), (16, 16, 1024, 128), (4, 16, 4096, 64)]
SMOKE_SHAPES = [(1, 2, 40, 16)]
PROGRAMS = (128, 512, 1024)
WARPS = (4, 8)
PROFILED_CALLS = 20


def with_range_pass(programs: int, warps: int, call):
    """`call` with the range pass's programs per tensor and warps set, restored after."""
    launch = jvp_attention.launch

    def run():
        saved = launch.RANGE_PROGRAMS, launch.RANGE_WARPS
        launch.RANGE_PROGRAMS, launch.RANGE_WARPS = programs, warps
        try:
            return call()
        finally:
            launch.RANGE_PROGRAMS, launch.RANGE_WARPS = saved
    return run


def variants(v: torch.Tensor, tv: torch.Tensor) -> dict[str, tuple]:
    """name -> (call, bytes read and written, whether it makes our copies)."""
    read = 2 * v.numel() * v.element_size()
    copied = read + 2 * v.numel() * 2  # and written as float16

    def ours():
        return value_operands(v, tv)

    def two_passes():  # as `value_operands` without copies made first
        (v_hat, tv_hat), exponents = carried_operands((v, tv), (), value_shifts, 0.0, 2)
        return v_hat, tv_hat, exponents

    table = {
        "copies made first": (ours, copied, True),
        "range pass, then copies": (two_passes, read + copied, True),
        "torch to float16": (lambda: (v.to(torch.float16), tv.to(torch.float16)), copied,
                             False),
        "torch max |x|": (lambda: [torch.linalg.vector_norm(x, float("inf")) for x in (v, tv)],
                          read, False),
    }
    for programs in PROGRAMS:
        for warps in WARPS:
            table[f"programs {programs}, warps {warps}"] = (
                with_range_pass(programs, warps, ours), copied, True)
    return table


def measure(shape: tuple[int, ...], device: str) -> list[dict]:
    """Every variant on one shape's v and tv."""
    generator = torch.Generator(device).manual_seed(0)
    v = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator)
    tv = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator) * 0.3
    expected = value_operands(v, tv)
    rows = []
    for name, (call, moved, ours) in variants(v, tv).items():
        if ours:  # every setting makes the same copies and exponents
            got = call()
            if not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
                raise AssertionError(f"{name} made other copies than value_operands")
        row = {"shape": list(shape), "variant": name, "gb_moved": round(moved / 1e9, 4),
               "ms": None, "tb_per_s": None, "kernels": None}
        if device == "cuda":
            call()  # warm-up (and compile)
            kernels = gpu_times(call, PROFILED_CALLS)
            ms = round(sum(kernels.values()), 4)
            row.update(kernels=kernels, ms=ms, tb_per_s=round(moved / 1e9 / ms, 2))
        rows.append(row)
        print(json.dumps({k: x for k, x in row.items() if k != "kernels"}), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny case")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--smoke runs a tiny case on the CPU")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    rows = [row for shape in (SMOKE_SHAPES if args.smoke else SHAPES)
            for row in measure(shape, device)]
    data = {**bench.run_record(SCHEMA, args.smoke), "dtype": "bfloat16", "rows": rows}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
