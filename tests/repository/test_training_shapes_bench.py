"""benchmarks/training_shapes.py: the planned cases, the FLOP count, the kernel count, the skips,
and a smoke run's JSON schema.

The smoke run executes the script as a user would (`training_shapes.py --smoke --cpu-compile
--out FILE`): on CPU our kernels go through Triton's interpreter at a tiny size in fp16, and
the compiled column through the aot_eager backend, which checks the plumbing (not the speed)
in about 45 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "training_shapes.py"
sys.path.insert(0, str(SCRIPT.parent))
import training_shapes as ts  # noqa: E402

TOP_LEVEL = {"schema": str, "date": str, "command": str, "argv": list, "gpu": str,
             "device": dict, "smoke": bool, "interpreter": bool, "versions": dict, "git": dict,
             "settings": dict, "shapes": dict, "modes": dict, "impls": dict,
             "flop_convention": str, "definitions": dict, "case_fields": list, "cases": list,
             "wall_seconds": float, "complete": bool}
# The fields every case carries (None where not measured), as benchmarks/README.md lists them.
CASE_FIELDS = (
    "shape", "impl", "mode", "B", "H", "N", "d", "dtype", "causal", "flops",
    "status", "error", "skipped", "notes",
    "first_call_s", "compile_s", "warmup_step_ms",
    "gpu_ms", "wall_ms", "host_ms", "host_overlapped", "tflops", "tflops_wall",
    "kernels_per_call", "memcpy_memset_per_call", "launch_api_calls_per_call", "kernel_names",
    "kernel_ms", "setup_memory_mb", "peak_memory_mb", "peak_reserved_mb",
    "reps", "case_wall_s",
)
# Measured on every device; the GPU-only ones are None on CPU with the reason in `notes`.
ALWAYS_MEASURED = ("first_call_s", "warmup_step_ms", "wall_ms", "tflops", "tflops_wall", "reps")
GPU_MEASURED = ("gpu_ms", "host_ms", "host_overlapped", "kernels_per_call",
                "memcpy_memset_per_call", "kernel_names", "kernel_ms", "peak_memory_mb",
                "peak_reserved_mb", "setup_memory_mb")


def check_schema(data: dict) -> None:
    for key, kind in TOP_LEVEL.items():
        assert isinstance(data.get(key), kind), f"{key}: {data.get(key)!r} is not {kind.__name__}"
    assert data["schema"] == ts.SCHEMA
    for name in ("python", "torch", "triton", "jvp_attention"):
        assert data["versions"][name], name
    assert "jvp_flash_attention" in data["versions"]
    assert "commit" in data["git"]
    assert tuple(data["case_fields"]) == CASE_FIELDS == ts.CASE_FIELDS
    assert set(data["modes"]) == set(ts.MODES) and set(data["impls"]) == set(ts.IMPLS)
    # The header says what the columns mean.
    definitions = data["definitions"]
    for key in ("gpu_ms", "wall_ms", "host_ms", "kernels_per_call", "tflops",
                "peak_memory_mb", "peak_reserved_mb", "compile_s", "first_call_s"):
        assert len(definitions.get(key, "")) > 40, key
    assert "torch.cuda._sleep" in definitions["host_ms"]
    assert "memcpy" in definitions["kernels_per_call"]
    assert "ProfilerActivity.CUDA" in definitions["kernels_per_call"]
    assert "5.5x" in data["flop_convention"] and "10.5x" in data["flop_convention"]
    for case in data["cases"]:
        assert list(case)[: len(CASE_FIELDS)] == list(CASE_FIELDS), case
        assert case["shape"] in data["shapes"]
        assert case["status"] in ("ok", "error", "skipped"), case
        assert bool(case["error"]) == (case["status"] == "error"), case
        assert bool(case["skipped"]) == (case["status"] == "skipped"), case
        assert case["flops"] == ts.bench.case_flops(case["B"], case["H"], case["N"], case["N"],
                                                    case["d"], case["causal"], case["mode"])
        if case["status"] != "ok":
            continue
        for key in ALWAYS_MEASURED:
            if not (case["impl"].startswith("floor") and key.startswith("tflops")):
                assert case[key] is not None, f"{key} of {case}"
        assert case["wall_ms"] > 0 and case["first_call_s"] > 0
        assert (case["compile_s"] is not None) == (case["impl"] in ts.COMPILE_MODES)
        if case["impl"] in ts.COMPILE_MODES:  # the uncompiled step that tunes our kernels
            assert case["eager_warmup_s"] > 0
        ms = case["gpu_ms"] if data["device"]["cuda"] else case["wall_ms"]
        if case["impl"].startswith("floor"):  # no attention: no FLOPs to credit
            assert case["tflops"] is None and case["tflops_wall"] is None, case
        else:
            assert case["tflops"] == pytest.approx(case["flops"] / (ms * 1e-3) / 1e12, rel=1e-3)
        for key in GPU_MEASURED:
            if data["device"]["cuda"]:
                assert case[key] is not None, f"{key} of {case}"
            else:
                assert case[key] is None and (key == "setup_memory_mb" or case["notes"][key])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run (a GPU runs it for "
                                                      "real: benchmarks/README.md)")
def test_smoke_run_writes_the_schema(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--cpu-compile", "--out",
                             str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    check_schema(data)
    assert data["smoke"] and data["complete"] and data["interpreter"]
    assert "--smoke" in data["command"] and data["settings"]["dtype"] == "fp16"
    # the command as run from a checkout: no interpreter path, the script relative to it
    assert data["command"].startswith("python benchmarks/training_shapes.py --smoke")
    assert data["argv"][0] == "benchmarks/training_shapes.py"
    cases = {(c["impl"], c["mode"]): c for c in data["cases"]}
    assert set(cases) == {(impl, mode) for impl in ts.IMPLS for mode in ts.MODES}
    for (impl, _mode), case in cases.items():
        if impl in ("ours", "ours_fast", "ours_compiled", "math", "floor", "floor_compiled"):
            assert case["status"] == "ok", case
        else:  # CUDA graphs and jvp-flash-attention: CUDA only
            assert case["status"] == "skipped", case
    assert re.search(r"^\[\s*1/24 ", result.stdout, re.MULTILINE), "progress per case"
    assert "wall_ms per call" in result.stdout


def test_plan_shapes_modes_and_filters() -> None:
    cases = ts.plan(ts.parse_args([]))
    assert len(cases) == len(ts.SHAPES) * len(ts.IMPLS) * len(ts.MODES) == 144
    assert len({c.key for c in cases}) == len(cases)
    assert {(c.B, c.H, c.N, c.d) for c in cases} == {
        (64, 12, 256, 64), (32, 16, 256, 72), (16, 16, 1024, 72), (32, 12, 1024, 64),
        (16, 16, 1024, 128), (1, 12, 32760, 128)}
    # Shape by shape, ours first in each (it autotunes what the compiled columns reuse).
    assert [c.shape for c in cases] == sorted((c.shape for c in cases),
                                              key=list(ts.SHAPES).index)
    assert cases[0].impl == "ours" and {c.impl for c in cases[:3]} == {"ours"}
    some = ts.plan(ts.parse_args(["--shape", "dit-xl2-512", "--impl", "jfa", "math",
                                  "--mode", "meanflow"]))
    assert [(c.shape, c.impl, c.mode) for c in some] == [("dit-xl2-512", "math", "meanflow"),
                                                        ("dit-xl2-512", "jfa", "meanflow")]


def test_fast_column_runs_in_fast_precision_and_restores_the_mode(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(ts.jvp_attention, "attention",
                        lambda q, k, v: seen.append(ts.jvp_attention.get_precision()) or v)
    case = ts.Case("smoke", "ours_fast", "fwd_jvp", 1, 1, 16, 16, "fp16")
    before = ts.jvp_attention.get_precision()
    ts.attention_function(case, ts.parse_args([]))(*(torch.zeros(1, 1, 16, 16),) * 3)
    assert seen == ["fast"] and ts.jvp_attention.get_precision() == before


def test_flop_count() -> None:
    forward = 4 * 16 * 16 * 1024 * 1024 * 72
    flops = {mode: ts.Case("s", "ours", mode, 16, 16, 1024, 72, "bf16").flops for mode in ts.MODES}
    assert flops == {"fwd_jvp": 3 * forward, "meanflow": 5.5 * forward,
                     "second_order": 10.5 * forward}


def test_saved_results_keep_their_flops() -> None:
    """bench.py's one convention gives every saved record's FLOPs (and so its TFLOP/s)."""
    bench = ts.bench
    for path in sorted(bench.RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            continue
        schema = data.get("schema", "")
        if schema.startswith("jvp_attention.first_call/"):  # times, no FLOPs
            continue
        for case in data.get("cases", []):
            flops = bench.case_flops(case["B"], case["H"], case["N"], case["N"], case["d"],
                                     case["causal"], case["mode"])
            if "flops" in case:  # bench.py's and training_shapes.py's records
                assert case["flops"] == flops, (path.name, case)
            elif schema.startswith("jvp_attention.context_parallel/") and case.get("ms"):
                assert case["tflops"] == pytest.approx(flops / case["ms"] / 1e9, abs=0.06), case


def test_skips_jfa_head_dim_and_the_math_path_above_its_memory() -> None:
    args = ts.parse_args([])
    for mode in ts.MODES:
        xl = ts.Case("dit-xl2-256", "jfa", mode, *ts.SHAPES["dit-xl2-256"], "bf16")
        with pytest.raises(ts.Skip, match=r"^unsupported \(d=72\)"):
            ts.attention_function(xl, args)
        video = ts.Case("video-32k", "math", mode, *ts.SHAPES["video-32k"], "bf16")
        with pytest.raises(ts.Skip, match="GB"):
            ts.attention_function(video, args)
    # The DiT shapes fit the math path's limit.
    for name, shape in ts.SHAPES.items():
        if name != "video-32k":
            case = ts.Case(name, "math", "second_order", *shape, "bf16")
            assert ts.math_memory_estimate(case) < 30e9


def test_kernel_count_excludes_copies_and_counts_launch_calls() -> None:
    cuda, cpu = "DeviceType.CUDA", "DeviceType.CPU"
    typed = [("triton_attention_forward_jvp", cuda, "kernel"),
             ("Memcpy DtoD (Device -> Device)", cuda, "gpu_memcpy"),
             ("Memset (Device)", cuda, "gpu_memset"),
             ("void at::native::vectorized_elementwise_kernel<4>", cuda, "kernel"),
             ("triton_attention_forward_jvp", cuda, "kernel"),
             ("Context Sync", cuda, "cuda_sync"),
             ("cuLaunchKernelEx", cpu, "cuda_driver"), ("cudaLaunchKernel", cpu, "cuda_runtime"),
             ("cudaGraphLaunch", cpu, "cuda_runtime"), ("aten::empty", cpu, "cpu_op"),
             ("cudaMemcpyAsync", cpu, "cuda_runtime")]
    untyped = [(name, device, None) for name, device, _ in typed]
    for events in (typed, untyped):
        counts = ts.kernel_counts(events)
        assert counts["kernels_per_call"] == 3 and counts["memcpy_memset_per_call"] == 2
        assert counts["kernel_names"]["triton_attention_forward_jvp"] == 2
        assert counts["launch_api_calls_per_call"] == 3
    assert ts.kernel_counts([("k", cuda, "kernel")])["launch_api_calls_per_call"] is None
    assert counts["kernel_ms"] is None  # no durations given


def test_kernel_time_sums_each_kernels_launches() -> None:
    cuda, cpu = "DeviceType.CUDA", "DeviceType.CPU"
    events = [("forward", cuda, "kernel", 120.0), ("range", cuda, "kernel", 30.0),
              ("forward", cuda, "kernel", 80.0), ("Memset (Device)", cuda, "gpu_memset", 5.0),
              ("cudaLaunchKernel", cpu, "cuda_runtime", 4.0)]
    counts = ts.kernel_counts(events)
    assert counts["kernel_ms"] == {"forward": 0.2, "range": 0.03}
    # A kernel without a duration leaves the split unknown rather than short.
    assert ts.kernel_counts([*events, ("dq", cuda, "kernel", None)])["kernel_ms"] is None


def test_resume_keeps_measured_cases_and_reruns_budget_skips(tmp_path: Path) -> None:
    case = ts.Case("dit-b2-256", "ours", "fwd_jvp", *ts.SHAPES["dit-b2-256"], "bf16")
    measured = ts.complete_record(case, {"status": "ok", "error": None, "skipped": None,
                                         "wall_ms": 1.0})
    other = ts.Case("dit-b2-256", "ours", "meanflow", *ts.SHAPES["dit-b2-256"], "bf16")
    cut = ts.complete_record(other, {"status": "skipped", "error": None,
                                     "skipped": "wall budget: 600 s elapsed"})
    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps({"cases": [measured, cut]}))
    done = ts.load_resume([previous])
    assert list(done) == [case.key] and done[case.key]["resumed_from"] == str(previous)


def test_resume_keeps_cases_outside_the_selection(tmp_path: Path) -> None:
    """`--resume F --out F` with a narrower selection (here one mode) keeps F's other
    cases, as they were, before the run's own."""
    out = tmp_path / "run.json"
    data = ts.main(["--smoke", "--mode", "fwd_jvp", "--impl", "floor", "--max-seconds", "1e-6",
                    "--out", str(out)])
    other = ts.complete_record(ts.Case("dit-b2-256", "ours", "meanflow",
                                       *ts.SHAPES["dit-b2-256"], "bf16"),
                               {"status": "ok", "error": None, "skipped": None, "wall_ms": 1.0})
    out.write_text(json.dumps({**data, "cases": [*data["cases"], other]}))
    again = ts.main(["--smoke", "--mode", "fwd_jvp", "--impl", "floor", "--max-seconds", "1e-6",
                     "--resume", str(out), "--out", str(out)])
    assert again["cases"][0] == {**other, "resumed_from": str(out)}
    assert len(again["cases"]) == len(data["cases"]) + 1
    assert json.loads(out.read_text()) == again


def test_resume_refuses_a_run_of_another_layout(tmp_path: Path) -> None:
    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps({"settings": {"layout": "qkv"}, "cases": []}))
    assert ts.load_resume([previous], "qkv") == {}
    with pytest.raises(ValueError, match="--layout qkv"):
        ts.load_resume([previous])


def test_qkv_layout_views_one_projection_per_operand_triple() -> None:
    """DiT's layout: q, k, v are views of one (B, N, 3, H, d) tensor, heads d elements apart;
    only the packs are leaves."""
    case = ts.Case("smoke", "ours", "second_order", 2, 3, 5, 8, "fp32")
    inputs, grad, _ = ts.layout_tensors(case, "qkv", "cpu", torch.float32, grads_of=6)
    assert [tuple(x.shape) for x in inputs] == [(2, 5, 3, 3, 8)] * 2
    assert all(x.requires_grad and x.is_leaf for x in inputs)
    q, k, v, tq, tk, tv = ts.attention_operands(inputs, "qkv")
    assert q.shape == (2, 3, 5, 8) and q.stride() == (5 * 3 * 3 * 8, 8, 3 * 3 * 8, 1)
    assert torch.equal(k, inputs[0][:, :, 1].transpose(1, 2))
    assert torch.equal(tv, inputs[1][:, :, 2].transpose(1, 2))
    assert grad.shape == (2, 3, 5, 8) and grad.stride(1) == 8
    meanflow, _, _ = ts.layout_tensors(case, "qkv", "cpu", torch.float32, grads_of=3)
    assert [x.requires_grad for x in meanflow] == [True, False]


@pytest.mark.parametrize("mode", ["meanflow", "second_order"])
def test_qkv_layout_step_matches_the_math_path(mode: str) -> None:
    """One step of ours and of PyTorch's math path on the same (B, N, 3, H, d) inputs: the
    gradients reach the packs and agree."""
    args = ts.parse_args(["--smoke", "--layout", "qkv", "--dtype", "fp32"])
    grads = {}
    for impl in ("ours", "math"):
        case = ts.Case("smoke", impl, mode, 1, 2, 17, 16, "fp32")
        torch.manual_seed(0)
        step = ts.make_step(case, "cpu", args)
        step()
        grads[impl] = [x.grad for x in step.leaves]
    assert len(grads["ours"]) == {"meanflow": 1, "second_order": 2}[mode]
    for ours, math in zip(grads["ours"], grads["math"], strict=True):
        assert ours is not None and ours.shape == math.shape
        torch.testing.assert_close(ours, math, rtol=1e-4, atol=1e-5)


def test_key_side_passes_option_sets_the_library_switch(monkeypatch) -> None:
    """--key-side-passes 1 runs the second-order key side in one pass, 2 in two; without it
    the library's default stays."""
    import jvp_attention.backward as backward

    for argv, expected in ((["--key-side-passes", "1"], False),
                           (["--key-side-passes", "2"], True), ([], "default")):
        monkeypatch.setattr(backward, "SPLIT_KEY_SIDE", "default")
        ts.configure_library(ts.parse_args(argv))
        assert backward.SPLIT_KEY_SIDE == expected, argv
