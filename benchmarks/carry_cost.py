#!/usr/bin/env python3
"""What accurate mode's bf16 carry costs a forward+JVP call (chapter 2): GPU time per call in
"accurate" and in "fast", in the same process, split into the attention kernels and the
carry's two passes (the range pass and the fp16 copies). Saved as JSON.

    python benchmarks/carry_cost.py --out benchmarks/results/carry_cost_h100.json
    python benchmarks/carry_cost.py --smoke --out /tmp/carry_cost.json   # CPU, interpreter
    python benchmarks/carry_cost.py --bias --modes accurate split fast --out results.json
    python benchmarks/carry_cost.py --bias --backward --modes accurate --out results.json

Each case calls `torch.func.jvp(attention)` as a user does (bf16, random inputs and
tangents), warms it up with three calls, times it with `triton.testing.do_bench` (`call_ms`:
the call as the host sees it, launches included) and then profiles ten calls: `kernels` is
each CUDA kernel's GPU time per call, `gpu_ms` their sum, `carry_ms` the carry's share.
Mode "split" is "accurate" with the carry turned off (the split products at every length).
With `--bias` the call also takes a learnable additive mask, (1, H, N, N) in bf16, with a
tangent of its own (`attention(..., attn_mask=bias)` under `torch.func.jvp`).
With `--parameter-bias` that bias has no tangent: a parameter closed over, as a model's
bias is under `torch.func.jvp` of its inputs (MeanFlow's call).
With `--backward` each call is a MeanFlow step's attention: the forward+JVP with q, k, v (and
the bias) requiring grad, then `out.backward(grad)`, so `kernels` holds the backward's too.
Without CUDA (`--smoke`) a tiny fp16 case runs through Triton's interpreter and the times
are None.
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

import jvp_attention  # noqa: E402

SCHEMA = "jvp_attention.carry_cost/1"
# (B, H, N, d): the training shapes that carry (1024 keys and more), and one that splits
SHAPES = [(16, 16, 1024, 72), (32, 12, 1024, 64), (16, 16, 1024, 128), (8, 16, 2048, 64),
          (64, 12, 256, 64), (4, 16, 4096, 64)]
SMOKE_SHAPES = [(1, 2, 40, 16)]
CARRY_KERNELS = ("range_partials_kernel", "carried_copies_kernel")
PROFILED_CALLS = 10


def gpu_times(call, calls: int = PROFILED_CALLS) -> dict[str, float]:
    """Each CUDA kernel's GPU time per call of `call`, in ms (the profiler's mean of
    `calls`)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return {event.key: round(event.device_time_total / calls / 1000, 4)
            for event in prof.key_averages()
            if event.device_type.name == "CUDA" and event.device_time_total > 0}


def measure(shape: tuple[int, ...], causal: bool, mode: str, dtype: torch.dtype,
            device: str, bias: bool = False, backward: bool = False,
            bias_tangent: bool = True) -> dict:
    """One case: the call's times in `mode` ("split": accurate without the carry); with
    `backward`, the forward+JVP and then the primal backward of q, k, v (and the bias).
    Without `bias_tangent` the bias is a parameter the transform does not see (no tangent)."""
    generator = torch.Generator(device).manual_seed(0)
    x = [torch.randn(shape, device=device, dtype=dtype, generator=generator) for _ in range(6)]
    parameters = ()
    if bias:  # a learnable bias (1, H, N, N): after v, its tangent after tv, or a parameter
        b, tb = (torch.randn((1, shape[1], shape[2], shape[2]), device=device, dtype=dtype,
                             generator=generator) for _ in range(2))
        x, parameters = ([*x[:3], b, *x[3:], tb], ()) if bias_tangent else (x, (b,))

    def attention(q, k, v, *mask):
        return jvp_attention.attention(q, k, v, *(mask or parameters), is_causal=causal)

    primals, tangents = tuple(x[:len(x) // 2]), tuple(x[len(x) // 2:])
    grad = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    learnable = (*primals, *parameters) if backward else ()
    for tensor in learnable:
        tensor.requires_grad_(True)

    def call():
        out, t_out = torch.func.jvp(attention, primals, tangents)
        if backward:
            for tensor in learnable:
                tensor.grad = None
            out.backward(grad)
        return out, t_out

    carry_min_keys = jvp_attention.launch.CARRY_MIN_KEYS
    if mode == "split":
        jvp_attention.launch.CARRY_MIN_KEYS = 1 << 62
    try:
        return {**timed_row(call, shape, causal, mode, bias, device), "backward": backward,
                "bias_tangent": bias and bias_tangent}
    finally:
        jvp_attention.launch.CARRY_MIN_KEYS = carry_min_keys


def timed_row(call, shape: tuple[int, ...], causal: bool, mode: str, bias: bool,
              device: str) -> dict:
    """`call` warmed up and timed in `mode` ("split" runs as "accurate")."""
    with jvp_attention.launch.precision("accurate" if mode == "split" else mode):
        for _ in range(3):
            call()
        row = {"shape": list(shape), "causal": causal, "mode": mode, "bias": bias,
               "call_ms": None, "gpu_ms": None, "carry_ms": None, "kernels": None}
        if device == "cuda":
            import triton.testing

            row["call_ms"] = round(triton.testing.do_bench(call, warmup=50, rep=300), 4)
            kernels = gpu_times(call)
            row.update(kernels=kernels, gpu_ms=round(sum(kernels.values()), 4),
                       carry_ms=round(sum(ms for name, ms in kernels.items()
                                          if name in CARRY_KERNELS), 4))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny fp16 case")
    parser.add_argument("--bias", action="store_true",
                        help="with a learnable additive mask and its tangent")
    parser.add_argument("--parameter-bias", action="store_true",
                        help="with --bias: the bias has no tangent (a parameter, as in "
                             "MeanFlow, where the tangents are the inputs')")
    parser.add_argument("--backward", action="store_true",
                        help="then the primal backward (a MeanFlow step's attention)")
    parser.add_argument("--modes", nargs="+", default=["accurate", "fast"],
                        choices=["accurate", "split", "fast"])
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="B,H,N,d shapes instead of the default list")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--smoke runs a tiny case on the CPU")
    args.bias = args.bias or args.parameter_bias
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shapes, dtype = (SMOKE_SHAPES, torch.float16) if args.smoke else (SHAPES, torch.bfloat16)
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split(",")) for shape in args.shapes]
    rows = []
    for shape in shapes:
        for causal in (False, True):
            if causal and shape[2] < 1024 and not args.smoke:
                continue
            for mode in args.modes:
                rows.append(measure(shape, causal, mode, dtype, device, args.bias,
                                    args.backward, not args.parameter_bias))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "kernels"}),
                      flush=True)
    data = {**bench.run_record(SCHEMA, args.smoke), "dtype": str(dtype).removeprefix("torch."),
            "carry_kernels": list(CARRY_KERNELS), "rows": rows}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
