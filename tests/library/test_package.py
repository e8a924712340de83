"""jvp_attention/__init__.py: the package exports its API lazily and consistently."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import jvp_attention

INIT = Path(jvp_attention.__file__)


def test_exports_agree() -> None:
    """`__all__`, the run-time table and the imports that type checkers and the API
    reference read name the same objects, from the same modules."""
    tree = ast.parse(INIT.read_text())
    static = {alias.name: node.module.removeprefix("jvp_attention.")
              for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              and (node.module or "").startswith("jvp_attention.") for alias in node.names}
    assert static == jvp_attention._HOME
    assert sorted(jvp_attention.__all__) == sorted(static)
    for name, module in static.items():
        assert getattr(jvp_attention, name) is getattr(getattr(jvp_attention, module), name)
        assert name in dir(jvp_attention)


def test_importing_a_module_imports_only_what_it_needs() -> None:
    """The kernels' modules do not import the autograd layer (which registers the custom
    operators), so chapter 7 registers them once; using the API imports it."""
    code = ("import sys, jvp_attention.backward, jvp_attention.reference; "
            "assert 'jvp_attention.autograd' not in sys.modules, sorted(sys.modules); "
            "import torch, jvp_attention; jvp_attention.attention; "
            "assert 'jvp_attention.autograd' in sys.modules; "
            "assert hasattr(torch.ops.jvp_attention, 'forward_jvp')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, TRITON_INTERPRET="1"), check=False,
                            cwd=INIT.parent.parent)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_module_is_an_attribute() -> None:
    """`jvp_attention.forward` and the like work without an import, for every module."""
    modules = {p.stem for p in INIT.parent.glob("*.py")} - {"__init__", "__main__"}
    assert set(jvp_attention._MODULES) == modules
    for name in modules:
        assert getattr(jvp_attention, name).__name__ == f"jvp_attention.{name}"


def test_unknown_names_raise_attribute_error() -> None:
    try:
        jvp_attention.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("expected AttributeError")
