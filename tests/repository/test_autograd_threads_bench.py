"""benchmarks/autograd_threads.py: the Python-backward floor and a smoke run through the
interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "autograd_threads.py"
sys.path.insert(0, str(SCRIPT.parent))
import autograd_threads as at  # noqa: E402


def test_the_python_floor_is_v_times_one_under_jvp_and_backward():
    v = torch.randn(3, requires_grad=True)
    tangent = torch.randn(3)
    out, t_out = torch.func.jvp(at.PythonFloor.apply, (v,), (tangent,))
    out.backward(torch.full((3,), 2.0))
    assert torch.equal(out, v.detach()) and torch.equal(t_out, tangent)
    assert torch.equal(v.grad, torch.full((3,), 2.0))


@pytest.mark.skipif(at.ts.HAS_CUDA, reason="the smoke run is the CPU path")
def test_smoke_run_times_both_settings_for_every_impl(tmp_path: Path):
    out = tmp_path / "threads.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["schema"] == at.SCHEMA and data["smoke"]
    assert [row["impl"] for row in data["rows"]] == list(at.IMPLS)
    for row in data["rows"]:
        for setting in ("device_thread", "calling_thread"):
            assert 0 < row[setting]["min_ms"] <= row[setting]["median_ms"], row
