"""The work one call does, counted, so that it cannot creep back: Triton launches per call and
PyTorch operations dispatched around the library's operators, for the calls training makes
(torch.func.jvp of attention, then a backward through the primal output only, as in
MeanFlow and sCM, or through both outputs).

Counted on the CPU through Triton's interpreter, which launches exactly what the GPU would for
float16/float32 inputs. (bfloat16 on the GPU adds the range pass and fp16 copies of accurate
mode at long sequences, chapter 2.) Besides our launches a call may dispatch only
allocations, views and forward AD's metadata checks: no PyTorch operation that would be a GPU
kernel. The budgets are today's counts: lower them when a call gets leaner, never raise them
without a reason written here.
"""

import collections

import pytest
import torch
from helpers import HAS_CUDA
from torch.utils._python_dispatch import TorchDispatchMode

import jvp_attention

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(HAS_CUDA, reason="counts launches through the interpreter")]

FORWARD_JVP_LAUNCHES = 1  # the fused forward+JVP kernel
PRIMAL_BACKWARD_LAUNCHES = 3  # row statistics, dK/dV, dQ
SECOND_ORDER_LAUNCHES = 3  # the same three with the tangent switched on
# PyTorch operations dispatched per call: our operator (under a dispatch mode, such as the
# counter here, the library calls its operators, whose launchers the mode does not see; in
# plain eager mode it calls the launchers directly), views, and forward AD's dual
# bookkeeping (make_dual's metadata checks).
FORWARD_JVP_OPS = 38
PRIMAL_BACKWARD_OPS = 11  # with the test's own ones_like
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


def test_backward_through_both_outputs(launches) -> None:
    inputs, tangents = _inputs(torch.float32)
    out, tangent_out = torch.func.jvp(jvp_attention.attention, inputs, tangents)
    launches.clear()
    (out.sum() + tangent_out.square().sum()).backward()
    assert sum(launches.values()) == SECOND_ORDER_LAUNCHES, launches


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
    for name in ("forward_jvp", "backward"):
        monkeypatch.setattr(torch.ops.jvp_attention, name, _refuse)
    out, _ = torch.func.jvp(jvp_attention.attention, inputs, tangents)
    out.backward(torch.ones_like(out))
    assert inputs[0].grad is not None


def _refuse(*args):
    raise AssertionError("an eager call went through the dispatcher")
