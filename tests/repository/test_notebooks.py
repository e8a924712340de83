"""Every numbered notebook runs top to bottom (through nbmake), on the GPU or in the interpreter.

Each `notebooks/NN_name.py` is converted by jupytext to an .ipynb in a temporary folder (nbmake
reads .ipynb only) and executed by `pytest --nbmake` in a subprocess, with the repository on
PYTHONPATH so that `import jvp_attention` finds the exported package. The notebook's kernel runs
with that temporary folder as its working directory (a `notebooks/` folder beside links to the
repository's folders, so relative paths resolve as under Jupyter). Without a CUDA device the subprocess gets
`TRITON_INTERPRET=1`, and the notebooks pick small sizes themselves.
"""

import os
import sys
from pathlib import Path

import jupytext
import pytest
import torch
from helpers import run_with_one_retry

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.py"))
TIMEOUT_S = 1200


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(notebook: Path, tmp_path: Path) -> None:
    # The notebook runs from a temporary notebooks/ folder beside links to the repository's
    # folders, so that paths relative to notebooks/ (../benchmarks/results/...) resolve as
    # they do under Jupyter, without writing into the checkout.
    folder = tmp_path / "notebooks"
    folder.mkdir()
    for name in ("benchmarks", "docs", "examples", "jvp_attention", "tools"):
        (tmp_path / name).symlink_to(REPO / name, target_is_directory=True)
    ipynb = folder / f"{notebook.stem}.ipynb"
    jupytext.write(jupytext.read(notebook), ipynb)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    command = [
        sys.executable, "-m", "pytest", "--nbmake", f"--nbmake-timeout={TIMEOUT_S}",
        "-p", "no:cacheprovider", "-q", str(ipynb),
    ]  # fmt: skip
    result = run_with_one_retry(command, cwd=REPO, env=env, timeout=TIMEOUT_S + 300)
    if result.returncode != 0:
        pytest.fail(f"{notebook.name} failed:\n{result.stdout}\n{result.stderr}", pytrace=False)



@pytest.mark.parametrize("output, runs", [("Address already in use", 2), ("AssertionError", 1)])
def test_a_machine_failure_is_run_once_more(output: str, runs: int, tmp_path: Path) -> None:
    count = tmp_path / "runs"
    code = (f"import pathlib, sys; p = pathlib.Path({str(count)!r}); "
            f"p.write_text(p.read_text() + '.' if p.exists() else '.'); "
            f"print({output!r}); sys.exit(1)")
    result = run_with_one_retry([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 1 and output in result.stdout
    assert count.read_text() == "." * runs
