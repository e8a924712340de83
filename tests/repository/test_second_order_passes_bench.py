"""benchmarks/second_order_passes.py: a smoke run through Triton's interpreter, what it saves,
and what each variant hands over."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from jvp_attention import hopper_backward as hb

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "second_order_passes.py"


def load_script():
    spec = importlib.util.spec_from_file_location("second_order_passes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_saves_each_variant(tmp_path) -> None:
    out = tmp_path / "passes.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--causal", "1", "--precision",
                    "fast", "--variants", "chapter6", "dv:32", "all", "--out", str(out)],
                   env=env, check=True, capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text())
    assert data["schema"] == "jvp_attention.second_order_passes/1" and data["smoke"] is True
    assert data["command"].startswith("python ") and data["versions"]["triton"]
    rows = data["rows"]
    assert [row["variant"] for row in rows] == ["chapter6", "dv:32", "all"]
    assert all(row["shape"] == [1, 2, 96, 16] and row["causal"] and not row["error"]
               for row in rows), rows
    # No Hopper GPU: nothing is handed over, so every variant gives chapter 6's bits.
    assert not any(row["handed_over"] for row in rows)
    assert rows[0]["max_rel_diff"] is None
    assert all(set(row["max_rel_diff"].values()) == {0.0} for row in rows[1:]), rows
    assert all(row["call_ms"] is None for row in rows)  # no GPU: no times


def test_variants_hand_over_their_pass_at_their_tile() -> None:
    script = load_script()
    chosen = hb.SECOND_ORDER_PASSES
    with script.variant_context("chapter6"):
        assert hb.SECOND_ORDER_PASSES == frozenset()
    with script.variant_context("dk:16"):
        assert hb.SECOND_ORDER_PASSES == frozenset({"dk"})
        assert hb.launch_warp_specialized_dk_tangent.keywords == {"query_rows": 16}
    with script.variant_context("dq:64"):
        assert hb.launch_warp_specialized_dq_tangent.keywords == {"key_block": 64}
    with script.variant_context("all"):
        assert hb.SECOND_ORDER_PASSES == chosen
    assert hb.SECOND_ORDER_PASSES == chosen
    assert not hasattr(hb.launch_warp_specialized_dk_tangent, "keywords")
