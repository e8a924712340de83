"""Time every tile of the forward+JVP kernel's autotuning list at given shapes and head dims,
on a GPU: what the autotuner chooses from, and how far the best tile of one head dim is from
another's. Times are the attention kernels' GPU time per `torch.func.jvp(attention)` call,
from the profiler (short calls are bound by host work, so wall time would hide the kernels).

    python tools/tile_sweep.py --shape 64 12 256 --shape 32 12 1024 --head-dims 64 72 80 \
        --json sweep.json

Each tile runs alone (the autotuner's list is narrowed to it); a tile that cannot launch
(shared memory) is reported with its error. `auto` is the autotuner's own choice.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jvp_attention  # noqa: E402
from jvp_attention import forward  # noqa: E402
from jvp_attention.launch import tile_configs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def kernel_ms(call, calls: int) -> float:
    """GPU time of all kernels per call (the call's launches), from the profiler."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.device_type == DeviceType.CUDA)
    return total_us / calls / 1e3


def tile_name(config) -> str:
    kw = config.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']} w{config.num_warps} s{config.num_stages}"


def sweep(shape: tuple[int, int, int, int], dtype: torch.dtype, calls: int,
          tiles: list | None = None) -> list[dict]:
    """One row per tile (and one for the autotuner's choice among them) at `shape` =
    (B, H, N, d); `tiles`: configurations to try in place of the kernel's list."""
    torch.manual_seed(0)
    primals = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3)]
    tangents = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3)]
    b, h, n, d = shape
    flops = 3 * 4 * b * h * n * n * d  # the forward's two products, credited 3x for the JVP

    def call():
        return torch.func.jvp(jvp_attention.attention, tuple(primals), tuple(tangents))

    tuner = forward._attention_forward_jvp
    every = list(tuner.configs)
    candidates = tiles or every
    rows = []
    try:
        for config in [*candidates, None]:
            tuner.configs = candidates if config is None else [config]
            tuner.tuned.clear()
            tuner.cache.clear()
            row = {"B": b, "H": h, "N": n, "d": d, "tile": "auto" if config is None
                   else tile_name(config)}
            try:
                ms = kernel_ms(call, calls)
                row |= {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
                if config is None:
                    row["chosen"] = tile_name(tuner.best_config)
            except Exception as error:  # noqa: BLE001 - a tile that cannot launch is a row
                row["error"] = f"{type(error).__name__}: {str(error)[:120]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        tuner.configs = every
        tuner.tuned.clear()
        tuner.cache.clear()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", nargs=3, type=int, action="append", metavar=("B", "H", "N"),
                        help="batch, heads, tokens (repeatable); default 64 12 256")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 72])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tiles", help="try these tiles instead of the kernel's list: "
                        "'M,N,warps,stages;...' (tools/kernel_resources.py checks them for "
                        "spills without a GPU)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the sweep times kernels on a CUDA GPU")
    tiles = args.tiles and tile_configs([tuple(int(x) for x in tile.split(","))
                                         for tile in args.tiles.split(";")])
    rows = [row for b, h, n in (args.shape or [[64, 12, 256]]) for d in args.head_dims
            for row in sweep((b, h, n, d), DTYPES[args.dtype], args.calls, tiles)]
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "dtype": args.dtype,
                                         "gpu": torch.cuda.get_device_name(),
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
