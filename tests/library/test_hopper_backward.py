"""Chapter 12's warp-specialised first-order backward (Gluon, Hopper only).

On CPU: which calls it takes (`fits_warp_specialized_backward`,
`warp_specialized_backward_kernels`), that chapter 5's launcher hands it exactly those calls,
with Delta computed first and the carried operands in "accurate" mode, and falls back when it
cannot compile; what the launchers hand the kernels; that the kernels compile for sm_90
within their budget. On an sm_90 GPU: dq, dk, dv against float64 with the floor-ratio
criterion of every kernel test, in both precisions, through the library's call.
"""

import math

import pytest
import torch
from helpers import (
    DEVICE,
    Spec,
    accuracy_table,
    allowed_error,
    assert_accurate,
    assert_deterministic,
    cancellation_scale,
    dtype_name,
    expected_backward,
    expected_second_order,
    kernel_backward,
    kernel_second_order,
    make_problem,
    precision,
)
from test_warp_specialized import (
    assert_within_budget,
    compiled_for_hopper,
    heads,
    launch_directly_stand_ins,
    recorded_launches,
)

from jvp_attention import backward as backward_module
from jvp_attention import hopper_backward as hb
from jvp_attention import warp_specialized as ws

N = ws.WARP_SPECIALIZED_MIN_KEYS


def test_which_calls_fit() -> None:
    q = heads()  # (4, 16, 4096, 128) bf16: 2**37 of work
    assert hb.fits_warp_specialized_backward(q, q, q, q, exact=True) == (True, True)
    assert hb.fits_warp_specialized_backward(q, q, q, q, exact=False) == (True, True)
    d64 = heads(d=64, layout="bnhd")
    assert hb.fits_warp_specialized_backward(d64, d64, d64, d64, False) == (False, True)
    half = q.half()  # fp16 "accurate" splits its products: chapter 5's kernels
    assert hb.fits_warp_specialized_backward(half, half, half, half, True) == (False, False)
    assert hb.fits_warp_specialized_backward(half, half, half, half, False) == (True, True)
    kv = heads(heads=4)  # GQA
    assert hb.fits_warp_specialized_backward(q, kv, kv, q, True) == (True, True)
    short = heads(n=N - 1)
    assert hb.fits_warp_specialized_backward(short, q, q, short, True) == (False, False)
    assert hb.fits_warp_specialized_backward(q, short, short, q, True) == (False, False)
    few = torch.empty(1, 1, N, 128, dtype=torch.bfloat16)  # too little work for the launch
    assert hb.fits_warp_specialized_backward(few, few, few, few, True) == (False, False)
    d72 = heads(d=72)
    assert hb.fits_warp_specialized_backward(d72, d72, d72, d72, False) == (False, False)
    assert hb.fits_warp_specialized_backward(q, q, q, q.half(), False) == (False, False)
    expanded = torch.ones(1, 1, 1, 128, dtype=torch.bfloat16).expand(4, 16, N, 128)
    # A stride-0 cotangent: "fast" reads the inputs, "accurate" its contiguous copies.
    assert hb.fits_warp_specialized_backward(q, q, q, expanded, False) == (False, False)
    assert hb.fits_warp_specialized_backward(q, q, q, expanded, True) == (True, True)


def test_taken_only_on_hopper_gpus(monkeypatch) -> None:
    q = heads()
    assert hb.warp_specialized_backward_kernels(q, q, q, q, True) == (False, False)  # CPU
    if DEVICE == "cuda":
        g = q.cuda()
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert hb.warp_specialized_backward_kernels(g, g, g, g, True) == (hopper, hopper)
        monkeypatch.setenv("JVP_ATTENTION_WARP_SPECIALIZED", "0")
        assert hb.warp_specialized_backward_kernels(g, g, g, g, True) == (False, False)


def first_order(p, mode: str, mask=None, **options):
    """The library's first-order backward of problem `p` from its own forward."""
    from jvp_attention.forward import flash_attention_forward

    fwd = flash_attention_forward(p.q, p.k, p.v, mask, p.spec.causal, precision=mode)
    return backward_module.flash_attention_backward(
        p.q, p.k, p.v, fwd.out, fwd.lse, p.grad_out, mask, p.spec.causal, precision=mode,
        **options), fwd


def test_backward_hands_over_unmasked_calls(monkeypatch) -> None:
    """Chapter 5's launcher asks for first-order unmasked calls only, runs the
    row-statistics pass first when dQ is handed over (Delta), hands dq to the dK/dV
    launcher where that kernel sums it (`fuses_dq`) and launches no dQ kernel then, passes
    the carried factors only when it carries, and runs its own kernels for what is not
    handed over or does not compile."""
    asked, launches = [], []

    def kernels(q, k, v, grad_out, exact):
        asked.append(exact)
        return True, True

    def recorder(name):
        def launch(q, k, v, grad_out, lse, delta, factors, *outputs_and_options):
            fused = name == "dkdv" and len(outputs_and_options) > 4 \
                and outputs_and_options[4] is not None
            launches.append((name + " with dq" * fused, delta.clone(), factors))
        return launch

    monkeypatch.setattr(backward_module, "warp_specialized_backward_kernels", kernels)
    monkeypatch.setattr(backward_module, "launch_warp_specialized_dq", recorder("dq"))
    monkeypatch.setattr(backward_module, "launch_warp_specialized_dkdv", recorder("dkdv"))
    p = make_problem(Spec(batch=1, hq=2, hkv=1, nq=20, nk=24, d=16, causal=True),
                     torch.float16, device=DEVICE)
    (_, fwd) = first_order(p, "fast")
    assert asked == [False] and [name for name, _, _ in launches] == ["dkdv with dq"]
    monkeypatch.setattr(backward_module, "fuses_dq", lambda *args: False)
    first_order(p, "fast")
    assert [name for name, _, _ in launches[1:]] == ["dq", "dkdv"]
    delta = (fwd.out.float() * p.grad_out.float()).sum(-1)
    for _, handed, factors in launches:
        assert factors is None  # fp16 does not carry
        torch.testing.assert_close(handed, delta, rtol=1e-3, atol=1e-3)
    # A mask, or the backward through the tangent, keep chapter 5's kernels.
    first_order(p, "fast", torch.zeros(20, 24, device=DEVICE, dtype=torch.float16))
    assert asked == [False, False] and len(launches) == 3
    # Only dK/dV handed over: chapter 5's dQ kernel runs (and computes Delta itself).
    monkeypatch.setattr(backward_module, "warp_specialized_backward_kernels",
                        lambda *args: (False, True))
    (dq, _, _), _ = first_order(p, "fast")
    monkeypatch.setattr(backward_module, "warp_specialized_backward_kernels",
                        lambda *args: (False, False))
    (dq_alone, _, _), _ = first_order(p, "fast")
    assert torch.equal(dq, dq_alone) and [name for name, _, _ in launches] == [
        "dkdv with dq", "dq", "dkdv", "dkdv"]
    # Under deterministic algorithms dQ is not summed by atomic adds: the split kernels.
    monkeypatch.setattr(backward_module, "warp_specialized_backward_kernels", kernels)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    first_order(p, "fast")
    assert [name for name, _, _ in launches[4:]] == ["dq", "dkdv"]


def test_carried_operands_reach_the_kernels(monkeypatch) -> None:
    """"accurate" bf16 with long rows hands the kernels chapter 5's fp16 copies and their
    factors, and Delta from the copy kernel: the fused dK/dV kernel alone, with the fp32 dQ
    sum the copy kernel zeroed (no fill launch), or both kernels where it does not sum dQ."""
    seen, sums = [], []

    def launch(q, k, v, grad_out, lse, delta, factors, *rest):
        seen.append((q.dtype, grad_out.dtype, factors.dtype, factors.numel() > 0,
                     bool(torch.isfinite(delta).all())))
        if len(rest) > 5:  # dk, dv, is_causal, scale, dq, dq_sum
            sums.append(rest[5])

    monkeypatch.setattr(backward_module, "warp_specialized_backward_kernels",
                        lambda *args: (True, True))
    monkeypatch.setattr(backward_module, "launch_warp_specialized_dq", launch)
    monkeypatch.setattr(backward_module, "launch_warp_specialized_dkdv", launch)
    from jvp_attention.launch import carry_min_keys

    n = carry_min_keys(16)
    p = make_problem(Spec(batch=1, hq=1, hkv=1, nq=16, nk=n, d=16), torch.bfloat16,
                     device=DEVICE)
    first_order(p, "accurate")
    assert seen == [(torch.float16, torch.float16, torch.float32, True, True)]
    assert len(sums) == 1 and sums[0].shape == p.q.shape and sums[0].dtype == torch.float32
    assert (sums[0] == 0).all()
    monkeypatch.setattr(backward_module, "fuses_dq", lambda *args: False)
    first_order(p, "accurate")
    assert seen == [(torch.float16, torch.float16, torch.float32, True, True)] * 3


def test_a_failed_summing_compile_keeps_the_split_kernels(monkeypatch) -> None:
    """A Triton that compiles the split kernels but not the dK/dV kernel that sums dQ:
    warned once, the split kernels take that call and every later one, none asks for the
    summing form again, and the other kernels stay on."""
    import triton

    launches = []

    def launch(name):
        def record(*args):
            if len(args) > 11:  # dq handed over: the summing form
                raise triton.CompilationError(None, None, "an API this Triton lacks")
            launches.append(name)
        return record

    monkeypatch.setattr(hb, "_failed", False)
    monkeypatch.setattr(hb, "_summing_failed", False)
    monkeypatch.setattr(backward_module, "warp_specialized_backward_kernels",
                        lambda *args: (True, True))
    monkeypatch.setattr(backward_module, "launch_warp_specialized_dq", launch("dq"))
    monkeypatch.setattr(backward_module, "launch_warp_specialized_dkdv", launch("dkdv"))
    p = make_problem(Spec(batch=1, hq=2, hkv=2, nq=20, nk=20, d=16), torch.float16,
                     device=DEVICE)
    with pytest.warns(RuntimeWarning, match="summing dK/dV kernel does not compile"):
        first_order(p, "fast")
    assert launches == ["dq", "dkdv"] and hb._summing_failed and not hb._failed
    assert not hb.fuses_dq(64, False, False)
    first_order(p, "fast")
    assert launches == ["dq", "dkdv"] * 2


def test_a_failed_compile_falls_back_with_a_warning(monkeypatch) -> None:
    """A Triton whose Gluon has moved on: warned once for each form it tried (the summing
    kernel, then the split ones), then chapter 5's kernels for good, with the same
    gradients as without the hand-over."""
    import triton

    def broken(*args, **kwargs):
        raise triton.CompilationError(None, None, "an API this Triton no longer has")

    monkeypatch.setattr(hb, "_failed", False)
    monkeypatch.setattr(hb, "_summing_failed", False)
    monkeypatch.setattr(backward_module, "warp_specialized_backward_kernels",
                        lambda *args: (True, True))
    monkeypatch.setattr(backward_module, "launch_warp_specialized_dq", broken)
    monkeypatch.setattr(backward_module, "launch_warp_specialized_dkdv", broken)
    p = make_problem(Spec(batch=1, hq=2, hkv=2, nq=20, nk=20, d=16), torch.float16,
                     device=DEVICE)
    with pytest.warns(RuntimeWarning, match="does not compile") as warned:
        grads, _ = first_order(p, "fast")
    # the summing form first, then dQ's kernel
    summing, split = (str(w.message) for w in warned if "not compile" in str(w.message))
    assert "summing dK/dV kernel" in summing and "specialised backward does" in split
    assert hb._failed
    assert hb.warp_specialized_backward_kernels(heads(), heads(), heads(), heads(),
                                                True) == (False, False)
    monkeypatch.setattr(backward_module, "warp_specialized_backward_kernels",
                        lambda *args: (False, False))
    again, _ = first_order(p, "fast")
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


def test_launch_plumbing(monkeypatch) -> None:
    """What the launchers hand the kernels (on CPU, the kernels replaced by recorders):
    grids of 128 keys (dK/dV, by B·Hkv) and 128 queries (dQ, by B·Hq), descriptors over
    each tensor's own strides in the tiles of the design, the GQA group, the scale in log2
    units, and the carried factors (the LSE standing in without them)."""
    dkdv = recorded_launches(monkeypatch, "warp_specialized_dkdv_kernel", hb)
    dq_launch = recorded_launches(monkeypatch, "warp_specialized_dq_kernel", hb)
    q, grad_out = heads(n=300, heads=8, layout="bnhd"), heads(n=300, heads=8)
    k, v = heads(n=4100, heads=2), heads(n=4100, heads=2)
    lse, delta, factors = torch.empty(4, 8, 300), torch.empty(4, 8, 300), torch.ones(6)
    dq, dk, dv = torch.empty_like(grad_out), torch.empty_like(k), torch.empty_like(v)
    hb.launch_warp_specialized_dkdv(q, k, v, grad_out, lse, delta, factors, dk, dv, True, 0.5)
    assert dkdv["grid"] == (33, 8)
    descriptors, rest = dkdv["args"][:7], dkdv["args"][7:]
    assert [d.base for d in descriptors] == [k, v, q, grad_out, dk, dv, dk]  # dQ's unread
    assert [d.block_shape[2] for d in descriptors] == [64, 64, hb.DKDV_QUERY_ROWS,
                                                      hb.DKDV_QUERY_ROWS, 64, 64, 64]
    assert list(descriptors[2].strides) == list(q.stride())  # its own (B, N, H, D) strides
    assert rest[:3] == (lse, delta, factors) and rest[3:6] == (2, 300, 4)
    assert math.isclose(rest[6], 0.5 * math.log2(math.e)) and rest[7] == 0.5
    assert dkdv["kwargs"] == dict(STAGES=hb.DKDV_STAGES, CAUSAL=True, CARRY=True,
                                  FUSED_DQ=False, HEAD_GROUP=hb.key_head_group(True, q, grad_out, 4),
                                  num_warps=4, maxnreg=ws.LAUNCH_REGS)
    hb.launch_warp_specialized_dq(q, k, v, grad_out, lse, delta, None, dq, False, 0.5)
    assert dq_launch["grid"] == (3, 32)
    descriptors, rest = dq_launch["args"][:5], dq_launch["args"][5:]
    assert [d.base for d in descriptors] == [q, k, v, grad_out, dq]
    assert [d.block_shape[2] for d in descriptors] == [64, hb.DQ_KEY_BLOCK, hb.DQ_KEY_BLOCK,
                                                      64, 64]
    assert rest[2] is lse and rest[3:7] == (8, 300, 4100, 4)  # no carry: LSE stands in
    assert dq_launch["kwargs"] == dict(STAGES=hb.DQ_STAGES, CAUSAL=False, CARRY=False,
                                       num_warps=4, maxnreg=ws.LAUNCH_REGS)


def test_fused_launch_sums_dq_and_scales_it(monkeypatch) -> None:
    """With dq the dK/dV launcher hands the kernel a zeroed fp32 sum in (1, 1, 64, 64)
    blocks, 64-query tiles (even where the unfused kernel takes 128) and FUSED_DQ; then
    the sum times the scale and dQ's carried factor, rounded, lands in dq."""
    launched = {}

    class Kernel:  # stands in for the Gluon kernel: records, and adds 1 to the sum
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                assert not args[6].base.any()
                args[6].base.add_(1.0)
                launched.update(grid=grid, args=args, kwargs=kwargs)
            return launch

    monkeypatch.setattr(hb, "warp_specialized_dkdv_kernel", Kernel())
    launch_directly_stand_ins(monkeypatch, hb)
    q = heads(n=300, heads=4, d=64, layout="bnhd").to(DEVICE)  # .to keeps the strides
    k = heads(n=4100, heads=2, d=64).to(DEVICE)
    lse = torch.empty(4, 4, 300, device=DEVICE)
    factors = torch.tensor([1.0, 1.0, 4.0, 1.0, 1.0, 0.0], device=DEVICE)
    dq = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
    hb.launch_warp_specialized_dkdv(q, k, k, q, lse, lse, factors, torch.empty_like(k),
                                    torch.empty_like(k), False, 0.5, dq)
    total = launched["args"][6]
    assert total.base.dtype == torch.float32 and total.base.shape == dq.shape
    assert list(total.block_shape) == [1, 1, 64, hb.DQ_SUM_COLS]
    assert [t.block_shape[2] for t in launched["args"][2:4]] == [64, 64]
    assert launched["kwargs"]["FUSED_DQ"] and launched["kwargs"]["CARRY"]
    assert torch.equal(dq, torch.full_like(dq, 0.5 * 4.0))


def test_dq_is_fused_unless_its_compile_failed(monkeypatch) -> None:
    """The dK/dV kernel sums dQ at every head dim, causal or not, carried or not; nowhere
    once the summing form has failed to compile."""
    forms = [(d, causal, carried) for d in (64, 128) for causal in (False, True)
             for carried in (False, True)]
    assert all(hb.fuses_dq(*form) for form in forms)
    monkeypatch.setattr(hb, "_summing_failed", True)
    assert not any(hb.fuses_dq(*form) for form in forms)


def test_dkdv_query_tile_widens_only_at_d64_without_the_mask(monkeypatch) -> None:
    """128-query dK/dV tiles at d = 64 without the causal mask, 64 otherwise."""
    dkdv = recorded_launches(monkeypatch, "warp_specialized_dkdv_kernel", hb)
    for d, causal, rows in ((64, False, 128), (64, True, 64), (128, False, 64),
                            (128, True, 64)):
        assert hb.dkdv_query_rows(d, causal) == rows
        q, k = heads(n=300, heads=4, d=d), heads(n=4100, heads=2, d=d)
        lse = torch.empty(4, 4, 300)
        hb.launch_warp_specialized_dkdv(q, k, k, q, lse, lse, None, torch.empty_like(k),
                                        torch.empty_like(k), causal, 0.5)
        assert [t.block_shape[2] for t in dkdv["args"][2:4]] == [rows, rows]


@pytest.mark.parametrize("tile", ["dq_d128_n128_s2", "dkdv_d64_m64_s2", "fused_d64_m64_s2"])
def test_compiles_for_hopper_within_its_budget(tile: str) -> None:
    """The library's dQ tile and its d = 64 dK/dV tiles (without and with the dQ sum),
    carried ("accurate" bf16) and causal, for sm_90: no spills, the register budgets of the
    design."""
    report = compiled_for_hopper("warp_specialized_backward",
                                 f"compile_for_hopper({tile!r}, causal=True, carry=True)")
    assert_within_budget(report)
    assert report["wgmma"] > 0


@pytest.mark.parametrize(("tile", "causal", "carry", "max_spills"), [
    ("dkdv_d128_m64_s2", True, True, 64), ("dkdv_d64_m128_s2", False, True, 64),
    *[("fused_d128_m64_s2", causal, carry, 72 if causal else 64) for causal in (False, True)
      for carry in (False, True)]])
def test_spilling_dkdv_tiles_stay_within_bounds(tile: str, causal: bool, carry: bool,
                                                max_spills: int) -> None:
    """The dK/dV tiles at d = 128 (224 of its 240 registers hold live values), split or
    summing dQ, in every form, and the split 128-query tile at d = 64 without the mask
    (run only where the summing form failed to compile): at most a few values a thread
    (Triton 3.6: 8 bytes for the split d = 128 tile causal; the summing tile causal 40, and
    68 carried, since its programs take the grouped order, whose key tile and head are no
    longer the program's ids, which the compiler re-reads for free; 0 otherwise), within 64
    bytes (72 for the causal summing tile), and within the shared memory a block may take."""
    report = compiled_for_hopper(
        "warp_specialized_backward",
        f"compile_for_hopper({tile!r}, causal={causal}, carry={carry})")
    assert (report["spills"] <= max_spills and report["shared"] <= 232448
            and report["wgmma"] > 0)


GPU_SPECS = [  # each with at least WARP_SPECIALIZED_MIN_WORK of work
    Spec(batch=4, hq=8, hkv=8, nq=4096, nk=4096, d=64),
    Spec(batch=2, hq=16, hkv=4, nq=4200, nk=4500, d=64, layout="bnhd"),  # 128-query tiles
    Spec(batch=2, hq=16, hkv=4, nq=4160, nk=5000, d=64, scale=0.3, causal=True),
    Spec(batch=2, hq=16, hkv=4, nq=4250, nk=4250, d=128, causal=True, layout="bnhd"),
    Spec(batch=2, hq=16, hkv=16, nq=4100, nk=8200, d=128, causal=True),  # Nq != Nk
    Spec(batch=2, hq=8, hkv=2, nq=8200, nk=4100, d=128),
]
PATHS = [(torch.bfloat16, "accurate"), (torch.bfloat16, "fast"), (torch.float16, "fast")]


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "mode"), PATHS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.id)
def test_backward_on_hopper(monkeypatch, spec: Spec, dtype: torch.dtype, mode: str) -> None:
    """dq, dk, dv through the library's call, which hands them to chapter 12's kernels."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup products need an sm_90 GPU")
    p = make_problem(spec, dtype, device="cuda")
    expected = (spec.d == 128, True)
    assert hb.warp_specialized_backward_kernels(p.q, p.k, p.v, p.grad_out,
                                                mode == "accurate") == expected
    fused = hb.fuses_dq(spec.d, spec.causal, mode == "accurate" and dtype == torch.bfloat16)
    ran = []
    for name in ("launch_warp_specialized_dq", "launch_warp_specialized_dkdv"):
        launch = getattr(backward_module, name)
        monkeypatch.setattr(backward_module, name,
                            lambda *args, _launch=launch, _name=name: (
                                # the summing call passes dq and its fp32 sum after scale
                                ran.append(_name + " with dq" * (len(args) > 11
                                                                 and args[11] is not None)),
                                _launch(*args)))
    truth, floor = expected_backward(p)
    with precision(mode):
        ours = kernel_backward(p)
    assert ran == (["launch_warp_specialized_dkdv with dq"] if fused else
                   ["launch_warp_specialized_dq", "launch_warp_specialized_dkdv"])
    assert_accurate(ours, truth, floor, dtype, p.label, f"warp-specialised backward, {mode}")



@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["summing", "split"])
@pytest.mark.parametrize("spec", [s for s in GPU_SPECS if s.causal], ids=lambda s: s.id)
def test_causal_order_changes_no_gradient_on_hopper(monkeypatch, spec: Spec,
                                                    deterministic: bool) -> None:
    """The dK/dV kernel's causal programs give the same dK and dV bits whatever the key/value
    heads per group of their launch order (`key_head_group`): groups of one (the order
    before the groups), of 2, and the library's choice. dQ too where the split kernels
    compute it (deterministic algorithms); the summing kernel adds it up atomically, in the
    order the programs run."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup products need an sm_90 GPU")
    p = make_problem(spec, torch.bfloat16, device="cuda")
    compared = ("dq", "dk", "dv") if deterministic else ("dk", "dv")
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    runs = []
    try:
        for group in (1, 2, None):  # None: the library's own choice
            if group is not None:
                monkeypatch.setattr(hb, "key_head_group",
                                    lambda is_causal, *_, g=group: g if is_causal else 1)
            else:
                monkeypatch.undo()
            with precision("accurate"):
                grads = kernel_backward(p)
            runs.append([grads[name] for name in compared])
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))


@pytest.mark.gpu
def test_deterministic_algorithms_keep_the_split_kernels_on_hopper() -> None:
    """Under `torch.use_deterministic_algorithms(True)` dQ is not summed by the dK/dV
    kernel's atomic adds: chapter 12's split kernels, bitwise the same gradients each run."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup products need an sm_90 GPU")
    p = make_problem(GPU_SPECS[1], torch.bfloat16, device="cuda")
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert_deterministic(kernel_backward, p)
    finally:
        torch.use_deterministic_algorithms(deterministic)


# --- the second order's passes in chapter 12's form --------------------------------------------
CHAPTER6_PASSES = {"dq": "_backward_dq_tangent", "dk": "_backward_dk_tangent",
                   "dv": "_backward_dv_tangent"}


def chapter12_arguments(name: str, args, switches) -> tuple:
    """The arguments of chapter 12's launcher for pass `name`, from those the library hands
    chapter 6's kernel for it (positional `args`, keyword `switches`)."""
    factors = args[15 if name == "dq" else 13] if switches["CARRY"] else None
    causal, scale = switches["IS_CAUSAL"], args[-3]
    q, k, v, tq, tk, tv, _, grad_out, dto = args[:9]
    if name == "dq":  # ..., out, residual, lse, delta, mu, c, factors, dq, dtq, ...
        return (q, k, v, tq, tk, tv, grad_out, dto, *args[11:15], factors, args[16], args[17],
                causal, scale)
    lse, delta, mu, c = args[9:13]  # ..., factors, dk, dv, dtk, dtv, ...
    if name == "dk":
        return (q, k, v, tq, tk, tv, grad_out, dto, lse, delta, mu, c, factors, args[14],
                args[16], causal, scale)
    return q, k, tq, tk, grad_out, dto, lse, mu, factors, args[15], args[17], causal, scale


def route_tangent_pass(monkeypatch, name: str, tile: int, ran: list | None = None,
                       launch=None) -> None:
    """Send the library's pass `name` ("dq", "dk" or "dv") of the backward through the
    tangent (chapter 6's kernel `CHAPTER6_PASSES[name]`) to chapter 12's Gluon kernel, `tile`
    queries (dK, dV) or keys (dQ) a visit, or to `launch`, which takes the Gluon launcher's
    arguments."""
    launchable = backward_module.launchable
    chapter6 = getattr(backward_module, CHAPTER6_PASSES[name])
    launch = launch or getattr(hb, f"launch_warp_specialized_{name}_tangent")
    keyword = "key_block" if name == "dq" else "query_rows"

    def routed(kernel, q):
        if kernel is not chapter6:
            return launchable(kernel, q)

        class Launch:
            def __getitem__(self, grid):
                def run(*args, **switches):
                    assert switches["MASK_KIND"] == 0 and switches["HAS_TANGENT"]
                    launch(*chapter12_arguments(name, args, switches), **{keyword: tile})
                    if ran is not None:
                        ran.append((name, tile))
                return run
        return Launch()

    monkeypatch.setattr(backward_module, "launchable", routed)


SECOND_ORDER_SPECS = [
    Spec(batch=2, hq=8, hkv=8, nq=1000, nk=1000, d=128),
    Spec(batch=2, hq=8, hkv=2, nq=1100, nk=900, d=64, causal=True),
    Spec(batch=1, hq=4, hkv=4, nq=700, nk=1300, d=128, causal=True, layout="bnhd"),
]
# tile None: the launcher's own (`dq_tangent_key_block`: 64 keys at d = 64, 32 at d = 128)
def assert_as_accurate_as_chapter6(ours: dict, chapter6: dict | None, truth: dict,
                                   floor: dict, dtype: torch.dtype, p, what: str) -> None:
    """The accuracy rule; or, in "fast" (`chapter6` given), each gradient past the rule
    within chapter 6's error on the same problem plus the rule's eps. "fast" rounds P, its
    tangent and dS to 16 bits before each product, and at some shapes chapter 6's own
    kernels pass the rule's 2x the math path's error (fp16, on an H100: dk 2.14x at (1,
    4, 700 x 1300, 128) causal, dv 2.52x at (4, 8, 4096, 64)); this chapter's passes had
    the same ratios to the digit there."""
    cancellation = cancellation_scale(p, second_order=True)
    try:
        assert_accurate(ours, truth, floor, dtype, p.label, what, cancellation=cancellation)
        return
    except AssertionError as failure:
        if chapter6 is None:
            raise
        rule = str(failure)
    mine, theirs = accuracy_table(ours, floor, truth), accuracy_table(chapter6, floor, truth)
    scale = max(truth[name].abs().max().item() for name in ours)
    for name, x in ours.items():
        eps = allowed_error(dtype, 0.0, scale, x.device.type, cancellation=cancellation,
                            rows=x.numel() // x.shape[-1])
        assert mine[name].error <= max(allowed_error(dtype, mine[name].floor, scale,
                                                     x.device.type, cancellation=cancellation,
                                                     rows=x.numel() // x.shape[-1]),
                                       theirs[name].error + eps), (
            f"{rule}\n  and {name} is less accurate than chapter 6's kernels: "
            f"{mine[name].error:.3e} > {theirs[name].error:.3e} + eps {eps:.2e}")


def test_fast_is_held_to_chapter6_where_it_passes_the_rule() -> None:
    """`assert_as_accurate_as_chapter6` lets "fast" past the rule only as far as chapter 6's
    own error (plus eps): a gradient worse than chapter 6's fails, and without chapter 6's
    result (accurate) the rule alone holds."""
    p = make_problem(Spec(batch=1, hq=2, hkv=2, nq=64, nk=64, d=16), torch.float16,
                     device="cpu")
    truth = {name: torch.linspace(-1, 1, 256, dtype=torch.float64).view(1, 2, 8, 16)
             for name in ("dq", "dk")}
    floor = {name: (x + 2.0**-11).to(torch.float16) for name, x in truth.items()}
    chapter6 = {name: (x + 2.0**-8).to(torch.float16) for name, x in truth.items()}
    as_chapter6 = dict(chapter6)
    assert_as_accurate_as_chapter6(as_chapter6, chapter6, truth, floor, torch.float16, p,
                                   "as chapter 6")
    worse = {**chapter6, "dk": (truth["dk"] + 2.0**-6).to(torch.float16)}
    with pytest.raises(AssertionError, match="dk is less accurate than chapter 6's"):
        assert_as_accurate_as_chapter6(worse, chapter6, truth, floor, torch.float16, p,
                                       "worse")
    with pytest.raises(AssertionError, match="max error"):
        assert_as_accurate_as_chapter6(as_chapter6, None, truth, floor, torch.float16, p,
                                       "accurate")


def chapter6_second_order(monkeypatch, p, mode: str) -> dict | None:
    """Chapter 6's six gradients of `p` in "fast" (for `assert_as_accurate_as_chapter6`),
    else None."""
    if mode != "fast":
        return None
    with monkeypatch.context() as patch, precision(mode):
        patch.setattr(hb, "SECOND_ORDER_PASSES", frozenset())
        return kernel_second_order(p)


GLUON_PASSES = [("dq", 16), ("dq", 32), ("dq", None), ("dk", 16), ("dk", 32), ("dv", 32),
                ("dv", 64)]


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "tile"), GLUON_PASSES)
@pytest.mark.parametrize(("dtype", "mode"), PATHS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("spec", SECOND_ORDER_SPECS, ids=lambda s: s.id)
def test_second_order_pass_on_hopper(monkeypatch, spec: Spec, dtype: torch.dtype, mode: str,
                                     name: str, tile: int) -> None:
    """Chapter 12's dQ, dK or dV pass in place of chapter 6's: every gradient of the
    backward through both outputs within the math path's error."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup products need an sm_90 GPU")
    monkeypatch.setattr(hb, "SECOND_ORDER_PASSES", frozenset())  # chapter 6's elsewhere
    p = make_problem(spec, dtype, device="cuda")
    truth, floor = expected_second_order(p)
    chapter6 = chapter6_second_order(monkeypatch, p, mode)
    ran = []
    route_tangent_pass(monkeypatch, name, tile, ran)
    with precision(mode):
        ours = kernel_second_order(p)
    assert ran == [(name, tile)]
    assert_as_accurate_as_chapter6(ours, chapter6, truth, floor, dtype, p,
                                   f"Gluon {name} pass, {mode}")


@pytest.mark.parametrize(("name", "d", "tile", "max_spills"), [
    ("dq", 64, 32, 0), ("dq", 64, 64, 0), ("dq", 128, 16, 0), ("dq", 128, 32, 64), ("dk", 64, 32, 0),
    ("dk", 128, 16, 8), ("dk", 128, 32, 128), ("dv", 64, 64, 0), ("dv", 128, 32, 0),
    ("dv", 128, 64, 32)])
def test_second_order_passes_compile_for_hopper(name: str, d: int, tile: int,
                                                max_spills: int) -> None:
    """The three passes compiled for sm_90 in every form: warpgroup products, shared memory
    within a block's, and (Triton 3.6) spills: none at d = 64; at d = 128 none for dQ on
    16-key visits, a few words for dQ on 32 and dV on 64, 36 to 108 bytes for dK on
    32-query visits."""
    for causal in (False, True):
        for carry in (False, True):
            report = compiled_for_hopper(
                "warp_specialized_backward",
                "__import__('warp_specialized_backward').compile_tangent_pass_for_hopper("
                f"{name!r}, {d}, causal={causal}, carry={carry}, query_rows={tile})")
            assert report["spills"] <= max_spills, report
            assert report["shared"] <= 232448 and report["wgmma"] > 0, report


def _factor(factors, index: int, identity: float) -> float:
    return identity if factors is None else factors[index].item()


def _tiles_in_torch(q, k, v, tq, tk, tv, lse, mu, factors, is_causal: bool, scale: float):
    """K, V, tK, tV in the query heads' layout (fp32), and P (times its carried shift), tS
    and mu in the carried units, as the Gluon passes make them (untransposed)."""
    group = q.shape[1] // k.shape[1]
    k, v, tk, tv = (x.repeat_interleave(group, dim=1).float() for x in (k, v, tk, tv))
    s = q.float() @ k.transpose(-1, -2)
    if is_causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    lse2 = lse * math.log2(math.e) - _factor(factors, 5, 0.0)
    p = torch.exp2(s * (scale * math.log2(math.e) * _factor(factors, 0, 1.0)) - lse2[..., None])
    ts = (tq.float() @ k.transpose(-1, -2) + q.float() @ tk.transpose(-1, -2)) * (
        scale * _factor(factors, 9, 1.0))
    return (k, v, tk, tv), p, ts, mu * _factor(factors, 10, 1.0)


def _score_gradients_in_torch(p, ts, mu, v, tv, grad_out, dto, c, delta, factors, dtype):
    """dS and dtS rounded to the products' 16-bit type, as `_score_gradients`."""
    g = dto.float() @ v.transpose(-1, -2)
    dp = grad_out.float() @ v.transpose(-1, -2) + dto.float() @ tv.transpose(-1, -2)
    c, delta = c * _factor(factors, 11, 1.0), delta * _factor(factors, 1, 1.0)
    g = g - c[..., None]  # G - c replaces G: dP = dP0 + (G - c)(tS - mu) - c mu
    dp = dp + g * (ts - mu[..., None]) - (c * mu)[..., None]
    ds = (p * (dp - delta[..., None]) * _factor(factors, 12, 1.0)).to(dtype).float()
    dts = (p * g * _factor(factors, 13, 1.0)).to(dtype).float()
    return ds, dts


def _store_summed(out: torch.Tensor, grad: torch.Tensor, factor: float) -> None:
    """Sum a query head's gradient over its GQA group into `out` (query heads: itself),
    times `factor`."""
    group = grad.shape[1] // out.shape[1]
    out.copy_((grad.unflatten(1, (-1, group)).sum(2) * factor).to(out.dtype))


def dq_tangent_pass_in_torch(q, k, v, tq, tk, tv, grad_out, dto, lse, delta, mu, c, factors,
                             dq, dtq, is_causal: bool, scale: float, **tiles) -> None:
    """The Gluon dQ pass's arithmetic in PyTorch, step for step (fp32, 16-bit operands of the
    accumulating products, the same carried factors), on whole (B, H, Nq, Nk) tiles."""
    (k, v, tk, tv), p, ts, mu = _tiles_in_torch(q, k, v, tq, tk, tv, lse, mu, factors,
                                                is_causal, scale)
    ds, dts = _score_gradients_in_torch(p, ts, mu, v, tv, grad_out, dto, c, delta, factors,
                                        q.dtype)
    _store_summed(dq, ds @ k + dts @ tk * _factor(factors, 15, 1.0),
                  scale * _factor(factors, 2, 1.0))
    _store_summed(dtq, dts @ k, scale * _factor(factors, 6, 1.0))


def dk_tangent_pass_in_torch(q, k, v, tq, tk, tv, grad_out, dto, lse, delta, mu, c, factors,
                             dk, dtk, is_causal: bool, scale: float, **tiles) -> None:
    """The Gluon dK pass's arithmetic in PyTorch, as `dq_tangent_pass_in_torch`."""
    (_, v, _, tv), p, ts, mu = _tiles_in_torch(q, k, v, tq, tk, tv, lse, mu, factors,
                                               is_causal, scale)
    ds, dts = _score_gradients_in_torch(p, ts, mu, v, tv, grad_out, dto, c, delta, factors,
                                        q.dtype)
    grad_k = (ds.transpose(-1, -2) @ q.float()
              + dts.transpose(-1, -2) @ tq.float() * _factor(factors, 15, 1.0))
    _store_summed(dk, grad_k, scale * _factor(factors, 3, 1.0))
    _store_summed(dtk, dts.transpose(-1, -2) @ q.float(), scale * _factor(factors, 7, 1.0))


def dv_tangent_pass_in_torch(q, k, tq, tk, grad_out, dto, lse, mu, factors, dv, dtv,
                             is_causal: bool, scale: float, **tiles) -> None:
    """The Gluon dV pass's arithmetic in PyTorch, as `dq_tangent_pass_in_torch`."""
    _, p, ts, mu = _tiles_in_torch(q, k, k, tq, tk, tk, lse, mu, factors, is_causal, scale)
    tp = (p * (ts - mu[..., None])).to(q.dtype).float()
    p = p.to(q.dtype).float()
    do32, dto32 = grad_out.float(), dto.float()
    _store_summed(dv, p.transpose(-1, -2) @ do32 + tp.transpose(-1, -2) @ dto32,
                  _factor(factors, 4, 1.0))
    _store_summed(dtv, p.transpose(-1, -2) @ dto32, _factor(factors, 8, 1.0))


IN_TORCH = {"dq": dq_tangent_pass_in_torch, "dk": dk_tangent_pass_in_torch,
            "dv": dv_tangent_pass_in_torch}


@pytest.mark.parametrize("name", ["dq", "dk", "dv"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("spec", [Spec(hq=4, hkv=2, nq=40, nk=56, d=16, causal=True),
                                  Spec(nq=48, nk=33, d=32)], ids=lambda s: s.id)
def test_second_order_pass_arithmetic(monkeypatch, spec: Spec, dtype: torch.dtype,
                                      name: str) -> None:
    """The Gluon passes' arithmetic and arguments, in PyTorch on the CPU (the kernels need
    Hopper): routed where chapter 6's pass runs, the library's inputs (Delta_2, mu, c, the
    scale) make every gradient within the math path's error. The carried factors: below."""
    p = make_problem(spec, dtype)
    truth, floor = expected_second_order(p)
    ran = []
    route_tangent_pass(monkeypatch, name, 0, ran, IN_TORCH[name])
    with precision("fast"):
        ours = kernel_second_order(p)
    assert ran == [(name, 0)]
    assert_accurate(ours, truth, floor, dtype, p.label, f"{name} pass in torch",
                    cancellation=cancellation_scale(p, second_order=True))


# Powers of two for the sixteen carried factors, distinct where two quantities could be read
# in each other's place (scores and tS, mu and c, dS and dtS, dQ, dtQ, dK, dtK, dV and dtV),
# so that an index read in the wrong place changes the result (entry 5 is P's exponent
# shift; 14 and 15, the steps of dQ's and dK's accumulators, are inverses, as the carry
# makes them).
TEST_FACTOR_EXPONENTS = [1, -1, 1, 2, -2, 1, -2, -1, 1, 2, -1, 1, -2, 1, 1, -1]


@pytest.mark.parametrize("name", ["dq", "dk", "dv"])
def test_second_order_passes_read_the_carried_factors(monkeypatch, name: str) -> None:
    """The PyTorch forms of the passes read each carried factor as chapter 6's kernels do:
    both given the same operands and made-up factors (the carry is bf16's, which the CPU's
    interpreter cannot run), their gradients agree to fp16's rounding."""
    p = make_problem(Spec(hq=4, hkv=2, nq=40, nk=56, d=16, causal=True), torch.float16)
    launchable = backward_module.launchable
    compared = []

    def routed(kernel, q):
        launch = launchable(kernel, q)
        if kernel is not getattr(backward_module, CHAPTER6_PASSES[name]):
            return launch

        class Both:
            def __getitem__(self, grid):
                def run(*args, **switches):
                    args = list(args)
                    args[15 if name == "dq" else 13] = torch.tensor(
                        [2.0 ** e for e in TEST_FACTOR_EXPONENTS] + [1.0] * 8)
                    switches = {**switches, "CARRY": True}
                    launch[grid](*args, **switches)
                    arguments = list(chapter12_arguments(name, args, switches))
                    chapter6 = arguments[-4:-2]
                    arguments[-4:-2] = ours = [torch.empty_like(x) for x in chapter6]
                    IN_TORCH[name](*arguments)
                    compared.append((ours, chapter6))
                return run
        return Both()

    monkeypatch.setattr(backward_module, "launchable", routed)
    with precision("fast"):
        kernel_second_order(p)
    assert len(compared) == 1
    for ours, chapter6 in zip(*compared[0], strict=True):
        scale = chapter6.abs().max().item()
        assert scale > 0 and (ours - chapter6).abs().max().item() <= 1e-2 * scale


def test_second_order_launch_plumbing(monkeypatch) -> None:
    """What the three passes' launchers hand their kernels (on CPU, the kernels replaced by
    recorders): grids of 128 keys by B·Hkv (dK, dV) or 128 queries by B·Hq (dQ),
    descriptors over each tensor's own strides in the design's tiles, the row statistics,
    the factors, the heads, the scale in log2 units and natural."""
    q, grad_out = heads(n=300, heads=8, layout="bnhd"), heads(n=300, heads=8)
    k, v = heads(n=4100, heads=2), heads(n=4100, heads=2)
    stats = [torch.empty(4, 8, 300) for _ in range(4)]
    dk, dtk, factors = torch.empty_like(k), torch.empty_like(k), torch.ones(16)
    dq, dtq = torch.empty_like(grad_out), torch.empty_like(grad_out)
    recorded = recorded_launches(monkeypatch, "warp_specialized_tangent_pass_kernel", hb)
    hb.launch_warp_specialized_dk_tangent(q, k, v, q, k, v, grad_out, grad_out, *stats,
                                          factors, dk, dtk, True, 0.5, query_rows=16)
    dk_launch = dict(recorded)
    hb.launch_warp_specialized_dv_tangent(q, k, q, k, grad_out, grad_out, stats[0], stats[2],
                                          None, dk, dtk, False, 0.5)
    for launch, key_side, rows, statistics, keys in (
            (dk_launch, [k, k, v, v], 16, stats, True),
            (recorded, [k, k, k, k], hb.DV_TANGENT_QUERY_ROWS,
             [stats[0], stats[0], stats[2], stats[2]], False)):  # Delta_2, c unread
        assert launch["grid"] == (33, 8)
        descriptors, rest = launch["args"][:10], launch["args"][10:]
        assert [d.base for d in descriptors] == [*key_side, q, q, grad_out, grad_out, dk, dtk]
        assert [d.block_shape[2] for d in descriptors] == [64] * 4 + [rows] * 4 + [64] * 2
        assert list(descriptors[4].strides) == list(q.stride())
        assert list(rest[:4]) == statistics
        assert rest[4] is (factors if keys else stats[0])  # without a carry the LSE stands in
        assert rest[5:8] == (2, 300, 4)
        assert math.isclose(rest[8], 0.5 * math.log2(math.e)) and rest[9] == 0.5
        assert launch["kwargs"] == dict(STAGES=hb.TANGENT_PASS_STAGES, CAUSAL=keys,
                                        CARRY=keys, KEYS=keys, num_warps=4,
                                        maxnreg=ws.LAUNCH_REGS)
    dq_launch = recorded_launches(monkeypatch, "warp_specialized_dq_tangent_kernel", hb)
    hb.launch_warp_specialized_dq_tangent(q, k, v, q, k, v, grad_out, grad_out, *stats,
                                          factors, dq, dtq, True, 0.5)
    assert dq_launch["grid"] == (3, 32)
    descriptors, rest = dq_launch["args"][:10], dq_launch["args"][10:]
    assert [d.base for d in descriptors] == [q, q, grad_out, grad_out, k, k, v, v, dq, dtq]
    assert [d.block_shape[2] for d in descriptors] == (
        [64] * 4 + [hb.dq_tangent_key_block(q.shape[-1])] * 4 + [64] * 2)
    assert list(rest[:5]) == [*stats, factors] and rest[5:9] == (8, 300, 4100, 4)
    assert math.isclose(rest[9], 0.5 * math.log2(math.e)) and rest[10] == 0.5
    assert dq_launch["kwargs"] == dict(STAGES=hb.TANGENT_PASS_STAGES, CAUSAL=True, CARRY=True,
                                       HEAD_GROUP=hb.head_group(True, k, v, k, v, queries_per_head=4),
                                       num_warps=4, maxnreg=ws.LAUNCH_REGS)


def test_backward_through_the_tangent_hands_over_its_passes(monkeypatch) -> None:
    """Chapter 5's launcher asks chapter 12 for unmasked calls through the tangent and hands
    over the dQ pass, then the dV and dK passes (here to their PyTorch forms, the kernels
    needing Hopper), with the gradients within the math path's error; a mask keeps chapter
    6's kernels; so do passes left out of SECOND_ORDER_PASSES; a Triton that cannot compile
    them warns and runs chapter 6's, with the same gradients as without the hand-over."""
    import triton

    asked, ran = [], []

    def fits(q, k, v, tangents, grad_out, grad_tangent_out, exact):
        asked.append(exact)
        return True

    def recorded(name):
        def launch(*args):
            ran.append(name)
            IN_TORCH[name](*args)
        return launch

    monkeypatch.setattr(backward_module, "warp_specialized_tangent_passes", fits)
    for name in IN_TORCH:
        monkeypatch.setattr(hb, f"launch_warp_specialized_{name}_tangent", recorded(name))
    p = make_problem(Spec(hq=4, hkv=2, nq=40, nk=56, d=16, causal=True), torch.float16,
                     device=DEVICE)
    truth, floor = expected_second_order(p)
    with precision("fast"):
        ours = kernel_second_order(p)
    assert asked == [False] and ran == ["dq", "dv", "dk"]
    assert_accurate(ours, truth, floor, torch.float16, p.label, "handed over",
                    cancellation=cancellation_scale(p, second_order=True))
    masked = make_problem(Spec(hq=4, hkv=2, nq=40, nk=56, d=16, mask="additive"),
                          torch.float16, device=DEVICE)
    with precision("fast"):
        kernel_second_order(masked)
    assert asked == [False] and ran == ["dq", "dv", "dk"]
    monkeypatch.setattr(hb, "SECOND_ORDER_PASSES", frozenset({"dk"}))
    with precision("fast"):
        kernel_second_order(p)
    assert ran == ["dq", "dv", "dk", "dk"]

    def broken(*args, **kwargs):
        raise triton.CompilationError(None, None, "an API this Triton no longer has")

    monkeypatch.setattr(hb, "SECOND_ORDER_PASSES", frozenset({"dq", "dk", "dv"}))
    monkeypatch.setattr(hb, "_failed", False)
    for name in IN_TORCH:
        monkeypatch.setattr(hb, f"launch_warp_specialized_{name}_tangent", broken)
    with precision("fast"), pytest.warns(RuntimeWarning, match="does not compile"):
        fallen_back = kernel_second_order(p)
    assert hb._failed
    monkeypatch.setattr(backward_module, "warp_specialized_tangent_passes",
                        lambda *args: False)
    with precision("fast"):
        chapter6 = kernel_second_order(p)
    assert all(torch.equal(fallen_back[name], chapter6[name]) for name in chapter6)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "mode"), PATHS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("spec", [GPU_SPECS[0], GPU_SPECS[3], GPU_SPECS[5]],
                         ids=lambda s: s.id)
def test_second_order_on_hopper(monkeypatch, spec: Spec, dtype: torch.dtype,
                                mode: str) -> None:
    """The library's backward through the tangent on Hopper, unrouted: it takes this
    chapter's dQ, dV and dK passes, and every gradient is within the math path's error."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup products need an sm_90 GPU")
    ran = []
    for name in IN_TORCH:
        launch = getattr(hb, f"launch_warp_specialized_{name}_tangent")
        monkeypatch.setattr(hb, f"launch_warp_specialized_{name}_tangent",
                            lambda *args, _launch=launch, _name=name: (
                                ran.append(_name), _launch(*args)))
    p = make_problem(spec, dtype, device="cuda")
    truth, floor = expected_second_order(p)
    chapter6 = chapter6_second_order(monkeypatch, p, mode)
    assert not ran
    with precision(mode):
        ours = kernel_second_order(p)
    assert ran == ["dq", "dv", "dk"]
    assert_as_accurate_as_chapter6(ours, chapter6, truth, floor, dtype, p,
                                   f"second order on Hopper, {mode}")
