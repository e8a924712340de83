"""benchmarks/causal_order.py: a smoke run through Triton's interpreter (every order gives the
outputs of groups of one, bit for bit) and what it saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "causal_order.py"


def test_smoke_run_saves_each_group_with_the_same_outputs(tmp_path) -> None:
    out = tmp_path / "causal_order.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--mode", "fwd_jvp", "--groups",
                    "1", "2", "auto", "--out", str(out)], env=env, check=True,
                   capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text())
    assert data["schema"] == "jvp_attention.causal_order/1" and data["smoke"] is True
    assert data["command"] and data["versions"]["triton"]
    rows = data["rows"]
    assert [row["group"] for row in rows] == ["1", "2", "auto"]
    assert [row["heads_per_group"] for row in rows] == [1, 2, 16]
    assert all(row["same_as_one"] and row["shape"] == [1, 3, 200, 16] for row in rows), rows
    assert all(row["kernel_ms"] is None for row in rows)  # no GPU: no times
