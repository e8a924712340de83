"""Chapter 11's warp-specialised forward (Gluon, Hopper only).

On CPU: who takes it (`fits_warp_specialized`, `takes_warp_specialized`), that chapter 2's
launcher hands it exactly the calls it should and falls back when it cannot compile, and that
it compiles for sm_90 within its budget (ptxas ships with Triton; no GPU needed). On an sm_90
GPU: out and lse against float64 with the floor-ratio criterion of every kernel test, the
rounding residual, and the first-order backward from its saved outputs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    DEVICE,
    Spec,
    assert_accurate,
    dtype_name,
    expected_backward,
    expected_forward,
    kernel_backward,
    kernel_forward,
    make_problem,
)

from jvp_attention import forward as forward_module
from jvp_attention import warp_specialized as ws
from jvp_attention.reference import AttentionOutputs

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
N = ws.WARP_SPECIALIZED_MIN_KEYS


def heads(n: int = N, d: int = 128, dtype: torch.dtype = torch.bfloat16, layout: str = "bhnd",
          heads: int = 16) -> torch.Tensor:
    """(4, heads, n, d) zeros: with the defaults, 2**37 of work (B·H·Nq·Nk·D)."""
    if layout == "bnhd":
        return torch.empty(4, n, heads, d, dtype=dtype).transpose(1, 2)
    return torch.empty(4, heads, n, d, dtype=dtype)


def test_which_inputs_fit() -> None:
    q = heads()
    assert ws.fits_warp_specialized(q, q, q)
    assert ws.fits_warp_specialized(q.half(), q.half(), q.half())
    assert ws.fits_warp_specialized(*(heads(d=64, layout="bnhd") for _ in range(3)))
    assert ws.fits_warp_specialized(heads(n=1024), q, q)  # fewer queries, work enough
    assert not ws.fits_warp_specialized(heads(n=7), q, q)  # too little work to hide the launch
    assert ws.fits_warp_specialized(heads(heads=32), q, q)  # GQA
    short = heads(n=N - 1)
    assert not ws.fits_warp_specialized(q, short, short)  # too few keys to pay
    assert not ws.fits_warp_specialized(q.float(), q.float(), q.float())  # fp32
    assert not ws.fits_warp_specialized(q, q.half(), q.half())  # mixed dtypes
    d72 = heads(d=72)
    assert not ws.fits_warp_specialized(d72, d72, d72)
    assert not ws.fits_warp_specialized(q, q, heads(d=64))  # Dv != D
    padded = torch.empty(4, 16, N, 131, dtype=torch.bfloat16)[..., :128]  # 262-byte rows
    assert not ws.fits_warp_specialized(padded, padded, padded)
    expanded = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16).expand(4, 16, N, 128)
    assert not ws.fits_warp_specialized(q, expanded, expanded)  # stride 0
    empty = heads(heads=0)
    assert not ws.fits_warp_specialized(empty, empty, empty)


def test_taken_only_on_hopper_gpus(monkeypatch) -> None:
    q = heads()
    assert not ws.takes_warp_specialized(q, q, q)  # a CPU tensor
    if DEVICE == "cuda":
        g = q.cuda()
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert ws.takes_warp_specialized(g, g, g) == hopper
        monkeypatch.setenv("JVP_ATTENTION_WARP_SPECIALIZED", "0")
        assert not ws.takes_warp_specialized(g, g, g)


def test_forward_hands_over_unmasked_primal_calls(monkeypatch) -> None:
    """Chapter 2's launcher asks for every call and hands over only those without tangents
    or a mask; when the kernel cannot compile (None back) it runs its own."""
    calls = []
    sentinel = AttentionOutputs(torch.zeros(1), torch.zeros(1), None, None)

    def recorded(q, k, v, is_causal, scale, residuals):
        calls.append((is_causal, scale, residuals))
        return sentinel

    monkeypatch.setattr(forward_module, "takes_warp_specialized", lambda q, k, v: True)
    monkeypatch.setattr(forward_module, "warp_specialized_forward", recorded)
    q = torch.randn(1, 2, 8, 16, device=DEVICE, dtype=torch.float16)
    assert forward_module.flash_attention_forward(q, q, q, None, True, 0.5) is sentinel
    assert forward_module.flash_attention_forward(q, q, q, residuals=True) is sentinel
    assert calls == [(True, 0.5, False), (False, 16**-0.5, True)]
    tangents = (q, q, q)
    with_tangent = forward_module.flash_attention_forward(q, q, q, tangents=tangents)
    masked = forward_module.flash_attention_forward(q, q, q, torch.ones(8, 8, dtype=torch.bool,
                                                                        device=DEVICE))
    assert len(calls) == 2 and with_tangent.tangent_out is not None and masked.out.shape == q.shape
    monkeypatch.setattr(forward_module, "warp_specialized_forward", lambda *args: None)
    fallback = forward_module.flash_attention_forward(q, q, q)
    monkeypatch.setattr(forward_module, "takes_warp_specialized", lambda q, k, v: False)
    assert torch.equal(fallback.out, forward_module.flash_attention_forward(q, q, q).out)


def test_a_failed_compile_falls_back_with_a_warning(monkeypatch) -> None:
    """A Triton whose Gluon has moved on: warned once, then chapter 2's kernel for good."""
    import triton

    def broken(*args, **kwargs):
        raise triton.CompilationError(None, None, "an API this Triton no longer has")

    monkeypatch.setattr(ws, "launch_warp_specialized", broken)
    monkeypatch.setattr(ws, "_failed", False)
    q = heads()
    with pytest.warns(RuntimeWarning, match="warp-specialised forward does not compile"):
        assert ws.warp_specialized_forward(q, q, q, False, 0.1) is None
    assert ws._failed
    assert not ws.takes_warp_specialized(q, q, q)


def compiled_for_hopper(module: str, call: str) -> dict:
    """`module.compile_for_hopper` report from benchmarks/, run with Triton in GPU mode (not
    the interpreter the CPU tests run under), hence the subprocess."""
    code = (f"import sys, json; sys.path.insert(0, {str(BENCHMARKS)!r}); "
            f"from {module} import compile_for_hopper; print(json.dumps({call}))")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=600, check=False, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_within_budget(report: dict) -> None:
    """No spills, within the 227 KB of shared memory a block may take, and the register
    budgets of the design (240 a compute thread, 24 a loader thread)."""
    assert report["spills"] == 0
    assert report["shared"] <= 232448
    budgets = {tuple(budget) for budget in report["setmaxnreg"]}
    assert {("inc", "240"), ("dec", "24")} <= budgets


@pytest.mark.parametrize("d", [64, 128])
def test_compiles_for_hopper_within_its_budget(d: int) -> None:
    """The library's schedule (ping-pong, three ring slots), causal with the residual, for
    sm_90."""
    report = compiled_for_hopper(
        "warp_specialized",
        f"compile_for_hopper('ws_pingpong_s3', causal=True, d={d}, residual=True)")
    assert_within_budget(report)
    assert report["wgmma"] > 0


def test_jvp_experiment_compiles_for_hopper_within_its_budget() -> None:
    """benchmarks/warp_specialized_jvp.py, the tangent carried into the same schedule: its
    d = 128 candidate (64-key tiles) for sm_90."""
    assert_within_budget(compiled_for_hopper(
        "warp_specialized_jvp", "compile_for_hopper('d128_n64_s2', causal=True)"))


GPU_SPECS = [  # each with at least WARP_SPECIALIZED_MIN_WORK of work
    Spec(batch=4, hq=8, hkv=8, nq=4096, nk=4096, d=64),
    Spec(batch=2, hq=16, hkv=16, nq=4160, nk=5000, d=64, scale=0.3),
    Spec(batch=2, hq=16, hkv=4, nq=4250, nk=4250, d=128, causal=True, layout="bnhd"),
    Spec(batch=2, hq=16, hkv=4, nq=2100, nk=8200, d=128, causal=True),  # Nq != Nk, top-left
]


def hopper_problem(spec: Spec, dtype: torch.dtype):
    if DEVICE != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup products need an sm_90 GPU")
    p = make_problem(spec, dtype, device="cuda")
    assert ws.takes_warp_specialized(p.q, p.k, p.v)
    return p


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.id)
def test_forward_on_hopper(spec: Spec, dtype: torch.dtype) -> None:
    p = hopper_problem(spec, dtype)
    truth, floor = expected_forward(p, with_tangents=False)
    assert_accurate(kernel_forward(p, with_tangents=False), truth, floor, dtype, p.label,
                    "warp-specialised forward")
    fwd, (residual, _) = ws.warp_specialized_forward(p.q, p.k, p.v, spec.causal,
                                                     spec.scale or spec.d**-0.5, True)
    # The residual is what rounding the fp32 output to 16 bits dropped: at most half a unit
    # in the last place of the output (give or take its own rounding, and the subnormal
    # spacing), and adding it back brings the output closer to the truth on average.
    info = torch.finfo(dtype)
    half_ulp = 0.5 * info.eps * fwd.out.float().abs() * (1 + info.eps)
    assert (residual.float().abs() <= half_ulp + info.tiny * info.eps).all(), p.label
    rounded = (fwd.out.double() - truth["out"]).square().mean().item()
    kept = (fwd.out.double() + residual.double() - truth["out"]).square().mean().item()
    assert kept < rounded, f"mean squared error with the residual {kept:.2e}, without {rounded:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("spec", GPU_SPECS[:2], ids=lambda s: s.id)
def test_backward_from_its_outputs(spec: Spec, dtype: torch.dtype) -> None:
    """The backward reads the saved out, lse and residual: the conventions must match."""
    p = hopper_problem(spec, dtype)
    truth, floor = expected_backward(p)
    assert_accurate(kernel_backward(p), truth, floor, dtype, p.label,
                    "backward from the warp-specialised forward")


def test_launch_plumbing(monkeypatch) -> None:
    """What the launcher hands the kernel, read on CPU with the kernel replaced by a
    recorder: the grid (128-row tiles by B·Hq), the GQA group, the scale in log2 units,
    the options, and descriptors over each tensor's own shape and strides, in blocks of
    (1, 1, rows, D)."""
    import math

    recorded = {}

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                recorded.update(grid=grid, args=args, kwargs=kwargs)
            return launch

    monkeypatch.setattr(ws, "warp_specialized_forward_kernel", Recorder())
    q = heads(n=300, d=64, layout="bnhd", heads=8)  # (4, 8, 300, 64) from (4, 300, 8, 64)
    k = v = heads(n=4100, d=64, heads=2)
    out, lse = torch.empty(4, 8, 300, 64, dtype=q.dtype), torch.empty(4, 8, 300)
    ws.launch_warp_specialized(q, k, v, out, None, lse, True, 0.25)
    assert recorded["grid"] == (3, 32)
    q_desc, k_desc, v_desc, o_desc, r_desc, lse_arg, *scalars = recorded["args"]
    assert scalars[:4] == [8, 300, 4100, 4] and math.isclose(scalars[4], 0.25 * math.log2(math.e))
    assert recorded["kwargs"] == dict(STAGES=ws.RING_STAGES, PIPELINE=True, PINGPONG=True,
                                      CAUSAL=True, STORE_RESIDUAL=False, num_warps=4,
                                      maxnreg=ws.LAUNCH_REGS)
    assert lse_arg is lse and r_desc.base is out  # no residual: the output stands in
    for desc, tensor, rows in ((q_desc, q, ws.GROUP_ROWS), (k_desc, k, ws.KEY_BLOCK),
                               (v_desc, v, ws.KEY_BLOCK), (o_desc, out, ws.GROUP_ROWS)):
        assert desc.base is tensor
        assert list(desc.shape) == list(tensor.shape)
        assert list(desc.strides) == list(tensor.stride())
        assert list(desc.block_shape) == [1, 1, rows, 64]
