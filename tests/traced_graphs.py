"""Trace the operators' traced twins (chapter 7) as AOTAutograd does under torch.compile, on a
machine without a GPU, and print what each graph launches as JSON lines.

Run as a script without TRITON_INTERPRET (the twins are not registered under the
interpreter); `tests/library/test_traced.py` does. Fake CUDA tensors stand in for real ones,
and Triton is given a Hopper target, so Inductor's analysis of which kernel arguments a
launch writes (from the kernels' Triton IR) runs as it would on an H100/H200. Nothing runs
on a device: the graphs are only traced.
"""

import contextlib
import json
import re
import sys

import torch
import torch._inductor.config
import triton
from triton.backends.compiler import GPUTarget


class HopperTarget:
    """A stand-in for Triton's active driver that only names the target to compile for."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_benchmarker(self):  # autotuners ask for it when made; nothing is timed here
        return None

    def __getattr__(self, name: str):
        raise AttributeError(name)


triton.runtime.driver.set_active(HopperTarget())

from torch._functorch.aot_autograd import aot_function  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.symbolic_shapes import (  # noqa: E402
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)

import jvp_attention.autograd  # noqa: E402,F401  (registers the twins)
import jvp_attention.backward as backward  # noqa: E402
import jvp_attention.forward as forward  # noqa: E402

# No CUDA here: the device guard around the launches is the one thing that needs it.
forward.on_device = backward.on_device = lambda t: contextlib.nullcontext()

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# The operators that make the bf16 carry's copies inside a traced graph (chapter 2's
# `graph_carry`); any other operator of ours in a graph is a whole call kept opaque.
CARRY_OPERATORS = ("value_operands", "backward_operands", "second_order_operands")


def operands(case: dict, mode: FakeTensorMode) -> dict:
    """The fake tensors of one case, on CUDA unless it names another device: (B, H, N, d) q,
    k, v, their tangents, the saved outputs and cotangents the backward takes, and the mask
    if any."""
    b, h, n, d = case.get("shape", (2, 4, 64, 64))
    hkv, dtype = case.get("hkv", h), DTYPES[case.get("dtype", "fp16")]
    device = case.get("device", "cuda")
    dynamic = case.get("dynamic")  # "batch" or "tokens": that size is a symbol (on the CPU)

    def make(heads, width=d, dt=dtype):
        if dynamic is None:
            with mode:
                return torch.empty(b, heads, n, width, device=device, dtype=dt)
        sizes = [DimDynamic.STATIC] * 4
        sizes[0 if dynamic == "batch" else 2] = DimDynamic.DYNAMIC
        return mode.from_tensor(torch.empty(b, heads, n, width, dtype=dt),
                                symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    t = {name: make(h) for name in ("q", "tq", "out", "tangent_out", "grad_out", "dto")}
    t.update({name: make(hkv) for name in ("k", "v", "tk", "tv")})
    residual = make(h, dt=torch.float32) if case.get("residual") else None
    with mode:
        t["lse"] = torch.empty(b, h, n, device=device, dtype=torch.float32)
        t["mu"] = torch.empty_like(t["lse"])
        t["none"] = torch.empty(0, device=device, dtype=dtype)
        t["residual"] = t["none"] if residual is None else residual
        mask = case.get("mask")
        t["mask"] = (None if mask is None else torch.empty(
            b, h, n, n, device=device, dtype=torch.bool if mask == "bool" else torch.float32))
        t["mask_tangent"] = torch.empty_like(t["mask"]) if case.get("mask_tangent") else None
    return t


def call(case: dict, t: dict):
    """The twin's call with the case's operands (the operators' argument lists, chapter 7)."""
    ops, op = torch.ops.jvp_attention, case["op"]
    causal, scale, precision = case.get("causal", False), 0.125, case.get("precision",
                                                                         "accurate")
    residual, mask_grad = bool(case.get("residual")), bool(case.get("mask_grad"))
    q, k, v, tq, tk, tv = (t[n] for n in ("q", "k", "v", "tq", "tk", "tv"))
    if op == "forward":
        return ops.forward_traced(q, k, v, t["mask"], causal, scale, residual, precision)
    if op == "forward_jvp":
        return ops.forward_jvp_traced(q, k, v, tq, tk, tv, t["mask"], t["mask_tangent"],
                                      causal, scale, residual, precision)
    if op == "backward":
        return ops.backward_traced(q, k, v, t["out"], t["lse"], t["residual"], t["grad_out"],
                                   t["mask"], causal, scale, mask_grad, precision)
    return ops.backward_tangent_traced(
        q, k, v, tq, tk, tv, t["out"], t["lse"], t["tangent_out"], t["mu"], t["residual"],
        t["residual"], t["grad_out"], t["dto"], t["mask"], t["mask_tangent"], causal, scale,
        mask_grad, precision)


def trace(case: dict) -> dict:
    """The forward graph AOTAutograd traces for one case: the kernels it launches, the
    arguments each launch was found to write, the opaque operators it calls for whole
    calls, those it calls for the carry's copies, and the symbolic sizes it fixed."""
    mode = FakeTensorMode(shape_env=ShapeEnv() if case.get("dynamic") else None)
    graphs = []

    def keep(graph, _inputs):
        graphs.append(graph.code)
        return graph

    t = operands(case, mode)
    names = [name for name, x in t.items() if x is not None]  # the graph's inputs

    def traced(*inputs):
        return call(case, {**t, **dict(zip(names, inputs, strict=True))})

    error = None
    # Inductor sets triton.cudagraphs while it compiles for mode="reduce-overhead"
    replayed = torch._inductor.config.patch({"triton.cudagraphs": bool(case.get("cudagraphs"))})
    try:
        with mode, replayed:
            aot_function(traced, fw_compiler=keep)(*(t[name] for name in names))
    except Exception as e:  # noqa: BLE001 - reported; running the traced graph needs CUDA
        error = f"{type(e).__name__}: {e}"[:500]
    code = graphs[0] if graphs else ""
    operators = re.findall(r"torch\.ops\.jvp_attention\.(\w+)\.default", code)
    return {"case": case, "error": None if graphs else error,
            "launches": len(re.findall(r"triton_kernel_wrapper_functional\(", code)),
            "written": [re.findall(r"'(\w+)'", m) for m in
                        re.findall(r"tensors_to_clone = \[([^\]]*)\]", code)],
            "opaque": [name for name in operators if name not in CARRY_OPERATORS],
            "carried": [name for name in operators if name in CARRY_OPERATORS],
            "fixed": fixed_sizes(mode.shape_env), "traced": bool(graphs)}


def fixed_sizes(shape_env: ShapeEnv | None) -> list[str]:
    """The symbolic sizes that tracing fixed to a number (a guard that the size equals it:
    the graph would serve that size only, and every other would compile one of its own)."""
    if shape_env is None:
        return []
    return sorted(f"{symbol} = {value}" for symbol, value in shape_env.replacements.items()
                  if value.is_number)


if __name__ == "__main__":
    for case in json.loads(sys.argv[1]):
        print(json.dumps(trace(case)), flush=True)
