"""benchmarks/host_breakdown.py: the layer timers and a smoke run through the interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "host_breakdown.py"
sys.path.insert(0, str(SCRIPT.parent))
import host_breakdown as hb  # noqa: E402


def test_timers_count_every_thread_and_restore():
    module = types.ModuleType("jvp_attention._timed_for_test")
    module.work = lambda x: x + 1
    sys.modules[module.__name__] = module
    alias = types.ModuleType("jvp_attention._imports_it_by_name")
    alias.work = module.work  # `from module import work`
    sys.modules[alias.__name__] = alias
    original = module.work
    try:
        timers = hb.LayerTimers()
        timers.wrap("work", module, "work")
        assert alias.work is module.work is not original
        module.work(1)
        thread = threading.Thread(target=alias.work, args=(2,))
        thread.start()
        thread.join()
        assert timers.calls["work"] == 2 and timers.seconds["work"] > 0
        timers.reset()
        assert timers.calls["work"] == 0 and timers.seconds["work"] == 0
        timers.restore()
        assert module.work is original and alias.work is original
    finally:
        del sys.modules[module.__name__], sys.modules[alias.__name__]


@pytest.mark.skipif(hb.ts.HAS_CUDA, reason="the smoke run is the CPU path")
def test_smoke_run_times_each_layer(tmp_path: Path):
    out = tmp_path / "breakdown.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--cpu-compile", "--mode",
                           "fwd_jvp", "meanflow", "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["schema"] == hb.SCHEMA and data["smoke"]
    rows = {(row["impl"], row["mode"]): row for row in data["rows"]}
    ran = [impl for impl in hb.IMPLS if impl != "ours_cudagraphs"]
    assert set(rows) == {(impl, mode) for impl in ran for mode in ("fwd_jvp", "meanflow")}
    assert set(data["skipped"]) == {"ours_cudagraphs"}  # said, not silently left out
    # Compiled (aot_eager here): the graph calls our operators, whose launchers are timed;
    # `attention` itself is not (a timer there would be a graph break).
    compiled = rows["ours_compiled", "meanflow"]["layers"]
    assert not set(compiled) & set(hb.TRACED_LAYERS)
    assert compiled["forward launcher"]["calls"] == compiled["backward launcher"]["calls"] == 1
    ours = rows["ours", "meanflow"]["layers"]
    # One call of each launcher per step; the layers nest, so none exceeds the step.
    assert ours["attention"]["calls"] == ours["forward launcher"]["calls"] == 1
    assert ours["functorch lift (_apply)"]["calls"] == 1  # inside the jvp: lifted
    assert ours["Function.apply (_apply_bound)"]["calls"] == 1
    assert ours["backward launcher"]["calls"] == 1
    assert ours["Triton interpreter (runs the kernel)"]["calls"] == 3  # fwd+JVP, dQ, dK/dV
    # After the warm-up steps every launch is a replay of the recorded call's (chapter 2),
    # which calls neither the autotuner nor our launcher.
    assert ours["CallReplay (a replayed call)"]["calls"] == 2  # the forward's, the backward's
    assert ours["ReplayedLaunch (a replayed launch)"]["calls"] == 3
    assert "CachedLauncher.run" not in ours and "KeyedAutotuner.run" not in ours
    for row in data["rows"]:
        assert all(0 < part["us"] <= row["step_us"] for part in row["layers"].values()), row
    assert rows["floor", "meanflow"]["layers"] == {}  # none of our layers runs


@pytest.mark.skipif(hb.ts.HAS_CUDA, reason="the smoke run is the CPU path")
def test_helpers_are_timed_apart_from_the_layers(tmp_path: Path):
    """--helpers times the launchers' helpers (allocations, checks) in each row's `helpers`,
    leaving the nested `layers` as they are."""
    out = tmp_path / "helpers.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--impl", "ours", "--mode",
                           "fwd_jvp", "--helpers", "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    [row] = data["rows"]
    assert data["settings"]["helpers"] is True
    helpers = {label for label, _, _ in hb.helper_layers()}
    assert set(row["helpers"]) <= helpers and not set(row["layers"]) & helpers
    assert row["helpers"]["argument checks (check_arguments)"]["calls"] == 1
    assert row["helpers"]["torch.empty (every caller)"]["us"] > 0
    assert "forward launcher" in row["layers"]


@pytest.mark.parametrize("thread", ["device", "calling"])
def test_backward_thread_is_set_around_every_step(monkeypatch, thread: str):
    """--backward-thread calling runs the warm-up and the timed steps with the autograd
    engine's device threads off (the backward on the thread that calls it), and puts
    PyTorch's setting back afterwards."""
    seen = []

    def make_step(case, device, args):
        def step():
            seen.append(hb.torch._C._is_multithreading_enabled())
        step.leaves, step.eager = [], None
        return step

    monkeypatch.setattr(hb.ts, "make_step", make_step)
    args = hb.parse_args(["--steps", "3", "--warmup-steps", "2", "--backward-thread", thread])
    case = hb.ts.Case("dit-b2-256", "floor", "meanflow", 1, 1, 8, 8, "fp16")
    row = hb.breakdown(case, args, hb.LayerTimers())
    assert seen == [thread == "device"] * 5 and row["steps"] == 3
    assert hb.torch._C._is_multithreading_enabled()


@pytest.mark.parametrize("impl", ["ours", "math", "floor"])
def test_parameter_bias_is_a_trained_leaf_of_the_step(impl: str):
    """--parameter-bias: every call of the step takes a (1, H, N, N) bias that requires grad
    (a parameter closed over, no tangent); the MeanFlow step gives it a gradient, except in
    the floor, which ignores it."""
    args = hb.parse_args(["--smoke", "--parameter-bias", "--dtype", "fp32"])
    b, h, n, d = next(iter(hb.ts.SMOKE_SHAPES.values()))
    case = hb.ts.Case("smoke", impl, "meanflow", b, h, n, d, "fp32")
    step = hb.ts.make_step(case, "cpu", args)
    bias = step.leaves[-1]  # after q, k and v
    assert len(step.leaves) == 4 and bias.shape == (1, h, n, n)
    step()
    if impl == "floor":
        assert bias.grad is None
    else:
        assert bias.grad is not None and bias.grad.abs().max() > 0
