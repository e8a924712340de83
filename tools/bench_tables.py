"""Tables of measured numbers, built from the saved results so that no page can drift from them.

The site and README.md quote the H200 benchmark (`benchmarks/results/h200_2026-11-30.json`,
written by `benchmarks/bench.py`) and chapter 9's DiT-B/2 training steps
(`examples/results/bench_dit_b2_*.json`, written by `examples/meanflow_dit.py --bench`;
each cell from the newest run that measured it beside the math path).
Rather than copying numbers by hand, pages carry
markers and the markdown is generated here:

- on the site, `docs/hooks.py` replaces a marker `<!-- table:NAME -->` at build time;
- README.md, which no hook touches, holds the generated text between
  `<!-- table:NAME -->` and `<!-- /table:NAME -->`; this script rewrites it, and
  `--check` (run by `tests/repository/test_bench_tables.py`) fails when it differs from the results.

    python tools/bench_tables.py            # rewrite README.md's generated tables
    python tools/bench_tables.py --check    # write nothing; print a diff and exit 1 if stale

Tables (NAME): `headline` (the headline shape, B4 H16 N4096 d128), `headline-summary` (the
same run in words: ratios and the larger shapes), `precision` (what "fast" saves over
"accurate"), `training` and `training-summary` (chapter 9's end-to-end training step).

Memory is counted as chapter 8 counts it, "held during the call": the inputs and saved
forward state the case holds before the call (`setup_memory_mb`) plus the call's own peak
above that (`peak_memory_mb`), in GB of 2^30 bytes.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARK = REPO / "benchmarks" / "results" / "h200_2026-11-30.json"
# Chapter 9's DiT-B/2 runs, oldest first: a cell of the training table comes from the newest
# run that measured it together with the math path at the same tokens, batch and mode.
TRAINING_RUNS = tuple(REPO / "examples" / "results" / f"bench_dit_b2_{name}h200.json" for name in
                      ("", "twins_", "twins_1024_", "rerun_", "1024_compiled_", "refresh_"))
README = REPO / "README.md"

HEADLINE = (4, 16, 4096, 128)  # B, H, N, d: chapter 8's first headline shape
LONG = (1, 16, 16384, 128)  # chapter 8's second headline shape
LONGEST = (1, 16, 65536, 128)

IMPL_LABELS = {
    "ours": '**jvp_attention**, "accurate" (default)',
    "ours_fast": '**jvp_attention**, "fast"',
    "sdpa_math": "PyTorch math path + forward AD",
    "jfa": "jvp-flash-attention 0.14",
    "sdpa": "PyTorch SDPA, best backend",
}
TRAINING_LABELS = {
    "math": "PyTorch math (softmax(sQKᵀ)V)",
    "jvp_attention": 'jvp_attention "accurate"',
    "jvp_attention_fast": 'jvp_attention "fast"',
    "jvp_flash_attention": "jvp-flash-attention 0.14",
}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _rel(path: Path) -> str:
    """The path as the pages name it: from the repository's root (absolute outside it)."""
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


class Benchmark:
    """The saved benchmark run, looked up by (impl, mode, shape, causal)."""

    def __init__(self, path: Path = BENCHMARK):
        self.path = path
        self.data = _load(path)
        self.cases = {
            (c["impl"], c["mode"], c["B"], c["H"], c["N"], c["d"], c["causal"]): c
            for c in self.data["cases"]
            if c.get("dtype", "bf16") == "bf16"
        }

    def case(self, impl: str, mode: str, shape: tuple[int, int, int, int], causal: bool):
        """The measured case, or None when it is missing, skipped or failed."""
        found = self.cases.get((impl, mode, *shape, causal))
        if not found or found.get("median_ms") is None:
            return None
        return found

    def tflops(self, impl, mode, shape, causal) -> float | None:
        found = self.case(impl, mode, shape, causal)
        return None if found is None else found["tflops"]

    def forwards(self, mode: str, shape: tuple[int, int, int, int]) -> float:
        """The forwards the run credited one call of `mode` (bench.py's MODE_FORWARDS), read
        from the saved FLOPs: ours' `mode` over ours' forward at `shape`, not causal."""
        flops = {m: self.cases[("ours", m, *shape, False)]["flops"] for m in (mode, "fwd")}
        return flops[mode] / flops["fwd"]

    def ms(self, impl, mode, shape, causal) -> float | None:
        found = self.case(impl, mode, shape, causal)
        return None if found is None else found["median_ms"]

    def held_gb(self, impl, mode, shape, causal=False) -> float | None:
        """Chapter 8's memory: inputs and saved state plus the call's own peak, in GB (2^30)."""
        found = self.case(impl, mode, shape, causal)
        if found is None or found.get("peak_memory_mb") is None:
            return None
        return ((found.get("setup_memory_mb") or 0) + found["peak_memory_mb"]) / 1024

    def speedup(self, fast_impl, slow_impl, mode, shape, causal) -> float | None:
        """How many times faster `fast_impl` ran than `slow_impl` (a ratio of times)."""
        fast, slow = self.ms(fast_impl, mode, shape, causal), self.ms(slow_impl, mode, shape, causal)
        return None if fast is None or slow is None else slow / fast

    def source(self) -> str:
        versions = self.data.get("versions", {})
        return (
            f"`{_rel(self.path)}`: {self.data.get('gpu', 'GPU')}, "
            f"torch {versions.get('torch', '?')}, Triton {versions.get('triton', '?')}, "
            f"{self.data.get('settings', {}).get('dtype', 'bf16')}, "
            f"{self.data.get('date', '?')[:10]}"
        )


def _gb(value: float) -> str:
    return f"{value:.2f} GB" if value < 10 else f"{value:.1f} GB"


def _shape(shape: tuple[int, int, int, int]) -> str:
    return "B{} H{} N{} d{}".format(*shape)


def _pair(full: float | None, causal: float | None, fmt: str = "{:.0f}") -> str:
    """'full (causal)', the way the tables show a non-causal and a causal number."""
    if full is None and causal is None:
        return ""
    text = "-" if full is None else fmt.format(full)
    return text if causal is None else f"{text} ({fmt.format(causal)})"


def headline_table(bench: Benchmark | None = None) -> str:
    """TFLOP/s (causal in brackets) and memory of each implementation at the headline shape."""
    bench = bench or Benchmark()
    shape = HEADLINE
    columns: list[tuple[str, Callable[[str], str]]] = [
        ("forward + JVP, TFLOP/s",
         lambda i: _pair(bench.tflops(i, "fwd_jvp", shape, False),
                         bench.tflops(i, "fwd_jvp", shape, True))),
        ("memory held, forward + JVP",
         lambda i: "" if bench.held_gb(i, "fwd_jvp", shape) is None
         else _gb(bench.held_gb(i, "fwd_jvp", shape))),
        ("forward, TFLOP/s",
         lambda i: _pair(bench.tflops(i, "fwd", shape, False), bench.tflops(i, "fwd", shape, True))),
        ("backward, TFLOP/s",
         lambda i: _pair(bench.tflops(i, "bwd", shape, False), bench.tflops(i, "bwd", shape, True))),
    ]
    lines = ["| | " + " | ".join(title for title, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for impl, label in IMPL_LABELS.items():
        cells = [cell(impl) for _, cell in columns]
        if impl == "sdpa" and not cells[0]:
            cells[0] = "raises (no forward-mode AD)"
        if impl == "ours_fast" and not cells[2]:  # the primal forward rounds once in both
            cells[2] = "as accurate"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    note = (
        f"\n{_shape(shape)}, bf16, one run ({bench.source()}). TFLOP/s count "
        f"4·B·H·N²·d per forward (halved when causal), ×{bench.forwards('fwd_jvp', shape):g} "
        f"for forward + JVP and ×{bench.forwards('bwd', shape):g} for the backward, the same "
        "for every implementation, so they compare times; causal in brackets. *Memory held* "
        "is what chapter 8 counts: the inputs and saved state plus the call's own peak "
        "(`setup_memory_mb + peak_memory_mb`), in GB of 2³⁰ bytes."
    )
    return "\n".join(lines) + "\n" + note


def headline_summary(bench: Benchmark | None = None) -> str:
    """The benchmark in words: ratios at the headline shape and what the larger shapes add."""
    bench = bench or Benchmark()
    s, long, longest = HEADLINE, LONG, LONGEST
    items = []

    def x(value: float | None, fmt: str = "{:.1f}x") -> str:
        return "n/a" if value is None else fmt.format(value)

    math_mem, ours_mem = bench.held_gb("sdpa_math", "fwd_jvp", s), bench.held_gb("ours", "fwd_jvp", s)
    memory_ratio = None if not (math_mem and ours_mem) else math_mem / ours_mem
    items.append(
        f"At {_shape(s)}, forward + JVP runs "
        f"{x(bench.speedup('ours', 'sdpa_math', 'fwd_jvp', s, False))} "
        f"(causal {x(bench.speedup('ours', 'sdpa_math', 'fwd_jvp', s, True))}) as fast as "
        f"PyTorch's math path in {x(memory_ratio, '{:.0f}x')} less memory "
        f"({ours_mem:.2f} GB against {math_mem:.1f} GB held), and "
        f"{x(bench.speedup('ours', 'jfa', 'fwd_jvp', s, False))} "
        f"(causal {x(bench.speedup('ours', 'jfa', 'fwd_jvp', s, True))}) as fast as "
        "jvp-flash-attention."
    )
    fwd_cost = bench.ms("ours", "fwd_jvp", s, False), bench.ms("sdpa", "fwd", s, False)
    if None not in fwd_cost:
        items.append(
            f"The output and its tangent together take {fwd_cost[0] / fwd_cost[1]:.1f}x the "
            "time of PyTorch's fastest forward alone (which cannot give the tangent); the "
            "backward runs at "
            f"{x(bench.speedup('ours', 'sdpa', 'bwd', s, False), '{:.2f}x')} the speed of "
            f"SDPA's (causal {x(bench.speedup('ours', 'sdpa', 'bwd', s, True), '{:.2f}x')})."
        )
    bwd2 = bench.ms("ours", "bwd2", s, False), bench.ms("sdpa_math", "bwd2", s, False)
    if None not in bwd2:
        items.append(
            f"The backward through the output and its tangent (second order) takes "
            f"{bwd2[0]:.0f} ms and {bench.held_gb('ours', 'bwd2', s):.1f} GB against the math "
            f"path's {bwd2[1]:.0f} ms and {bench.held_gb('sdpa_math', 'bwd2', s):.1f} GB "
            "(its saved O(N²) graph included)."
        )
    long_tf = bench.tflops("ours", "fwd_jvp", long, False)
    if long_tf is not None:
        items.append(
            f"At {_shape(long)}, forward + JVP reaches {long_tf:.0f} TFLOP/s "
            f"({x(bench.speedup('ours', 'sdpa_math', 'fwd_jvp', long, False))} the math path, "
            f"which holds {bench.held_gb('sdpa_math', 'fwd_jvp', long):.1f} GB against "
            f"{bench.held_gb('ours', 'fwd_jvp', long):.2f} GB; "
            f"{x(bench.speedup('ours', 'jfa', 'fwd_jvp', long, False))} jvp-flash-attention)."
        )
    longest_mem = bench.held_gb("ours", "fwd_jvp", longest)
    if longest_mem is not None:
        items.append(
            f"At {_shape(longest)}, forward + JVP holds {longest_mem:.1f} GB, inputs included "
            f"({bench.tflops('ours', 'fwd_jvp', longest, False):.0f} TFLOP/s)."
        )
    return "\n".join(f"- {item}" for item in items)


def precision_table(bench: Benchmark | None = None) -> str:
    """How many times faster "fast" runs than "accurate", per headline shape and mode."""
    bench = bench or Benchmark()
    modes = [("fwd_jvp", "forward + JVP"), ("bwd", "backward"),
             ("bwd2", "backward through output and tangent")]
    lines = ["| shape | " + " | ".join(title for _, title in modes) + " |",
             "|---|" + "---|" * len(modes)]
    for shape in (HEADLINE, LONG):
        for causal in (False, True):
            cells = [
                "-" if (r := bench.speedup("ours_fast", "ours", mode, shape, causal)) is None
                else f"{r:.2f}x"
                for mode, _ in modes
            ]
            label = _shape(shape) + (" causal" if causal else "")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        f"\n\nTime of \"accurate\" over time of \"fast\" ({bench.source()}); "
        "the primal forward rounds once in both modes."
    )


def _run_rows(path: Path, failed: bool) -> dict[tuple[int, int, str, str], dict]:
    """One run's measured rows (and with `failed` its failed ones) by (tokens, batch,
    attention, compile mode), with PyTorch's own zero tangents: a row run with
    `lean_zero_tangents` (chapter 13) is another model step, not a cell of this table."""
    if not path.is_file():
        return {}
    return {(r["tokens"], r["batch"], r["attention"], r.get("compile", "eager")): r
            for r in _load(path)["rows"]
            if r.get("zero_tangents", "pytorch") == "pytorch"
            and ("step_ms" in r or (failed and "error" in r))}


def training_rows(paths: tuple[Path, ...] = TRAINING_RUNS, failed: bool = False,
                  ) -> dict[tuple[int, str, str], dict]:
    """The DiT-B/2 step benchmark's rows by (tokens, attention, compile mode): for each, the
    newest run of `paths` (oldest first) that measured it beside the math path at the same
    tokens, batch and mode, with that run's math row under "math_row" (empty if it has
    none) and the run's path under "run". With `failed` a failed row counts as measured. A
    row without a math row beside it, or at another batch, replaces no earlier row; empty
    when nothing has run."""
    chosen: dict[tuple[int, str, str], dict] = {}
    for path in paths:
        rows = _run_rows(path, failed)
        for (tokens, batch, attention, mode), row in rows.items():
            math = rows.get((tokens, batch, "math", mode), {})
            earlier = chosen.get((tokens, attention, mode))
            alone = attention != "math" and "step_ms" not in math
            if earlier is None or (not alone and earlier["batch"] == batch):
                chosen[tokens, attention, mode] = {**row, "math_row": math, "run": path}
    return chosen


NOT_MEASURED = ("The DiT-B/2 training step (chapter 9) has not been measured yet: "
                "`examples/README.md` has the command.")


def _failure(row: dict) -> str:
    return "out of memory" if "OutOfMemoryError" in row["error"] else "failed"


def training_table(paths: tuple[Path, ...] = TRAINING_RUNS) -> str:
    """Chapter 9's DiT-B/2 step, eager and compiled: time and peak memory, and the speed-up
    over the math path run the same way, in the same run."""
    rows = training_rows(paths, failed=True)
    if not any("step_ms" in row for row in rows.values()):
        return NOT_MEASURED
    runs = [path for path in paths if any(row["run"] == path for row in rows.values())]
    data = _load(runs[-1])
    compiled = sorted({mode for _, _, mode in rows} - {"eager"})
    columns = [(name, "eager", label) for name, label in TRAINING_LABELS.items()]
    columns += [(name, mode, f"{label}, compiled ({mode})") for mode in compiled
                for name, label in TRAINING_LABELS.items()
                if any(key[1:] == (name, mode) for key in rows)]
    tokens = sorted({t for t, _, _ in rows})
    lines = ["| tokens (image), batch | " + " | ".join(label for *_, label in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for n in tokens:
        cells = []
        for name, mode, _ in columns:
            row = rows.get((n, name, mode))
            if row is None:
                cells.append("-")
                continue
            if "step_ms" not in row:
                cells.append(_failure(row))
                continue
            math = row["math_row"]
            text = f"{row['step_ms']:.0f} ms" + (f" [{runs.index(row['run']) + 1}]"
                                                  if len(runs) > 1 else "")
            if "step_ms" in math and name != "math":
                text += f" (**{math['step_ms'] / row['step_ms']:.2f}x**)"
            memory = row.get("peak_memory_gb")
            cells.append(text + ("" if memory is None else f", {memory:.1f} GB"))
        first = next(r for (t, _, _), r in rows.items() if t == n)
        lines.append(f"| {n} ({first['image_size']}²), {first['batch']} | " + " | ".join(cells)
                     + " |")
    env, model = data.get("environment", {}), data["model"]
    return "\n".join(lines) + (
        f"\n\nOne MeanFlow training step (forward with `torch.func.jvp` through the whole "
        f"DiT, backward, Adam) of DiT-B/2 ({data['parameters'] / 1e6:.0f} M parameters: width "
        f"{model['width']}, depth {model['depth']}, {model['heads']} heads, patch "
        f"{model['patch_size']}), {first['dtype']} autocast, median of a few steps: time, in "
        "brackets the speed-up over the math path run the same way, eager or compiled (below "
        "1x: slower than it), and the step's peak allocated memory, parameters and Adam state "
        "included, in GB of 2³⁰ bytes (with CUDA graphs, `reduce-overhead`, taken over the "
        "warm-up too, when the graphs' memory pool is allocated; a time with no memory is a row "
        "whose peak missed that pool); compiled: the training forward under `torch.compile` "
        f"({env.get('gpu', 'GPU')}, torch {env.get('torch', '?')}; chapter 9). "
        + _runs_note(runs)
    )


def _runs_note(runs: list[Path]) -> str:
    """Which saved run each cell comes from, when there is more than one."""
    if len(runs) == 1:
        return f"From `{_rel(runs[0])}`."
    return ("Each cell is the newest run that measured it beside the math path at the same "
            "tokens, batch and mode, and its speed-up is within that run: "
            + "; ".join(f"[{i}] `{_rel(path)}`" for i, path in enumerate(runs, 1))
            + " (oldest first).")


def training_summary(paths: tuple[Path, ...] = TRAINING_RUNS) -> str:
    """Chapter 9's step in words: jvp_attention's speed and memory against the math path."""
    rows = training_rows(paths)
    parts = []
    for n in sorted({t for t, _, _ in rows}):
        for mode in ("eager", *sorted({m for _, _, m in rows} - {"eager"})):
            ours = rows.get((n, "jvp_attention", mode))
            math = None if ours is None else ours["math_row"]
            if not math:
                continue
            speed = math["step_ms"] / ours["step_ms"]
            verdict = "faster" if speed >= 1.05 else "slower" if speed <= 0.95 else "about as fast"
            text = (f"at {n} tokens{'' if mode == 'eager' else f', compiled ({mode}),'} "
                    f"{speed:.2f}x the math path's speed ({verdict})")
            if ours.get("peak_memory_gb") and math.get("peak_memory_gb"):
                text += f" in {math['peak_memory_gb'] / ours['peak_memory_gb']:.1f}x less memory"
            parts.append(text)
    if not parts:
        return NOT_MEASURED
    return ("Measured step by step on DiT-B/2 (chapter 9, default precision, the math path run "
            "the same way), jvp_attention ran " + "; ".join(parts) + ".")


def training_speedup(tokens: int, attention: str = "jvp_attention",
                     paths: tuple[Path, ...] = TRAINING_RUNS, compile_mode: str = "eager") -> float:
    """The math path's step time over `attention`'s at `tokens`, both run in `compile_mode`
    in the same run (chapter 9)."""
    row = training_rows(paths)[tokens, attention, compile_mode]
    return row["math_row"]["step_ms"] / row["step_ms"]


TABLES: dict[str, Callable[[], str]] = {
    "headline": headline_table,
    "headline-summary": headline_summary,
    "precision": precision_table,
    "training": training_table,
    "training-summary": training_summary,
}
MARKER = re.compile(r"<!-- table:([a-z-]+) -->")


def fill_markers(markdown: str) -> str:
    """Replace each `<!-- table:NAME -->` with its table (the site's hook)."""
    return MARKER.sub(lambda match: TABLES[match.group(1)](), markdown)


def fill_blocks(text: str) -> str:
    """Rewrite what lies between `<!-- table:NAME -->` and `<!-- /table:NAME -->` (README)."""

    def block(match: re.Match[str]) -> str:
        name = match.group(1)
        return f"<!-- table:{name} -->\n{TABLES[name]()}\n<!-- /table:{name} -->"

    return re.sub(r"<!-- table:([a-z-]+) -->.*?<!-- /table:\1 -->", block, text, flags=re.DOTALL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; print a diff and exit 1 if README.md is stale")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    old = args.readme.read_text()
    new = fill_blocks(old)
    if args.check:
        if old != new:
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(keepends=True), new.splitlines(keepends=True),
                f"{args.readme.name} (as written)", f"{args.readme.name} (from the results)"))
            return 1
        return 0
    if old != new:
        args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
