"""`python -m jvp_attention`: check the kernels against the float64 reference and compare
speed and memory with PyTorch on this machine.

Hand-written (like ``__init__.py``): it only calls the public API and chapter 3's tools.
On a machine without a CUDA GPU the Triton kernels run in Triton's CPU interpreter at small
sizes; the timings are then those of the interpreter, not of the kernels.
"""

import os
import sys
import time

import torch

GPU = torch.cuda.is_available()
if not GPU and os.environ.get("TRITON_INTERPRET") != "1":
    # `python -m` imported the package (and triton) before this file ran, and Triton reads
    # TRITON_INTERPRET at import: start again with the interpreter switched on.
    os.environ["TRITON_INTERPRET"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "jvp_attention", *sys.argv[1:]])

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import jvp_attention  # noqa: E402
from jvp_attention.tangents import accuracy_table, float64_truth, math_path  # noqa: E402

DEVICE = "cuda" if GPU else "cpu"


def check_accuracy(dtype: torch.dtype, n: int) -> float:
    """Worst ratio (our error / PyTorch math's error, both against float64) over O, tO, grads."""
    q, k, v, tq, tk, tv, do = (torch.randn(1, 4, n, 64, device=DEVICE, dtype=dtype)
                               for _ in range(7))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, t_out = torch.func.jvp(lambda a, b, c: jvp_attention.attention(a, b, c, is_causal=True),
                                tuple(leaves), (tq, tk, tv))
    grads = torch.autograd.grad(out, leaves, do)
    ours = {"out": out, "tangent_out": t_out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    options = {"is_causal": True, "tangents": (tq, tk, tv), "grad_out": do}
    table = accuracy_table(ours, math_path(q, k, v, **options),
                           float64_truth(q, k, v, **options))
    for name, acc in table.items():
        print(f"  {str(dtype)[6:]:9} {name:12} error {acc.error:.1e}  floor {acc.floor:.1e}  "
              f"ratio {acc.ratio:.2f}")
    return max(acc.ratio for acc in table.values())


def measure(fn, repeats: int) -> tuple[float, float]:
    """Median milliseconds and peak extra memory (GB) of `fn()`."""
    fn()  # warm-up: compilation, autotuning
    times = []
    for _ in range(repeats):
        if GPU:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if GPU else 0
        start = time.perf_counter()
        fn()
        if GPU:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9 if GPU else float("nan")
    return sorted(times)[len(times) // 2], peak


def speed_table(batch: int, heads: int, n: int, d: int, dtype: torch.dtype, repeats: int):
    q, k, v, tq, tk, tv = (torch.randn(batch, heads, n, d, device=DEVICE, dtype=dtype)
                           for _ in range(6))

    def ours_jvp():
        return torch.func.jvp(lambda a, b, c: jvp_attention.attention(a, b, c, is_causal=True),
                              (q, k, v), (tq, tk, tv))

    def math_jvp():
        with sdpa_kernel(SDPBackend.MATH):
            return torch.func.jvp(lambda a, b, c: F.scaled_dot_product_attention(
                a, b, c, is_causal=True), (q, k, v), (tq, tk, tv))

    def ours_fwd():
        return jvp_attention.attention(q, k, v, is_causal=True)

    def sdpa_fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    flops = 4 * batch * heads * n * n * d * 0.5
    print(f"\n  B{batch} H{heads} N{n} d{d} {str(dtype)[6:]}, causal")
    print(f"  {'':34}{'ms':>10}{'TFLOP/s':>10}{'peak GB':>10}")
    for name, fn, work in [("forward + JVP: jvp_attention", ours_jvp, 3 * flops),
                           ("forward + JVP: PyTorch math", math_jvp, 3 * flops),
                           ("forward: jvp_attention", ours_fwd, flops),
                           ("forward: PyTorch SDPA (best)", sdpa_fwd, flops)]:
        ms, gb = measure(fn, repeats)
        print(f"  {name:34}{ms:10.2f}{work / ms / 1e9:10.1f}{gb:10.2f}")


def main() -> int:
    torch.manual_seed(0)
    where = (f"GPU: {torch.cuda.get_device_name()}" if GPU else
             "no CUDA GPU: the Triton kernels run in Triton's CPU interpreter, at small sizes; "
             "timings below are the interpreter's, not the kernels'")
    print(f"jvp_attention {jvp_attention.__version__}, torch {torch.__version__}\n{where}\n")
    print("Accuracy against float64, relative to PyTorch's math path in the same dtype "
          "(ratio <= 1: as accurate as PyTorch):")
    dtypes = [torch.bfloat16, torch.float16] if GPU else [torch.float16]
    worst = max(check_accuracy(dtype, 1024 if GPU else 40) for dtype in dtypes)
    if GPU:
        speed_table(4, 16, 4096, 128, torch.bfloat16, repeats=10)
    else:
        speed_table(1, 2, 64, 32, torch.float32, repeats=1)
    ok = worst <= 2.0
    print(f"\nworst accuracy ratio {worst:.2f}: {'OK' if ok else 'FAILED (> 2)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
