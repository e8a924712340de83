"""tests/conftest.py: after a test that lost the CUDA context (a kernel fault), the later tests
of the process are skipped with the culprit named, instead of all failing too."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

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
