"""The work one call does, counted, so that it cannot creep back: Triton launches per call and
PyTorch operations dispatched around the library's operators, for the calls training makes
(torch.func.jvp of attention, then a backward through the primal output only, as in
MeanFlow and sCM, or through both outputs).

Counted on the CPU through Triton's interpreter, which launches exactly what the GPU would for
float16/float32 inputs. bfloat16 in accurate mode at long sequences carries exact fp16
copies (chapter 2): two launches more per call, the range pass and the copies, counted here
by forcing that path on float16 inputs. Besides our launches a call may dispatch only
allocations, views and forward AD's metadata checks: no PyTorch operation that would be a GPU
kernel. The dispatch-mode counts see the operations around the library's operators; the
profiler's (`test_eager_call_dispatches_only_its_launches`) see the plain eager call from
the inside, its launchers included, and also refuse any operation that would make the host
wait for the GPU. The budgets are today's counts: lower them when a call gets leaner, never
raise them without a reason written here.
"""

import collections
import sys
from unittest import mock

import pytest
import torch
from helpers import HAS_CUDA
from torch.utils._python_dispatch import TorchDispatchMode

import jvp_attention

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(HAS_CUDA, reason="counts launches through the interpreter")]

FORWARD_JVP_LAUNCHES = 1  # the fused forward+JVP kernel
PRIMAL_BACKWARD_LAUNCHES = 2  # dQ (which also computes Delta = rowsum(dO * O)), dK/dV
# Row statistics, dQ, then the key side in two passes (dV and dtV, dK and dtK; chapter 5's
# SPLIT_KEY_SIDE), with the tangent switched on: 4, one more than the single key-side pass,
# which held four accumulators and ran 5% ("accurate") to 13% ("fast") slower at (4, 16,
# 4096, 128) on the H200.
SECOND_ORDER_LAUNCHES = 4
CARRY_LAUNCHES = 2  # the range pass over the inputs, then the shifted fp16 copies
# Carried, the copy kernel writes Delta and dQ reads it: 2 + 2 launches (at most 4, #15).
CARRIED_BACKWARD_LAUNCHES = PRIMAL_BACKWARD_LAUNCHES + CARRY_LAUNCHES
# PyTorch operations dispatched per call: our operator (under a dispatch mode, such as the
# counter here, the library calls its operators, whose launchers the mode does not see; in
# plain eager mode it calls the launchers directly), views, and forward AD's dual
# bookkeeping (make_dual's metadata checks).
FORWARD_JVP_OPS = 22
PRIMAL_BACKWARD_OPS = 7  # with the test's own ones_like
# Python function calls (generator steps included) outside Triton launches, with torch 2.13:
# a proxy for host time that a timer on a shared CI machine could not give. The attention
# call inside torch.func.jvp (argument checks, dual unpacking, launcher) was 1195 while
# functorch lifted the Function on every call, and 185 without; the primal backward was
# 159, then 131. Unpacking each dual once, without forward AD's Python wrappers, and host
# versions of triton.next_power_of_2 and triton.cdiv (constexpr functions, dear to call from
# the host) brought them to 138 and 111. The `CachedLauncher` in front of each launch
# (chapter 2) adds one call per launch here, where Triton's interpreter runs the kernel;
# the dQ kernel computing Delta (chapter 5) took a launch out of the primal backward: 147
# and 115. Chapter 11's forward with its JVP made chapter 2's launcher ask whether a call
# with tangents goes there (`takes_warp_specialized`, whose environment switch is read per
# call so that it can be flipped at run time): 148 became 152. The check that a launch's
# tensors are plain (`_plain_eager`, chapter 7) walks them in a loop instead of a generator,
# whose every step is a call, and `attention` hands its 4-D work to `_attend`, which the
# vmap rule calls too: 146 and 110. Whether the forward's rows are long enough for tensor
# descriptors (`long_forward_rows`, chapter 2), asked apart from whether a traced graph may
# take them, adds one: 147. The causal launch order's heads per group (`head_group`, chapter
# 2), asked on every launch and answering 1 at once without the mask, adds one: 148.
# Replaying a call at a key seen before (chapter 2, "Replaying a call": what the decisions
# read of the inputs and settings, then the outputs' allocation and the launch) skips the
# decisions: 109 (here the replay still launches through the autotuner, as the
# interpreter needs; on a GPU it calls the C launcher directly). Marking launches that
# bypass the C launcher (which makes a call unreplayable) costs one call per launch here,
# where the interpreter runs every launch: 111 and, for the backward's launches, 113. The
# replay recorded from the interpreter's own launch (a call after the tuning one: the test
# warms up twice) and the backward's replay (chapter 5): 101 and 86. One kind of replay
# for both (`CallReplay`, its slots read with `map`, its check a loop): 101 and 67.
FORWARD_JVP_PYTHON_CALLS = 101
PRIMAL_BACKWARD_PYTHON_CALLS = 67
# Carried (bf16 "accurate" from 1024 keys, forced here on float16), each direction adds
# the carry's launcher (`carried_operands`: strides, shapes and allocations for the range
# pass and the copies, then their two cached launches) and the copy kernel's epilogue
# arguments: 228 and 181 on 2026-12-05. Most of the difference is generator steps over the
# copied tensors' strides and shapes (about 50 a direction). `head_group`: 229. A carried
# call is not replayed (its copies are launches of their own), and pays for the key and
# the recording that would let a plain one be (chapter 2): 249; with the marks, 253 and 187.
# The backward's key and recording, which a carried call pays without a replay, and the
# forward's launch without recording where it cannot be replayed: 243 and 216. Carried
# calls replayed too (the carry's launches with their tensors in tuples, filled in from the
# pool, and its copies allocated anew): 130 and 96.
CARRIED_FORWARD_JVP_PYTHON_CALLS = 130
CARRIED_PRIMAL_BACKWARD_PYTHON_CALLS = 96
# Operations that are no GPU kernel: what a call may dispatch besides our launches.
NO_KERNEL = {"jvp_attention.forward_jvp.default", "jvp_attention.backward.default",
             "aten.alias.default", "aten.is_same_size.default", "aten.view.default",
             "aten._has_same_storage_numel.default", "aten.detach.default",
             "aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default"}


_IN_LAUNCH = {"depth": 0}  # > 0 while Triton's interpreter runs a kernel


class _CountOps(TorchDispatchMode):
    """Counts the PyTorch operations dispatched outside Triton launches (the interpreter's
    own tensor copies are not work the GPU does)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _IN_LAUNCH["depth"]:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch):
    """Names of the Triton kernels launched while the test runs, with their counts."""
    from triton.runtime.interpreter import InterpretedFunction

    counts = collections.Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counts[self.fn.__name__] += 1
        _IN_LAUNCH["depth"] += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            _IN_LAUNCH["depth"] -= 1

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    return counts


def _inputs(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    return (q, k, v), tangents


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_jvp_then_primal_backward(dtype, launches) -> None:
    inputs, tangents = _inputs(dtype)
    torch.func.jvp(jvp_attention.attention, inputs, tangents)  # warm: autotuning, caches
    launches.clear()
    with _CountOps() as counter:
        out, _ = torch.func.jvp(jvp_attention.attention, inputs, tangents)
    assert sum(launches.values()) == FORWARD_JVP_LAUNCHES, launches
    assert sum(counter.ops.values()) <= FORWARD_JVP_OPS, counter.ops
    assert set(counter.ops) <= NO_KERNEL, counter.ops
    launches.clear()
    with _CountOps() as counter:
        out.backward(torch.ones_like(out))
    assert sum(launches.values()) == PRIMAL_BACKWARD_LAUNCHES, launches
    assert sum(counter.ops.values()) <= PRIMAL_BACKWARD_OPS, counter.ops
    assert set(counter.ops) - {"aten.ones_like.default"} <= NO_KERNEL, counter.ops


def test_carried_operands_add_two_launches(launches, monkeypatch) -> None:
    """The bf16 carry of accurate mode (forced here on float16 inputs, which the interpreter
    computes correctly): the range pass and the copies are one launch each, whatever the
    number of tensors, and no PyTorch operation runs besides allocations and views. In the
    backward the copies replace the row-statistics launch."""
    for module in (jvp_attention.forward, jvp_attention.backward):
        monkeypatch.setattr(module, "carries", lambda q, n_keys: True)
    inputs, tangents = _inputs(torch.float16)
    torch.func.jvp(jvp_attention.attention, inputs, tangents)
    launches.clear()
    with _CountOps() as counter:
        out, _ = torch.func.jvp(jvp_attention.attention, inputs, tangents)
    assert sum(launches.values()) == FORWARD_JVP_LAUNCHES + CARRY_LAUNCHES, launches
    assert set(counter.ops) <= NO_KERNEL, counter.ops
    launches.clear()
    grad = torch.ones_like(out)
    with _CountOps() as counter:
        out.backward(grad)
    assert sum(launches.values()) == CARRIED_BACKWARD_LAUNCHES, launches
    assert "_row_statistics_kernel" not in launches, launches
    assert set(counter.ops) <= NO_KERNEL, counter.ops


@pytest.fixture
def launch_storages(launches, monkeypatch):
    """Per launch, the storages (data pointers) of its tensor arguments."""
    from triton.runtime.interpreter import InterpretedFunction

    storages = []
    run = InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        storages.append({x.untyped_storage().data_ptr() for x in args
                         if isinstance(x, torch.Tensor)})
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    return storages


@pytest.mark.parametrize("head_dim", [16, 24])
def test_fused_qkv_views_are_read_in_place(launches, launch_storages, head_dim) -> None:
    """The layout a DiT block hands attention: q, k, v (and their tangents) are views of one
    (B, N, 3, H, d) projection, permuted to (B, H, N, d), and the incoming gradient is a
    transposed (B, N, H, d) tensor. The kernels read them where they are, through their
    strides: the same launches as for contiguous inputs, each given the projections' and
    the gradient's own storage, and no PyTorch operation besides views. (A step's `stack`
    and layout copy of the three gradients on their way back into the projection are
    autograd's, outside the library.)"""
    torch.manual_seed(0)
    pack, tangent_pack = (torch.randn(2, 16, 3, 2, head_dim, dtype=torch.float16,
                                      requires_grad=grad) for grad in (True, False))
    q, k, v = pack.permute(2, 0, 3, 1, 4).unbind(0)
    tangents = tangent_pack.permute(2, 0, 3, 1, 4).unbind(0)
    grad = torch.randn(2, 16, 2, head_dim, dtype=torch.float16).transpose(1, 2)
    storage = {name: x.untyped_storage().data_ptr()
               for name, x in (("pack", pack), ("tangents", tangent_pack), ("grad", grad))}
    out, _ = torch.func.jvp(jvp_attention.attention, (q, k, v), tangents)  # warm
    torch.autograd.grad(out, (q, k, v), grad)
    launches.clear()
    launch_storages.clear()
    with _CountOps() as counter:
        out, _ = torch.func.jvp(jvp_attention.attention, (q, k, v), tangents)
    assert sum(launches.values()) == FORWARD_JVP_LAUNCHES, launches
    assert set(counter.ops) <= NO_KERNEL, counter.ops
    assert {storage["pack"], storage["tangents"]} <= launch_storages[0]
    launches.clear()
    launch_storages.clear()
    with _CountOps() as counter:
        torch.autograd.grad(out, (q, k, v), grad)
    rows_apart = head_dim % 16 != 0  # d = 24: the row-statistics kernel computes Delta
    assert sum(launches.values()) == PRIMAL_BACKWARD_LAUNCHES + rows_apart, launches
    assert set(counter.ops) <= NO_KERNEL, counter.ops
    for arguments in launch_storages[rows_apart:]:  # dQ, then dK/dV
        assert {storage["pack"], storage["grad"]} <= arguments


@pytest.mark.parametrize("split_key_side", [True, False], ids=["two-key-passes", "one-key-pass"])
def test_backward_through_both_outputs(launches, monkeypatch, split_key_side: bool) -> None:
    import jvp_attention.backward as backward

    monkeypatch.setattr(backward, "SPLIT_KEY_SIDE", split_key_side)
    inputs, tangents = _inputs(torch.float32)
    out, tangent_out = torch.func.jvp(jvp_attention.attention, inputs, tangents)
    launches.clear()
    (out.sum() + tangent_out.square().sum()).backward()
    expected = SECOND_ORDER_LAUNCHES - (not split_key_side)
    assert sum(launches.values()) == expected, launches
    assert launches["_attention_backward_dkdv_kernel"] == 1 + split_key_side, launches


def test_carried_backward_through_both_outputs(launches, monkeypatch) -> None:
    """The carried backward through the tangent (forced on float16 inputs): the range pass
    and the eight copies add two launches to the row statistics, dQ and the two key-side
    passes, and no PyTorch operation besides allocations and views."""
    import jvp_attention.backward as backward

    monkeypatch.setattr(backward, "carries", lambda q, n_keys: True)
    inputs, tangents = _inputs(torch.float16)
    out, tangent_out = torch.func.jvp(jvp_attention.attention, inputs, tangents)
    (out.float().sum() + tangent_out.float().square().sum()).backward()  # warm
    out, tangent_out = torch.func.jvp(jvp_attention.attention, inputs, tangents)
    loss = out.float().sum() + tangent_out.float().square().sum()
    launches.clear()
    with mock.patch.object(backward, "carried_second_order_operands",
                           wraps=backward.carried_second_order_operands) as carried:
        loss.backward()
    assert carried.called
    assert sum(launches.values()) == SECOND_ORDER_LAUNCHES + CARRY_LAUNCHES, launches
    assert launches["_row_statistics_kernel"] == 1, launches


def test_plain_forward_is_one_launch(launches) -> None:
    inputs, _ = _inputs(torch.float16)
    with torch.no_grad():
        jvp_attention.attention(*inputs)
        launches.clear()
        jvp_attention.attention(*inputs)
    assert sum(launches.values()) == 1, launches


def test_eager_calls_skip_the_dispatcher(monkeypatch) -> None:
    """In plain eager mode the Functions call the launchers, not the operators (whose
    dispatch costs as much host time as the kernels take at training shapes)."""
    inputs, tangents = _inputs(torch.float16)
    assert jvp_attention.autograd  # registers the operators (the package imports it lazily)
    for name in ("forward_jvp", "backward"):
        monkeypatch.setattr(torch.ops.jvp_attention, name, _refuse)
    out, _ = torch.func.jvp(jvp_attention.attention, inputs, tangents)
    out.backward(torch.ones_like(out))
    assert inputs[0].grad is not None


def _refuse(*args):
    raise AssertionError("an eager call went through the dispatcher")


class _CountPythonCalls:
    """Counts Python function calls (sys.setprofile "call" events) outside Triton launches."""

    def __init__(self):
        self.calls = collections.Counter()

    def _profile(self, frame, event, arg):
        if event == "call" and not _IN_LAUNCH["depth"]:
            self.calls[f"{frame.f_code.co_filename}:{frame.f_code.co_name}"] += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def total(self) -> int:
        return sum(self.calls.values())


def test_unaligned_rows_keep_the_row_statistics_launch(launches) -> None:
    """With O's rows not 16-element aligned (d = 24 here, 72 in DiT-XL) the dQ kernel does
    not compute Delta (its loads would not vectorise): the row-statistics kernel does."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 24, dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    out = jvp_attention.attention(q, k, v)
    launches.clear()
    out.backward(torch.ones_like(out))
    assert launches["_row_statistics_kernel"] == 1, launches
    assert sum(launches.values()) == PRIMAL_BACKWARD_LAUNCHES + 1, launches



@pytest.mark.skipif(torch.__version__.split("+")[0] != "2.13.0",
                    reason="the budgets count PyTorch 2.13's own Python calls")
@pytest.mark.parametrize(("carried", "forward_budget", "backward_budget"), [
    (False, FORWARD_JVP_PYTHON_CALLS, PRIMAL_BACKWARD_PYTHON_CALLS),
    (True, CARRIED_FORWARD_JVP_PYTHON_CALLS, CARRIED_PRIMAL_BACKWARD_PYTHON_CALLS),
], ids=["plain", "carried"])
def test_python_work_per_call(launches, monkeypatch, carried: bool, forward_budget: int,
                              backward_budget: int) -> None:
    if carried:
        for module in (jvp_attention.forward, jvp_attention.backward):
            monkeypatch.setattr(module, "carries", lambda q, n_keys: True)
    inputs, tangents = _inputs(torch.float16)
    counter = _CountPythonCalls()

    def attend(q, k, v):
        with counter:
            return jvp_attention.attention(q, k, v)

    for _ in range(2):  # warm: lazy imports, caches, tuning, then a call recorded to replay
        out, _ = torch.func.jvp(attend, inputs, tangents)
        out.backward(torch.ones_like(out), retain_graph=True)
    counter.calls.clear()
    copies = launches["carried_copies_kernel"]  # not cleared: a new key would be a call
    out, _ = torch.func.jvp(attend, inputs, tangents)
    assert launches["carried_copies_kernel"] - copies == carried, launches
    assert counter.total() <= forward_budget, counter.calls.most_common(20)
    grad = torch.ones_like(out)
    with _CountPythonCalls() as backward:
        out.backward(grad)
    assert backward.total() <= backward_budget, backward.calls.most_common(20)


def test_jvp_does_not_lift_the_function(monkeypatch) -> None:
    """Inside one torch.func.jvp the Function runs as plain autograd: functorch's lifting
    (a generated Function class per call) is skipped, and the results are the same."""
    inputs, tangents = _inputs(torch.float32)
    expected = torch.func.jvp(jvp_attention.attention, inputs, tangents)
    from torch._functorch import autograd_function

    monkeypatch.setattr(autograd_function, "generate_single_level_function", _refuse)
    out, tangent = torch.func.jvp(jvp_attention.attention, inputs, tangents)
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(tangent, expected[1], rtol=0, atol=0)
    out.backward(torch.ones_like(out))
    assert all(x.grad is not None for x in inputs)


# What the plain eager call may dispatch, seen from the inside: the profiler records every
# PyTorch operation, those of the library's own launchers included (which a dispatch mode
# does not see: under one the library calls its operators). Allocations, views and forward
# AD's dual bookkeeping are no GPU kernel; anything else would be a launch of its own, and
# an operation that reads a device value on the host (`.item()`, `nonzero`, a copy to the
# CPU) would make the call wait for the GPU.
EAGER_NO_KERNEL = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                   "aten::alias", "aten::view", "aten::reshape", "aten::expand",
                   "aten::as_strided", "aten::is_same_size", "aten::_has_same_storage_numel",
                   "aten::_make_dual", "aten::_unpack_dual", "aten::_fw_primal"}
# A learnable additive mask's own work, which no other call does: its bias and tangent
# interleaved into one operand (`mask_operand`, chapter 2), its gradient summed over the
# dimensions it was broadcast along (autograd of `expand`; on the CPU the sum fills its
# output first).
BIAS_WORK = {"aten::promote_types", "aten::to", "aten::_to_copy", "aten::copy_",
             "aten::broadcast_tensors", "aten::stack", "aten::unsqueeze", "aten::cat",
             "aten::narrow", "aten::slice", "aten::zeros", "aten::zeros_like", "aten::zero_",
             "aten::fill_", "aten::sum"}
# What the backward no longer does for it: the kernels write the mask's gradient in its own
# dtype into an unfilled buffer (chapter 5), where a zero-filled fp32 buffer was cast after
# them (0.32 and 0.52 ms of a 4.1 ms MeanFlow step on an H100 at (16, 16, 1024, 72)).
GRADIENT_FILL_AND_CAST = {"aten::zeros", "aten::zeros_like", "aten::zero_", "aten::_to_copy",
                          "aten::copy_"}
HOST_WAITS = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero",
              "aten::equal", "aten::tolist", "aten::cpu"}


def _profiled_ops(run) -> tuple[collections.Counter, collections.Counter]:
    """(PyTorch operations outside Triton launches, Triton launches) of `run()` in plain
    eager mode, from the profiler."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile
    from triton.runtime.interpreter import InterpretedFunction

    launch = InterpretedFunction.run

    def marked(self, *args, **kwargs):
        with record_function(f"launch::{self.fn.__name__}"):
            return launch(self, *args, **kwargs)

    def in_launch(event) -> bool:
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("launch::"):
            parent = parent.cpu_parent
        return parent is not None

    with mock.patch.object(InterpretedFunction, "run", marked), \
            profile(activities=[ProfilerActivity.CPU]) as profiler:
        run()
    events = profiler.events()
    ops = collections.Counter(e.name for e in events
                              if e.name.startswith("aten::") and not in_launch(e))
    launches = collections.Counter(e.name.removeprefix("launch::") for e in events
                                   if e.name.startswith("launch::"))
    return ops, launches


def _eager_cases():
    """(name, call(q, k, v, bias) for torch.func.jvp, whether it carries, has a learnable
    mask) for the ways models call attention."""
    bool_mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(1)) > 0.3
    return [
        ("plain", lambda q, k, v, bias: jvp_attention.attention(q, k, v), False, False),
        ("causal", lambda q, k, v, bias: jvp_attention.attention(q, k, v, is_causal=True),
         False, False),
        ("bool-mask", lambda q, k, v, bias: jvp_attention.attention(q, k, v, attn_mask=bool_mask),
         False, False),
        ("carried", lambda q, k, v, bias: jvp_attention.attention(q, k, v), True, False),
        ("learnable-bias", lambda q, k, v, bias: jvp_attention.attention(q, k, v, attn_mask=bias),
         False, True),
    ]


@pytest.mark.parametrize("case", _eager_cases(), ids=lambda case: case[0])
@pytest.mark.parametrize("backward", ["primal", "both"])
def test_eager_call_dispatches_only_its_launches(case, backward: str, monkeypatch) -> None:
    """Inside the plain eager call (the launchers included): no PyTorch operation that is a
    GPU kernel besides a learnable mask's own (and in the backward neither a fill nor a cast
    of its gradient), and none that waits for the GPU, in the forward with its JVP and in
    the backward through the primal output (MeanFlow) or through both outputs (second
    order)."""
    _, call, carried, learnable = case
    if carried:
        for module in (jvp_attention.forward, jvp_attention.backward):
            monkeypatch.setattr(module, "carries", lambda q, n_keys: True)
    inputs, tangents = _inputs(torch.float16)
    bias = torch.randn(2, 1, 16, 16, dtype=torch.float16, requires_grad=learnable)
    primals, directions = (*inputs, bias), (*tangents, torch.randn_like(bias))
    results = {}

    def jvp():
        results["out"] = torch.func.jvp(call, primals, directions)

    def grad():
        outputs, cotangents = results["out"], results["cotangents"]
        n = 1 if backward == "primal" else 2
        torch.autograd.grad(outputs[:n], primals[:3 + learnable], cotangents[:n],
                            retain_graph=True)

    allowed = EAGER_NO_KERNEL | (BIAS_WORK if learnable else set())
    for profiled in (False, True):  # the first time round warms up: autotuning, caches
        for phase in (jvp, grad):
            if not profiled:
                phase()
            else:
                ops, launches = _profiled_ops(phase)
                assert launches, f"{phase.__name__}: no Triton launch was profiled"
                assert not set(ops) & HOST_WAITS, (phase.__name__, ops)
                assert set(ops) <= allowed, (phase.__name__, set(ops) - allowed, launches)
                if phase is grad:
                    assert not set(ops) & GRADIENT_FILL_AND_CAST, ops
            if phase is jvp:
                out, tangent_out = results["out"]
                results["cotangents"] = (torch.ones_like(out), tangent_out.detach())
