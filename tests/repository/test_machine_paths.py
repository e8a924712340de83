"""The repository speaks of the project alone: executed chapters, benchmark results and logs
name files by their paths in a checkout, not by the folders of the machine that produced
them (an interpreter's installation, a home or scratch directory)."""

from __future__ import annotations

import importlib.util
import re
import site
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDS = [*sorted((ROOT / "docs" / "executed").glob("*.ipynb")),
           *sorted((ROOT / "benchmarks" / "results").glob("*.json")),
           *sorted((ROOT / "examples" / "results").glob("*.json")),
           *sorted((ROOT / "examples" / "results").glob("*.log"))]
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:opt|root|home|work|Users|usr/local)/[\w.-]+")


@pytest.mark.parametrize("path", RECORDS, ids=[str(p.relative_to(ROOT)) for p in RECORDS])
def test_records_name_no_machine_paths(path: Path) -> None:
    found = sorted(set(MACHINE_PATH.findall(path.read_text())))
    assert not found, f"{path.relative_to(ROOT)} names this machine's folders: {found[:5]}"


def test_executed_outputs_shorten_installation_and_repository_paths() -> None:
    spec = importlib.util.spec_from_file_location("execute_notebooks",
                                                  ROOT / "tools" / "execute_notebooks.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    text = (f"{site.getsitepackages()[0]}/torch/_inductor/x.py:3: UserWarning\n"
            f"  File \"{ROOT}/jvp_attention/launch.py\", line 1")
    assert tool.without_local_paths(text) == ("<site-packages>/torch/_inductor/x.py:3: "
                                              "UserWarning\n  File \"jvp_attention/launch.py\","
                                              " line 1")
