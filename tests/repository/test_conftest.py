"""tests/conftest.py: after a test that lost the CUDA context (a kernel fault), the later tests
of the process are skipped with the culprit named, instead of all failing too; under Triton's
interpreter, kernels compute the same without its repeated patching (site/fast_interpreter.py),
in the test process and in the processes it starts."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
SITE = CONFTEST.parent / "site"

TESTS = '''
def test_before():
    pass

def test_fault():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

def test_after():
    pass
'''


def run(tmp_path: Path, body: str, *options: str) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    shutil.copytree(SITE, tmp_path / "site")
    (tmp_path / "test_cases.py").write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(options or ("-p", "no:xdist")), "-rs", "test_cases.py"],
                          cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("options", [(), ("-n", "1")], ids=["one-process", "xdist"])
def test_a_lost_cuda_context_skips_the_later_tests(tmp_path: Path, options) -> None:
    result = run(tmp_path, TESTS, *options)
    assert result.returncode == 1
    assert "1 failed, 1 passed, 1 skipped" in result.stdout, result.stdout[-2000:]
    assert "lost by test_cases.py::test_fault" in result.stdout


def test_other_failures_skip_nothing(tmp_path: Path) -> None:
    result = run(tmp_path, TESTS.replace("CUDA error: an illegal memory access", "a bug"))
    assert "1 failed, 2 passed" in result.stdout, result.stdout[-2000:]


interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs "
                                 "without a CUDA device only (conftest sets TRITON_INTERPRET)")


@triton.jit
def _doubled(x):
    return x * 2


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets, mask=inside)
    for _ in range(3):  # helper calls after the first find the language patched
        x = _doubled(x) + tl.abs(x)
    tl.store(out_ptr + offsets, tl.exp2(_doubled(x) * 0.0), mask=inside)
    tl.store(out_ptr + n + offsets, x, mask=inside)


@interpreted
def test_the_interpreter_skips_its_repeated_patching_and_computes_the_same() -> None:
    from triton.runtime import interpreter

    assert interpreter._patch_lang.__name__ == "patch_lang", "site/fast_interpreter.py not active"
    builtins = (tl.program_id, tl.load, tl.tensor.__add__, tl.math.exp2)
    x = torch.randn(40)
    out = torch.empty(80)
    _helpers_kernel[(3,)](x, out, 40, BLOCK=16)
    expected = x
    for _ in range(3):
        expected = expected * 2 + expected.abs()
    assert torch.equal(out[:40], torch.ones(40)) and torch.equal(out[40:], expected)
    # the launch restored what it patched: the next launch (and code outside kernels) sees
    # Triton's own builtins
    assert (tl.program_id, tl.load, tl.tensor.__add__, tl.math.exp2) == builtins


@interpreted
def test_processes_the_tests_start_get_the_same_interpreter() -> None:
    code = ("import triton.runtime.interpreter as i; assert i._patch_lang.__name__ == "
            "'patch_lang', i._patch_lang")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
