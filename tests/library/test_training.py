"""The MeanFlow training example (examples/meanflow_dit.py) on CPU.

- One training step with `jvp_attention.sdpa()` (the kernels, in Triton's interpreter when
  there is no GPU) gives the math path's loss, per-sample errors and gradients.
- The data of a global step do not depend on how many ranks share it.
- `--ddp` (and `--fsdp`, FSDP2) under torchrun with two gloo processes follows the
  single-process loss trajectory (the CPU tiled path, without the interpreter, keeps it fast).
- The benchmark records every attention, and skips jvp-flash-attention with a note when it
  does not import; it measures the attention's share of the step from a profile (eager:
  profiler ranges and the autograd nodes created in them; compiled: our custom operators, or
  a note saying why not), eager and under torch.compile; `--preset dit-b2` is DiT-B/2 sized.
"""

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import run_with_one_retry

import jvp_attention

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "meanflow_dit.py"
TINY = ["--image-size", "8", "--patch-size", "2", "--width", "32", "--depth", "2",
        "--heads", "2"]


def load_example():
    """examples/meanflow_dit.py as a module (examples/ is not a package)."""
    if "meanflow_dit" not in sys.modules:
        spec = importlib.util.spec_from_file_location("meanflow_dit", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["meanflow_dit"] = module
        spec.loader.exec_module(module)
    return sys.modules["meanflow_dit"]


mf = load_example()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny_model(seed: int = 0):
    """A tiny MeanFlow whose zero-initialised layers are perturbed, so every weight gets a
    gradient (with adaLN-Zero's zeros only the last layer would)."""
    torch.manual_seed(seed)
    model = mf.MeanFlow(mf.DiTConfig(image_size=8, width=32, depth=2, heads=2),
                        adaptive_p=0.0).to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def step_results(attention: str):
    model = tiny_model()
    batch = tuple(b.to(DEVICE) for b in mf.global_batch(0, 4, 8))
    with mf.attention_context(attention):
        loss, error = model(*batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), error, grads


def test_sdpa_step_matches_math_path():
    with mock.patch.object(jvp_attention.autograd, "attention",
                           wraps=jvp_attention.autograd.attention) as spy:
        loss, error, grads = step_results("jvp_attention")
    assert spy.call_count == 2  # one per block: every SDPA call went to jvp_attention
    ref_loss, ref_error, ref_grads = step_results("math")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(error, ref_error, rtol=1e-5, atol=1e-7)
    for name, grad in grads.items():
        ref = ref_grads[name]
        scale = ref.abs().max().clamp_min(1e-12)
        assert ((grad - ref).abs().max() / scale).item() < 1e-4, name
    assert ref_grads["net.blocks.0.qkv.weight"].abs().max() > 0


def test_global_batch_is_shared_by_any_number_of_ranks():
    whole = mf.global_batch(3, 8, 8, seed=1)
    again = mf.global_batch(3, 8, 8, seed=1)
    for a, b in zip(whole, again, strict=True):
        assert torch.equal(a, b)
    slices = [mf.rank_slice(whole, rank, 2) for rank in range(2)]
    for i, part in enumerate(whole):
        assert torch.equal(torch.cat([s[i] for s in slices]), part)
    x, noise, t, r = whole
    assert x.shape == noise.shape == (8, 3, 8, 8) and x.min() >= -1 and x.max() <= 1
    assert bool((r <= t).all()) and bool(((t > 0) & (t < 1)).all())
    assert not torch.equal(mf.global_batch(4, 8, 8, seed=1)[0], x)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_two_ranks_match_one(tmp_path: Path, wrapper: str):
    out = tmp_path / f"{wrapper}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # two CPU ranks over gloo on any machine (a one-GPU
    # machine has no second device for rank 1)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(SCRIPT), f"--{wrapper}", *TINY, "--steps", "4",
               "--batch-size", "8", "--dtype", "float32", "--warmup", "1", "--out", str(out)]
    result = run_with_one_retry(command, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["wrapper"] == wrapper
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert len(report["loss_ddp"]) == len(report["loss_single"]) == 4
    assert report["passed"] and report["max_rel_diff"] < 1e-4, report
    assert report["loss_ddp"][-1] != report["loss_ddp"][0]  # the model trained


@pytest.mark.parametrize("version, reshards", [("2.11.0+cu130", False), ("2.13.0", True)])
def test_fsdp_blocks_stay_gathered_where_pytorch_does_not_regather_under_jvp(
        monkeypatch, capsys, version: str, reshards: bool):
    """Before PyTorch 2.13 FSDP2 frees a block's weights after its forward and, under
    `torch.func.jvp`, does not gather them again for the backward (seen on 2.11): the
    example's blocks then keep them gathered, and say so."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **options: calls.append(options)
                        or module)
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    mf.shard_fsdp2(tiny_model())
    assert calls[:-1] == [{"reshard_after_forward": reshards}] * 2  # the two blocks
    assert calls[-1] == {}  # the root: FSDP2's default
    assert ("pytorch/pytorch#182641" in capsys.readouterr().out) is not reshards


BENCH_TINY = mf.DiTConfig(width=32, depth=1, heads=2)


def test_benchmark_records_every_attention():
    seen = []
    rows = mf.benchmark(BENCH_TINY, {8: 2}, DEVICE, "float32", image_sizes=(8,), warmup=1,
                        repeats=1, profile=False, on_row=lambda rows: seen.append(len(rows)))
    assert seen == list(range(1, len(rows) + 1)) and {row["batch"] for row in rows} == {2}
    by_attention = {row["attention"]: row for row in rows}
    assert set(by_attention) == set(mf.ATTENTIONS)
    for attention in ("jvp_attention", "jvp_attention_fast", "math"):
        row = by_attention[attention]
        assert row["step_ms"] > 0, row
        # the host's phases of the same steps, each measured, together within the step
        phases = [row[name] for name in mf.HOST_PHASES]
        assert all(ms > 0 for ms in phases) and sum(phases) <= row["step_ms"] * 1.05, row
    from jvp_attention.launch import accurate
    assert accurate()  # "jvp_attention_fast" restored the default precision
    flash = by_attention["jvp_flash_attention"]
    if mf.jvp_flash_attention_available() is not None:
        assert flash["skipped"].startswith("not importable")
    table = mf.summary_table(rows)
    assert "| 16 | eager | jvp_attention |" in table


def test_benchmark_attention_share_eager():
    """Eager, the attention's forward + JVP (profiler ranges) and backward (the autograd nodes
    created inside them) are both found, on our kernels and on the math path."""
    rows = mf.benchmark(BENCH_TINY, 2, DEVICE, "float32", image_sizes=(8,), warmup=1,
                        repeats=1, attentions=("jvp_attention", "math"))
    for row in rows:
        assert row["compile"] == "eager" and row["step_ms"] > 0, row
        assert 0 < row["attention_share"] < 1, row
        assert row["attention_fwd_ms"] > 0 and row["attention_bwd_ms"] > 0, row
        assert row["attention_ms"] == pytest.approx(row["attention_fwd_ms"]
                                                    + row["attention_bwd_ms"])
    table = mf.summary_table(rows)
    assert "| 16 | eager | math |" in table and "%" in table


def test_attention_backward_is_linked_by_sequence_number():
    """The backward nodes counted are those the forward created inside the attention ranges:
    on the math path one of each op's per block (the transpose right after the range shares
    the range's last sequence number and must not be counted); on ours, the fused op's."""
    model = tiny_model()  # two blocks
    for attention, expected in [("math", {"SoftmaxBackward0": 2, "BmmBackward0": 4,
                                          "TransposeBackward0": 2, "MulBackward0": 2}),
                                ("jvp_attention", {"_FusedTangentBackward": 2})]:
        config = mf.TrainConfig(batch_size=2, dtype="float32", attention=attention)
        optimizer, _ = mf.make_optimizer(model, config)
        step = functools.partial(mf.training_step, model, optimizer, mf.global_batch(0, 2, 8),
                                 config, DEVICE, label_attention=True)
        row = mf.attention_profile(mf.profile_step(step, DEVICE), DEVICE.type == "cuda")
        assert 0 < row["attention_share"] < 1, row
        nodes = row["attention_backward_nodes"]
        assert {name: nodes.get(name) for name in expected} == expected, nodes
        if attention == "jvp_attention":
            assert "TransposeBackward0" not in nodes, nodes


def test_attention_profile_on_cuda_events():
    """The CUDA accounting on a made-up profile: a kernel counts for the operator that
    launched it; the backward node numbered inside the range counts, the one numbered like
    the op right after it does not; a device-side copy of a range is not a kernel."""
    from torch.autograd.profiler_util import FunctionEvent

    def op(number, name, thread, start, end, seq=-1, parent=None, fwd_thread=None):
        event = FunctionEvent(number, name, thread, start, end, fwd_thread=fwd_thread,
                              sequence_nr=seq, use_device="cuda")
        if parent is not None:
            event.set_cpu_parent(parent)
            parent.append_cpu_child(event)
        return event

    def kernel(duration, launcher, annotation=False):
        # What the profiler does with a device event: it appends it to the kernels of the
        # CPU event it is linked to (a range's device-side copy keeps the range's name).
        launcher.append_kernel(launcher.name if annotation else "k", 0, duration)

    step = op(1, "meanflow step", 1, 0, 1000)
    attention = op(2, mf.ATTENTION_RANGE, 1, 10, 100, parent=step)
    mm = op(3, "aten::mm", 1, 20, 50, seq=5, parent=attention)
    same = op(4, "aten::is_same_size", 1, 60, 61, seq=6, parent=attention)  # makes no node
    transpose = op(5, "aten::transpose", 1, 110, 120, seq=6, parent=step)
    mm_bwd = op(6, mf.BACKWARD_NODE + "MmBackward0", 2, 500, 600, seq=5, fwd_thread=1)
    t_bwd = op(7, mf.BACKWARD_NODE + "TransposeBackward0", 2, 400, 450, seq=6, fwd_thread=1)
    events = [step, attention, mm, same, transpose, mm_bwd, t_bwd]
    for duration, launcher in ((30, mm), (40, mm_bwd), (20, t_bwd), (10, transpose)):
        kernel(duration, launcher)
    kernel(900, attention, annotation=True)
    row = mf.attention_profile(events, on_cuda=True)
    assert row["attention_backward_nodes"] == {"MmBackward0": 1}
    assert row["attention_fwd_ms"] == pytest.approx(0.030)
    assert row["attention_bwd_ms"] == pytest.approx(0.040)
    assert row["attention_share"] == pytest.approx(70 / 100)
    assert row["attention_basis"] == "cuda kernel time"


def test_attention_profile_finds_kernels_a_compiled_graph_launches():
    """Where Inductor launches our kernels itself (chapter 7's traced twins) the profile has
    no range or operator of ours, only the kernels, named after the Triton function with a
    number appended: they count, forward and backward by name, and Inductor's own kernels
    do not."""
    from torch.autograd.profiler_util import FunctionEvent

    import jvp_attention.backward
    import jvp_attention.forward

    for name in mf.OUR_KERNELS:  # the names are the library's kernels
        module = jvp_attention.forward if "forward" in name else jvp_attention.backward
        assert hasattr(module, name), name

    def event(number, name, start, end, kernels):
        e = FunctionEvent(number, name, 1, start, end, use_device="cuda")
        for kernel_name, duration in kernels:
            e.append_kernel(kernel_name, 0, duration)
        return e

    forward = event(1, "CompiledFunction", 0, 100, [("_attention_forward_kernel_0", 30),
                                                    ("triton_poi_fused_mul_0", 25)])
    backward = event(2, "CompiledFunctionBackward", 200, 300,
                     [("_attention_backward_dq_kernel_1", 15),
                      ("_attention_backward_dkdv_kernel_2", 10), ("triton_red_fused_1", 20)])
    row = mf.attention_profile([forward, backward], on_cuda=True)
    assert row["attention_fwd_ms"] == pytest.approx(0.030)
    assert row["attention_bwd_ms"] == pytest.approx(0.025)
    assert row["attention_share"] == pytest.approx(55 / 100)
    assert row["attention_backward_nodes"] == {}


def _measured_step(config, batch, attention, device, dtype, warmup, repeats, compile_mode,
                   profile):
    """Stands in for `mf.benchmark_step`: a row measured at 1 ms."""
    return {"attention": attention, "compile": compile_mode, "tokens": config.tokens,
            "batch": batch, "step_ms": 1.0}


def test_compiled_rows_only_for_the_attentions_asked():
    earlier = [{"attention": "math", "compile": "eager", "tokens": 16, "batch": 2,
                "step_ms": 9.0},  # measured: kept
               {"attention": "jvp_attention", "compile": "eager", "tokens": 16, "batch": 2,
                "skipped": "..."}]  # neither measured nor failed: run again
    with mock.patch.object(mf, "benchmark_step", side_effect=_measured_step) as run:
        rows = mf.benchmark(BENCH_TINY, 2, DEVICE, "float32", image_sizes=(8,),
                            attentions=("jvp_attention", "math"),
                            compile_modes=("eager", "default"),
                            compiled_attentions=("jvp_attention",), previous=earlier)
    assert [(r["compile"], r["attention"]) for r in rows] == [
        ("eager", "jvp_attention"), ("eager", "math"), ("default", "jvp_attention")]
    assert run.call_count == 2 and rows[1]["step_ms"] == 9.0 and rows[1]["resumed"]


def test_resume_keeps_rows_outside_the_new_plan():
    """A resumed run at one size keeps the earlier run's other sizes, in table order."""
    earlier = [{"attention": "math", "compile": "eager", "tokens": tokens, "batch": 2,
                "step_ms": 9.0} for tokens in (16, 64)]
    with mock.patch.object(mf, "benchmark_step", side_effect=_measured_step) as run:
        rows = mf.benchmark(BENCH_TINY, 2, DEVICE, "float32", image_sizes=(8,),
                            attentions=("jvp_attention", "math"),
                            compile_modes=("eager", "default"), previous=earlier)
    assert run.call_count == 3
    assert [(r["tokens"], r["compile"], r["attention"], r["step_ms"]) for r in rows] == [
        (16, "eager", "jvp_attention", 1.0), (16, "eager", "math", 9.0),
        (16, "default", "jvp_attention", 1.0), (16, "default", "math", 1.0),
        (64, "eager", "math", 9.0)]


def test_resumed_file_names_the_commands_behind_its_rows(tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"command": "python first", "rows": []}))
    out = tmp_path / "out.json"
    with mock.patch.object(mf, "benchmark", return_value=[]):
        mf.main(["--bench", "--resume", str(earlier), "--out", str(out), "--steps", "1"])
    saved = json.loads(out.read_text())
    assert saved["earlier_commands"] == ["python first"]
    assert saved["command"].endswith(f"--out {out} --steps 1")


def _lean_state_step(config, batch, attention, device, dtype, warmup, repeats, compile_mode,
                     profile):
    """Stands in for `mf.benchmark_step`: a row that says whether the lean zero-tangent
    kernels were on while it ran."""
    lean = jvp_attention.zero_tangents.lean_zero_tangents_enabled()
    return {**_measured_step(config, batch, attention, device, dtype, warmup, repeats,
                             compile_mode, profile), "lean_was_on": lean,
            "cache_key_tag": torch.compiler.config.cache_key_tag}


def test_each_row_runs_with_each_zero_tangents_setting(tmp_path):
    """--zero-tangents pytorch lean runs every row both ways, one after the other, the lean
    kernels on only for the lean rows (chapter 13), and says so in each row; a resumed run
    keeps rows by their setting too (rows from before the setting was recorded used
    PyTorch's)."""
    earlier = [{"attention": "math", "compile": "eager", "tokens": 16, "batch": 2,
                "step_ms": 9.0}]
    with mock.patch.object(mf, "benchmark_step", side_effect=_lean_state_step) as run:
        rows = mf.benchmark(BENCH_TINY, 2, DEVICE, "float32", image_sizes=(8,),
                            attentions=("jvp_attention", "math"), previous=earlier,
                            zero_tangents=("pytorch", "lean"))
    assert [(r["attention"], r["zero_tangents"], r.get("lean_was_on")) for r in rows] == [
        ("jvp_attention", "pytorch", False), ("jvp_attention", "lean", True),
        ("math", "pytorch", None), ("math", "lean", True)]
    assert run.call_count == 3 and rows[2]["resumed"]
    assert not jvp_attention.zero_tangents.lean_zero_tangents_enabled()
    # Each setting has its own compile-cache keys (a graph compiled with PyTorch's zero
    # tangents must not stand in for the lean one), and the tag is restored afterwards.
    assert [r.get("cache_key_tag") for r in rows] == [
        "|zero_tangents=pytorch", "|zero_tangents=lean", None, "|zero_tangents=lean"]
    assert torch.compiler.config.cache_key_tag == ""
    table = mf.summary_table(rows)
    assert "| 16 | eager | jvp_attention | lean | 1.0 |" in table
    out = tmp_path / "out.json"
    with mock.patch.object(mf, "benchmark", return_value=rows) as bench:
        mf.main(["--bench", "--zero-tangents", "pytorch", "lean", "--out", str(out)])
    assert bench.call_args.kwargs["zero_tangents"] == ("pytorch", "lean")
    assert "zero_tangents" not in json.loads(out.read_text())["environment"]


def test_zero_tangents_outside_the_benchmark_is_one_setting():
    with pytest.raises(SystemExit, match="one setting"):
        mf.main(["--zero-tangents", "pytorch", "lean", "--steps", "1"])
    assert mf.environment()["zero_tangents"] == "pytorch"


@pytest.mark.parametrize("attention", ["jvp_attention", "math"])
def test_benchmark_compiled(attention: str):
    """torch.compile over the training forward (inductor; on CPU it builds C++ with gcc). Our
    kernels are custom operators in the compiled graph, so their share is still found; the
    math path's attention is fused into inductor's kernels, and the row says so."""
    [row] = mf.benchmark(BENCH_TINY, 2, DEVICE, "float32", image_sizes=(8,), warmup=1,
                         repeats=1, attentions=(attention,), compile_modes=("default",))
    assert row["compile"] == "default" and "error" not in row, row
    assert row["step_ms"] > 0
    assert row["graphs"] == 1 and row["graph_breaks"] == 0, row  # one compiled region
    if attention == "jvp_attention":
        assert 0 < row["attention_share"] <= 1, row
    else:
        assert "attention_share" not in row and row["attention_note"].startswith(
            "not attributed"), row
    assert f"| 16 | default | {attention} |" in mf.summary_table([row])


def test_dit_b2_preset():
    assert 125e6 < mf.parameter_count(mf.PRESETS["dit-b2"]) < 135e6
    args = mf.parse_args(["--bench", "--preset", "dit-b2", "--depth", "2",
                          "--compile", "eager", "default"])
    assert mf.model_config(args) == mf.DiTConfig(patch_size=2, width=768, depth=2, heads=12)
    assert args.compile == ["eager", "default"]
    assert mf.model_config(mf.parse_args([])) == mf.DiTConfig()


def test_bench_json_records_the_command(tmp_path: Path):
    out = tmp_path / "bench.json"
    row = {"attention": "math", "compile": "eager", "tokens": 16, "batch": 2, "image_size": 8,
           "dtype": "float32", "step_ms": 1.0}
    argv = ["--bench", "--preset", "dit-b2", "--bench-sizes", "8", "16", "--batch-per-size",
            "16=1", "--out", str(out)]
    with mock.patch.object(mf, "benchmark", return_value=[row]) as bench:
        assert mf.main(argv) == 0
    assert bench.call_args.kwargs["compile_modes"] == ("eager",)
    assert bench.call_args.kwargs["compiled_attentions"] is None
    assert bench.call_args.args[1] == {8: 128, 16: 1}  # the default batch, and 16's own
    report = json.loads(out.read_text())
    assert set(report) >= {"model", "environment", "rows", "argv", "command", "complete"}
    assert report["argv"] == argv and report["rows"] == [row] and report["complete"]
    with pytest.raises(SystemExit, match="SIZE=BATCH"):
        mf.main(["--bench", "--batch-per-size", "16:1", "--out", str(out)])
    assert report["model"]["width"] == 768 and report["preset"] == "dit-b2"


@pytest.mark.parametrize("thread", ["device", "calling"])
def test_backward_thread_is_set_for_the_run_and_recorded(tmp_path: Path, thread: str):
    """--backward-thread calling runs the benchmark (and training) with the autograd
    engine's device threads off, says so in the file, and restores PyTorch's setting."""
    out = tmp_path / "bench.json"
    seen = []

    def bench(*args, **kwargs):
        seen.append(torch._C._is_multithreading_enabled())
        return [{"attention": "math", "compile": "eager", "tokens": 16, "batch": 2,
                 "image_size": 8, "dtype": "float32", "step_ms": 1.0}]

    with mock.patch.object(mf, "benchmark", side_effect=bench):
        assert mf.main(["--bench", "--backward-thread", thread, "--out", str(out)]) == 0
    assert seen == [thread == "device"]
    assert json.loads(out.read_text())["environment"]["backward_thread"] == thread
    assert torch._C._is_multithreading_enabled()


@pytest.mark.gpu
def test_attention_share_on_gpu():
    """On CUDA the share is of kernel time; the backward runs on autograd's device thread and
    is linked to the forward's thread by `fwd_thread`."""
    rows = mf.benchmark(mf.DiTConfig(width=128, depth=2, heads=2), 4, DEVICE, "bfloat16",
                        image_sizes=(32,), warmup=1, repeats=2,
                        attentions=("jvp_attention", "math"), compile_modes=("eager", "default"))
    for row in rows:
        assert "error" not in row and row["step_ms"] > 0, row
        if row["compile"] == "eager" or "attention_share" in row:
            assert 0 < row["attention_share"] < 1, row
            assert row["attention_basis"] == "cuda kernel time"
        else:  # compiled: a share, or a note that says why none
            assert row["attention_note"].startswith("not attributed"), row


@pytest.mark.gpu
def test_training_step_on_gpu_in_bf16():
    model = tiny_model()
    optimizer, _ = mf.make_optimizer(model, mf.TrainConfig())
    batch = mf.global_batch(0, 4, 8)
    error = mf.training_step(model, optimizer, batch, mf.TrainConfig(dtype="bfloat16"), DEVICE)
    assert torch.isfinite(error).all()
