#!/usr/bin/env python3
"""Causal calls in each launch order: the kernel's GPU time with the programs taken in groups
of 1, 4, 8 or 16 heads (chapter 2's `query_program`) and in the library's own choice
(`head_group`; for the backward's dK/dV kernel on Hopper, key/value heads and
`key_head_group`), outputs checked bitwise against groups of one. Saved as JSON.

    python benchmarks/causal_order.py --out benchmarks/results/causal_order_h100.json
    python benchmarks/causal_order.py --smoke --out /tmp/causal_order.json   # CPU, interpreter

A group of one is the order the kernels had before the groups: each head's tiles last first,
head after head. Times are the profiler's GPU time per call (`kernel_ms`: the attention
kernel, the largest; `call_ms`: every kernel of the call, the carry's passes included), the
mean of --calls calls after two warm-up calls. Each row also says whether its outputs equal
the group-of-one outputs bit for bit (`same_as_one`): the order moves programs, never the
arithmetic of a row (the backward compares dK and dV; its dQ, summed by atomic adds on
Hopper, rounds in the order the programs finish). Without CUDA (`--smoke`) the calls run through Triton's interpreter at
a small shape and the times are None.
"""

from __future__ import annotations

import argparse
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
from jvp_attention import forward, launch  # noqa: E402
from jvp_attention import hopper_backward as hb  # noqa: E402
from jvp_attention import warp_specialized as ws  # noqa: E402

SCHEMA = "jvp_attention.causal_order/1"
SHAPES = ["4,16,4096,128", "4,16,4096,64", "2,16,8192,64", "1,16,16384,128", "4,16,2048,64",
          "4,16,2048,128"]
SMOKE_SHAPES = ["1,3,200,16"]
GROUPS = ["1", "4", "8", "16", "auto"]


def forced_groups(group: str) -> ExitStack:
    """A context in which causal launches take `group` heads per group ("auto": the
    library's `head_group`)."""
    stack = ExitStack()
    if group != "auto":
        def fixed(is_causal, *keys, queries_per_head=1):
            return int(group) if is_causal else 1
        for module in (forward, ws):
            stack.enter_context(mock.patch.object(module, "head_group", fixed))
        stack.enter_context(mock.patch.object(
            hb, "key_head_group", lambda is_causal, *_: int(group) if is_causal else 1))
    return stack


def gpu_times(call, calls: int) -> tuple[float, float, str]:
    """(largest kernel's ms, all kernels' ms, its name) per call, from the profiler
    (`tools/tile_sweep.py`'s `kernel_ms`, after one more warm-up call)."""
    from tile_sweep import kernel_ms

    call()
    per_kernel = kernel_ms(call, calls)
    name = max(per_kernel, key=per_kernel.get)
    return per_kernel[name], sum(per_kernel.values()), name


def measure(shape: tuple[int, ...], mode: str, groups: list[str], calls: int,
            precision: str, device: str) -> list[dict]:
    """One row per group at `shape` (B, H, N, D) causal, bf16 on the GPU (fp16 on the CPU)."""
    batch, heads, n, d = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, dtype=dtype, device=device,
                           requires_grad=mode == "bwd") for _ in range(3))
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    if mode == "bwd":
        with jvp_attention.precision(precision):
            out = jvp_attention.attention(q, k, v, is_causal=True)

    def call():
        with jvp_attention.precision(precision):
            if mode == "bwd":  # dK, dV (dQ's atomic sum rounds in the programs' order)
                return torch.autograd.grad(out, (q, k, v), tangents[0], retain_graph=True)[1:]
            if mode == "fwd_jvp":
                return torch.func.jvp(
                    lambda a, b, c: jvp_attention.attention(a, b, c, is_causal=True),
                    (q, k, v), tangents)
            return (jvp_attention.attention(q, k, v, is_causal=True),)

    rows, reference = [], None
    for group in ["1", *[g for g in groups if g != "1"]]:
        with forced_groups(group):
            outputs = [x.clone() for x in call()]
            if reference is None:
                reference = outputs
            kernel_ms = call_ms = kernel = None
            if device == "cuda":
                kernel_ms, call_ms, kernel = gpu_times(call, calls)
        chosen = int(group) if group != "auto" else (
            hb.key_head_group(True, q, q, 1) if mode == "bwd" else
            launch.head_group(True, k, v, *(tangents[1:] if mode == "fwd_jvp" else ())))
        row = {"shape": list(shape), "mode": mode, "group": group, "heads_per_group": chosen,
               "kernel": kernel, "kernel_ms": kernel_ms, "call_ms": call_ms,
               "same_as_one": all(torch.equal(a, b) for a, b in zip(outputs, reference,
                                                                     strict=True))}
        if group in groups:
            rows.append(row)
        print(f"{str(shape):22} {mode:8} group {group:>4} ({chosen:>2} heads): "
              + (f"{kernel_ms:.3f} ms ({kernel[:30]}), call {call_ms:.3f} ms"
                 if kernel_ms is not None else "interpreter")
              + ("" if row["same_as_one"] else "  OUTPUTS DIFFER"), flush=True)
    return rows


def main() -> None:
    from warp_specialized import run_record

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", help="B,H,N,D (repeatable)")
    parser.add_argument("--mode", nargs="+", choices=("fwd", "fwd_jvp", "bwd"),
                        default=["fwd_jvp", "fwd", "bwd"])
    parser.add_argument("--groups", nargs="+", default=GROUPS)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--precision", choices=("accurate", "fast"), default="accurate")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--smoke runs a tiny case on the CPU")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shapes = args.shape or (SMOKE_SHAPES if args.smoke else SHAPES)
    rows = []
    for text in shapes:
        shape = tuple(int(x) for x in text.split(","))
        for mode in args.mode:
            rows += measure(shape, mode, args.groups, args.calls, args.precision, device)
    record = run_record(SCHEMA, rows, smoke=args.smoke, precision=args.precision,
                        calls=args.calls)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
