#!/usr/bin/env python3
"""Chapter 11's warp-specialised forward with its JVP, timed beside chapter 2's Triton
forward with its JVP on Hopper, checked against float64 first. Saved as JSON (read by
chapter 11).

    python benchmarks/warp_specialized_jvp.py --out benchmarks/results/warp_specialized_jvp_h200.json
    python benchmarks/warp_specialized_jvp.py --resources   # CPU: compile for sm_90, ptxas -v

Calls, each `torch.func.jvp(jvp_attention.attention)` as users make it unless named `ws_`:
`ours_accurate` and `ours_fast` (the library's choice: chapter 11's kernel where it takes
the call), `triton_accurate` and `triton_fast` (JVP_ATTENTION_WARP_SPECIALIZED=0: chapter
2's kernel), and `ws_<tile>` direct launches of chapter 11's kernel with other key tiles and
ring depths, in "fast" precision. FLOPs are credited as 3x the forward's (chapter 8). Each
call's out and tangent_out are checked against float64 (the error as a multiple of PyTorch
math's `torch.func.jvp` in the same dtype) up to --check-n.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from warp_specialized import (  # noqa: E402
    checked_and_timed,
    compiled_report,
    run_record,
    schedule_arguments,
)

from jvp_attention import warp_specialized as ws  # noqa: E402

SCHEMA = "jvp_attention.warp_specialized_jvp/1"
TILES = {  # name: (d, keys per tile, ring slots); the library's are JVP_KEY_BLOCKS, 2 slots
    "d128_n64_s2": (128, 64, 2),
    "d128_n128_s1": (128, 128, 1),
    "d64_n128_s2": (64, 128, 2),
    "d64_n64_s3": (64, 64, 3),
}


def compile_for_hopper(name: str, causal: bool = False, carry: bool = False,
                       residual: bool = False) -> dict:
    """Tile `name` of the forward with its JVP compiled for sm_90 (`compiled_report`);
    `carry` compiles "accurate" bf16's (fp16 values, the factors read on the device)."""
    d, key_block, stages = TILES[name]
    x = torch.empty(1, 1, 1024, d, dtype=torch.bfloat16)
    values = x.half() if carry else x
    rows = {"q_desc": (x, ws.GROUP_ROWS), "k_desc": (x, key_block),
            "v_desc": (values, key_block), "tq_desc": (x, ws.GROUP_ROWS),
            "tk_desc": (x, key_block), "tv_desc": (values, key_block),
            "o_desc": (x, ws.GROUP_ROWS), "t_desc": (x, ws.GROUP_ROWS),
            "r_desc": (x, ws.GROUP_ROWS), "tr_desc": (x, ws.GROUP_ROWS)}
    descriptors = {name: ws._descriptor(t, r) for name, (t, r) in rows.items()}
    scalars = {"lse_ptr": "*fp32", "mu_ptr": "*fp32", "factors_ptr": "*fp32", "n_heads": "i32",
               "n_q": "i32", "n_k": "i32", "group_size": "i32", "qk_scale": "fp32",
               "scale": "fp32"}
    constexprs = {"STAGES": stages, "CAUSAL": causal, "CARRY": carry,
                  "STORE_RESIDUAL": residual, "HEAD_GROUP": 8 if causal else 1}
    report = compiled_report(ws.warp_specialized_jvp_kernel, descriptors, scalars, constexprs, 4)
    return {"tile": name, "d": d, "key_block": key_block, "stages": stages, "causal": causal,
            "carry": carry, "residual": residual, **report}


def resources() -> list[dict]:
    """Every tile compiled for sm_90 in "fast" precision, and the library's tiles as the
    library runs them in "accurate" (carried, with residuals, causal)."""
    rows = []
    for name, causal, carry in ([(name, False, False) for name in TILES]
                                + [("d128_n64_s2", True, True), ("d64_n128_s2", True, True)]):
        rows.append(compile_for_hopper(name, causal, carry, residual=carry))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def errors(result, q, k, v, tangents, causal: bool) -> dict:
    """Max errors of out and tangent_out against float64, each over PyTorch math's in the
    inputs' dtype (torch.func.jvp of the math path)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from jvp_attention.reference import reference_attention

    exact = reference_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                enable_gqa=True, tangents=tuple(t.double() for t in tangents))
    with sdpa_kernel(SDPBackend.MATH):
        floor = torch.func.jvp(
            lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                a, b, c, is_causal=causal, enable_gqa=True), (q, k, v), tangents)
    row = {}
    for name, mine, low, truth in (("out", result[0], floor[0], exact.out),
                                   ("tangent_out", result[1], floor[1], exact.tangent_out)):
        error = (mine.double() - truth).abs().max().item()
        row[f"{name}_err_ratio"] = error / (low.double() - truth).abs().max().item()
    return row


def library(q, k, v, tangents, causal: bool, precision: str, warp_specialized: bool):
    """torch.func.jvp(jvp_attention.attention) in `precision`, with chapter 11's kernels
    allowed or switched off."""
    import jvp_attention

    os.environ["JVP_ATTENTION_WARP_SPECIALIZED"] = "1" if warp_specialized else "0"
    try:
        with jvp_attention.precision(precision):
            return torch.func.jvp(
                lambda a, b, c: jvp_attention.attention(a, b, c, is_causal=causal),
                (q, k, v), tangents)
    finally:
        del os.environ["JVP_ATTENTION_WARP_SPECIALIZED"]


def direct(q, k, v, tangents, causal: bool, key_block: int, stages: int):
    """Chapter 11's kernel launched with these tiles, "fast": a zero-argument call."""
    out, t_out = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    mu = torch.empty_like(lse)

    def call():
        ws.launch_warp_specialized_jvp(q, k, v, tangents, (out, t_out), None, lse, mu, causal,
                                       q.shape[-1] ** -0.5, key_block=key_block,
                                       stages=stages)
        return out, t_out
    return call


def timed_calls(q, k, v, tangents, causal: bool) -> dict:
    """name -> zero-argument call returning (out, tangent_out)."""
    calls = {}
    for precision in ("accurate", "fast"):
        for name, on in (("ours", True), ("triton", False)):
            calls[f"{name}_{precision}"] = functools.partial(library, q, k, v, tangents, causal,
                                                             precision, on)
    for name, (d, key_block, stages) in TILES.items():
        if d == q.shape[-1]:
            calls[f"ws_{name}"] = direct(q, k, v, tangents, causal, key_block, stages)
    return calls


def measure(shapes, dtype, check_n: int, causal_modes) -> list[dict]:
    """Every call at every shape: checked, then timed."""
    from jvp_attention.reference import FORWARDS_PER_CALL, sdpa_flops

    rows = []
    for (B, H, N, d), causal in ((shape, c) for shape in shapes for c in causal_modes):
        q, k, v, tq, tk, tv = (torch.randn(B, H, N, d, device="cuda", dtype=dtype)
                               for _ in range(6))
        flops = sdpa_flops(B, H, N, N, d, d, causal) * FORWARDS_PER_CALL["fwd_jvp"]
        check = functools.partial(errors, q=q, k=k, v=v, tangents=(tq, tk, tv), causal=causal)
        for name, call in timed_calls(q, k, v, (tq, tk, tv), causal).items():
            rows.append(checked_and_timed(
                {"shape": [B, H, N, d], "causal": causal, "dtype": str(dtype)[6:],
                 "impl": name}, call, check if N <= check_n else None, flops))
    return rows


def main() -> None:
    parser = schedule_arguments(__doc__.split("\n")[0], ["4,16,4096,128", "1,16,16384,128",
                                                         "4,16,4096,64"])
    parser.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16"), default=["bf16"])
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both")
    args = parser.parse_args()
    if not args.resources and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--resources compiles for sm_90 on the CPU")
    if args.resources:
        rows = resources()
    else:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        causal_modes = {"0": (False,), "1": (True,), "both": (False, True)}[args.causal]
        rows = [row for name in args.dtypes for row in measure(
            shapes, {"bf16": torch.bfloat16, "fp16": torch.float16}[name], args.check_n,
            causal_modes)]
    if args.out:  # the GPU run and the compile report share the file: keep the other's part
        record = json.loads(args.out.read_text()) if args.out.exists() else {}
        run = run_record(SCHEMA, rows)
        if args.resources:
            record["resources_sm90"] = {"command": run["command"] + " (CPU machine)",
                                        "versions": run["versions"], "rows": rows}
        else:
            record = run | {"resources_sm90": record.get("resources_sm90")}
        args.out.write_text(json.dumps(record, indent=1) + "\n")

if __name__ == "__main__":
    main()
