"""benchmarks/bench.py: the grid, the FLOP count, the budget, and a smoke run's JSON schema.

The smoke run executes the script as a user would (`bench.py --smoke --out FILE`): on CPU every
implementation that runs there goes through Triton's interpreter at a tiny size, which checks
the plumbing (not the speed) in well under a minute. The rcm column (`--rcm-kernel PATH`) runs
through a stand-in kernel file written by the tests: none depends on the third-party file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench.py"
sys.path.insert(0, str(BENCH.parent))
import bench  # noqa: E402

from jvp_attention.launch import accurate  # noqa: E402

TOP_LEVEL = {"schema": str, "date": str, "command": str, "argv": list, "gpu": str,
             "device": dict, "smoke": bool, "versions": dict, "git": dict, "settings": dict,
             "flop_convention": str, "cases": list, "wall_seconds": float, "complete": bool}
CASE_FIELDS = {"impl": str, "mode": str, "B": int, "H": int, "N": int, "d": int,
               "causal": bool, "dtype": str, "flops": float}
MEASURED_FIELDS = ("median_ms", "tflops", "first_call_ms", "peak_memory_mb", "setup_memory_mb",
                   "wall_s")
# The implementations a run has without options: rcm needs --rcm-kernel.
DEFAULT_IMPLS = {impl: modes for impl, modes in bench.IMPLS.items() if impl != "rcm"}
# rcm's entry point, attention(q, k, v, tq, tk, tv, sm_scale=None) -> (out, tangent_out), in
# plain PyTorch: the output differentiable, the tangent from torch.func.jvp.
RCM_STAND_IN = '''"""A stand-in for rcm's flash_attention_jvp_triton.py."""
import torch


def _attend(q, k, v, scale):
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v


def attention(q, k, v, tq, tk, tv, sm_scale=None):
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    primals = (q.detach(), k.detach(), v.detach())
    _, tangent = torch.func.jvp(lambda *p: _attend(*p, scale), primals, (tq, tk, tv))
    return _attend(q, k, v, scale), tangent
'''


def check_schema(data: dict) -> None:
    for key, kind in TOP_LEVEL.items():
        assert isinstance(data.get(key), kind), f"{key}: {data.get(key)!r} is not {kind.__name__}"
    assert data["schema"] == bench.SCHEMA
    for name in ("python", "torch", "triton", "jvp_attention"):
        assert data["versions"][name], name
    assert "jvp_flash_attention" in data["versions"]
    assert "commit" in data["git"]
    for case in data["cases"]:
        for key, kind in CASE_FIELDS.items():
            assert isinstance(case[key], kind), f"{key} of {case}"
        assert case["mode"] in bench.IMPLS[case["impl"]]
        outcome = [case.get("median_ms") is not None, bool(case.get("error")),
                   bool(case.get("skipped"))]
        assert sum(outcome) == 1, f"a case is measured, failed or skipped: {case}"
        if case.get("median_ms") is not None:
            for key in MEASURED_FIELDS:
                assert key in case, f"{key} missing from {case}"
            assert case["median_ms"] > 0 and case["first_call_ms"] > 0
            expected = case["flops"] / (case["median_ms"] * 1e-3) / 1e12
            assert case["tflops"] == pytest.approx(expected, rel=1e-4)


def test_smoke_run_writes_the_schema(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    # causal only: the plumbing is the same for both, and CI's two cores pay per kernel variant
    result = subprocess.run([sys.executable, str(BENCH), "--smoke", "--causal", "1", "--out",
                             str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    check_schema(data)
    assert data["smoke"] and data["complete"]
    assert "--smoke" in data["command"]
    pairs = {(c["impl"], c["mode"]) for c in data["cases"]}
    assert pairs == {(impl, mode) for impl, modes in DEFAULT_IMPLS.items() for mode in modes}
    assert data["settings"]["precision"]["ours_fast"] == "fast" and "ours_fast" in data["impls"]
    for case in data["cases"]:
        assert not case.get("error"), case
        if case["impl"] != "jfa":  # jvp-flash-attention is optional: skipped when missing
            assert case.get("median_ms") is not None, case
    assert re.search(r"^\[\s*1/\d+ ", result.stdout, re.MULTILINE), "progress per case"
    assert "Cold start" in result.stdout


def test_grid_keeps_tokens_and_width_fixed() -> None:
    cases = bench.plan(bench.parse_args([]))
    shapes = {(c.B, c.H, c.N, c.d) for c in cases}
    assert len(shapes) == len(bench.GRID_N) * len(bench.GRID_D)
    for B, H, N, d in shapes:
        assert B * N == max(bench.GRID_TOKENS, N) and H * d == bench.GRID_WIDTH
    per_shape = sum(len(modes) for modes in DEFAULT_IMPLS.values())
    assert len(cases) == len(shapes) * 2 * per_shape == 392  # benchmarks/README.md
    assert len({c.key for c in cases}) == len(cases)
    # The headline shapes run first, then increasing N.
    headline = [c for c in cases if c.tier == 0]
    assert cases[: len(headline)] == headline
    assert {(c.B, c.H, c.N, c.d) for c in headline} == set(bench.HEADLINE)
    rest = [c.N for c in cases[len(headline):]]
    assert rest == sorted(rest)


def test_quick_and_filters() -> None:
    quick = bench.plan(bench.parse_args(["--quick"]))
    assert {(c.B, c.H, c.N, c.d) for c in quick} == set(bench.HEADLINE)
    assert {c.causal for c in quick} == {False, True}
    assert len(quick) == 56  # benchmarks/README.md
    some = bench.plan(bench.parse_args(["--impl", "ours", "--mode", "fwd_jvp", "--n", "4k",
                                        "16384", "--d", "128", "--causal", "1"]))
    assert [(c.impl, c.mode, c.N, c.d, c.causal) for c in some] == [
        ("ours", "fwd_jvp", 4096, 128, True), ("ours", "fwd_jvp", 16384, 128, True)]


def test_priority_lists_every_pair_fast_right_after_ours() -> None:
    pairs = [(impl, mode) for impl, modes in bench.IMPLS.items() for mode in modes]
    assert sorted(bench.PRIORITY) == sorted(pairs)
    assert set(bench.IMPL_LABELS) == set(bench.IMPLS)
    for mode in bench.IMPLS["ours_fast"]:
        at = bench.PRIORITY.index(("ours", mode))
        assert bench.PRIORITY[at + 1] == ("ours_fast", mode)


def test_precision_restores_the_previous_mode() -> None:
    for previous, other in (("accurate", "fast"), ("fast", "accurate")):
        with bench.precision(previous):
            with pytest.raises(RuntimeError), bench.precision(other):
                assert bench.precision_mode() == other
                raise RuntimeError
            assert bench.precision_mode() == previous


@pytest.mark.parametrize("mode", bench.IMPLS["ours_fast"])
def test_ours_fast_calls_the_kernels_in_fast_precision(mode: str, monkeypatch) -> None:
    seen = []

    def spy(kernel):
        def call(*args, **kwargs):
            seen.append(accurate())
            return kernel(*args, **kwargs)

        return call

    for name in ("flash_attention_forward", "flash_attention_backward"):
        monkeypatch.setattr(bench, name, spy(getattr(bench, name)))
    case = bench.Case("ours_fast", mode, *bench.SMOKE_SHAPE, True, "fp32")
    with bench.precision("accurate"):
        fn = bench.prepare(case, "cpu", bench.parse_args(["--smoke"]))
        assert accurate(), "the set-up restores the mode"
        seen.clear()
        result = fn()
        assert accurate(), "the timed call restores the mode"
    assert seen and not any(seen), "every kernel call ran in fast precision"
    assert result is not None
    assert bench.Case("ours", mode, *bench.SMOKE_SHAPE, True, "fp32").flops == case.flops


def test_flop_count() -> None:
    forward = 4 * 4 * 16 * 4096 * 4096 * 128
    assert bench.case_flops(4, 16, 4096, 4096, 128, False, "fwd") == forward
    assert bench.case_flops(4, 16, 4096, 4096, 128, True, "fwd") == forward / 2
    assert bench.case_flops(4, 16, 4096, 4096, 128, False, "fwd_jvp") == 3 * forward
    assert bench.case_flops(4, 16, 4096, 4096, 128, False, "bwd") == 2.5 * forward
    assert bench.case_flops(4, 16, 4096, 4096, 128, True, "bwd2") == 7.5 * forward / 2
    from jvp_attention.reference import FORWARDS_PER_CALL, sdpa_flops

    assert sdpa_flops(4, 16, 4096, 4096, 128, 128) == forward
    assert bench.MODE_FORWARDS is FORWARDS_PER_CALL  # one convention, the library's


def test_math_path_is_skipped_above_its_memory_estimate() -> None:
    big = bench.Case("sdpa_math", "fwd_jvp", 1, 32, 16384, 64, False, "bf16")
    with pytest.raises(bench.Skip, match="GB"):
        bench.prepare_sdpa_math(big, "cuda", limit_bytes=100e9)
    # 83 GB at B1 H16 N16k d128 ran on an H200 (141 GB); the estimate lets it run.
    assert bench.math_memory_estimate(
        bench.Case("sdpa_math", "fwd_jvp", 1, 16, 16384, 128, False, "bf16")) < 100e9


def test_carry_min_keys_moves_the_crossover(tmp_path: Path, monkeypatch) -> None:
    import jvp_attention.launch

    monkeypatch.setattr(jvp_attention.launch, "CARRY_MIN_KEYS", 2048)  # restored afterwards
    out = tmp_path / "carry.json"
    data = bench.main(["--smoke", "--max-seconds", "1e-6", "--autotune-rep-ms", "0",
                       "--carry-min-keys", "0", "--out", str(out)])
    assert data["settings"]["carry_min_keys"] == 0
    assert jvp_attention.launch.carries(torch.empty(0, 64, dtype=torch.bfloat16), 1)


def test_wall_budget_records_what_it_skipped(tmp_path: Path) -> None:
    out = tmp_path / "budget.json"
    data = bench.main(["--smoke", "--max-seconds", "1e-6", "--autotune-rep-ms", "0",
                       "--out", str(out)])
    assert json.loads(out.read_text()) == data
    check_schema(data)
    assert not data["complete"]
    assert all(c["skipped"].startswith("wall budget") for c in data["cases"])
    # A resumed run keeps measured cases and runs the budget skips again.
    measured = {**data["cases"][0], "skipped": None, "median_ms": 1.0}
    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps({**data, "cases": [measured, *data["cases"][1:]]}))
    done = bench.load_resume([previous])
    key = bench.Case(**{k: measured[k] for k in CASE_FIELDS if k != "flops"}).key
    assert list(done) == [key]
    # Several files: each contributes its cases, and a later file wins a key both have.
    later = tmp_path / "later.json"
    second = {**data["cases"][1], "skipped": None, "median_ms": 2.0}
    later.write_text(json.dumps({**data, "cases": [{**measured, "median_ms": 3.0}, second]}))
    done = bench.load_resume([previous, later])
    assert len(done) == 2 and done[key]["median_ms"] == 3.0
    assert done[key]["resumed_from"] == str(later)


def test_resume_keeps_cases_outside_the_selection(tmp_path: Path) -> None:
    """Resuming into the same file with a narrower selection adds to the file: the cases the
    run does not plan are copied as they were, before its own."""
    out = tmp_path / "run.json"
    data = bench.main(["--smoke", "--max-seconds", "1e-6", "--autotune-rep-ms", "0",
                       "--out", str(out)])
    other = {**data["cases"][0], "impl": "elsewhere", "skipped": None, "median_ms": 1.5}
    out.write_text(json.dumps({**data, "cases": [other, *data["cases"]]}))
    again = bench.main(["--smoke", "--max-seconds", "1e-6", "--autotune-rep-ms", "0",
                        "--resume", str(out), "--out", str(out)])
    assert again["cases"][0] == {**other, "resumed_from": str(out)}
    assert len(again["cases"]) == len(data["cases"]) + 1
    assert json.loads(out.read_text()) == again


def test_budget_prediction_scales_with_the_work() -> None:
    small = bench.Case("ours", "bwd2", 1, 16, 16384, 128, False, "bf16")
    large = bench.Case("ours", "bwd2", 1, 16, 32768, 128, False, "bf16")
    history = {("ours", "bwd2", 128, False): (small.scores, 3.0)}
    assert bench.predicted_seconds(large, history) == pytest.approx(2 * 3.0 * 4)
    assert bench.predicted_seconds(bench.Case("jfa", "fwd", 1, 16, 4096, 128, False, "bf16"),
                                   history) == 0.0


def test_quick_autotune_reaches_every_autotuned_kernel() -> None:
    from triton.runtime.autotuner import Autotuner

    tuners = {f"{name}.{attr}": value for name, module in list(sys.modules.items())
              if name.startswith("jvp_attention") or name == bench.RCM_MODULE
              for attr, value in vars(module).items()
              if isinstance(value, Autotuner)}
    before = {name: dict(vars(tuner)) for name, tuner in tuners.items()}
    try:
        patched = bench.use_quick_autotune(20.0)
        assert set(patched) == set(tuners)
        assert {"jvp_attention.forward._attention_forward",
                "jvp_attention.forward._attention_forward_jvp",
                "jvp_attention.backward._backward_dq", "jvp_attention.backward._backward_dq_tangent",
                "jvp_attention.backward._backward_dkdv",
                "jvp_attention.backward._backward_dkdv_tangent"} <= set(patched)
    finally:  # leave the library's autotuners as they were for the other tests
        for name, tuner in tuners.items():
            vars(tuner).pop("do_bench", None)
            if "do_bench" in before[name]:
                tuner.do_bench = before[name]["do_bench"]


def rcm_stand_in(tmp_path: Path, text: str = RCM_STAND_IN) -> Path:
    """Write a kernel file for --rcm-kernel into tmp_path; return its path."""
    path = tmp_path / "flash_attention_jvp_triton.py"
    path.write_text(text)
    return path


def test_rcm_kernel_option_adds_the_rcm_column(tmp_path: Path) -> None:
    path = rcm_stand_in(tmp_path)
    args = bench.parse_args(["--quick", "--rcm-kernel", str(path)])
    assert args.rcm_kernel == path.resolve()
    rcm = {(c.mode, c.N, c.causal) for c in bench.plan(args) if c.impl == "rcm"}
    assert rcm == {(mode, shape[2], causal) for mode in bench.IMPLS["rcm"]
                   for shape in bench.HEADLINE for causal in (False, True)}
    assert not [c for c in bench.plan(bench.parse_args(["--quick"])) if c.impl == "rcm"]


def test_rcm_kernel_option_refuses_a_missing_file(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--rcm-kernel", str(tmp_path / "absent.py")])
    assert "absent.py: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--impl", "rcm"])
    assert "--impl rcm needs --rcm-kernel" in capsys.readouterr().err
    broken = rcm_stand_in(tmp_path, "import torch\n")  # no entry point
    with pytest.raises(SystemExit, match="cannot load it: AttributeError"):
        bench.main(["--smoke", "--impl", "rcm", "--rcm-kernel", str(broken),
                    "--out", str(tmp_path / "none.json")])


def test_rcm_column_runs_a_stand_in_kernel(tmp_path: Path) -> None:
    path = rcm_stand_in(tmp_path)
    out = tmp_path / "rcm.json"
    data = bench.main(["--smoke", "--impl", "rcm", "--rcm-kernel", str(path), "--out", str(out)])
    assert json.loads(out.read_text()) == data
    check_schema(data)
    assert data["complete"]
    settings = data["settings"]["rcm_kernel"]
    assert settings["path"] == str(path.resolve()) and settings["placeholders"] == []
    assert settings["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    cases = {(c["mode"], c["causal"]): c for c in data["cases"]}
    assert set(cases) == {(mode, causal) for mode in bench.IMPLS["rcm"] for causal in (0, 1)}
    for mode in bench.IMPLS["rcm"]:
        measured, causal = cases[(mode, False)], cases[(mode, True)]
        assert measured["median_ms"] is not None and not measured["error"], measured
        ours = bench.Case("ours", mode, *bench.SMOKE_SHAPE, False, "fp32")
        assert measured["flops"] == ours.flops  # the same FLOPs credited
        assert causal["skipped"] == "rcm's kernel has no causal mask"
    # The timed call is the entry point's: the output and the tangent.
    case = bench.Case("rcm", "fwd_jvp", *bench.SMOKE_SHAPE, False, "fp32")
    out, tangent = bench.prepare_rcm(case, "cpu", path)()
    assert out.shape == tangent.shape == (1, 2, 64, 32)
    wide = bench.Case("rcm", "fwd_jvp", 1, 2, 64, 48, False, "fp32")
    with pytest.raises(bench.Skip, match="d in"):
        bench.prepare_rcm(wide, "cpu", path)


@pytest.mark.skipif(any(importlib.util.find_spec(name) for name in ("flash_attn", "einops")),
                    reason="placeholders stand in only for modules that are not installed")
def test_rcm_backward_imports_get_placeholders(tmp_path: Path) -> None:
    imports = ("from einops import rearrange\n"
               "from flash_attn.flash_attn_interface import _flash_attn_backward\n")
    path = rcm_stand_in(tmp_path, imports + RCM_STAND_IN)
    kernel = bench.load_rcm(path.resolve())
    assert kernel.placeholders == ("einops", "flash_attn")
    assert "flash_attn" not in sys.modules and "einops" not in sys.modules
    with pytest.raises(RuntimeError, match="flash_attn is not installed"):
        kernel.module._flash_attn_backward()
    fwd_jvp = bench.Case("rcm", "fwd_jvp", *bench.SMOKE_SHAPE, False, "fp32")
    assert len(bench.prepare_rcm(fwd_jvp, "cpu", path)()) == 2
    bwd = bench.Case("rcm", "bwd", *bench.SMOKE_SHAPE, False, "fp32")
    with pytest.raises(bench.Skip, match="flash_attn not installed"):
        bench.prepare_rcm(bwd, "cpu", path)
