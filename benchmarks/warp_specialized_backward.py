#!/usr/bin/env python3
"""Chapter 12's warp-specialised first-order backward, timed beside chapter 5's kernels and
SDPA's cuDNN backward on Hopper, checked against float64 first. Saved as JSON (read by
chapter 12 and chapter 8).

    python benchmarks/warp_specialized_backward.py --out benchmarks/results/warp_specialized_backward_h200.json
    python benchmarks/warp_specialized_backward.py --resources \
        --out benchmarks/results/warp_specialized_backward_resources_sm90.json
    python benchmarks/warp_specialized_backward.py --tangent-resources \
        --out benchmarks/results/warp_specialized_second_order_resources_sm90.json

Calls: `ours_accurate` and `ours_fast` are the library's first-order backward,
`flash_attention_backward` as autograd calls it (chapter 5's launcher, which hands its dQ
and dK/dV to chapter 12's kernels where they take the call); `triton_accurate` and
`triton_fast` the same with JVP_ATTENTION_WARP_SPECIALIZED=0 (chapter 5's kernels alone);
`sdpa_cudnn` SDPA's cuDNN backward through autograd. Each library row also records its GPU
kernels' times from the profiler. `ws_<tile>` rows launch one of chapter 12's kernels alone
with another tile ("fast"); `ws_fused_*` the dK/dV kernel that sums dQ too, with the
zeroing of its sum and the pass that scales it. `--tangent-resources` compiles the three
passes of the backward through the tangent (dQ, dK, dV) at each tile for sm_90 instead.
FLOPs: the backward's five products,
10·B·H·N²·d (half when causal); a dK/dV kernel alone is credited four of them, a dQ kernel
three (it recomputes S and dP), a fused one all five. Gradients are checked against float64
(each error over PyTorch math's in the same dtype) up to --check-n.
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

from jvp_attention import hopper_backward as hb  # noqa: E402
from jvp_attention import warp_specialized as ws  # noqa: E402

SCHEMA = "jvp_attention.warp_specialized_backward/2"
DKDV_TILES = {  # name: (d, query rows per tile, ring slots); the library's: 64 rows, 2 slots
    # (128 rows at d = 64 without the causal mask)
    "dkdv_d128_m64_s2": (128, 64, 2),
    "dkdv_d64_m64_s2": (64, 64, 2),
    "dkdv_d64_m128_s2": (64, 128, 2),
}
DQ_TILES = {  # name: (d, keys per tile, ring slots); the library's: 128 keys, 2 slots
    "dq_d128_n128_s2": (128, 128, 2),
}
FUSED_TILES = {  # name: (d, query rows, ring slots): dK/dV summing dQ too (FUSED_DQ)
    "fused_d128_m64_s2": (128, 64, 2),
    "fused_d64_m64_s2": (64, 64, 2),
}


def compile_for_hopper(name: str, causal: bool = False, carry: bool = False) -> dict:
    """Tile `name` (of DKDV_TILES or DQ_TILES) compiled for sm_90 (`compiled_report`);
    `carry` compiles "accurate" bf16's (fp16 operands, bf16 gradients, factors read on the
    device)."""
    grads = torch.empty(1, 1, 1024, 128 if "d128" in name else 64, dtype=torch.bfloat16)
    operands = grads.half() if carry else grads
    if name in DQ_TILES:
        d, key_block, stages = DQ_TILES[name]
        kernel = hb.warp_specialized_dq_kernel
        rows = {"q_desc": (operands, ws.GROUP_ROWS), "k_desc": (operands, key_block),
                "v_desc": (operands, key_block), "do_desc": (operands, ws.GROUP_ROWS),
                "dq_desc": (grads, ws.GROUP_ROWS)}
        heads = {"n_heads": "i32", "n_q": "i32", "n_k": "i32"}
        shape = {"d": d, "key_block": key_block, "stages": stages}
    else:
        fused = name in FUSED_TILES
        d, query_rows, stages = (FUSED_TILES if fused else DKDV_TILES)[name]
        kernel = hb.warp_specialized_dkdv_kernel
        rows = {"k_desc": (operands, ws.GROUP_ROWS), "v_desc": (operands, ws.GROUP_ROWS),
                "q_desc": (operands, query_rows), "do_desc": (operands, query_rows),
                "dk_desc": (grads, ws.GROUP_ROWS), "dv_desc": (grads, ws.GROUP_ROWS)}
        heads = {"n_kv_heads": "i32", "n_q": "i32"}
        shape = {"d": d, "query_rows": query_rows, "stages": stages}
    descriptors = {arg: ws._descriptor(t, r) for arg, (t, r) in rows.items()}
    constexprs = {"STAGES": stages, "CAUSAL": causal, "CARRY": carry}
    if name not in DQ_TILES:  # the dK/dV kernel: its dQ sum's descriptor (unread unfused)
        descriptors["dq_desc"] = (ws._descriptor(grads.float(), query_rows, hb.DQ_SUM_COLS)
                                  if fused else descriptors["dk_desc"])
        constexprs["FUSED_DQ"] = fused
        constexprs["HEAD_GROUP"] = 8 if causal else 1
    scalars = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "factors_ptr": "*fp32", **heads,
               "group_size": "i32", "qk_scale": "fp32", "scale": "fp32"}
    report = compiled_report(kernel, descriptors, scalars, constexprs, 4)
    return {"tile": name, **shape, "causal": causal, "carry": carry, **report}


def compile_tangent_pass_for_hopper(kernel: str = "dk", d: int = 128, causal: bool = False,
                                    carry: bool = False, query_rows: int | None = None,
                                    stages: int = hb.TANGENT_PASS_STAGES) -> dict:
    """Chapter 12's dQ, dK or dV pass (`kernel`) of the backward through the tangent
    compiled for sm_90 (`compiled_report`); `carry` as `compile_for_hopper`."""
    keys = kernel == "dk"
    grads = torch.empty(1, 1, 1024, d, dtype=torch.bfloat16)
    operands = grads.half() if carry else grads
    if kernel == "dq":  # query_rows: here the keys a visit
        block = query_rows or hb.dq_tangent_key_block(d)
        rows = {**{f"{name}_desc": (operands, ws.GROUP_ROWS) for name in ("q", "tq", "do", "dto")},
                **{f"{name}_desc": (operands, block) for name in ("k", "tk", "v", "tv")},
                **{f"{name}_desc": (grads, ws.GROUP_ROWS) for name in ("dq", "dtq")}}
        scalars = {**{f"{name}_ptr": "*fp32" for name in ("lse", "delta", "mu", "c", "factors")},
                   "n_heads": "i32", "n_q": "i32", "n_k": "i32", "group_size": "i32",
                   "qk_scale": "fp32", "scale": "fp32"}
        report = compiled_report(hb.warp_specialized_dq_tangent_kernel,
                                 {arg: ws._descriptor(t, r) for arg, (t, r) in rows.items()},
                                 scalars, {"STAGES": stages, "CAUSAL": causal, "CARRY": carry,
                                           "HEAD_GROUP": 8 if causal else 1}, 4)
        return {"kernel": "dq_tangent", "d": d, "key_block": block, "stages": stages,
                "causal": causal, "carry": carry, **report}
    query_rows = query_rows or (hb.DK_TANGENT_QUERY_ROWS if keys else hb.DV_TANGENT_QUERY_ROWS)
    rows = {**{f"{name}_desc": (operands, ws.GROUP_ROWS) for name in ("k", "tk", "v", "tv")},
            **{f"{name}_desc": (operands, query_rows) for name in ("q", "tq", "do", "dto")},
            **{f"{name}_desc": (grads, ws.GROUP_ROWS) for name in ("out", "t_out")}}
    descriptors = {arg: ws._descriptor(t, r) for arg, (t, r) in rows.items()}
    scalars = {**{f"{name}_ptr": "*fp32" for name in ("lse", "delta", "mu", "c", "factors")},
               "n_kv_heads": "i32", "n_q": "i32", "group_size": "i32", "qk_scale": "fp32",
               "scale": "fp32"}
    constexprs = {"STAGES": stages, "CAUSAL": causal, "CARRY": carry, "KEYS": keys}
    report = compiled_report(hb.warp_specialized_tangent_pass_kernel, descriptors, scalars,
                             constexprs, 4)
    return {"kernel": f"{kernel}_tangent", "d": d, "query_rows": query_rows, "stages": stages,
            "causal": causal, "carry": carry, **report}


def resources() -> list[dict]:
    """Every tile compiled for sm_90 in "fast" precision, causal or not, and the library's
    tiles carried ("accurate" bf16)."""
    names = [*DKDV_TILES, *DQ_TILES, *FUSED_TILES]
    cases = [(name, causal, False) for name in names for causal in (False, True)]
    cases += [(name, causal, True) for name in ("dkdv_d128_m64_s2", "dkdv_d64_m64_s2",
                                                 "dq_d128_n128_s2", *FUSED_TILES)
              for causal in (False, True)]
    cases.append(("dkdv_d64_m128_s2", False, True))
    rows = []
    for case in cases:
        rows.append(compile_for_hopper(*case))
        print(json.dumps(rows[-1]), flush=True)
    return rows


TANGENT_TILES = {"dq": (16, 32, 64), "dk": (16, 32, 64), "dv": (32, 64, 128)}


def tangent_resources() -> list[dict]:
    """Each pass of the backward through the tangent compiled for sm_90 at d = 64 and 128,
    at each of its tiles (`TANGENT_TILES`: keys a visit for dQ, queries for dK and dV),
    causal or not, plain or carried; a tile that does not compile is recorded with the
    error."""
    rows = []
    for name, tiles in TANGENT_TILES.items():
        for d in (64, 128):
            for tile in tiles:
                for causal in (False, True):
                    for carry in (False, True):
                        try:
                            row = compile_tangent_pass_for_hopper(name, d, causal, carry,
                                                                  tile)
                        except Exception as error:  # noqa: BLE001 - recorded, not hidden
                            row = {"kernel": f"{name}_tangent", "d": d, "tile": tile,
                                   "causal": causal, "carry": carry,
                                   "error": f"{type(error).__name__}: {str(error)[:200]}"}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    return rows


def problem(B, H, N, d, causal, dtype=torch.bfloat16, seed=0):
    """Inputs, a cotangent, the library's forward (accurate, with residuals: what autograd
    saves) and Delta = rowsum(dO ∘ O) for the direct launches."""
    from jvp_attention.forward import flash_attention_forward

    generator = torch.Generator("cuda").manual_seed(seed)
    q, k, v, grad_out = (torch.randn(B, H, N, d, device="cuda", dtype=dtype,
                                     generator=generator) for _ in range(4))
    forward, (residual, _) = flash_attention_forward(q, k, v, None, causal, residuals=True,
                                                     precision="accurate")
    delta = (forward.out.float() * grad_out.float()).sum(-1)
    return q, k, v, grad_out, forward, residual, delta


def library_call(q, k, v, grad_out, forward, residual, causal: bool, precision: str,
                 triton_only: bool):
    """The library's first-order backward as autograd calls it."""
    from jvp_attention.backward import flash_attention_backward

    def call():
        if triton_only:
            os.environ["JVP_ATTENTION_WARP_SPECIALIZED"] = "0"
        try:
            return flash_attention_backward(q, k, v, forward.out, forward.lse, grad_out, None,
                                            causal, out_residual=residual,
                                            precision=precision)
        finally:
            os.environ.pop("JVP_ATTENTION_WARP_SPECIALIZED", None)
    return call


def kernel_times(call) -> dict:
    """GPU time per call of each kernel `call` launches (profiler, five calls)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels[event.name[:60]] = kernels.get(event.name[:60], 0.0) + event.device_time / 5e3
    return {"kernels_ms": {name: round(ms, 4) for name, ms in kernels.items()},
            "kernels_total_ms": sum(kernels.values())}


def gradient_errors(result, q, k, v, grad_out, causal: bool,
                    names=("dq", "dk", "dv")) -> dict:
    """Max errors of `result` (the gradients `names`) against float64, each over PyTorch
    math's in the inputs' dtype (autograd through the math path)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def grads(a, b, c, cotangent):
        a, b, c = (x.detach().requires_grad_() for x in (a, b, c))
        with sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal)
        return dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (a, b, c), cotangent),
                        strict=True))

    exact = grads(q.double(), k.double(), v.double(), grad_out.double())
    floor = grads(q, k, v, grad_out)
    return {f"{name}_err_ratio": (mine.double() - exact[name]).abs().max().item()
            / (floor[name].double() - exact[name]).abs().max().item()
            for name, mine in zip(names, result, strict=False)}


def direct_launch(q, k, v, grad_out, forward, delta, causal: bool, name: str):
    """One of chapter 12's kernels alone with tile `name`, "fast": (dk, dv), (dq,), or
    (dq, dk, dv) for a fused tile (with its zeroed sum and the pass that scales it)."""
    scale = q.shape[-1] ** -0.5
    if name in FUSED_TILES:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        hb.launch_warp_specialized_dkdv(q, k, v, grad_out, forward.lse, delta, None, dk, dv,
                                        causal, scale, dq, stages=FUSED_TILES[name][2])
        return dq, dk, dv
    if name in DQ_TILES:
        _, key_block, stages = DQ_TILES[name]
        dq = torch.empty_like(q)
        hb.launch_warp_specialized_dq(q, k, v, grad_out, forward.lse, delta, None, dq, causal,
                                      scale, key_block=key_block, stages=stages)
        return (dq,)
    _, query_rows, stages = DKDV_TILES[name]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    hb.launch_warp_specialized_dkdv(q, k, v, grad_out, forward.lse, delta, None, dk, dv,
                                    causal, scale, query_rows=query_rows, stages=stages)
    return dk, dv


def measure(shapes, check_n: int, tiles: list[str] | None = None) -> list[dict]:
    """Every call at every shape, full and causal: checked, then timed; `tiles` limits the
    `ws_*` rows to those tiles (default: all)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for (B, H, N, d), causal in ((shape, c) for shape in shapes for c in (False, True)):
        q, k, v, grad_out, forward, residual, delta = problem(B, H, N, d, causal)
        flops = 10 * B * H * N * N * d / (2 if causal else 1)
        base = {"shape": [B, H, N, d], "causal": causal}
        check = functools.partial(gradient_errors, q=q, k=k, v=v, grad_out=grad_out,
                                  causal=causal) if N <= check_n else None
        for precision in ("accurate", "fast"):
            for impl, triton_only in (("ours", False), ("triton", True)):
                call = library_call(q, k, v, grad_out, forward, residual, causal, precision,
                                    triton_only)
                row = checked_and_timed(base | {"impl": f"{impl}_{precision}"}, call, check,
                                        flops)
                if "error" not in row:
                    row |= kernel_times(call)
                rows.append(row)
        for name, tile in (*DKDV_TILES.items(), *DQ_TILES.items(), *FUSED_TILES.items()):
            if tile[0] == d and (tiles is None or name in tiles):
                names, share = (("dq",), 0.6) if name in DQ_TILES else (
                    (("dq", "dk", "dv"), 1.0) if name in FUSED_TILES else (("dk", "dv"), 0.8))
                rows.append(checked_and_timed(
                    base | {"impl": f"ws_{name}"},
                    functools.partial(direct_launch, q, k, v, grad_out, forward, delta,
                                      causal, name),
                    functools.partial(check, names=names) if check else None, flops * share))
        inputs = tuple(x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa_out = torch.nn.functional.scaled_dot_product_attention(*inputs,
                                                                        is_causal=causal)
        rows.append(checked_and_timed(
            base | {"impl": "sdpa_cudnn"},
            functools.partial(torch.autograd.grad, sdpa_out, inputs, grad_out,
                              retain_graph=True), check, flops))
    return rows


def main() -> None:
    parser = schedule_arguments(__doc__.split("\n")[0], ["4,16,4096,128", "1,16,16384,128",
                                                         "4,32,4096,64"])
    parser.add_argument("--tiles", nargs="*", choices=[*DKDV_TILES, *DQ_TILES, *FUSED_TILES],
                        help="time only these tiles alone (ws_* rows; the flag alone: none)")
    parser.add_argument("--tangent-resources", action="store_true",
                        help="compile the backward through the tangent's passes instead")
    args = parser.parse_args()
    if not (args.resources or args.tangent_resources) and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--resources compiles for sm_90 on the CPU")
    if args.tangent_resources:
        rows = tangent_resources()
    elif args.resources:
        rows = resources()
    else:
        rows = measure([tuple(int(x) for x in s.split(",")) for s in args.shapes], args.check_n,
                       args.tiles)
    if args.out:
        args.out.write_text(json.dumps(run_record(SCHEMA, rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
