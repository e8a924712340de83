#!/usr/bin/env python3
"""Products of zeros in a compiled MeanFlow training step: the matrix products and
convolutions one step runs, and its GPU time, with PyTorch's kernels for forward AD's zero
tangents and with `jvp_attention.lean_zero_tangents` (chapter 13). Saved as JSON.

    python benchmarks/compiled_products.py --out benchmarks/results/compiled_products_h200.json
    python benchmarks/compiled_products.py --smoke   # CPU: a tiny DiT, float32

Under `torch.func.jvp` every linear layer whose weight has no tangent multiplies by that
zero tangent, and PyTorch's fallback computes the product on zeros filled in memory. The
lean kernels answer such a product with a zero tensor, and when they are on while a step is
traced, the compiled graph holds the zero tensor instead of the product. Whether a compiled
training step (the DiT's forward with its JVP, the loss, its backward) still runs those
products with PyTorch's kernels is what this measures: for each setting the step is
compiled anew (`torch._dynamo.reset()`, Inductor's caches off: a graph cached from the other
setting would otherwise stand in for it), run a few times, then profiled for one step.

Counted: the products in the code Inductor writes for the step (`products_in_code`: calls
of `extern_kernels.mm`, `addmm`, `bmm`, `convolution`, forward and backward graphs); per
step, the profiler's `aten::mm`, `aten::addmm`, `aten::bmm` and
`aten::convolution` calls (Inductor calls these for the products it does not generate
itself: all of them in the default mode), and on a GPU the time of all kernels and of the
kernels named like cuBLAS's GEMMs. The model is `examples/meanflow_dit.py`'s DiT with
DiT-B/2's width and heads, fewer blocks (the count scales with the depth), bf16 autocast
(`--dtype float32`: none).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for folder in (HERE, REPO / "examples"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import bench  # noqa: E402  (the run record: device, versions, commit)
import meanflow_dit as md  # noqa: E402
import torch  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import jvp_attention  # noqa: E402

SCHEMA = "jvp_attention.compiled_products/1"
PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::convolution")
# cuBLAS's and CUTLASS's GEMM kernels by name (Hopper's cuBLAS names its own nvjet_*).
GEMM_KERNEL = re.compile(r"gemm|nvjet|cutlass|sm90_xmma", re.IGNORECASE)
# The products in Inductor's code for the graphs (forward and backward).
PRODUCT_CALL = re.compile(r"extern_kernels\.(?:mm|addmm|bmm|convolution)\(")
ZERO_TANGENTS = ("pytorch", "lean")


def profiled_step(step) -> profile:
    """One call of `step` under the profiler (CUDA kernels too, on a GPU)."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
        bench.synchronize()
    return prof


def step_products(prof: profile) -> dict:
    """The step's product calls by op, and on a GPU its kernels' times (ms)."""
    ops = collections.Counter(e.name for e in prof.events() if e.name in PRODUCT_OPS)
    row = {"products": sum(ops.values()), "products_by_op": dict(sorted(ops.items()))}
    if torch.cuda.is_available():
        kernels = [e for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        gemms = [e for e in kernels if GEMM_KERNEL.search(e.key)]
        row |= {"gpu_ms": round(sum(e.self_device_time_total for e in kernels) / 1e3, 3),
                "gemm_kernels": sum(e.count for e in gemms),
                "gemm_ms": round(sum(e.self_device_time_total for e in gemms) / 1e3, 3)}
    return row


@torch._inductor.config.patch(force_disable_caches=True)
def measure(dit: md.DiTConfig, batch: int, attention: str, dtype: str, zeros: str,
            warmup: int) -> dict:
    """One compiled MeanFlow step's products with `zeros` ("pytorch" or "lean"), compiled
    without Inductor's caches: the lean kernels change the graph below what a cache may key
    on, so a graph cached from the other setting must not stand in for this one."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = md.TrainConfig(batch_size=batch, attention=attention, dtype=dtype)
    torch._dynamo.reset()
    torch.manual_seed(0)
    with jvp_attention.lean_zero_tangents(zeros == "lean"):
        model = md.MeanFlow(dit).to(device)
        optimizer, _ = md.make_optimizer(model, config)
        compiled = torch.compile(model)
        data = md.global_batch(0, batch, dit.image_size)

        def step():
            md.training_step(compiled, optimizer, data, config, device)

        start = time.perf_counter()
        _, sources = run_and_get_code(step)  # compiles: the code Inductor wrote
        for _ in range(warmup - 1):
            step()
        bench.synchronize()
        warmup_s = time.perf_counter() - start
        row = {"zero_tangents": zeros, "warmup_s": round(warmup_s, 1),
               "products_in_code": sum(len(PRODUCT_CALL.findall(code)) for code in sources),
               **step_products(profiled_step(step))}
    torch._dynamo.reset()
    return row


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=2, help="DiT blocks (default 2)")
    parser.add_argument("--image-size", type=int, default=64,
                        help="pixels a side, patch 2: 64 -> 1024 tokens (default)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--attention", choices=("jvp_attention", "math"),
                        default="jvp_attention")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the step's autocast dtype (float32: no autocast)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps before the profiled one (the first compiles)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU plumbing check: width 64, 4 heads, 8x8 images, float32")
    parser.add_argument("--out", type=Path, help="the JSON file to write")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--smoke runs a tiny case on the CPU")
    if args.smoke:
        dit = md.DiTConfig(image_size=8, patch_size=2, width=64, depth=args.depth, heads=4)
        batch, dtype, warmup = 2, "float32", 1
    else:
        dit = md.DiTConfig(image_size=args.image_size, patch_size=2, width=768,
                           depth=args.depth, heads=12)
        batch, dtype, warmup = args.batch, args.dtype, args.warmup
    data = bench.run_record(SCHEMA, args.smoke)
    data |= {"model": {"width": dit.width, "depth": dit.depth, "heads": dit.heads,
                       "tokens": dit.tokens, "batch": batch, "dtype": dtype,
                       "attention": args.attention},
             "step": "examples/meanflow_dit.py's MeanFlow training step (torch.func.jvp through "
                     "the DiT, the loss, its backward, Adam), the model under torch.compile "
                     "(default mode)",
             "counted": f"products_in_code: {PRODUCT_CALL.pattern} in Inductor's code; "
                        f"profiler calls of {', '.join(PRODUCT_OPS)} in one step; on a GPU "
                        f"also every kernel's time (gpu_ms) and the kernels named like GEMMs "
                        f"(gemm_kernels, gemm_ms: {GEMM_KERNEL.pattern})",
             "rows": []}
    for zeros in ZERO_TANGENTS:
        row = measure(dit, batch, args.attention, dtype, zeros, warmup)
        data["rows"].append(row)
        print(row, flush=True)
    if args.out:
        bench.write_json(args.out, data)
        print(f"-> {args.out}")
    return data


if __name__ == "__main__":
    main()
