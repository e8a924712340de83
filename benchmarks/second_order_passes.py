#!/usr/bin/env python3
"""The backward through both outputs (second order) with chapter 6's passes and with chapter
12's Gluon passes: each pass alone at each of its tiles, and all three. Saved as JSON.

    python benchmarks/second_order_passes.py --out benchmarks/results/second_order_passes_h200.json
    python benchmarks/second_order_passes.py --smoke --out /tmp/passes.json   # CPU, interpreter

Each row times the library's call as a user makes it: `torch.autograd.grad` of both outputs
of `torch.func.jvp(attention)` (bf16 on the GPU), its kernels' GPU time per call from the
profiler (`call_ms`, with the largest kernels in `kernels`), TFLOP/s at fifteen products,
30 B H N^2 d (half when causal). A variant hands over the passes it names, at the tile it
names, and leaves the rest to chapter 6's kernels: "chapter6" none, "dk:32" the dK pass on
32-query visits, "all" the library's own choice (`SECOND_ORDER_PASSES` and default tiles).
`max_rel_diff` is each gradient's largest difference from chapter 6's, over chapter 6's
largest entry. A tile that does not fit (shared memory) is recorded with its error. Without
CUDA (`--smoke`) the calls run through Triton's interpreter at a small shape, where no pass
is handed over (`handed_over` false) and the times are None.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

if "--smoke" in sys.argv:  # Triton's interpreter: set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))

import jvp_attention  # noqa: E402
from jvp_attention import hopper_backward as hb  # noqa: E402

SCHEMA = "jvp_attention.second_order_passes/1"
SHAPES = ["4,16,4096,128", "4,16,4096,64", "2,16,8192,128"]
SMOKE_SHAPES = ["1,2,96,16"]
VARIANTS = ["chapter6", "dq:16", "dq:32", "dq:64", "dk:16", "dk:32", "dv:32", "dv:64", "all"]
TILE_KEYWORD = {"dq": "key_block", "dk": "query_rows", "dv": "query_rows"}
GRADIENTS = ("dq", "dk", "dv", "dtq", "dtk", "dtv")


def variant_context(variant: str) -> ExitStack:
    """A context in which the library hands over the passes `variant` names, at its tile."""
    stack = ExitStack()
    if variant == "all":
        return stack
    name, _, tile = variant.partition(":")
    passes = frozenset() if variant == "chapter6" else frozenset({name})
    stack.enter_context(mock.patch.object(hb, "SECOND_ORDER_PASSES", passes))
    if tile:
        launcher = f"launch_warp_specialized_{name}_tangent"
        stack.enter_context(mock.patch.object(hb, launcher, functools.partial(
            getattr(hb, launcher), **{TILE_KEYWORD[name]: int(tile)})))
    return stack


def measure(shape: tuple[int, ...], causal: bool, precision: str, variants: list[str],
            calls: int, device: str) -> list[dict]:
    """One row per variant at `shape` (B, H, N, D), bf16 on the GPU (fp16 on the CPU)."""
    from tile_sweep import kernel_ms

    batch, heads, n, d = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    torch.manual_seed(0)
    inputs = [torch.randn(batch, heads, n, d, dtype=dtype, device=device, requires_grad=True)
              for _ in range(6)]
    cotangents = [torch.randn(batch, heads, n, d, dtype=dtype, device=device)
                  for _ in range(2)]
    with jvp_attention.precision(precision):
        outputs = torch.func.jvp(lambda *x: jvp_attention.attention(*x, is_causal=causal),
                                 tuple(inputs[:3]), tuple(inputs[3:]))
    handed_over = hb.warp_specialized_tangent_passes(
        *inputs[:3], tuple(inputs[3:]), cotangents[0], cotangents[1], precision == "accurate")

    def call():
        with jvp_attention.precision(precision):
            return torch.autograd.grad(outputs, inputs, cotangents, retain_graph=True)

    flops = 30 * batch * heads * n * n * d / (2 if causal else 1)
    rows, reference = [], None
    for variant in ["chapter6", *[v for v in variants if v != "chapter6"]]:
        row = {"shape": list(shape), "causal": causal, "precision": precision,
               "variant": variant, "handed_over": handed_over, "call_ms": None,
               "tflops": None, "kernels": None, "max_rel_diff": None, "error": None}
        with variant_context(variant):
            try:
                grads = call()
                if device == "cuda":
                    per_kernel = kernel_ms(call, calls)
                    row["call_ms"] = sum(per_kernel.values())
                    row["tflops"] = flops / row["call_ms"] / 1e9
                    row["kernels"] = dict(sorted(per_kernel.items(),
                                                 key=lambda item: -item[1])[:4])
            except Exception as error:  # a tile over the shared memory, say: recorded
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                grads = None
        if reference is None:
            reference = grads
        elif grads is not None:
            row["max_rel_diff"] = {
                name: ((a.float() - b.float()).abs().max()
                       / b.float().abs().max().clamp_min(1e-30)).item()
                for name, a, b in zip(GRADIENTS, grads, reference, strict=True)}
        if variant in variants:
            rows.append(row)
        print(f"{str(shape):20} {'causal' if causal else 'full':6} {precision:8} "
              f"{variant:8}: " + (row["error"] or (
                  f"{row['call_ms']:.2f} ms ({row['tflops']:.0f} TFLOP/s)"
                  if row["call_ms"] is not None else "interpreter")), flush=True)
    return rows


def main() -> None:
    from warp_specialized import run_record

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", help="B,H,N,D (repeatable)")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both")
    parser.add_argument("--precision", nargs="+", choices=("accurate", "fast"),
                        default=["accurate", "fast"])
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--smoke runs a tiny case on the CPU")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    causal_modes = {"0": (False,), "1": (True,), "both": (False, True)}[args.causal]
    cases = [(tuple(int(x) for x in text.split(",")), causal, precision)
             for text in args.shape or (SMOKE_SHAPES if args.smoke else SHAPES)
             for causal in causal_modes for precision in args.precision]
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for done, (shape, causal, precision) in enumerate(cases, 1):
        rows += measure(shape, causal, precision, args.variants, args.calls, device)
        # Saved after every case, so that a run cut short keeps what it measured.
        record = run_record(SCHEMA, rows, smoke=args.smoke, calls=args.calls,
                            cases_done=f"{done} of {len(cases)}")
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
