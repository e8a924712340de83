#!/usr/bin/env python3
"""Chapter 11's warp-specialised forward, schedule by schedule, timed beside chapter 2's
forward and SDPA's backends on Hopper. Saved as JSON (read by chapter 11).

    python benchmarks/warp_specialized.py --out benchmarks/results/warp_specialized_h200.json
    python benchmarks/warp_specialized.py --resources   # CPU: compile for sm_90, ptxas -v

Each variant changes one launch option of `jvp_attention.warp_specialized` (chapter 11):
`ws_serial`, one group of 8 compute warps that waits for each product; `ws_pipelined`, the
same group overlapping a tile's softmax with the previous tile's value product;
`ws_pingpong`, two groups of 64 rows taking turns at the tensor cores; `ws_pingpong_s3`,
a ring of three key/value slots (the library's choice); `ws_pingpong_n64`, 64-key tiles.

Every call is checked against float64 attention before it is timed (the error as a multiple
of PyTorch's math path's in the same dtype, up to --check-n), then timed with
`triton.testing.do_bench` beside `jvp_attention.attention` under no_grad (`ours`, which
takes chapter 11's kernel itself where eligible: run with JVP_ATTENTION_WARP_SPECIALIZED=0
for chapter 2's) and SDPA's flash and cuDNN backends, credited 4·B·H·N²·d FLOPs (half of
it when causal). `--resources` compiles each variant for sm_90 on a machine without a GPU
and reports registers, spills, shared memory and the partitions' register budgets.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from jvp_attention import warp_specialized as ws  # noqa: E402

SCHEMA = "jvp_attention.warp_specialized/1"
VARIANTS = {  # name: launch options of chapter 11's kernel, one change at a time
    "ws_serial": dict(stages=2, key_block=128, pipeline=False, pingpong=False),
    "ws_pipelined": dict(stages=2, key_block=128, pipeline=True, pingpong=False),
    "ws_pingpong_serial": dict(stages=2, key_block=128, pipeline=False, pingpong=True),
    "ws_pingpong": dict(stages=2, key_block=128, pipeline=True, pingpong=True),
    "ws_pingpong_s3": dict(stages=3, key_block=128, pipeline=True, pingpong=True),
    "ws_pingpong_n64": dict(stages=3, key_block=64, pipeline=True, pingpong=True),
}
assert VARIANTS["ws_pingpong_s3"]["stages"] == ws.RING_STAGES  # the library's choice


def ws_call(q, k, v, causal: bool, options: dict):
    """Chapter 11's kernel with these launch options: a zero-argument call."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    scale = q.shape[-1] ** -0.5
    return lambda: ws.launch_warp_specialized(q, k, v, out, None, lse, causal, scale,
                                              **options) or out


def compiled_report(kernel, descriptors: dict, scalars: dict, constexprs: dict,
                    num_warps: int) -> dict:
    """Compile Gluon `kernel` for sm_90 on this machine (no GPU needed): registers and
    spills (ptxas -v), shared memory, the partitions' register budgets (setmaxnreg) and the
    count of warpgroup products in the PTX. `descriptors` and `scalars` (argument name ->
    Triton type) are its runtime arguments, in order."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    from kernel_resources import ptxas_report  # noqa: E402

    signature = {arg: native_specialize_impl(BaseBackend, desc, False, True, True)[0]
                 for arg, desc in descriptors.items()}
    signature |= scalars
    constexprs = constexprs | {"num_warps": num_warps}
    signature |= {constant: "constexpr" for constant in constexprs}
    start = time.perf_counter()
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 128),
                              options={"num_warps": num_warps, "maxnreg": ws.LAUNCH_REGS})
    ptx = compiled.asm["ptx"]
    budgets = re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)
    return {**ptxas_report(ptx), "shared": compiled.metadata.shared,
            "setmaxnreg": sorted(set(budgets)),
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "compile_s": round(time.perf_counter() - start, 2)}


def compile_for_hopper(name: str, causal: bool = False, d: int = 128,
                       dtype: torch.dtype = torch.bfloat16, residual: bool = False) -> dict:
    """Variant `name` of the primal kernel compiled for sm_90 (`compiled_report`)."""
    options = VARIANTS[name]
    x = torch.empty(1, 1, 1024, d, dtype=dtype)
    group_rows = ws.GROUP_ROWS if options["pingpong"] else 2 * ws.GROUP_ROWS
    rows = (group_rows, options["key_block"], options["key_block"], group_rows, group_rows)
    descriptors = {name: ws._descriptor(x, r) for name, r in
                   zip(("q_desc", "k_desc", "v_desc", "o_desc", "r_desc"), rows, strict=True)}
    scalars = {"lse_ptr": "*fp32", "n_heads": "i32", "n_q": "i32", "n_k": "i32",
               "group_size": "i32", "qk_scale": "fp32"}
    constexprs = {"STAGES": options["stages"], "PIPELINE": options["pipeline"],
                  "PINGPONG": options["pingpong"], "CAUSAL": causal,
                  "STORE_RESIDUAL": residual, "HEAD_GROUP": 8 if causal else 1}
    report = compiled_report(ws.warp_specialized_forward_kernel, descriptors, scalars,
                             constexprs, 4 if options["pingpong"] else 8)
    return {"variant": name, **options, "causal": causal, "residual": residual,
            "dtype": str(dtype).removeprefix("torch."), "d": d, **report}


def resources(dtype: torch.dtype, d: int) -> list[dict]:
    """Every variant compiled for sm_90, and the library's with the causal mask."""
    rows = []
    for name, causal in [(name, False) for name in VARIANTS] + [("ws_pingpong_s3", True)]:
        rows.append(compile_for_hopper(name, causal, d, dtype))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def reference_error(out, q, k, v, causal: bool) -> tuple[float, float]:
    """Max error of `out` and of PyTorch's math path in the same dtype, both against float64."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    exact = sdpa(q.double(), k.double(), v.double(), is_causal=causal)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        math_out = sdpa(q, k, v, is_causal=causal)
    return ((out.double() - exact).abs().max().item(),
            (math_out.double() - exact).abs().max().item())


def triton_forward(q, k, v, causal: bool):
    """`jvp_attention.attention` with chapter 11's kernel switched off: chapter 2's forward."""
    import jvp_attention

    os.environ["JVP_ATTENTION_WARP_SPECIALIZED"] = "0"
    try:
        return jvp_attention.attention(q, k, v, is_causal=causal)
    finally:
        del os.environ["JVP_ATTENTION_WARP_SPECIALIZED"]


def timed_calls(q, k, v, causal: bool) -> dict:
    """name -> zero-argument forward call, ours and SDPA's fused backends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import jvp_attention

    def sdpa(backend):
        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=causal)
        return call

    calls = {name: ws_call(q, k, v, causal, options) for name, options in VARIANTS.items()}
    calls["ours"] = lambda: jvp_attention.attention(q, k, v, is_causal=causal)
    calls["ours_triton"] = lambda: triton_forward(q, k, v, causal)
    calls["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    calls["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    return calls


def measure(shapes, dtype, check_n: int, causal_modes) -> list[dict]:
    """Check and time every call at every shape; FLOPs credited as dense (causal: half)."""
    rows = []
    for (B, H, N, d), causal in ((shape, c) for shape in shapes for c in causal_modes):
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        flops = 4 * B * H * N * N * d / (2 if causal else 1)
        check = functools.partial(output_errors, q=q, k=k, v=v, causal=causal)
        with torch.no_grad():
            for name, call in timed_calls(q, k, v, causal).items():
                rows.append(checked_and_timed(
                    {"shape": [B, H, N, d], "causal": causal, "impl": name}, call,
                    check if N <= check_n else None, flops))
    return rows


def output_errors(out, q, k, v, causal: bool) -> dict:
    """The error columns of a call's output (the first of a tuple)."""
    out = out[0] if isinstance(out, tuple) else out
    ours_err, math_err = reference_error(out, q, k, v, causal)
    return {"max_err": ours_err, "math_max_err": math_err, "err_ratio": ours_err / math_err}


def checked_and_timed(row: dict, call, check, flops: float) -> dict:
    """`row` with `check(call())`'s columns (unless check is None), then the call's time and
    TFLOP/s; a call that fails records why, so that the others still run. Printed too."""
    try:
        result = call()
        torch.cuda.synchronize()
        if check is not None:
            row |= check(result)
        ms = triton.testing.do_bench(call, warmup=25, rep=100)
        row |= {"ms": ms, "tflops": flops / ms / 1e9}
    except Exception as error:  # a backend that does not run here: say why
        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    print(json.dumps(row), flush=True)
    return row


def schedule_arguments(description: str, shapes: list[str]) -> argparse.ArgumentParser:
    """The options the warp-specialised benchmarks share: --resources, --shapes, --check-n
    and --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--resources", action="store_true",
                        help="compile each variant for sm_90 and report (no GPU needed)")
    parser.add_argument("--shapes", nargs="+", default=shapes, help="B,H,N,d")
    parser.add_argument("--check-n", type=int, default=4096,
                        help="check against float64 up to this N (the reference is O(N^2))")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    return parser


def run_record(schema: str, rows: list[dict], **extra) -> dict:
    """A saved run: schema, date, command, GPU, versions, `extra` and the rows."""
    return {"schema": schema, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python", *sys.argv]),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "versions": {"torch": torch.__version__, "triton": triton.__version__},
            **extra, "rows": rows}


def main() -> None:
    parser = schedule_arguments(__doc__.split("\n")[0], ["4,16,4096,128", "1,16,16384,128",
                                                         "4,16,4096,64", "32,12,1024,64"])
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both")
    args = parser.parse_args()
    if not args.resources and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--resources compiles for sm_90 on the CPU")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.resources:
        rows = resources(dtype, 128) + resources(dtype, 64)
    else:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        causal_modes = {"0": (False,), "1": (True,), "both": (False, True)}[args.causal]
        rows = measure(shapes, dtype, args.check_n, causal_modes)
    if args.out:
        args.out.write_text(json.dumps(run_record(SCHEMA, rows, dtype=args.dtype), indent=1)
                            + "\n")

if __name__ == "__main__":
    main()
