"""The MeanFlow training example (examples/meanflow_dit.py) on CPU.

- One training step with `jvp_attention.sdpa()` (the kernels, in Triton's interpreter when
  there is no GPU) gives the math path's loss, per-sample errors and gradients.
- The data of a global step do not depend on how many ranks share it.
- `--ddp` (and `--fsdp`, FSDP2) under torchrun with two gloo processes follows the
  single-process loss trajectory (the CPU tiled path, without the interpreter, keeps it fast).
- The benchmark records every attention, and skips jvp-flash-attention with a note when it
  does not import.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

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
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(SCRIPT), f"--{wrapper}", *TINY, "--steps", "4",
               "--batch-size", "8", "--dtype", "float32", "--warmup", "1", "--out", str(out)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["wrapper"] == wrapper
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert len(report["loss_ddp"]) == len(report["loss_single"]) == 4
    assert report["passed"] and report["max_rel_diff"] < 1e-4, report
    assert report["loss_ddp"][-1] != report["loss_ddp"][0]  # the model trained


def test_benchmark_records_every_attention():
    rows = mf.benchmark(mf.DiTConfig(width=32, depth=1, heads=2), 2, DEVICE,
                        "float32", image_sizes=(8,), warmup=1, repeats=1)
    by_attention = {row["attention"]: row for row in rows}
    assert set(by_attention) == set(mf.ATTENTIONS)
    for attention in ("jvp_attention", "jvp_attention_fast", "math"):
        assert by_attention[attention]["step_ms"] > 0, by_attention[attention]
    from jvp_attention.launch import accurate
    assert accurate()  # "jvp_attention_fast" restored the default precision
    flash = by_attention["jvp_flash_attention"]
    if mf.jvp_flash_attention_available() is not None:
        assert flash["skipped"].startswith("not importable")
    table = mf.summary_table(rows)
    assert "| 16 | jvp_attention |" in table


@pytest.mark.gpu
def test_training_step_on_gpu_in_bf16():
    model = tiny_model()
    optimizer, _ = mf.make_optimizer(model, mf.TrainConfig())
    batch = mf.global_batch(0, 4, 8)
    error = mf.training_step(model, optimizer, batch, mf.TrainConfig(dtype="bfloat16"), DEVICE)
    assert torch.isfinite(error).all()
