# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 8: speed and memory, against what people use today
#
# Chapters 2 to 7 built a forward that also produces the tangent, and backward passes for
# both. They were checked for accuracy; this chapter asks what they cost. Three questions:
#
# 1. **What does the tangent cost?** The fused pass does three times the matrix work of a
#    forward. If it runs at the forward's throughput, the JVP costs 3x a forward, and no
#    more: no second pass, no score matrix in memory.
# 2. **How does it compare with the alternatives?** Today a `torch.func.jvp` through
#    attention falls back to PyTorch's *math* backend (the fast SDPA backends raise under
#    forward-mode AD), which materialises the $N \times N$ scores in fp32: O(N²) memory
#    and about 20 TFLOP/s. The other option is
#    [jvp-flash-attention](https://pypi.org/project/jvp_flash_attention/) 0.14, a Triton
#    kernel grown from the same starting code as this project.
# 3. **How far is the plain path from the best?** Our primal forward and backward against
#    PyTorch's own best SDPA backend (flash, cuDNN or memory-efficient, as PyTorch picks).
#
# The measurements come from `benchmarks/bench.py`, which writes one JSON file per run into
# `benchmarks/results/`; this notebook only reads and plots. Running it on an H200 takes
# about six minutes (`benchmarks/README.md` has the exact command). Without saved GPU
# results the notebook runs `bench.py --smoke` instead, whose numbers are **CPU plumbing
# numbers from Triton's interpreter, not speed**, and says so.
#
# ## What is measured
#
# | implementation | modes | what is called |
# |---|---|---|
# | ours | `fwd`, `fwd_jvp`, `bwd`, `bwd2` | the kernels of chapters 2 and 5 directly: `flash_attention_forward` (with and without tangents) and `flash_attention_backward` (with `grad_tangent_out` for `bwd2`), in the default `"accurate"` precision |
# | ours, fast precision | `fwd_jvp`, `bwd`, `bwd2` | the same calls under `jvp_attention.set_precision("fast")` |
# | SDPA best | `fwd`, `bwd` | `F.scaled_dot_product_attention`, PyTorch's default backend choice |
# | SDPA math + forward AD | `fwd_jvp`, `bwd2` | the same under `sdpa_kernel(SDPBackend.MATH)` and `torch.func.jvp`; `bwd2` differentiates its outputs and tangents with autograd |
# | jvp-flash-attention 0.14 | `fwd_jvp`, `fwd`, `bwd` | `JVPAttn.fwd_dual` under `torch.func.jvp` (its README's JVP entry point), `JVPAttn.fwd`, and autograd through it |
#
# **Two precision modes.** With 16-bit inputs the tangent's and the backward's matrix
# products take operands the kernel computed in fp32 (probabilities, score tangents, score
# gradients). `set_precision("fast")` rounds each such operand to 16 bits once, as
# FlashAttention does. `"accurate"`, the default, keeps the errors at the level of PyTorch's
# fp32-accumulating math path (chapter 3 compares the two): for bf16, the benchmark's dtype,
# the forward+JVP and first-order backward run those products on exact fp16 copies of the
# inputs (chapter 2), paying O(N) passes to make the copies; the second-order backward (and
# fp16 everywhere) splits each operand into a 16-bit head and remainder and multiplies both. The plain forward
# rounds once in both modes, so it is timed once. Both modes are credited the same FLOPs:
# the extra products are the price of accuracy, not work the attention needs.
#
# The backward modes time the backward only: the forward runs once while the case is set
# up, and its saved state (our `out`, `lse`, `tangent_out`, `mu`, or an autograd graph) is
# reused by every timed call. `bwd2` is the backward of chapter 6: cotangents for both the
# output and its tangent, gradients for the inputs and the tangents.
#
# The grid keeps the work per call comparable: $B \cdot N = 16\text{k}$ tokens
# ($B = 1$ from $N = 16\text{k}$ up), $H \cdot d = 2048$ ($d = 64$ with 32 heads, $d = 128$
# with 16), $N$ from 1k to 64k, causal and not, bf16. The headline shapes are
# B4 H16 N4096 d128 and B1 H16 N16384 d128.
#
# **Time** is the median of `triton.testing.do_bench` (25 ms warm-up, 100 ms of calls, the
# L2 cache flushed before each; at large $N$ that leaves one or two calls). The first call
# of every case is timed separately: it pays Triton's compilation and autotuning (once per
# shape key), which a training run pays once and a benchmark should not average in.
#
# **FLOPs** are counted the same for every implementation of a mode, so TFLOP/s compare
# times. One forward is two matrix products per head, $QK^\top$ and $PV$:
#
# $$\text{FLOPs}_\text{fwd} = 4\,B H N_q N_k d \quad (\times \tfrac12 \text{ when causal}),$$
#
# `fwd_jvp` is credited $3\times$ (chapter 2: six products per tile instead of two), `bwd`
# $2.5\times$ (five products), and `bwd2` $2.5 \times 3 = 7.5\times$ (the backward of the
# fused pass). The H200's ceiling to read utilisation against is **778 TFLOP/s**, a bf16
# 8192³ matmul measured through torch on the same machine.
#
# **Memory** is `torch.cuda.max_memory_allocated()` over one warm call minus what was
# allocated before it (outputs and workspace: `peak_memory_mb`), plus what the case holds
# before the call (inputs and saved forward state: `setup_memory_mb`). For the math path's
# `bwd2` the O(N²) part *is* the saved graph, so the plots below show the sum.

# %% tags=["hide_input"]
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import HTML

import jvp_attention
from jvp_attention.autograd import sdpa_flops

REPO = Path(jvp_attention.__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
ASSETS = REPO / "docs" / "assets" / "benchmarks"
H200_BF16_PEAK = 778.0  # TFLOP/s, bf16 8192^3 matmul through torch, measured on the H200

IMPL_NAMES = {"ours": "ours (jvp_attention)", "ours_fast": "ours, fast precision",
              "sdpa": "SDPA best", "sdpa_math": "SDPA math + forward AD",
              "jfa": "jvp-flash-attention 0.14"}
COLORS = {"ours": "C3", "ours_fast": "C4", "sdpa": "C0", "sdpa_math": "C2", "jfa": "C1"}
MODE_NAMES = {"fwd": "forward", "fwd_jvp": "forward + JVP", "bwd": "backward",
              "bwd2": "backward through output and tangent"}


def newest_gpu_results(folder: Path) -> tuple[Path | None, dict | None]:
    """The saved GPU run with the latest date (smoke runs and CPU runs are not results)."""
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):  # other saved data, e.g. kernel_resources_sm90.json
            continue
        if (str(data.get("schema", "")).startswith("jvp_attention.bench/")
                and data.get("device", {}).get("cuda") and not data.get("smoke")):
            found.append((data["date"], str(path), data))
    if not found:
        return None, None
    _, path, data = max(found, key=lambda item: item[:2])
    return Path(path), data


def run_smoke() -> dict:
    """Run `bench.py --smoke` into a temporary file and load it."""
    out = Path(tempfile.mkdtemp()) / "smoke.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--smoke",
                    "--out", str(out)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


SOURCE, DATA = newest_gpu_results(RESULTS)
REAL = DATA is not None
if not REAL:
    DATA = run_smoke()
    print("=" * 78)
    print("No saved GPU results in benchmarks/results/: showing `bench.py --smoke` instead.")
    print("These are CPU PLUMBING NUMBERS from Triton's interpreter at a tiny size. They")
    print("check that every implementation runs and that the JSON, tables and plots work;")
    print("they say nothing about speed or memory on a GPU.")
    print("=" * 78)
else:
    print(f"results: {SOURCE.relative_to(REPO)}")
print(f"device {DATA['gpu']} | torch {DATA['versions']['torch']} | triton "
      f"{DATA['versions']['triton']} | jvp_attention {DATA['versions']['jvp_attention']} | "
      f"jvp_flash_attention {DATA['versions']['jvp_flash_attention']}")
print(f"commit {DATA['git']['commit']} | {DATA['date']} | {len(DATA['cases'])} cases in "
      f"{DATA.get('wall_seconds', float('nan')):.0f} s")
print(f"command: {DATA['command']}")
CASES = DATA["cases"]
# The site's images are rewritten only when the chapter is executed for the site
# (tools/execute_notebooks.py says so); test runs draw into a temporary folder.
WRITE_ASSETS = REAL and os.environ.get("JVP_ATTENTION_EXECUTING") == "1"
FIGURES = ASSETS if WRITE_ASSETS else Path(tempfile.mkdtemp())
FIGURES.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# Every case records its credited FLOPs; they follow the formula above, and agree with the
# `sdpa_flops` helper of chapter 7 times the mode's multiplier.

# %%
MULTIPLIER = {"fwd": 1.0, "fwd_jvp": 3.0, "bwd": 2.5, "bwd2": 7.5}
for case in CASES:
    forward = sdpa_flops(case["B"], case["H"], case["N"], case["N"], case["d"], case["d"],
                         case["causal"])
    assert abs(case["flops"] - MULTIPLIER[case["mode"]] * forward) <= 1e-9 * case["flops"]
measured = [c for c in CASES if c.get("median_ms") is not None]
errors = [c for c in CASES if c.get("error")]
skipped = [c for c in CASES if c.get("skipped")]
print(f"{len(measured)} measured, {len(errors)} errors, {len(skipped)} skipped")
copied = Counter(c["resumed_from"] for c in CASES if c.get("resumed_from"))
for source, count in sorted(copied.items()):  # runs joined with bench.py --resume
    print(f"  {count} of them copied from {source}")
for reason in sorted({c["skipped"].split(":")[0] for c in skipped}):
    count = sum(c["skipped"].split(":")[0] == reason for c in skipped)
    print(f"  skipped ({count}): {reason}")
for case in errors:
    print(f"  error: {case['impl']} {case['mode']} N{case['N']} d{case['d']} "
          f"causal={case['causal']}: {case['error'][:120]}")


# %% [markdown]
# ## The headline shapes
#
# Three focused tables, each cell the median time and, in brackets, TFLOP/s. First the point
# of the project, the forward+JVP: ours is one fused kernel; the math path is what
# `torch.func.jvp` through SDPA does today; jvp-flash-attention is the other fused kernel;
# "fast" is our fast precision mode. Memory is what the call holds on the GPU: inputs, saved
# state and the call's own peak (GB), the same definition for every column. Then the plain
# passes against PyTorch's best SDPA backend, and the backward through both outputs. The
# whole grid, every case of the run, is one click away below them.

# %% tags=["hide_input"]
def find(impl, mode, B, H, N, d, causal):
    for case in CASES:
        if (case["impl"], case["mode"], case["B"], case["H"], case["N"], case["d"],
                case["causal"]) == (impl, mode, B, H, N, d, causal):
            return case
    return None


def held_gb(case):
    """Memory held during the call: inputs and saved state plus the call's own peak."""
    return ((case.get("setup_memory_mb") or 0) + case["peak_memory_mb"]) / 1024


def cell(case, memory=False):
    """'ms (TFLOP/s)', or why there is no number."""
    if case is None:
        return "-"
    if case.get("skipped"):
        return "skipped"
    if case.get("error"):
        return "OOM" if "OutOfMemory" in case["error"] else "error"
    if memory:
        return f"{held_gb(case):.1f} GB" if case.get("peak_memory_mb") is not None else "n/a"
    return f"{case['median_ms']:.3g} ms ({case['tflops']:.0f})"


HEADLINE = [(4, 16, 4096, 128), (1, 16, 16384, 128)]
shapes = sorted({(c["B"], c["H"], c["N"], c["d"]) for c in CASES})
if not REAL or not any(s in shapes for s in HEADLINE):
    HEADLINE = shapes[:2]
TABLES = {
    "Forward + JVP": [("ours", "fwd_jvp", False, "ours"), ("ours_fast", "fwd_jvp", False, "ours fast"),
                      ("sdpa_math", "fwd_jvp", False, "math"), ("jfa", "fwd_jvp", False, "jfa"),
                      ("ours", "fwd_jvp", True, "ours memory"),
                      ("sdpa_math", "fwd_jvp", True, "math memory")],
    "Plain forward and backward": [("ours", "fwd", False, "ours fwd"),
                                   ("sdpa", "fwd", False, "SDPA best fwd"),
                                   ("ours", "bwd", False, "ours bwd"),
                                   ("ours_fast", "bwd", False, "ours fast bwd"),
                                   ("sdpa", "bwd", False, "SDPA best bwd")],
    "Backward through output and tangent": [("ours", "bwd2", False, "ours"),
                                            ("ours_fast", "bwd2", False, "ours fast"),
                                            ("sdpa_math", "bwd2", False, "math")],
}


def html_table(header, rows):
    head = "".join(f"<th>{x}</th>" for x in header)
    body = "".join("<tr>" + "".join(f"<td>{x}</td>" for x in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def headline_rows(columns):
    rows = []
    for B, H, N, d in HEADLINE:
        for causal in (False, True):
            label = f"B{B} H{H} N{N} d{d}{' causal' if causal else ''}"
            rows.append([label] + [cell(find(impl, mode, B, H, N, d, causal), memory)
                                   for impl, mode, memory, _ in columns])
    return rows


def full_grid():
    """Every case of the run, in a collapsed HTML table."""
    header = ["impl", "mode", "B", "H", "N", "d", "causal", "median", "memory"]
    rows = []
    for c in sorted(CASES, key=lambda c: (c["d"], c["N"], c["causal"], c["mode"], c["impl"])):
        rows.append([c["impl"], MODE_NAMES.get(c["mode"], c["mode"]), *map(str, (
            c["B"], c["H"], c["N"], c["d"])), "yes" if c["causal"] else "", cell(c),
            cell(c, memory=True) if c.get("median_ms") else ""])
    return (f"<details><summary>The whole grid: {len(rows)} cases</summary>"
            f"{html_table(header, rows)}</details>")


HTML("".join(f"<h4>{title}</h4>" + html_table(["shape", *(name for *_, name in columns)],
                                               headline_rows(columns))
             for title, columns in TABLES.items()) + full_grid())

# %% [markdown]
# The same shapes in words: how much the tangent costs over a plain forward, how much
# faster and smaller it is than the alternatives, and what the fast precision saves.

# %%
def ratio(a, b):
    ok = a and b and a.get("median_ms") and b.get("median_ms")
    return b["median_ms"] / a["median_ms"] if ok else None


for B, H, N, d in HEADLINE:
    for causal in (False, True):
        jvp = find("ours", "fwd_jvp", B, H, N, d, causal)
        if not jvp or jvp.get("median_ms") is None:
            continue
        fwd = find("ours", "fwd", B, H, N, d, causal)
        best = find("sdpa", "fwd", B, H, N, d, causal)
        math_jvp = find("sdpa_math", "fwd_jvp", B, H, N, d, causal)
        jfa_jvp = find("jfa", "fwd_jvp", B, H, N, d, causal)
        speed = (f"{jvp['tflops']:.0f} TFLOP/s ({100 * jvp['tflops'] / H200_BF16_PEAK:.0f}% of "
                 f"{H200_BF16_PEAK:.0f})" if REAL else f"{jvp['median_ms']:.3g} ms (CPU, not speed)")
        parts = [f"B{B} H{H} N{N} d{d} {'causal' if causal else 'full'}: fwd+JVP {speed}"]
        for name, other in (("our fwd", fwd), ("SDPA best fwd", best)):
            r = ratio(other, jvp)
            if r:
                parts.append(f"costs {r:.2f}x {name}")
        for name, other in (("the math path", math_jvp), ("jvp-flash-attention", jfa_jvp)):
            r = ratio(jvp, other)
            if r:
                parts.append(f"{r:.1f}x faster than {name}")
        if math_jvp and math_jvp.get("peak_memory_mb") and jvp.get("peak_memory_mb"):
            parts.append(f"{held_gb(math_jvp) / held_gb(jvp):.0f}x less memory than math")
        print("; ".join(parts))
        fast = []
        for mode in ("fwd_jvp", "bwd", "bwd2"):
            r = ratio(find("ours_fast", mode, B, H, N, d, causal),
                      find("ours", mode, B, H, N, d, causal))
            if r:
                fast.append(f"{MODE_NAMES[mode]} {r:.2f}x faster than accurate")
        r = ratio(find("ours_fast", "fwd_jvp", B, H, N, d, causal), math_jvp)
        if r:
            fast.append(f"fwd+JVP {r:.1f}x faster than the math path")
        if fast:
            print("    fast precision: " + "; ".join(fast))

# %% [markdown]
# ## Throughput against the sequence length
#
# One panel per mode (rows) and per head dimension and masking (columns). A flat line means
# the kernel keeps its efficiency as $N$ grows (the work per call grows like $N$ here, since
# $B \cdot N$ is fixed up to 16k, then like $N^2$). The dotted line is the H200's 778 TFLOP/s.
# Points missing from a line were skipped (the math path above its memory estimate, or the
# wall budget) or failed; the tables above and the JSON say which. The fast precision has no
# line in the forward row: the plain forward is the same kernel in both modes.

# %% tags=["hide_input"]
def series(impl, mode, d, causal, value):
    points = sorted((c["N"], value(c)) for c in CASES
                    if (c["impl"], c["mode"], c["d"], c["causal"]) == (impl, mode, d, causal)
                    and c.get("median_ms") is not None and value(c) is not None)
    return [n for n, _ in points], [v for _, v in points]


def tflops(case):
    return case["tflops"]


panels = sorted({(c["d"], c["causal"]) for c in CASES})
modes = [m for m in MODE_NAMES if any(c["mode"] == m for c in CASES)]
fig, axes = plt.subplots(len(modes), len(panels), figsize=(4.2 * len(panels), 3.2 * len(modes)),
                         squeeze=False, sharex=True)
for row, mode in enumerate(modes):
    for col, (d, causal) in enumerate(panels):
        ax = axes[row][col]
        for impl in IMPL_NAMES:
            ns, ys = series(impl, mode, d, causal, tflops)
            if ns:
                ax.plot(ns, ys, "o-", color=COLORS[impl], label=IMPL_NAMES[impl])
        if REAL:
            ax.axhline(H200_BF16_PEAK, color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{MODE_NAMES[mode]}\nd={d}, {'causal' if causal else 'full'}", fontsize=9)
        if col == 0:
            ax.set_ylabel("TFLOP/s")
        if row == len(modes) - 1:
            ax.set_xlabel("N")
        ax.grid(alpha=0.3)
handles = {}
for ax in axes.flat:
    for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
        handles.setdefault(label, handle)
handles = {name: handles[name] for name in IMPL_NAMES.values() if name in handles}
ncol = min(len(handles), 2 * len(panels) - 1)  # about two entries fit under one panel
legend_rows = -(-len(handles) // ncol)
fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol)
fig.suptitle("Throughput, bf16, B*N = 16k tokens, H*d = 2048" if REAL else
             "CPU PLUMBING NUMBERS (interpreter, tiny size): not speed")
fig.tight_layout(rect=(0, 0.015 + 0.025 * legend_rows, 1, 0.97))
fig.savefig(FIGURES / "throughput.png", dpi=110)

# %% [markdown]
# ## Memory: O(N) against O(N²)
#
# Memory held during one call (inputs, saved state, outputs and workspace), divided by the
# batch size: memory per sequence. Ours holds a few $N \times d$ tensors per head, so it
# grows like $N$ (slope 1 on these log axes); the math path holds several fp32
# $N \times N$ score-sized tensors, so it grows like $N^2$ (slope 2) until it no longer fits
# and is skipped. The gray guides have slopes 1 and 2.

# %% tags=["hide_input"]
def per_sequence_gb(case):
    if case.get("peak_memory_mb") is None:
        return None
    return (case.get("setup_memory_mb", 0) + case["peak_memory_mb"]) / 1024 / case["B"]


memory_modes = [m for m in ("fwd_jvp", "bwd2") if m in modes]
has_memory = any(c.get("peak_memory_mb") is not None for c in CASES)
if not has_memory:
    print("no memory numbers: torch.cuda.max_memory_allocated needs a GPU (this is a CPU run)")
else:
    ds = sorted({d for d, _ in panels})
    fig, axes = plt.subplots(1, len(memory_modes), figsize=(6 * len(memory_modes), 4.2),
                             squeeze=False)
    for ax, mode in zip(axes[0], memory_modes, strict=True):
        for impl in [i for i in IMPL_NAMES if i != "ours_fast"]:  # same buffers as ours
            for d, style in zip(ds, ("o-", "s--"), strict=False):
                ns, ys = series(impl, mode, d, False, per_sequence_gb)
                if ns:
                    ax.plot(ns, ys, style, color=COLORS[impl], label=f"{IMPL_NAMES[impl]}, d={d}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        x0, x1 = ax.get_xlim()
        y0 = ax.get_ylim()[0]
        y1 = ax.get_ylim()[1]
        for slope, name in ((1, "~N"), (2, "~N²")):
            ax.plot([x0, x1], [y0, y0 * (x1 / x0) ** slope], color="gray", linewidth=0.8,
                    linestyle=":")
            x_label = min(x1, x0 * (y1 / y0) ** (1 / slope)) / 1.3
            ax.annotate(name, (x_label, y0 * (x_label / x0) ** slope), color="gray", fontsize=8)
        ax.set_xlim(x0, x1)
        ax.set_ylim(y0, y1)
        ax.set_title(f"{MODE_NAMES[mode]}, full attention")
        ax.set_xlabel("N")
        ax.set_ylabel("GB per sequence (held during the call)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(FIGURES / "memory.png", dpi=110)

# %% [markdown]
# ## Ratios
#
# Top row: our throughput over SDPA best's, for the plain forward and the backward in both
# precision modes (1 means as fast as PyTorch's best kernel; below 1, slower). Bottom row:
# how many times faster our fused forward+JVP is than the math path (in both modes) and than
# jvp-flash-attention, at the same shape (above 1, ours is faster). A run made before the
# fast mode was measured leaves its panels empty.

# %% tags=["hide_input"]
def paired(impl_a, mode_a, impl_b, mode_b, d, causal, faster=False):
    """N and the time ratio b/a (faster=True) or throughput ratio a/b, where both ran."""
    ns, values = [], []
    for n in sorted({c["N"] for c in CASES}):
        a = next((c for c in CASES if (c["impl"], c["mode"], c["N"], c["d"], c["causal"])
                  == (impl_a, mode_a, n, d, causal) and c.get("median_ms")), None)
        b = next((c for c in CASES if (c["impl"], c["mode"], c["N"], c["d"], c["causal"])
                  == (impl_b, mode_b, n, d, causal) and c.get("median_ms")), None)
        if a and b:
            ns.append(n)
            values.append(b["median_ms"] / a["median_ms"] if faster else
                          a["tflops"] / b["tflops"])
    return ns, values


comparisons = [
    ("ours fwd / SDPA best fwd", ("ours", "fwd", "sdpa", "fwd", False)),
    ("ours bwd / SDPA best bwd", ("ours", "bwd", "sdpa", "bwd", False)),
    ("ours fast bwd / SDPA best bwd", ("ours_fast", "bwd", "sdpa", "bwd", False)),
    ("fwd+JVP: ours vs SDPA math (x faster)", ("ours", "fwd_jvp", "sdpa_math", "fwd_jvp", True)),
    ("fwd+JVP: ours fast vs SDPA math (x faster)",
     ("ours_fast", "fwd_jvp", "sdpa_math", "fwd_jvp", True)),
    ("fwd+JVP: ours vs jvp-flash-attention (x faster)",
     ("ours", "fwd_jvp", "jfa", "fwd_jvp", True)),
]
styles = {(d, c): (f"C{i}", "o-" if not c else "s--") for i, (d, c) in enumerate(panels)}
fig, axes = plt.subplots(2, len(comparisons) // 2, figsize=(4.6 * (len(comparisons) // 2), 7.6),
                         squeeze=False)
for ax, (title, (ia, ma, ib, mb, faster)) in zip(axes.flat, comparisons, strict=True):
    for (d, causal), (color, style) in styles.items():
        ns, ys = paired(ia, ma, ib, mb, d, causal, faster)
        if ns:
            ax.plot(ns, ys, style, color=color, label=f"d={d}{' causal' if causal else ''}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("N")
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not in this run", transform=ax.transAxes, ha="center",
                color="gray")
fig.tight_layout()
fig.savefig(FIGURES / "ratio.png", dpi=110)

# %% [markdown]
# ## The headline picture
#
# Forward+JVP throughput at the headline shapes (ours in both precision modes, when the run
# has both), with SDPA best's plain forward (no tangent: it cannot compute one) as a
# reference for what a forward alone reaches on this GPU. This is the figure the
# documentation's landing page shows.

# %% tags=["hide_input"]
bars = [("ours", "fwd_jvp", "ours fwd+JVP"), ("ours_fast", "fwd_jvp", "ours fwd+JVP, fast precision"),
        ("jfa", "fwd_jvp", "jvp-flash-attention fwd+JVP"),
        ("sdpa_math", "fwd_jvp", "SDPA math + forward AD"),
        ("sdpa", "fwd", "SDPA best, forward only")]
bars = [bar for bar in bars if any((c["impl"], c["mode"]) == bar[:2] for c in CASES)]
groups = [(shape, causal) for shape in HEADLINE for causal in (False, True)]
fig, ax = plt.subplots(figsize=(9, 4))
width = 0.8 / len(bars)
for i, (impl, mode, label) in enumerate(bars):
    heights = []
    for (B, H, N, d), causal in groups:
        case = find(impl, mode, B, H, N, d, causal)
        heights.append(case["tflops"] if case and case.get("median_ms") else 0.0)
    xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))]
    drawn = ax.bar(xs, heights, width, color=COLORS[impl], label=label,
                   alpha=0.45 if mode == "fwd" else 1.0)
    ax.bar_label(drawn, labels=[f"{h:.0f}" if REAL and h else "" for h in heights],
                 fontsize=7, padding=1)
ax.set_xticks(range(len(groups)))
ax.set_xticklabels([f"B{B} H{H} N{N} d{d}\n{'causal' if c else 'full'}"
                    for (B, H, N, d), c in groups], fontsize=8)
ax.set_ylabel("TFLOP/s (fwd+JVP credited 3x a forward)")
if REAL:
    ax.axhline(H200_BF16_PEAK, color="gray", linestyle=":", linewidth=1)
    ax.set_title(f"Forward + JVP on {DATA['gpu']}, bf16 (dotted: bf16 matmul peak)")
else:
    ax.set_title("CPU PLUMBING NUMBERS (interpreter, tiny size): not speed")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(FIGURES / "headline.png", dpi=110)
print(f"figures saved in {FIGURES.relative_to(REPO) if WRITE_ASSETS else FIGURES}")

# %% [markdown]
# ## Cold starts
#
# The first call of each case, in seconds, at the headline shapes. For our kernels it pays
# Triton's compilation (once per kernel specialisation: head dim, causal, tangent on or
# off, dtype) and autotuning (once per shape key, i.e. per power-of-two length bucket; the
# precision mode is not a key, so the fast mode reuses the tile tuned for the accurate one
# and pays compilation only); for jvp-flash-attention, compilation; for SDPA, library
# set-up. A training run pays this once per shape; it is not part of any median above. `bench.py` times each candidate tile of our
# autotuner with one warm call and ~20 ms of calls instead of Triton's default 125 ms
# window, so a user's first call can take somewhat longer than shown.

# %%
print(f"{'implementation':26} {'mode':8} " + " ".join(
    f"{'N' + str(N) + (' c' if c else ''):>9}" for (_, _, N, _), c in groups))
for impl in IMPL_NAMES:
    for mode in MODE_NAMES:
        cells = []
        for (B, H, N, d), causal in groups:
            case = find(impl, mode, B, H, N, d, causal)
            first = case.get("first_call_ms") if case else None
            cells.append(f"{first / 1e3:9.2f}" if first is not None else f"{'-':>9}")
        if any(c.strip() != "-" for c in cells):
            print(f"{IMPL_NAMES[impl]:26} {mode:8} " + " ".join(cells))

# %% [markdown]
# ## What the numbers mean
#
# - **The cost of the tangent.** The fused pass does 3x a forward's matrix work in one
#   kernel. The ratio "fwd+JVP costs Nx our fwd" above is the price of the JVP: 3 would
#   mean the tangent runs at the forward's efficiency, more than 3 that its larger register
#   state (three accumulators instead of one) costs occupancy. It never reads or writes an
#   $N \times N$ matrix, so its memory is the inputs, the outputs and $O(N)$ row statistics.
# - **Against today's default.** The math path runs the same mathematics with the score
#   matrix in fp32 memory: it is bound by memory traffic rather than by the tensor cores, and
#   its footprint grows like $N^2$ per sequence: at $N = 16\text{k}$ one sequence of 16
#   heads already holds about 83 GB, and beyond that it does not fit on the GPU at all. The "x faster" column is what a consistency-model or MeanFlow training
#   step gains in its attention layers by switching, and the memory plot is what it gains
#   in batch size or sequence length.
# - **Against jvp-flash-attention.** The closest alternative: also a fused Triton kernel, but
#   with fixed 32 x 32 tiles and no autotuning. It needs $N$ divisible by 32, and its
#   tangent and gradients are 1.1x to 5.8x less accurate than PyTorch's math path in the same
#   dtype (chapter 3's yardstick), where ours stays at that floor.
# - **Against SDPA best.** For the plain forward and backward, PyTorch's flash / cuDNN kernels
#   are hand-tuned CUDA and the ceiling for a portable Triton kernel; the ratio plot shows
#   how close ours gets. Where no tangent is needed, a model can keep calling SDPA.
# - **Utilisation.** TFLOP/s over 778 is the fraction of the H200's bf16 matmul peak.
#   Attention's softmax and (for the JVP) its elementwise tangent work run on the CUDA cores
#   between the products and are not credited, so no attention kernel reaches 100%.
#
# To refresh these numbers, run `benchmarks/bench.py` on the GPU (the command is in
# `benchmarks/README.md`), put the JSON in `benchmarks/results/`, and re-run this notebook:
# it picks the newest GPU run and rewrites the figures in `docs/assets/benchmarks/`.
