"""The measured numbers that README.md and the site quote come from the saved results.

`tools/bench_tables.py` builds the tables from the benchmark JSON and chapter 9's training
JSON; the site's hook fills them in at build time, README.md holds a generated copy that must
match. The memory of a call is counted one way everywhere, chapter 8's "held during the call"
(inputs and saved state plus the call's own peak), so the ratio the home page states is the one
chapter 8's executed notebook prints.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_tables", REPO / "tools" / "bench_tables.py")
bench_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_tables)


def test_readme_tables_match_the_results(capsys) -> None:
    status = bench_tables.main(["--check"])
    assert status == 0, (
        "README.md's generated tables differ from the saved results; run "
        "`python tools/bench_tables.py`:\n" + capsys.readouterr().out)


def test_every_marker_has_a_table() -> None:
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for name in bench_tables.MARKER.findall(page.read_text()):
            assert name in bench_tables.TABLES, f"{page.name}: no table named {name!r}"
    filled = bench_tables.fill_markers((REPO / "docs" / "index.md").read_text())
    assert "<!-- table:" not in filled
    assert "| **jvp_attention**" in filled


def test_memory_ratio_is_chapter_8s() -> None:
    """The headline's 'Nx less memory' is the ratio chapter 8 prints for the same case."""
    bench = bench_tables.Benchmark()
    shape = bench_tables.HEADLINE
    ratio = bench.held_gb("sdpa_math", "fwd_jvp", shape) / bench.held_gb("ours", "fwd_jvp", shape)
    assert f"in {ratio:.0f}x less memory" in bench_tables.headline_summary(bench)
    notebook = json.loads((REPO / "docs" / "executed" / "08_benchmarks.ipynb").read_text())
    printed = "".join(
        "".join(output.get("text", ""))
        for cell in notebook["cells"] if cell["cell_type"] == "code"
        for output in cell.get("outputs", [])
    )
    label = "B{} H{} N{} d{} full".format(*shape)
    line = next(line for line in printed.splitlines() if line.startswith(label))
    assert re.search(rf"\b{ratio:.0f}x less memory than math", line), line


def test_training_table_is_the_saved_dit_b2_run(tmp_path: Path) -> None:
    rows = bench_tables.training_rows()
    table = bench_tables.training_table()
    if not rows:  # no GPU run saved yet: the pages say so rather than show old numbers
        assert table == bench_tables.NOT_MEASURED == bench_tables.training_summary()
    for tokens, attention, mode in rows:
        if attention != "math" and (tokens, "math", mode) in rows:
            speedup = bench_tables.training_speedup(tokens, attention, compile_mode=mode)
            assert f"(**{speedup:.2f}x**)" in table
    # The table from a made-up run: eager columns, then the compiled ones, each against the
    # math path run the same way; a failed row says why.
    run = {"model": {"width": 768, "depth": 12, "heads": 12, "patch_size": 2},
           "parameters": 130e6, "environment": {"gpu": "GPU", "torch": "2"},
           "rows": [{"tokens": 256, "attention": a, "compile": c, "step_ms": ms,
                     "image_size": 32, "batch": 32, "dtype": "bfloat16", "peak_memory_gb": 1.0}
                    for a, c, ms in (("math", "eager", 30.0), ("jvp_attention", "eager", 20.0),
                                     ("jvp_attention", "default", 15.0),
                                     ("math", "default", 12.0))]
           + [{"tokens": 1024, "attention": "math", "compile": "eager", "image_size": 64,
               "batch": 32, "dtype": "bfloat16", "error": "OutOfMemoryError: CUDA out of"}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(run))
    made = bench_tables.training_table((path,))
    assert "| 256 (32²), 32 | 30 ms, 1.0 GB | 20 ms (**1.50x**), 1.0 GB | - | - | " \
           "12 ms, 1.0 GB | 15 ms (**0.80x**), 1.0 GB |" in made
    assert "| 1024 (64²), 32 | out of memory | - | - | - | - | - |" in made
    assert "compiled (default)" in made.splitlines()[0]
    assert ("at 256 tokens, compiled (default), 0.80x the math path's speed (slower)"
            in bench_tables.training_summary((path,)))
    assert "1.50x the math path's speed (faster)" in bench_tables.training_summary((path,))


def test_training_table_takes_each_cell_from_the_newest_run_beside_math(tmp_path: Path) -> None:
    """A later run replaces a cell only where it measured the math path at the same tokens,
    batch and mode too, and the speed-up is within the run the cell comes from."""
    def row(attention, ms, batch=32, mode="eager"):
        return {"tokens": 256, "attention": attention, "compile": mode, "step_ms": ms,
                "image_size": 32, "batch": batch, "dtype": "bfloat16"}

    def saved(name, rows):
        path = tmp_path / name
        path.write_text(json.dumps({
            "model": {"width": 768, "depth": 12, "heads": 12, "patch_size": 2},
            "parameters": 130e6, "environment": {"gpu": "GPU", "torch": "2"}, "rows": rows}))
        return path

    older = saved("older.json", [row("math", 30.0), row("jvp_attention", 20.0),
                                 row("jvp_attention_fast", 25.0),
                                 row("math", 12.0, mode="default"),
                                 row("jvp_attention", 15.0, mode="default")])
    newer = saved("newer.json", [row("math", 40.0), row("jvp_attention", 16.0),
                                 row("jvp_attention_fast", 10.0, batch=64),
                                 row("math", 50.0, batch=64, mode="default"),
                                 row("jvp_attention", 25.0, batch=64, mode="default")])
    rows = bench_tables.training_rows((older, newer))
    assert rows[256, "jvp_attention", "eager"]["run"] == newer  # beside the newer math path
    assert rows[256, "jvp_attention_fast", "eager"]["run"] == older  # another batch
    assert rows[256, "jvp_attention", "default"]["run"] == older  # another batch
    assert bench_tables.training_speedup(256, paths=(older, newer)) == 40.0 / 16.0
    assert bench_tables.training_speedup(256, "jvp_attention_fast", paths=(older, newer)) \
        == 30.0 / 25.0
    table = bench_tables.training_table((older, newer))
    assert "| 256 (32²), 32 | 40 ms [2] | 16 ms [2] (**2.50x**) | 25 ms [1] (**1.20x**) |" \
        in table
    assert "[1] `" in table and "[2] `" in table


def test_training_table_takes_pytorchs_zero_tangents_only(tmp_path: Path) -> None:
    """A run with rows both ways (examples/meanflow_dit.py --zero-tangents pytorch lean):
    the table's cells are the rows with PyTorch's own zero tangents."""
    rows = [{"tokens": 256, "attention": attention, "compile": "eager", "step_ms": ms,
             "image_size": 32, "batch": 32, "dtype": "bfloat16", "zero_tangents": zeros}
            for attention, zeros, ms in (("math", "pytorch", 30.0), ("math", "lean", 20.0),
                                         ("jvp_attention", "pytorch", 15.0),
                                         ("jvp_attention", "lean", 10.0))]
    path = tmp_path / "both.json"
    path.write_text(json.dumps({"rows": rows}))
    chosen = bench_tables.training_rows((path,))
    assert chosen[256, "jvp_attention", "eager"]["step_ms"] == 15.0
    assert chosen[256, "jvp_attention", "eager"]["math_row"]["step_ms"] == 30.0
