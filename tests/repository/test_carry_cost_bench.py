"""benchmarks/carry_cost.py: a smoke run through Triton's interpreter writes a results file
that names its command, each case in both modes, and no times without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "carry_cost.py"


def test_smoke_run_saves_both_modes_of_each_case(tmp_path) -> None:
    out = tmp_path / "carry_cost.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], env=env,
                   check=True, capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text())
    assert data["schema"] == "jvp_attention.carry_cost/1" and data["smoke"] is True
    assert data["command"].startswith("python benchmarks/carry_cost.py --smoke")
    assert [(row["causal"], row["mode"]) for row in data["rows"]] == [
        (False, "accurate"), (False, "fast"), (True, "accurate"), (True, "fast")]
    assert all(row["gpu_ms"] is None and row["kernels"] is None for row in data["rows"])


def test_smoke_run_with_a_learnable_bias_the_split_and_the_backward(tmp_path) -> None:
    out = tmp_path / "carry_cost_bias.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--bias", "--backward", "--modes",
                    "accurate", "split", "--out", str(out)], env=env, check=True,
                   capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [(row["causal"], row["mode"], row["bias"], row["backward"]) for row in rows] == [
        (False, "accurate", True, True), (False, "split", True, True),
        (True, "accurate", True, True), (True, "split", True, True)]


def test_smoke_run_with_a_bias_that_is_a_parameter(tmp_path) -> None:
    """`--parameter-bias`: the bias has no tangent (closed over, as a model's parameter under
    torch.func.jvp of its inputs) and still gets its gradient in the backward."""
    out = tmp_path / "carry_cost_parameter_bias.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--parameter-bias", "--backward",
                    "--modes", "fast", "--out", str(out)], env=env, check=True,
                   capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [(row["causal"], row["bias"], row["bias_tangent"], row["backward"])
            for row in rows] == [(False, True, False, True), (True, True, False, True)]


def test_saved_results_split_each_call_into_kernels_and_carry() -> None:
    """The saved H100 runs: each accurate row's carry is part of its kernels' time, and the
    carried shapes (1024 keys and more) ran the carry's passes."""
    data = json.loads((REPO / "benchmarks/results/carry_cost_h100.json").read_text())
    for run in data["runs"]:
        for row in run["rows"]:
            assert abs(sum(row["kernels"].values()) - row["gpu_ms"]) < 2e-3, row
            assert 0 <= row["carry_ms"] <= row["gpu_ms"]
            carried = row["mode"] == "accurate" and row["shape"][2] >= 1024
            assert (row["carry_ms"] > 0) == carried, (run["code"], row)


def test_saved_bias_runs_time_the_mask_pairs_before_and_after() -> None:
    """The saved H100 runs with a learnable bias: each row's kernels add up to its GPU time,
    only carried rows run the carry's passes, every row copies the mask pairs once, and
    the copy at the batch's size ("before") is the slower one in every case."""
    data = json.loads((REPO / "benchmarks/results/carry_cost_bias_h100.json").read_text())
    pairs = next(iter(data["kernel_names"]))
    copy_ms = {}
    for run in data["runs"]:
        for row in run["rows"]:
            assert row["bias"] and abs(sum(row["kernels"].values()) - row["gpu_ms"]) < 2e-3
            assert (row["carry_ms"] > 0) == (row["mode"] == "accurate"), (run["code"], row)
            copy_ms.setdefault(run["code"], []).append(row["kernels"][pairs])
    assert min(copy_ms["before"]) > 10 * max(copy_ms["after"])


def test_saved_backward_runs_time_the_backward_copies_before_and_after() -> None:
    """The saved H100 MeanFlow-step runs (forward+JVP, then the primal backward): every row
    ran the backward, the carry only in accurate mode, and at the shape both runs timed the
    carry (the forward's and the backward's copies) is faster after than before."""
    data = json.loads((REPO / "benchmarks/results/carry_cost_backward_h100.json").read_text())
    assert data["command"].startswith("python benchmarks/carry_cost.py --backward")
    carry = {}
    for run in data["runs"]:
        for row in run["rows"]:
            assert row["backward"] and not row["bias"]
            assert (row["carry_ms"] > 0) == (row["mode"] == "accurate"), (run["code"], row)
            if row["kernels"] is not None:
                assert abs(sum(row["kernels"].values()) - row["gpu_ms"]) < 2e-3, row
            key = (tuple(row["shape"]), row["causal"], row["mode"])
            carry.setdefault(key, {})[run["code"]] = row["carry_ms"]
    shared = [times for key, times in carry.items() if len(times) == 2 and key[2] == "accurate"]
    assert shared and all(times["backward copies compiled as before"] < times["before"]
                          for times in shared)



def test_saved_h200_backward_runs_time_the_flat_copies() -> None:
    """The saved H200 MeanFlow-step runs before and after the backward's copies of q, k, v
    became flat arrays: every row's kernels add up to its GPU time, the carry runs only in
    accurate mode, and there the copy launch and the step are faster after than before."""
    data = json.loads((REPO / "benchmarks/results/carry_cost_backward_h200.json").read_text())
    assert data["command"].startswith("python benchmarks/carry_cost.py --backward")
    assert data["gpu"] == "NVIDIA H200"
    runs = {run["code"]: run for run in data["runs"]}
    assert set(runs) == {"before", "after"}
    rows = {}
    for code, run in runs.items():
        for row in run["rows"]:
            assert row["backward"] and not row["bias"]
            assert abs(sum(row["kernels"].values()) - row["gpu_ms"]) < 2e-3, row
            assert (row["carry_ms"] > 0) == (row["mode"] == "accurate"), (code, row)
            rows[code, tuple(row["shape"]), row["causal"], row["mode"]] = row
    accurate = [key[1:] for key in rows if key[0] == "before" and key[3] == "accurate"]
    assert accurate
    for key in accurate:
        before, after = rows[("before", *key)], rows[("after", *key)]
        assert (after["kernels"]["carried_copies_kernel"]
                < before["kernels"]["carried_copies_kernel"]), key
        assert after["gpu_ms"] < before["gpu_ms"], key


def test_saved_bias_backward_runs_carry_and_drop_the_cast() -> None:
    """The saved H100 MeanFlow-step runs with a learnable bias as a parameter: every row's
    kernels add up to its GPU time; before, "accurate" split its backward (the carry only
    in the forward) and every row filled and cast a float32 mask gradient; after, no row
    fills or casts, "accurate" carries its backward's copies too, and every case is faster."""
    data = json.loads((REPO / "benchmarks/results/carry_cost_bias_backward_h100.json").read_text())
    assert data["command"].startswith("python benchmarks/carry_cost.py --parameter-bias --backward")
    fill, cast, reduce = list(data["kernel_names"])
    gpu = {}
    for run in data["runs"]:
        for row in run["rows"]:
            assert row["backward"] and row["bias"] and not row["bias_tangent"]
            assert abs(sum(row["kernels"].values()) - row["gpu_ms"]) < 2e-3, row
            assert reduce in row["kernels"]
            for kernel in (fill, cast):
                assert (kernel in row["kernels"]) == (run["code"] == "before"), (run["code"], row)
            accurate = row["mode"] == "accurate"
            copies = row["kernels"].get("carried_copies_kernel", 0.0)
            assert (copies > 0.1) == (accurate and run["code"] == "after"), (run["code"], row)
            key = (tuple(row["shape"]), row["causal"], row["mode"])
            gpu.setdefault(key, {})[run["code"]] = row["gpu_ms"]
    assert len(gpu) == 12 and all(t["after"] < t["before"] for t in gpu.values())

PASSES_SCRIPT = REPO / "benchmarks" / "carry_passes.py"


def test_passes_smoke_run_checks_every_variant_of_ours(tmp_path) -> None:
    """benchmarks/carry_passes.py in the interpreter: every variant of a tiny case, each of
    ours compared with `value_operands`' copies (it raises otherwise), no times."""
    out = tmp_path / "carry_passes.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(PASSES_SCRIPT), "--smoke", "--out", str(out)], env=env,
                   check=True, capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text())
    assert data["schema"] == "jvp_attention.carry_passes/1" and data["smoke"] is True
    variants = [row["variant"] for row in data["rows"]]
    assert variants[:4] == ["copies made first", "range pass, then copies",
                            "torch to float16", "torch max |x|"]
    assert len(variants) == 4 + 6 and all(row["ms"] is None for row in data["rows"])


def test_saved_passes_add_up_and_move_what_they_must() -> None:
    """The saved H100 run: each row's time is its kernels' sum and its bandwidth the bytes
    it must move over that time; copies made first move a third less than the two passes."""
    data = json.loads((REPO / "benchmarks/results/carry_passes_h100.json").read_text())
    by_case = {}
    for row in data["rows"]:
        assert abs(sum(row["kernels"].values()) - row["ms"]) < 2e-3, row
        assert abs(row["gb_moved"] / row["ms"] - row["tb_per_s"]) < 0.01, row
        by_case[tuple(row["shape"]), row["variant"]] = row["gb_moved"]
    for shape in {shape for shape, _ in by_case}:
        first, two = by_case[shape, "copies made first"], by_case[shape, "range pass, then copies"]
        assert abs(first / two - 2 / 3) < 1e-3
