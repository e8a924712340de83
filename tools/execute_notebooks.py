"""Execute percent-format notebooks into .ipynb files with their outputs, with no Jupyter.

    python tools/execute_notebooks.py OUT_DIR notebooks/01_reference.py [...]
    python tools/execute_notebooks.py --refresh-prose docs/executed/*.ipynb

It needs neither Jupyter nor a kernel nor a network: it runs each notebook's code cells
in one namespace in this process, records what they print (stdout, stderr), the value of a
final bare expression, errors, and every matplotlib figure a cell leaves open (as PNG), and
writes an nbformat-4 notebook per source, with the machine it ran on in its metadata. The
cells' sources are the notebook's own, so `tests/repository/test_executed.py` can check that an executed
notebook still matches its source.
Stops a notebook at its first error (recorded in the output), like nbconvert does. Cells
tagged `skip-execution` are shown without running, as nbclient (and so nbmake) does.
"""

import argparse
import ast
import base64
import contextlib
import io
import json
import linecache
import os
import site
import sys
import time
import traceback
from pathlib import Path

CELL_MARKER = "# %%"
# Cells with this tag are shown but not run: a module's imports of names that the notebook
# defines itself (nbclient, which nbmake runs, skips them too).
SKIP_TAG = "skip-execution"


def parse_percent(text: str) -> list[dict]:
    """Split a jupytext percent file into cells: {"type", "source", "tags"}."""
    cells, current = [], None
    for line in text.splitlines():
        if line.startswith(CELL_MARKER):
            if current is not None:
                cells.append(current)
            header = line[len(CELL_MARKER):].strip()
            kind = "markdown" if header.startswith("[markdown]") else "code"
            tags = []
            if "tags=" in header:
                tags = json.loads(header.split("tags=", 1)[1].split("]")[0] + "]")
            current = {"type": kind, "lines": [], "tags": tags}
        elif current is not None:
            current["lines"].append(line)
    if current is not None:
        cells.append(current)
    for number, cell in enumerate(cells):
        cell["id"] = f"cell-{number}"
        lines = cell.pop("lines")
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if cell["type"] == "markdown":
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines]
        cell["source"] = "\n".join(lines)
    return cells


def _stream(name: str, text: str) -> dict:
    return {"output_type": "stream", "name": name, "text": without_local_paths(text)}


def without_local_paths(text: str) -> str:
    """`text` with the paths of this machine's installation (warnings and tracebacks name
    their files) shortened to `<site-packages>/...` and to paths in the repository, so that
    the book shows the library, not the machine it was executed on."""
    prefixes = {*site.getsitepackages(), site.getusersitepackages()}
    for prefix in sorted(prefixes, key=len, reverse=True):
        text = text.replace(prefix + os.sep, "<site-packages>/")
    return text.replace(str(Path(__file__).resolve().parent.parent) + os.sep, "")


def _figures() -> list[dict]:
    """PNG outputs of every open matplotlib figure, which are then closed."""
    if "matplotlib.pyplot" not in sys.modules:
        return []
    plt = sys.modules["matplotlib.pyplot"]
    outputs = []
    for number in plt.get_fignums():
        buffer = io.BytesIO()
        plt.figure(number).savefig(buffer, format="png", dpi=90, bbox_inches="tight")
        data = base64.b64encode(buffer.getvalue()).decode()
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": data, "text/plain": "<Figure>"}})
    plt.close("all")
    return outputs


def run_cell(source: str, namespace: dict, count: int) -> tuple[list[dict], bool]:
    """Execute one code cell; return its outputs and whether it succeeded."""
    stdout, stderr = io.StringIO(), io.StringIO()
    outputs, ok, value = [], True, None
    # Register the cell's source under a file name, as IPython does: inspect.getsource (which
    # @triton.jit needs to read a kernel's body) finds code in linecache.
    filename = f"<cell-{count}-{abs(hash(source)):x}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    try:
        tree = ast.parse(source, filename)
        last = tree.body[-1] if tree.body else None
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            if isinstance(last, ast.Expr):
                exec(compile(ast.Module(tree.body[:-1], []), filename, "exec"), namespace)
                value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
            else:
                exec(compile(tree, filename, "exec"), namespace)
    except Exception as error:  # recorded in the notebook, like Jupyter shows it
        ok = False
        outputs.append({"output_type": "error", "ename": type(error).__name__,
                        "evalue": str(error),
                        "traceback": without_local_paths(traceback.format_exc()).splitlines()})
    if stdout.getvalue():
        outputs.insert(0, _stream("stdout", stdout.getvalue()))
    if stderr.getvalue():
        outputs.insert(1 if stdout.getvalue() else 0, _stream("stderr", stderr.getvalue()))
    outputs.extend(_figures())
    if value is not None:
        data = {"text/plain": repr(value)}
        if hasattr(value, "_repr_html_"):  # IPython.display.HTML, pandas tables
            data["text/html"] = value._repr_html_()
        outputs.append({"output_type": "execute_result", "execution_count": count,
                        "metadata": {}, "data": data})
    return outputs, ok


def _machine() -> dict:
    """Where the outputs came from: the GPU (if any), library versions, the date."""
    import datetime

    import torch
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA device)"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            # one tile per kernel (JVP_ATTENTION_AUTOTUNE=0) makes timings lower bounds
            "autotune": os.environ.get("JVP_ATTENTION_AUTOTUNE", "1") != "0"}


def execute(path: Path, out_dir: Path) -> bool:
    """Execute one notebook; write OUT_DIR/<name>.ipynb; return True if no cell failed."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    # Chapters that draw the site's images (chapter 8) write them only for this run.
    os.environ["JVP_ATTENTION_EXECUTING"] = "1"
    cells = parse_percent(path.read_text())
    namespace = {"__name__": "__main__"}
    nb_cells, count, ok = [], 0, True
    cwd = os.getcwd()
    os.chdir(path.parent)  # notebooks run from their own folder, as under Jupyter
    start = time.perf_counter()
    try:
        for cell in cells:
            metadata = {"tags": cell["tags"]} if cell["tags"] else {}
            if cell["type"] == "markdown":
                nb_cells.append({"cell_type": "markdown", "id": cell["id"],
                                 "metadata": metadata, "source": cell["source"]})
                continue
            if SKIP_TAG in cell["tags"]:  # shown, not run (as nbclient does)
                nb_cells.append({"cell_type": "code", "id": cell["id"], "execution_count": None,
                                 "metadata": metadata, "outputs": [],
                                 "source": cell["source"]})
                continue
            count += 1
            outputs = []
            if ok:
                outputs, ok = run_cell(cell["source"], namespace, count)
                # progress on the real stderr (the cell's own is captured): chapters that
                # time kernels run for minutes
                print(f"{path.name}: cell {count} {'done' if ok else 'FAILED'} at "
                      f"{time.perf_counter() - start:.0f} s", file=sys.__stderr__, flush=True)
            nb_cells.append({"cell_type": "code", "id": cell["id"],
                             "execution_count": count if outputs or ok else None,
                             "metadata": metadata, "outputs": outputs,
                             "source": cell["source"]})
    finally:
        os.chdir(cwd)
    notebook = {
        "cells": nb_cells,
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                    "name": "python3"},
                     "language_info": {"name": "python"},
                     "jvp_attention": {"source": f"notebooks/{path.name}",
                                       "seconds": round(time.perf_counter() - start, 1),
                                       **_machine()}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / (path.stem + ".ipynb")).write_text(json.dumps(notebook, indent=1) + "\n")
    return ok


def refresh_prose(executed: Path, source: Path) -> None:
    """Give an executed notebook its source's current markdown, keeping the outputs.

    Prose can change without the code: then the chapter need not run again on the GPU. The
    code cells must be unchanged (else ValueError: execute the notebook again)."""
    notebook = json.loads(executed.read_text())
    ran = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    cells = parse_percent(source.read_text())
    code = [cell for cell in cells if cell["type"] == "code"]
    if [_text(cell["source"]) for cell in ran] != [cell["source"] for cell in code]:
        raise ValueError(f"{executed}: the code of {source} changed; execute it again")
    outputs = iter(ran)
    refreshed = []
    for cell in cells:
        metadata = {"tags": cell["tags"]} if cell["tags"] else {}
        if cell["type"] == "markdown":
            refreshed.append({"cell_type": "markdown", "id": cell["id"], "metadata": metadata,
                              "source": cell["source"]})
        else:
            refreshed.append({**next(outputs), "id": cell["id"], "metadata": metadata})
    notebook["cells"] = refreshed
    executed.write_text(json.dumps(notebook, indent=1) + "\n")


def _text(source: str | list[str]) -> str:
    return source if isinstance(source, str) else "".join(source)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Execute percent-format notebooks into .ipynb files with their outputs.",
        epilog="python tools/execute_notebooks.py OUT_DIR notebooks/01_reference.py ...; "
               "python tools/execute_notebooks.py --refresh-prose docs/executed/*.ipynb")
    parser.add_argument("--refresh-prose", action="store_true",
                        help="take the prose of executed notebooks (the paths) from their "
                             "sources, keeping the outputs (the code must be unchanged)")
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                        help="OUT_DIR then the notebooks to execute; with --refresh-prose, "
                             "the executed notebooks")
    args = parser.parse_args(argv)
    if not args.refresh_prose and len(args.paths) < 2:
        parser.error("give OUT_DIR and at least one notebook")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.refresh_prose:
        for path in args.paths:
            refresh_prose(path, Path(__file__).resolve().parent.parent / "notebooks"
                          / f"{path.stem}.py")
            print(f"{path.name}: prose refreshed")
        return 0
    out_dir, paths = args.paths[0], args.paths[1:]
    failed = []
    for path in paths:
        start = time.perf_counter()
        ok = execute(path.resolve(), out_dir)
        print(f"{path.name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s",
              flush=True)
        if not ok:
            failed.append(path.name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
