"""Chapter 11's warp-specialised forward and forward with its JVP (Gluon, Hopper only).

On CPU: who takes them (`fits_warp_specialized`, `takes_warp_specialized`), that chapter 2's
launcher hands them exactly the calls it should and falls back when they cannot compile, what
the launchers hand the kernels, and that they compile for sm_90 within their budget (ptxas
ships with Triton; no GPU needed). On an sm_90 GPU: out, lse (and tangent_out, mu) against
float64 with the floor-ratio criterion of every kernel test, in both precisions, the rounding
residuals, and the backwards (first and second order) from their saved outputs.
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
    assert ws.fits_warp_specialized(q, q, q, (q, q, q))
    assert ws.fits_warp_specialized(q, q, q, (heads(layout="bnhd"), q, q))
    assert not ws.fits_warp_specialized(q, q, q, (q.half(), q, q))  # a tangent's dtype
    assert not ws.fits_warp_specialized(q, q, q, (q, q, heads(n=N + 8)))  # a tangent's shape
    assert not ws.fits_warp_specialized(q, q, q, (q, expanded, q))  # stride 0
    small = heads(d=64, heads=8)  # 2**35 of work: enough, but not when causal halves it
    for tangents in (None, (small, small, small)):
        assert ws.fits_warp_specialized(small, small, small, tangents)
        assert not ws.fits_warp_specialized(small, small, small, tangents, is_causal=True)
    d64 = heads(d=64)
    assert ws.fits_warp_specialized(d64, d64, d64, (d64, d64, d64), is_causal=True)
    assert ws.fits_warp_specialized(q, q, q, (q, q, q), is_causal=True)


def test_taken_only_on_hopper_gpus(monkeypatch) -> None:
    q = heads()
    assert not ws.takes_warp_specialized(q, q, q)  # a CPU tensor
    if DEVICE == "cuda":
        g = q.cuda()
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert ws.takes_warp_specialized(g, g, g) == hopper
        monkeypatch.setenv("JVP_ATTENTION_WARP_SPECIALIZED", "0")
        assert not ws.takes_warp_specialized(g, g, g)


def test_forward_hands_over_unmasked_calls(monkeypatch) -> None:
    """Chapter 2's launcher asks for every call and hands over those without a mask, with
    or without tangents, with chapter 2's carry in "accurate" mode; when the kernel cannot
    compile (None back) it runs its own."""
    from jvp_attention.launch import precision

    calls, asked = [], []
    sentinel = AttentionOutputs(torch.zeros(1), torch.zeros(1), None, None)

    def recorded(q, k, v, is_causal, scale, residuals, tangents, carry):
        calls.append((is_causal, scale, residuals, tangents is not None, carry))
        return sentinel

    def takes(q, k, v, tangents=None, exact=True, is_causal=False):
        asked.append((tangents is not None, exact, is_causal))
        return True

    monkeypatch.setattr(forward_module, "takes_warp_specialized", takes)
    monkeypatch.setattr(forward_module, "warp_specialized_forward", recorded)
    q = torch.randn(1, 2, 8, 16, device=DEVICE, dtype=torch.float16)
    tangents = (q, q, q)
    assert forward_module.flash_attention_forward(q, q, q, None, True, 0.5) is sentinel
    assert forward_module.flash_attention_forward(q, q, q, residuals=True) is sentinel
    assert forward_module.flash_attention_forward(q, q, q, tangents=tangents,
                                                  precision="accurate") is sentinel
    with precision("fast"):
        assert forward_module.flash_attention_forward(q, q, q, tangents=tangents) is sentinel
    jvp_operands = forward_module.jvp_operands
    assert calls == [(True, 0.5, False, False, jvp_operands),
                     (False, 16**-0.5, True, False, jvp_operands),
                     (False, 16**-0.5, False, True, jvp_operands),
                     (False, 16**-0.5, False, True, None)]
    assert asked == [(False, True, True), (False, True, False), (True, True, False),
                     (True, False, False)]
    masked = forward_module.flash_attention_forward(q, q, q, torch.ones(8, 8, dtype=torch.bool,
                                                                        device=DEVICE))
    assert len(calls) == 4 and masked.out.shape == q.shape
    monkeypatch.setattr(forward_module, "warp_specialized_forward", lambda *args: None)
    fallback = forward_module.flash_attention_forward(q, q, q, tangents=tangents)
    monkeypatch.setattr(forward_module, "takes_warp_specialized", lambda *args: False)
    again = forward_module.flash_attention_forward(q, q, q, tangents=tangents)
    assert torch.equal(fallback.out, again.out)
    assert torch.equal(fallback.tangent_out, again.tangent_out)


@pytest.mark.parametrize("tangent", [False, True], ids=["primal", "jvp"])
def test_a_failed_compile_falls_back_with_a_warning(monkeypatch, tangent: bool) -> None:
    """A Triton whose Gluon has moved on: warned once, then chapter 2's kernels for good."""
    import triton

    def broken(*args, **kwargs):
        raise triton.CompilationError(None, None, "an API this Triton no longer has")

    launcher = "launch_warp_specialized_jvp" if tangent else "launch_warp_specialized"
    monkeypatch.setattr(ws, launcher, broken)
    monkeypatch.setattr(ws, "_failed", False)
    q = heads()
    tangents = (q, q, q) if tangent else None
    with pytest.warns(RuntimeWarning, match="warp-specialised forward does not compile"):
        assert ws.warp_specialized_forward(q, q, q, False, 0.1, tangents=tangents) is None
    assert ws._failed
    assert not ws.takes_warp_specialized(q, q, q)
    assert not ws.takes_warp_specialized(q, q, q, (q, q, q))


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


@pytest.mark.parametrize("d", [64, 128])
def test_jvp_compiles_for_hopper_within_its_budget(d: int) -> None:
    """The forward with its JVP as the library runs it in "accurate" bf16 (carried, causal,
    with residuals), at each head dim's tiles, for sm_90."""
    tile = f"d{d}_n{ws.JVP_KEY_BLOCKS[d]}_s{ws.JVP_RING_STAGES}"
    report = compiled_for_hopper(
        "warp_specialized_jvp",
        f"compile_for_hopper({tile!r}, causal=True, carry=True, residual=True)")
    assert_within_budget(report)
    assert (report["d"], report["key_block"]) == (d, ws.JVP_KEY_BLOCKS[d])
    assert report["wgmma"] > 0


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


def recorded_launches(monkeypatch, kernel: str, module=ws) -> dict:
    """Replace `kernel` of `module` by a recorder; the dict it returns gets the grid, the
    arguments and the keywords of its last launch."""
    recorded = {}

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                recorded.update(grid=grid, args=args, kwargs=kwargs)
            return launch

    monkeypatch.setattr(module, kernel, Recorder())
    launch_directly_stand_ins(monkeypatch, module)
    return recorded


def launch_directly_stand_ins(monkeypatch, module) -> None:
    """Let `module`'s launches reach a stand-in kernel as they are: a `CachedLauncher`
    (chapter 2) takes Triton kernels only, which have argument names."""
    from jvp_attention.launch import cached

    monkeypatch.setattr(module, "cached",
                        lambda kernel: cached(kernel) if hasattr(kernel, "arg_names") else kernel)


def test_launch_plumbing(monkeypatch) -> None:
    """What the launcher hands the kernel, read on CPU with the kernel replaced by a
    recorder: the grid (128-row tiles by B·Hq), the GQA group, the scale in log2 units,
    the options, and descriptors over each tensor's own shape and strides, in blocks of
    (1, 1, rows, D)."""
    import math

    recorded = recorded_launches(monkeypatch, "warp_specialized_forward_kernel")
    q = heads(n=300, d=64, layout="bnhd", heads=8)  # (4, 8, 300, 64) from (4, 300, 8, 64)
    k = v = heads(n=4100, d=64, heads=2)
    out, lse = torch.empty(4, 8, 300, 64, dtype=q.dtype), torch.empty(4, 8, 300)
    ws.launch_warp_specialized(q, k, v, out, None, lse, True, 0.25)
    assert recorded["grid"] == (3, 32)
    q_desc, k_desc, v_desc, o_desc, r_desc, lse_arg, *scalars = recorded["args"]
    assert scalars[:4] == [8, 300, 4100, 4] and math.isclose(scalars[4], 0.25 * math.log2(math.e))
    assert recorded["kwargs"] == dict(STAGES=ws.RING_STAGES, PIPELINE=True, PINGPONG=True,
                                      CAUSAL=True, STORE_RESIDUAL=False,
                                      HEAD_GROUP=16, num_warps=4,
                                      maxnreg=ws.LAUNCH_REGS)
    assert lse_arg is lse and r_desc.base is out  # no residual: the output stands in
    for desc, tensor, rows in ((q_desc, q, ws.GROUP_ROWS), (k_desc, k, ws.KEY_BLOCK),
                               (v_desc, v, ws.KEY_BLOCK), (o_desc, out, ws.GROUP_ROWS)):
        assert desc.base is tensor
        assert list(desc.shape) == list(tensor.shape)
        assert list(desc.strides) == list(tensor.stride())
        assert list(desc.block_shape) == [1, 1, rows, 64]


def test_jvp_launch_plumbing(monkeypatch) -> None:
    """What the JVP launcher hands its kernel (on CPU, the kernel replaced by a recorder):
    ten descriptors in order, the key tile of the head dim, and in "accurate" mode the
    carried values and their factors."""
    recorded = recorded_launches(monkeypatch, "warp_specialized_jvp_kernel")
    q, tq = heads(n=300, d=128, heads=8), heads(n=300, d=128, heads=8, layout="bnhd")
    k, v, tk, tv = (heads(n=4100, d=128, heads=2) for _ in range(4))
    outputs = (torch.empty_like(q), torch.empty_like(q))
    residuals = (torch.empty_like(q), torch.empty_like(q))
    lse, mu = torch.empty(4, 8, 300), torch.empty(4, 8, 300)
    v_hat, tv_hat, factors = v.half(), tv.half(), torch.ones(4)

    def carry(*args):
        assert args[:6] == (q, k, v, tq, tk, tv) and args[6] == 0.5
        return v_hat, tv_hat, factors

    ws.launch_warp_specialized_jvp(q, k, v, (tq, tk, tv), outputs, residuals, lse, mu, True,
                                   0.5, carry)
    assert recorded["grid"] == (3, 32)
    descriptors, rest = recorded["args"][:10], recorded["args"][10:]
    bases = (q, k, v_hat, tq, tk, tv_hat, *outputs, *residuals)
    assert all(desc.base is base for desc, base in zip(descriptors, bases, strict=True))
    blocks = [desc.block_shape[2] for desc in descriptors]
    assert blocks == [ws.GROUP_ROWS] + [ws.JVP_KEY_BLOCKS[128]] * 2 + [ws.GROUP_ROWS] + [
        ws.JVP_KEY_BLOCKS[128]] * 2 + [ws.GROUP_ROWS] * 4
    assert list(descriptors[3].strides) == list(tq.stride())  # its own (B, N, H, D) strides
    assert rest[:3] == (lse, mu, factors) and rest[3:7] == (8, 300, 4100, 4)
    assert recorded["kwargs"] == dict(STAGES=ws.JVP_RING_STAGES, CAUSAL=True, CARRY=True,
                                      STORE_RESIDUAL=True, HEAD_GROUP=8,
                                      num_warps=4, maxnreg=ws.LAUNCH_REGS)
    ws.launch_warp_specialized_jvp(q, k, v, (tq, tk, tv), outputs, None, lse, mu, False, 0.5)
    descriptors, rest = recorded["args"][:10], recorded["args"][10:]
    assert descriptors[2].base is v and descriptors[8].base is outputs[0]  # no carry, stand-ins
    assert rest[2] is lse and not recorded["kwargs"]["CARRY"]
    assert not recorded["kwargs"]["STORE_RESIDUAL"]


JVP_SPECS = [  # each with at least WARP_SPECIALIZED_MIN_WORK of work (halved when causal)
    Spec(batch=8, hq=8, hkv=8, nq=4096, nk=4096, d=64),
    Spec(batch=4, hq=16, hkv=16, nq=4160, nk=5000, d=64, scale=0.3),
    Spec(batch=4, hq=16, hkv=4, nq=4250, nk=4250, d=128, causal=True, layout="bnhd"),
    Spec(batch=4, hq=16, hkv=4, nq=2100, nk=8200, d=128, causal=True),  # Nq != Nk, top-left
]
JVP_PATHS = [(torch.bfloat16, "accurate"), (torch.bfloat16, "fast"), (torch.float16, "fast")]


def hopper_jvp_problem(spec: Spec, dtype: torch.dtype, mode: str):
    """A problem the forward with its JVP takes in `mode`; fp16 "accurate" must not be."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup products need an sm_90 GPU")
    p = make_problem(spec, dtype, device="cuda")
    assert ws.takes_warp_specialized(p.q, p.k, p.v, p.tangents, mode == "accurate", spec.causal)
    assert not ws.takes_warp_specialized(p.q.half(), p.k.half(), p.v.half(),
                                         tuple(t.half() for t in p.tangents), True, spec.causal)
    return p


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "mode"), JVP_PATHS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("spec", JVP_SPECS, ids=lambda s: s.id)
def test_forward_jvp_on_hopper(spec: Spec, dtype: torch.dtype, mode: str) -> None:
    from helpers import precision

    p = hopper_jvp_problem(spec, dtype, mode)
    truth, floor = expected_forward(p, with_tangents=True)
    with precision(mode):
        ours = kernel_forward(p, with_tangents=True)
        fwd, residuals = ws.warp_specialized_forward(
            p.q, p.k, p.v, spec.causal, spec.scale or spec.d**-0.5, True, p.tangents,
            forward_module.jvp_operands if mode == "accurate" else None)
    assert_accurate(ours, truth, floor, dtype, p.label, f"warp-specialised forward+JVP, {mode}")
    assert torch.equal(fwd.out, ours["out"]) and torch.equal(fwd.tangent_out, ours["tangent_out"])
    info = torch.finfo(dtype)
    for name, value, residual in (("out", fwd.out, residuals[0]),
                                  ("tangent_out", fwd.tangent_out, residuals[1])):
        half_ulp = 0.5 * info.eps * value.float().abs() * (1 + info.eps)
        assert (residual.float().abs() <= half_ulp + info.tiny * info.eps).all(), name
        rounded = (value.double() - truth[name]).square().mean().item()
        kept = (value.double() + residual.double() - truth[name]).square().mean().item()
        assert kept < rounded, f"{name}: with the residual {kept:.2e}, without {rounded:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tangent", [True, False], ids=["fwd_jvp", "fwd"])
@pytest.mark.parametrize("spec", JVP_SPECS[2:], ids=lambda s: s.id)
def test_causal_order_changes_no_output_on_hopper(spec: Spec, tangent: bool,
                                                  monkeypatch) -> None:
    """This chapter's causal kernels give the same bits whatever the heads per group of
    their launch order (`head_group`): groups of one (the order before the groups), of 4,
    and the library's own choice."""
    p = hopper_jvp_problem(spec, torch.bfloat16, "accurate")
    tangents = p.tangents if tangent else None
    carry = forward_module.jvp_operands if tangent else None
    runs = []
    for group in (1, 4, None):  # None: the library's own choice
        if group is not None:
            monkeypatch.setattr(ws, "head_group", lambda is_causal, *keys, queries_per_head=1,
                                g=group: g if is_causal else 1)
        else:
            monkeypatch.undo()
        outputs = ws.warp_specialized_forward(p.q, p.k, p.v, True, spec.d**-0.5,
                                              tangents=tangents, carry=carry)
        runs.append([x for x in outputs if x is not None])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", JVP_SPECS[1:3], ids=lambda s: s.id)
def test_second_order_backward_from_its_outputs(spec: Spec) -> None:
    """The second-order backward reads the saved out, tangent_out, lse, mu and residuals
    ("accurate" bf16, carried; "fast" mode's second order is 2.2x the math path's error at
    the first spec whichever forward ran, H200)."""
    from helpers import expected_second_order, kernel_second_order

    p = hopper_jvp_problem(spec, torch.bfloat16, "accurate")
    truth, floor = expected_second_order(p)
    assert_accurate(kernel_second_order(p), truth, floor, torch.bfloat16, p.label,
                    "second-order backward from the warp-specialised forward+JVP")
