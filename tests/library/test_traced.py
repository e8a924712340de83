"""The operators' traced twins (chapter 7) as AOTAutograd traces them under torch.compile.

`tests/traced_graphs.py` traces each twin on fake tensors, outside Triton's interpreter (the
twins are not registered under it), with Triton given a Hopper target. These tests check
which calls become kernel launches in the graph and which stay with the opaque operator,
and that Inductor's analysis of each launch finds exactly the arguments the kernel writes.
That analysis matters for correctness: where it fails, Inductor assumes that every argument
is written, and a tensor passed under two names (the forward passes `out` as its own
residual when there is none) would come back as an unwritten copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import jvp_attention.launch as launch

TESTS = Path(__file__).resolve().parents[1]
FORWARD = ["o_ptr", "lse_ptr"]
FORWARD_JVP = ["o_ptr", "to_ptr", "lse_ptr", "mu_ptr"]
RESIDUALS = ["o_residual_ptr", "to_residual_ptr"]
KEY_GRADS = ["dk_ptr", "dv_ptr"]
# the key side in two passes (chapter 5's SPLIT_KEY_SIDE): dV and dtV, then dK and dtK
SECOND_ORDER = [["delta_ptr", "c_ptr"], ["dq_ptr", "dtq_ptr"], ["dv_ptr", "dtv_ptr"],
                ["dk_ptr", "dtk_ptr"]]
# Triton 3.6's own ptxas miscompiles head dims cut into two column tiles (chapter 2): where
# this library compiles with another, a compiled graph pads them to one tile in calls of up
# to PADDED_MAX_SCORES scores and keeps the opaque operator in larger ones.
CUT_IS_OPAQUE = launch.sound_ptxas(90) is not None
LARGE_D72 = [16, 16, 1024, 72]  # 2**28 scores
assert 16 * 16 * 1024 * 1024 > launch.PADDED_MAX_SCORES
LARGE_SECOND_ORDER = [16, 16, 1024, 64]  # 2**28 scores
LARGE_LONG_ROWS = [4, 16, 4096, 64]  # 2**30 scores
assert 4 * 16 * 4096 * 4096 > launch.GRAPH_POINTER_MAX_SCORES


class Carried(NamedTuple):
    """A traced call that carries (bf16 "accurate", from carry_min_keys keys): the graph
    calls `operator` for the copies, then launches kernels that write `written`."""
    operator: str
    written: list

# (case, the arguments each launch writes, in launch order; None: the opaque operator).
# "device": "cpu" where fake CUDA tensors cannot run an operation the launcher needs
# (torch.stack in a CPU build of PyTorch); the graphs are the same.
CASES = [
    ({"op": "forward"}, [FORWARD]),
    ({"op": "forward", "causal": True, "hkv": 2}, [FORWARD]),
    # a bool mask is handed to the kernels as it is (Triton reads it as bytes)
    ({"op": "forward", "mask": "bool", "causal": True, "hkv": 2}, [FORWARD]),
    ({"op": "forward", "residual": True, "dtype": "bf16"}, [FORWARD + ["o_residual_ptr"]]),
    ({"op": "forward_jvp"}, [FORWARD_JVP]),
    ({"op": "forward_jvp", "causal": True, "hkv": 2}, [FORWARD_JVP]),
    ({"op": "forward_jvp", "mask": "bool"}, [FORWARD_JVP]),
    ({"op": "forward_jvp", "mask": "float"}, [FORWARD_JVP]),
    # a mask tangent: the kernels are handed the whole (bias, tangent) pairs they read
    ({"op": "forward_jvp", "mask": "float", "mask_tangent": True, "device": "cpu"},
     [FORWARD_JVP]),
    ({"op": "forward_jvp", "residual": True, "dtype": "bf16"}, [FORWARD_JVP + RESIDUALS]),
    ({"op": "forward_jvp", "dtype": "fp32"}, [FORWARD_JVP]),
    # dynamic shapes: a symbolic batch or token count stays symbolic in the launches
    # (`test_symbolic_sizes_stay_symbolic`)
    ({"op": "forward_jvp", "dynamic": "batch", "device": "cpu"}, [FORWARD_JVP]),
    ({"op": "forward_jvp", "dynamic": "tokens", "device": "cpu"}, [FORWARD_JVP]),
    ({"op": "backward", "dynamic": "tokens", "device": "cpu"}, [["delta_ptr", "dq_ptr"], KEY_GRADS]),
    ({"op": "backward_tangent", "dynamic": "tokens", "device": "cpu"}, SECOND_ORDER),
    # bf16 "accurate" from carry_min_keys keys carries: its copy kernel takes jit functions,
    # so the copies come from an operator of their own, and the attention kernel is traced,
    # whether CUDA graphs replay the graph or not
    ({"op": "forward_jvp", "dtype": "bf16", "shape": [1, 2, 1024, 64], "cudagraphs": True},
     Carried("value_operands", [FORWARD_JVP])),
    ({"op": "forward_jvp", "dtype": "bf16", "shape": [1, 2, 1024, 64]},
     Carried("value_operands", [FORWARD_JVP])),
    ({"op": "forward_jvp", "dtype": "bf16", "shape": [1, 2, 1024, 64], "residual": True},
     Carried("value_operands", [FORWARD_JVP + RESIDUALS])),
    # with a mask tangent too (it enters tS in natural units inside the kernel)
    ({"op": "forward_jvp", "dtype": "bf16", "shape": [1, 2, 1024, 64], "mask": "float",
      "mask_tangent": True, "device": "cpu"}, Carried("value_operands", [FORWARD_JVP])),
    ({"op": "forward_jvp", "dtype": "bf16", "shape": [1, 2, 1024, 64], "precision": "fast"},
     [FORWARD_JVP]),
    # from FORWARD_TMA_MIN_KEYS keys, tensor descriptors, chosen by the data's alignment:
    # opaque under CUDA graphs and in calls above GRAPH_POINTER_MAX_SCORES; smaller ones
    # are traced with pointers where the graph runs its launches from Python
    ({"op": "forward_jvp", "shape": [1, 2, 4096, 64], "precision": "fast"}, [FORWARD_JVP]),
    ({"op": "forward_jvp", "shape": [1, 2, 4096, 64], "precision": "fast", "cudagraphs": True},
     None),
    ({"op": "forward_jvp", "shape": LARGE_LONG_ROWS, "precision": "fast"}, None),
    # d = 72: padded to one column tile in a small call, opaque in a large one (see above)
    ({"op": "forward_jvp", "shape": [2, 4, 64, 72]}, [FORWARD_JVP]),
    ({"op": "forward_jvp", "shape": LARGE_D72}, None if CUT_IS_OPAQUE else [FORWARD_JVP]),
    ({"op": "backward"}, [["delta_ptr", "dq_ptr"], KEY_GRADS]),
    ({"op": "backward", "mask": "float", "mask_grad": True, "causal": True},
     [["delta_ptr", "dq_ptr", "dmask_ptr"], KEY_GRADS]),
    ({"op": "backward", "residual": True, "hkv": 2, "dtype": "bf16"},
     [["delta_ptr", "dq_ptr"], KEY_GRADS]),
    # d = 40: rows not 16-aligned, so the row-statistics kernel writes delta first
    ({"op": "backward", "shape": [2, 4, 64, 40], "device": "cpu"},
     [["delta_ptr"], ["dq_ptr"], KEY_GRADS]),
    # from BACKWARD_TMA_MIN_TOKENS the backward reads through descriptors: opaque under CUDA
    # graphs, traced with pointers otherwise, up to GRAPH_TMA_MIN_TOKENS; in bf16 it
    # carries, and the copy operator writes delta
    ({"op": "backward", "dtype": "bf16", "shape": [1, 2, 1024, 64], "cudagraphs": True}, None),
    ({"op": "backward", "shape": [1, 2, 1024, 64], "cudagraphs": True}, None),
    ({"op": "backward", "dtype": "bf16", "shape": [1, 2, 1024, 64]},
     Carried("backward_operands", [["dq_ptr"], KEY_GRADS])),
    ({"op": "backward", "dtype": "bf16", "shape": [1, 2, 1024, 64], "residual": True},
     Carried("backward_operands", [["dq_ptr"], KEY_GRADS])),
    # with the mask's gradient too: dS is carried as one more factor (2^-e_ds), so the
    # first-order backward carries; the dQ kernel writes the mask's gradient
    ({"op": "backward", "dtype": "bf16", "shape": [1, 2, 1024, 64], "mask": "float",
      "mask_grad": True}, Carried("backward_operands", [["dq_ptr", "dmask_ptr"], KEY_GRADS])),
    ({"op": "backward", "shape": [1, 2, 2048, 64]}, [["delta_ptr", "dq_ptr"], KEY_GRADS]),
    # from GRAPH_TMA_MIN_TOKENS, descriptors in calls above GRAPH_POINTER_MAX_SCORES only
    ({"op": "backward", "shape": [1, 2, 4096, 64]}, [["delta_ptr", "dq_ptr"], KEY_GRADS]),
    ({"op": "backward", "shape": LARGE_LONG_ROWS}, None),
    ({"op": "backward", "shape": [2, 4, 64, 72]}, [["delta_ptr"], ["dq_ptr"], KEY_GRADS]),
    # 1024 queries and keys: pointer kernels in the graph (GRAPH_TMA_MIN_TOKENS), so cut head
    # dims decide, as in the forward
    ({"op": "backward", "shape": LARGE_D72},
     None if CUT_IS_OPAQUE else [["delta_ptr"], ["dq_ptr"], KEY_GRADS]),
    ({"op": "backward_tangent"}, SECOND_ORDER),
    ({"op": "backward_tangent", "mask": "float", "mask_grad": True, "residual": True},
     [SECOND_ORDER[0], SECOND_ORDER[1] + ["dmask_ptr", "dtmask_ptr"], *SECOND_ORDER[2:]]),
    ({"op": "backward_tangent", "mask": "float", "mask_tangent": True, "mask_grad": True,
      "residual": True, "device": "cpu"},
     [SECOND_ORDER[0], SECOND_ORDER[1] + ["dmask_ptr", "dtmask_ptr"], *SECOND_ORDER[2:]]),
    ({"op": "backward", "mask": "bool"}, [["delta_ptr", "dq_ptr"], KEY_GRADS]),
    # bf16 "accurate" second order from carry_min_keys keys carries, its copies from their
    # own operator, in small and large calls alike
    ({"op": "backward_tangent", "dtype": "bf16", "shape": [1, 2, 1024, 64]},
     Carried("second_order_operands", SECOND_ORDER)),
    ({"op": "backward_tangent", "dtype": "bf16", "shape": LARGE_SECOND_ORDER},
     Carried("second_order_operands", SECOND_ORDER)),
    ({"op": "backward_tangent", "dtype": "bf16", "shape": LARGE_SECOND_ORDER,
      "precision": "fast"}, SECOND_ORDER),
    # a symbolic batch: the copies' shapes follow it
    ({"op": "backward_tangent", "dtype": "bf16", "shape": LARGE_SECOND_ORDER,
      "dynamic": "batch", "device": "cpu"}, Carried("second_order_operands", SECOND_ORDER)),
    ({"op": "backward_tangent", "dtype": "bf16", "shape": [1, 2, 1024, 64], "residual": True},
     Carried("second_order_operands", SECOND_ORDER)),
    ({"op": "backward_tangent", "dtype": "bf16", "shape": LARGE_SECOND_ORDER,
      "mask": "float", "mask_grad": True}, [SECOND_ORDER[0], SECOND_ORDER[1] +
                                             ["dmask_ptr", "dtmask_ptr"], *SECOND_ORDER[2:]]),
    # the second-order kernels keep d = 72 in one padded column tile: no cut, traced
    ({"op": "backward_tangent", "dtype": "bf16", "shape": [2, 4, 64, 72], "causal": True,
      "hkv": 2}, SECOND_ORDER),
]


@pytest.fixture(scope="module")
def traced() -> list[dict]:
    """Every case traced in one subprocess without TRITON_INTERPRET (about 25 s)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(TESTS / "traced_graphs.py"), json.dumps([c for c, _ in CASES])],
        capture_output=True, text=True, env=env, check=False, cwd=TESTS.parent, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("number", range(len(CASES)),
                         ids=[json.dumps(c, separators=(",", ":")) for c, _ in CASES])
def test_twin_launches_what_the_kernels_write(traced: list[dict], number: int) -> None:
    case, expected = CASES[number]
    graph = traced[number]
    assert graph["case"] == case
    assert graph["traced"], graph["error"]
    if expected is None:
        assert graph["opaque"] and graph["launches"] == 0, graph
        return
    assert not graph["opaque"], graph
    carried = isinstance(expected, Carried)
    assert graph["carried"] == ([expected.operator] if carried else []), graph
    assert graph["written"] == (expected.written if carried else expected)


def test_symbolic_sizes_stay_symbolic(traced: list[dict]) -> None:
    """A graph traced with the batch or the token count symbolic (PyTorch's automatic
    dynamic shapes, from the second size a compiled step meets) keeps it symbolic: its
    launches fix no size to a number, so that one graph serves the sizes after it (the
    launchers' guards only hold the thresholds where their launches change). The
    autotuners' length bucket (`length_bucket`) once fixed the token count: every new
    resolution compiled a graph of its own."""
    dynamic = [graph for graph, (case, _) in zip(traced, CASES, strict=True)
               if case.get("dynamic")]
    assert {graph["case"]["dynamic"] for graph in dynamic} == {"batch", "tokens"}
    for graph in dynamic:
        assert graph["traced"] and graph["fixed"] == [], graph


# --- on the GPU: compiled steps through the twins give eager's numbers ----------------------

COMPILED_CONFIGS = {
    "fp16-causal-gqa": {"dtype": "fp16", "causal": True, "hkv": 2},
    "bf16-bool-mask": {"dtype": "bf16", "mask": "bool"},
    "bf16-learnable-bias": {"dtype": "bf16", "mask": "bias"},
    "bf16-bias-parameter": {"dtype": "bf16", "mask": "parameter"},
    # autocast's way: an fp32 bias beside bf16 queries
    "bf16-fp32-bias-parameter": {"dtype": "bf16", "mask": "parameter", "mask_dtype": "fp32"},
    "fp16-key-padding": {"dtype": "fp16", "mask": "key_padding"},
    # head dims cut into two column tiles in eager mode, padded to one in the compiled graph
    "bf16-d72": {"dtype": "bf16", "d": 72},
    "fp16-d40-causal": {"dtype": "fp16", "d": 40, "causal": True},
    "fp32": {"dtype": "fp32"},
    "bf16-fast": {"dtype": "bf16", "precision": "fast"},
    # 1024 tokens: carried in the graph (copies from their own operator); the backward's
    # pointer kernels traced where eager reads through descriptors; under CUDA graphs the
    # opaque backward
    "bf16-1024": {"dtype": "bf16", "n": 1024},
    "bf16-1024-cuda-graphs": {"dtype": "bf16", "n": 1024, "mode": "reduce-overhead"},
    # 2**28 scores, carried in the graph as in eager mode
    "bf16-1024-large": {"dtype": "bf16", "n": 1024, "b": 16, "h": 16},
    # 4096 tokens, where eager calls read through descriptors: the pointer kernels traced
    # in a small call, the opaque operators under CUDA graphs
    "bf16-4096": {"dtype": "bf16", "n": 4096, "b": 1},
    "bf16-4096-cuda-graphs": {"dtype": "bf16", "n": 4096, "b": 1, "mode": "reduce-overhead"},
}
DTYPE_OF = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@pytest.mark.gpu
@pytest.mark.parametrize("step", ["meanflow", "second_order"])
@pytest.mark.parametrize("config", list(COMPILED_CONFIGS))
def test_compiled_step_through_the_twins_matches_eager(config: str, step: str) -> None:
    """A MeanFlow step (the tangent under a stop-gradient) and a second-order step compiled
    with Inductor, whose graphs launch the kernels themselves at these shapes, against the
    same steps in eager mode: every gradient within the dtype's rounding (Inductor times the
    tiles itself and may sum in another order), for bool masks, biases with a tangent, bias
    parameters whose gradient the kernels compute, causal GQA, head dims padded in the graph
    (cut in two in eager mode), fp32, the fast precision, and 1024 tokens (carried, the
    copies from their own operators and the kernels traced; the backward's pointer kernels,
    or its opaque operator under CUDA graphs; at 2**28 scores as well), and 4096 tokens
    (pointer kernels where eager mode reads through descriptors)."""
    import torch

    from jvp_attention import attention, precision

    options = COMPILED_CONFIGS[config]
    dtype = getattr(torch, DTYPE_OF[options["dtype"]])
    torch._dynamo.reset()
    torch.manual_seed(0)
    b, h = options.get("b", 4), options.get("h", 4)
    n, d = options.get("n", 256), options.get("d", 64)
    hkv = options.get("hkv", h)

    def tensor(heads):
        return torch.randn(b, heads, n, d, device="cuda", dtype=dtype, requires_grad=True)

    q, k, v = tensor(h), tensor(hkv), tensor(hkv)
    primals, mask, wanted = [q, k, v], None, []
    if options.get("mask") == "bool":
        mask = torch.rand(b, 1, n, n, device="cuda") > 0.2
    elif options.get("mask") == "key_padding":  # (B, 1, 1, Nk), as a padded batch masks keys
        mask = torch.arange(n, device="cuda") < torch.randint(n // 2, n + 1, (b, 1, 1, 1),
                                                              device="cuda")
    elif options.get("mask") == "bias":  # a primal of the jvp: its tangent enters the kernels
        primals.append(torch.randn(1, h, n, n, device="cuda", dtype=dtype, requires_grad=True))
    elif options.get("mask") == "parameter":  # outside the jvp: only its gradient is wanted
        mask_dtype = getattr(torch, DTYPE_OF[options.get("mask_dtype", options["dtype"])])
        mask = torch.randn(1, h, n, n, device="cuda", dtype=mask_dtype, requires_grad=True)
        wanted.append(mask)
    tangents = [torch.randn_like(x) for x in primals]

    def attend(q, k, v, bias=None):
        return attention(q, k, v, attn_mask=bias if bias is not None else mask,
                         is_causal=options.get("causal", False), enable_gqa=hkv != h)

    def grads(*primals):
        out, t_out = torch.func.jvp(attend, tuple(primals), tuple(tangents))
        t_out = t_out.detach() if step == "meanflow" else t_out
        loss = (out.float() * t_out.float()).mean() + out.float().square().mean()
        return torch.autograd.grad(loss, (*primals, *wanted))

    with precision(options.get("precision", "accurate")):
        compiled = torch.compile(grads, mode=options.get("mode"))(*primals)
        eager = grads(*primals)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for number, (ours, expected) in enumerate(zip(compiled, eager, strict=True)):
        scale = expected.float().abs().max().clamp_min(1e-30)
        error = ((ours.float() - expected.float()).abs().max() / scale).item()
        assert error <= tolerance, (config, step, number, error)
