"""A quick probe of the kernels on a GPU: accuracy ratios against the floor and first timings.

    python tools/gpu_probe.py [--out results.json]

Prints a table and writes JSON. It is a developer's tool for one device session: the real
tests live in tests/ (marked gpu) and the real benchmarks in benchmarks/bench.py.
"""

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jvp_attention.backward as backward_module  # noqa: E402
import jvp_attention.forward as forward_module  # noqa: E402
from jvp_attention.backward import flash_attention_backward  # noqa: E402
from jvp_attention.forward import flash_attention_forward  # noqa: E402
from jvp_attention.tangents import accuracy_table, float64_truth, math_path  # noqa: E402


def accuracy_case(b, h, n, d, dtype, causal, second_order):
    """Ratios of our error to the math path's, for O, tO and all gradients."""
    q, k, v, tq, tk, tv = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(6))
    do, dto = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(2))
    tangents = (tq, tk, tv)
    # With rounding residuals, as the public API runs it whenever a backward can follow.
    fwd, (res, t_res) = flash_attention_forward(q, k, v, is_causal=causal, tangents=tangents,
                                                residuals=True)
    ours = {"out": fwd.out, "tangent_out": fwd.tangent_out}
    if second_order:
        grads = flash_attention_backward(q, k, v, fwd.out, fwd.lse, do, None, causal, None,
                                         tangents, fwd.tangent_out, fwd.mu, dto,
                                         out_residual=res, tangent_out_residual=t_res)
        names = ("dq", "dk", "dv", "dtq", "dtk", "dtv")
    else:
        plain, (res, _) = flash_attention_forward(q, k, v, is_causal=causal, residuals=True)
        grads = flash_attention_backward(q, k, v, plain.out, plain.lse, do, None, causal,
                                         out_residual=res)
        names = ("dq", "dk", "dv")
    ours.update(zip(names, grads, strict=True))
    options = {"is_causal": causal, "tangents": tangents, "grad_out": do,
               "grad_tangent_out": dto if second_order else None}
    floor = math_path(q, k, v, **options)
    truth = float64_truth(q, k, v, **options)
    return accuracy_table(ours, floor, truth)


def tflops(ms, flops):
    return flops / ms / 1e9


@contextmanager
def rounding(variant):
    """The products' rounding: "accurate" (the default: exact fp16 operands for bf16),
    "split" (accurate by hi + lo splits, the way fp16 inputs go) or "fast"."""
    saved = forward_module.carries
    forward_module.set_precision("fast" if variant == "fast" else "accurate")
    if variant == "split":
        forward_module.carries = backward_module.carries = lambda q: False
    try:
        yield
    finally:
        forward_module.carries = backward_module.carries = saved
        forward_module.set_precision("accurate")


def timing_case(b, h, n, d, causal, variants=("accurate",)):
    q, k, v, tq, tk, tv, do, dto = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                                    for _ in range(8))
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    rows = {}
    start = time.perf_counter()
    fwd = flash_attention_forward(q, k, v, is_causal=causal, tangents=(tq, tk, tv))
    torch.cuda.synchronize()
    rows["cold_fwd_jvp_s"] = time.perf_counter() - start
    ms = triton.testing.do_bench(lambda: flash_attention_forward(q, k, v, is_causal=causal),
                                 return_mode="median")
    rows["fwd"] = tflops(ms, flops)
    plain = flash_attention_forward(q, k, v, is_causal=causal)
    for variant in variants:
        suffix = "" if variant == "accurate" else f"_{variant}"
        with rounding(variant):
            ms = triton.testing.do_bench(lambda: flash_attention_forward(
                q, k, v, is_causal=causal, tangents=(tq, tk, tv)), return_mode="median")
            rows["fwd_jvp" + suffix] = tflops(ms, 3 * flops)
            ms = triton.testing.do_bench(lambda: flash_attention_backward(
                q, k, v, plain.out, plain.lse, do, None, causal), return_mode="median")
            rows["bwd" + suffix] = tflops(ms, 2.5 * flops)
    ms = triton.testing.do_bench(lambda: flash_attention_backward(
        q, k, v, fwd.out, fwd.lse, do, None, causal, None, (tq, tk, tv), fwd.tangent_out,
        fwd.mu, dto), return_mode="median")
    rows["bwd2"] = tflops(ms, 7.5 * flops)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal), return_mode="median")
    rows["sdpa_fwd"] = tflops(ms, flops)
    out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (qs, ks, vs), do,
                                                             retain_graph=True),
                                 return_mode="median")
    rows["sdpa_bwd"] = tflops(ms, 2.5 * flops)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu_probe.json")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--variants", default="accurate",
                        help="comma-separated roundings to time: accurate, split, fast")
    parser.add_argument("--shapes", default="4,16,4096,128;1,16,16384,128",
                        help="B,H,N,d;... for the timings")
    args = parser.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "accuracy": {}, "timing": {}}
    if not args.skip_accuracy:
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                for second_order in (False, True):
                    name = f"{str(dtype)[6:]} B2 H4 N1024 d64 causal={causal} 2nd={second_order}"
                    table = accuracy_case(2, 4, 1024, 64, dtype, causal, second_order)
                    report["accuracy"][name] = {k: a._asdict() for k, a in table.items()}
                    cells = "  ".join(f"{k} {a.ratio:.2f}" for k, a in table.items())
                    print(f"{name:44} {cells}", flush=True)
                    Path(args.out).write_text(json.dumps(report, indent=1))
    shapes = [tuple(map(int, shape.split(","))) for shape in args.shapes.split(";")]
    for b, h, n, d in [] if args.skip_timing else shapes:
        for causal in (False, True):
            name = f"B{b} H{h} N{n} d{d} causal={causal}"
            rows = timing_case(b, h, n, d, causal, args.variants.split(","))
            report["timing"][name] = rows
            print(f"{name:32} " + "  ".join(f"{k} {v:.1f}" for k, v in rows.items()), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
