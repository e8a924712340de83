"""`python -m jvp_attention`: check the kernels against float64 and, on a GPU, compare speed
and memory with PyTorch. `python -m jvp_attention --help` lists the options.

Hand-written (like ``__init__.py``): it only calls the public API and chapter 3's tools.
On a machine without a CUDA GPU the Triton kernels run in Triton's CPU interpreter, at small
sizes: the accuracy check runs, the speed table does not (the interpreter's timings measure
numpy emulating the kernels, not the kernels).
"""

import argparse
import os
import sys
import time

import torch

GPU = torch.cuda.is_available()
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Defaults per device: on a GPU the speed table's problem; on a CPU a size the interpreter
# runs in seconds.
GPU_DEFAULTS = {"batch": 4, "heads": 16, "seq": 4096, "head_dim": 128, "repeats": 10}
CPU_DEFAULTS = {"batch": 1, "heads": 4, "seq": 40, "head_dim": 64, "repeats": 0}
# The float64 reference holds (seq x seq) scores per head: the accuracy check runs one batch
# element and at most this many queries and keys.
ACCURACY_MAX_SEQ = 1024
RATIO_LIMIT = 2.0  # ours may be at most this many times PyTorch math's error...
EPS = 1e-7  # ...where that error is taken as at least EPS (tangents.accuracy_table's eps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
        return value

    parser = argparse.ArgumentParser(
        prog="python -m jvp_attention",
        description="Check jvp_attention's forward, JVP tangent and gradients against float64 "
                    "(next to PyTorch's math path in the same dtype) and, on a CUDA GPU, time "
                    "them against PyTorch. Without a GPU the kernels run in Triton's CPU "
                    "interpreter: the accuracy check runs, timings are left out.",
        epilog="Exit status: 0 when every quantity is within its accuracy limit, 1 otherwise, "
               "2 for arguments the library cannot take.")
    sizes = parser.add_argument_group(
        "problem", "Shapes are (batch, heads, seq, head-dim). Defaults: "
        + ", ".join(f"--{k.replace('_', '-')} {GPU_DEFAULTS[k]}/{CPU_DEFAULTS[k]}"
                    for k in ("batch", "heads", "seq", "head_dim")) + " (GPU/CPU). The "
        f"accuracy check uses batch 1 and at most {ACCURACY_MAX_SEQ} positions (the float64 "
        "reference stores seq x seq scores).")
    sizes.add_argument("--batch", type=positive, help="batch size of the timed problem")
    sizes.add_argument("--heads", type=positive, help="number of heads")
    sizes.add_argument("--seq", type=positive, help="sequence length (queries = keys)")
    sizes.add_argument("--head-dim", type=positive, help="head dimension (at most 256)")
    sizes.add_argument("--dtype", choices=list(DTYPES),
                       help="default: bfloat16 and float16 checked, bfloat16 timed (GPU); "
                            "float16 (CPU, where bfloat16 is refused: Triton's interpreter "
                            "computes it wrongly)")
    sizes.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                       help="causal masking (default: on)")
    parser.add_argument("--repeats", type=positive,
                        help=f"timed runs per row on a GPU, median reported (default "
                             f"{GPU_DEFAULTS['repeats']}); no timing on a CPU")
    args = parser.parse_args(argv)
    defaults = GPU_DEFAULTS if GPU else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not GPU and args.dtype == "bfloat16":
        parser.error("--dtype bfloat16 needs a CUDA GPU: Triton's CPU interpreter computes "
                     "bfloat16 products wrongly, so the library refuses it there")
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before the restart below: --help and bad arguments answer at once
    if not GPU and os.environ.get("TRITON_INTERPRET") != "1":
        # `python -m` imported the package (and triton) before this file ran, and Triton reads
        # TRITON_INTERPRET at import: start again with the interpreter switched on.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "jvp_attention", *sys.argv[1:]])

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import jvp_attention  # noqa: E402
from jvp_attention.accuracy import accuracy_table, float64_truth, math_path  # noqa: E402
from jvp_attention.autograd import Unsupported  # noqa: E402
from jvp_attention.reference import sdpa_flops  # noqa: E402

DEVICE = "cuda" if GPU else "cpu"


def check_accuracy(dtype: torch.dtype, heads: int, n: int, d: int, causal: bool) -> bool:
    """Print, for O, its tangent and dQ, dK, dV, our error and PyTorch math's error (both
    against float64) and the limit; True when every error is within its limit."""
    q, k, v, tq, tk, tv, do = (torch.randn(1, heads, n, d, device=DEVICE, dtype=dtype)
                               for _ in range(7))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, t_out = torch.func.jvp(
        lambda a, b, c: jvp_attention.attention(a, b, c, is_causal=causal),
        tuple(leaves), (tq, tk, tv))
    grads = torch.autograd.grad(out, leaves, do)
    ours = {"out": out, "tangent_out": t_out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    options = {"is_causal": causal, "tangents": (tq, tk, tv), "grad_out": do}
    table = accuracy_table(ours, math_path(q, k, v, **options),
                           float64_truth(q, k, v, **options), eps=EPS)
    ok = True
    for name, acc in table.items():
        limit = RATIO_LIMIT * max(acc.floor, EPS)
        passed = acc.error <= limit  # the same test as acc.ratio <= RATIO_LIMIT
        ok &= passed
        print(f"  {str(dtype)[6:]:9} {name:12} {acc.error:11.2e} {acc.floor:11.2e} "
              f"{limit:11.2e}  {'ok' if passed else 'FAILED'}")
    return ok


def measure(fn, repeats: int) -> tuple[float, float]:
    """Median milliseconds over `repeats` runs and peak extra GPU memory (GB) of `fn()`."""
    fn()  # warm-up: compilation, autotuning
    times = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9
    return sorted(times)[len(times) // 2], peak


def speed_table(batch: int, heads: int, n: int, d: int, dtype: torch.dtype, causal: bool,
                repeats: int) -> None:
    q, k, v, tq, tk, tv = (torch.randn(batch, heads, n, d, device=DEVICE, dtype=dtype)
                           for _ in range(6))

    def ours_jvp():
        return torch.func.jvp(
            lambda a, b, c: jvp_attention.attention(a, b, c, is_causal=causal),
            (q, k, v), (tq, tk, tv))

    def math_jvp():
        with sdpa_kernel(SDPBackend.MATH):
            return torch.func.jvp(lambda a, b, c: F.scaled_dot_product_attention(
                a, b, c, is_causal=causal), (q, k, v), (tq, tk, tv))

    def ours_fwd():
        return jvp_attention.attention(q, k, v, is_causal=causal)

    def sdpa_fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    # One forward's FLOPs; the forward + JVP is credited 3 forwards, as benchmarks/bench.py's
    # MODE_FORWARDS credits it.
    flops = sdpa_flops(batch, heads, n, n, d, d, causal)
    print(f"\nSpeed: B{batch} H{heads} N{n} d{d} {str(dtype)[6:]}, "
          f"{'causal' if causal else 'not causal'}; median of {repeats} timed runs after one "
          "warm-up")
    print(f"  {'':34}{'ms':>10}{'TFLOP/s':>10}{'peak GB':>10}")
    for name, fn, work in [("forward + JVP: jvp_attention", ours_jvp, 3 * flops),
                           ("forward + JVP: PyTorch math", math_jvp, 3 * flops),
                           ("forward: jvp_attention", ours_fwd, flops),
                           ("forward: PyTorch SDPA (best)", sdpa_fwd, flops)]:
        ms, gb = measure(fn, repeats)
        print(f"  {name:34}{ms:10.2f}{work / ms / 1e9:10.1f}{gb:10.2f}")


def main(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    where = (f"GPU: {torch.cuda.get_device_name()}" if GPU else
             "no CUDA GPU: the Triton kernels run in Triton's CPU interpreter")
    print(f"jvp_attention {jvp_attention.__version__}, torch {torch.__version__}, "
          f"triton {triton.__version__}\n{where}\n")
    if args.dtype is not None:
        dtypes = [DTYPES[args.dtype]]
    else:
        dtypes = [torch.bfloat16, torch.float16] if GPU else [torch.float16]
    n = min(args.seq, ACCURACY_MAX_SEQ)
    print(f"Accuracy against float64 of the output, its JVP tangent and dQ, dK, dV "
          f"(B1 H{args.heads} N{n} d{args.head_dim}, "
          f"{'causal' if args.causal else 'not causal'}):")
    print(f"  passes when  max|ours - float64| <= {RATIO_LIMIT:g} x max(max|PyTorch math - "
          f"float64|, {EPS:g}),\n  PyTorch's math path run in the same dtype")
    print(f"  {'dtype':9} {'quantity':12} {'ours':>11} {'math':>11} {'limit':>11}")
    try:
        ok = all([check_accuracy(dtype, args.heads, n, args.head_dim, args.causal)
                  for dtype in dtypes])
        if GPU:
            speed_table(args.batch, args.heads, args.seq, args.head_dim, dtypes[0],
                        args.causal, args.repeats)
    except Unsupported as error:
        print(f"\njvp_attention cannot take this problem: {error}", file=sys.stderr)
        return 2
    if not GPU:
        print("\nSpeed: left out on a CPU. The interpreter runs each kernel program in numpy, "
              "so its timings\nsay nothing about the kernels; run this on a CUDA GPU for the "
              "speed and memory table.")
    print("\naccuracy OK: every quantity within its limit" if ok else
          "\naccuracy FAILED: a quantity beyond its limit (marked above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
