"""README.md's "Using it" example runs as written (on a CPU: the kernels in Triton's interpreter)."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_using_it_runs_as_written() -> None:
    section = REPO.joinpath("README.md").read_text().split("## Using it", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    environment = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environment, cwd=REPO, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
