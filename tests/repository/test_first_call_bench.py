"""benchmarks/first_call.py: a smoke run as a user runs it (four fresh processes through
Triton's interpreter, about 15 s) and the cache state it prepares between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "first_call.py"
sys.path.insert(0, str(SCRIPT.parent))
import first_call  # noqa: E402


def test_smoke_run_writes_every_state(tmp_path) -> None:
    out = tmp_path / "first_call.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], env=env,
                   check=True, capture_output=True, text=True, timeout=300)
    data = json.loads(out.read_text())
    assert data["schema"] == first_call.SCHEMA and data["smoke"] is True
    assert data["command"] and data["git"] and data["versions"]["triton"]
    assert set(data["states"]) == set(first_call.STATES)
    assert [case["state"] for case in data["cases"]] == list(first_call.STATES)
    assert data["bytecode_warmup_s"] > 0  # Python's bytecode compiled before the timed runs
    for case in data["cases"]:
        for step in ("first", "second"):
            assert case[step]["jvp_s"] > 0 and case[step]["backward_s"] > 0, case
        assert case["import_s"] > 0 and case["process_s"] >= case["import_s"]


def test_forgetting_tuned_tiles_keeps_compiled_kernels(tmp_path) -> None:
    kernel = tmp_path / "ab12" / "_attention_forward_kernel.cubin"
    tuned = tmp_path / "cd34" / "_attention_forward_kernel.autotune.json"
    for path in (kernel, tuned):
        path.parent.mkdir()
        path.write_text("x")
    assert first_call.forget_tuned_tiles(tmp_path) == 1
    assert kernel.exists() and not tuned.exists()
