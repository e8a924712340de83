"""The executed notebooks in docs/executed/ still belong to their sources and ran cleanly.

The site shows a chapter from `docs/executed/NN_name.ipynb` when that file exists (see
docs/hooks.py), so its outputs must come from the code the chapter has now: every code cell
must equal, in order, the code cell of `notebooks/NN_name.py` as jupytext reads it. When a
notebook's code changes, execute it again on the GPU (docs/install.md has the command).
A notebook with an error output is not shown either, and each must say which GPU it ran on.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import jupytext
import pytest

REPO = Path(__file__).resolve().parents[2]
EXECUTED = sorted((REPO / "docs" / "executed").glob("*.ipynb"))
RERUN = "execute it again on the GPU (docs/install.md, Executed notebooks) or delete it"

if EXECUTED:
    NOTEBOOKS = [pytest.param(path, id=path.stem) for path in EXECUTED]
else:
    NOTEBOOKS = [
        pytest.param(
            None,
            id="none",
            marks=pytest.mark.skip(reason="no executed notebooks under docs/executed yet"),
        )
    ]


def source_of(executed: Path) -> Path:
    return REPO / "notebooks" / f"{executed.stem}.py"


def text(source: str | list[str]) -> str:
    """A cell's source: nbformat allows a string or a list of lines."""
    return source if isinstance(source, str) else "".join(source)


def cell_diff(executed: str, source: str, names: tuple[str, str], limit: int = 20) -> str:
    """The first `limit` lines of a unified diff between two cells' sources."""
    lines = list(
        difflib.unified_diff(executed.splitlines(), source.splitlines(), *names, n=1, lineterm="")
    )
    return "\n".join(lines[:limit] + (["..."] if len(lines) > limit else []))


@pytest.mark.parametrize("executed", NOTEBOOKS)
def test_executed_notebook_has_its_source(executed: Path) -> None:
    source = source_of(executed)
    assert source.is_file(), f"{executed.name}: no notebooks/{source.name}; delete it"
    recorded = json.loads(executed.read_text())["metadata"].get("jvp_attention", {})
    assert recorded.get("source") == f"notebooks/{source.name}", (
        f"{executed.name}: its metadata names {recorded.get('source')!r} as its source, "
        f"not notebooks/{source.name}"
    )


@pytest.mark.parametrize("executed", NOTEBOOKS)
def test_code_cells_match_the_source(executed: Path) -> None:
    source = source_of(executed)
    if not source.is_file():
        pytest.skip(f"no notebooks/{source.name}")
    ran = [c for c in json.loads(executed.read_text())["cells"] if c["cell_type"] == "code"]
    now = [c for c in jupytext.read(source).cells if c.cell_type == "code"]
    for number, (old, new) in enumerate(zip(ran, now, strict=False), start=1):
        old_source, new_source = text(old["source"]), text(new.source)
        if old_source != new_source:
            names = (f"executed {executed.name}", f"notebooks/{source.name}")
            pytest.fail(
                f"{executed.name}: code cell {number} (id {old.get('id')!r}) differs from code "
                f"cell {number} of notebooks/{source.name}: {RERUN}\n"
                + cell_diff(old_source, new_source, names),
                pytrace=False,
            )
    if len(ran) != len(now):
        number = min(len(ran), len(now)) + 1
        pytest.fail(
            f"{executed.name}: has {len(ran)} code cells, notebooks/{source.name} has "
            f"{len(now)}; the first differing one is code cell {number}: {RERUN}",
            pytrace=False,
        )


@pytest.mark.parametrize("executed", NOTEBOOKS)
def test_prose_matches_the_source(executed: Path) -> None:
    """The site shows the executed copy's markdown: it must be the chapter's current prose.
    Prose alone can be brought up to date without running anything again."""
    source = source_of(executed)
    if not source.is_file():
        pytest.skip(f"no notebooks/{source.name}")
    shown = [text(c["source"]) for c in json.loads(executed.read_text())["cells"]
             if c["cell_type"] == "markdown"]
    now = [c.source for c in jupytext.read(source).cells if c.cell_type == "markdown"]
    assert shown == now, (
        f"{executed.name}: its markdown differs from notebooks/{source.name}'s; run "
        f"`python tools/execute_notebooks.py --refresh-prose docs/executed/{executed.name}`"
    )


@pytest.mark.parametrize("executed", NOTEBOOKS)
def test_no_error_outputs(executed: Path) -> None:
    errors = [
        f"cell {cell.get('id', number)!r}: {output.get('ename')}: {output.get('evalue')}"
        for number, cell in enumerate(json.loads(executed.read_text())["cells"])
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors, (
        f"{executed.name} stopped on an error ({'; '.join(errors)}): fix the notebook and {RERUN}"
    )


# Chapters whose outputs do not depend on the machine: float64 math on small shapes (1), and
# tables and plots of saved GPU benchmark results (8, which measures nothing itself). A CPU
# run is as good as a GPU run for them. Every other chapter's outputs must come from a GPU.
CPU_IS_ENOUGH = {"01_reference", "08_benchmarks"}


@pytest.mark.parametrize("executed", NOTEBOOKS)
def test_records_the_gpu_it_ran_on(executed: Path) -> None:
    recorded = json.loads(executed.read_text())["metadata"].get("jvp_attention", {})
    device = str(recorded.get("device", ""))
    if executed.stem in CPU_IS_ENOUGH:
        assert device, f"{executed.name}: its metadata does not name the machine it ran on"
        return
    assert device and not device.lower().startswith("cpu"), (
        f"{executed.name}: its metadata does not name the GPU it ran on "
        f"(metadata.jvp_attention.device); the site's outputs must come from a GPU run made "
        f"with the command in docs/install.md (Executed notebooks), which records it"
    )
