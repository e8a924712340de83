"""tests/conftest.py: the run stops after a test that lost the CUDA context (a kernel fault),
instead of reporting every later test as failed too."""

import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

TESTS = '''
def test_before():
    pass

def test_fault():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

def test_after():
    pass
'''


def run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "test_cases.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)


def test_a_lost_cuda_context_stops_the_run(tmp_path: Path) -> None:
    result = run(tmp_path, TESTS)
    assert "1 failed, 1 passed" in result.stdout, result.stdout[-2000:]
    assert "test_fault lost the CUDA context" in result.stdout


def test_other_failures_do_not_stop_it(tmp_path: Path) -> None:
    result = run(tmp_path, TESTS.replace("CUDA error: an illegal memory access", "a bug"))
    assert "1 failed, 2 passed" in result.stdout, result.stdout[-2000:]
