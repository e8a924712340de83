# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 13: zero tangents, a hidden share of every JVP step
#
# Chapters 8 and 9 found DiT training steps bound by the host at 256 and 1024 tokens: the
# GPU waits for Python. Chapter 8 measured the attention call's share of that work against
# a "floor" in its place, `v * 1`, meant to do as little as an op can. This chapter finds that the floor
# itself was not light, and why: a cost inside PyTorch's forward-mode AD that every model
# pays at almost every layer, and that has nothing to do with attention. Then it removes
# most of it, and with it a cost on the device that the same zero tangents bring: every
# linear layer's JVP multiplies by a tensor of zeros.
#
# ## Where zero tangents come from
#
# Under `torch.func.jvp` (or `torch.autograd.forward_ad`) each tensor may carry a tangent,
# and each op computes its output's tangent by its forward formula. For a product,
#
# $$\dot{(a\,b)} = \dot a\, b + a\, \dot b .$$
#
# A MeanFlow or consistency-model step gives tangents to the model's *inputs* only. The
# parameters, buffers and Python numbers that the activations meet have none: in
# `x * w`, `x @ W.T + bias`, `x * (1 + scale)` or `TIME_SCALE * t`, one operand has no
# tangent. PyTorch then stands in a *zero tensor* for the missing one (a tensor with the
# `ZeroTensor` dispatch key and no storage, so that a zero tangent costs no memory) and
# runs the formula as written. Its kernels for zero tensors know that $0 \cdot b = 0$ and
# $a + 0 = a$, but to return a result of the right shape and dtype, the ones for `add`,
# `sub`, `mul` and `div` ask the op itself: they run it once more on the `meta` device,
# where tensors have shapes but no data.
#
# That would cost a few microseconds, were the meta kernels of these ops PyTorch's C++
# ones. They are not: `torch/_meta_registrations.py` registers Python reference
# implementations (`torch._refs`, written for tracing with symbolic shapes) as the meta
# kernels of these ops, over the C++ ones. The dispatcher's table says so:

# %%
import re
import sys
import time
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
import torch.autograd.forward_ad as fwad

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def meta_kernel(op: str) -> str:
    """Where the `Meta` kernel in force for `op` was registered."""
    for line in torch._C._dispatch_dump(op).splitlines():
        if line.startswith("Meta: "):
            return line.split(" :: ")[0].removeprefix("Meta: registered at ").split("/torch/")[-1]
    return "none"


print(f"torch {torch.__version__}, device {DEVICE}")
for op in ("aten::add.Tensor", "aten::sub.Tensor", "aten::mul.Tensor", "aten::div.Tensor"):
    print(f"{op:18} Meta kernel: {meta_kernel(op)}")

# %% [markdown]
# ## What it costs
#
# The host time of common ops under forward AD, on tensors small enough that the work is
# all host work: each op applied to a tensor with a tangent (`x`) and either another one
# with a tangent (`y`) or a parameter, a bias or a number without one. The time is the
# difference between chains of 9 and 1 ops inside one `dual_level`, per op, best of 5
# repeats (the chain keeps the level's own cost out).

# %%
torch.manual_seed(0)
WIDTH = 16
x0, tx = torch.randn(4, WIDTH, device=DEVICE), torch.randn(4, WIDTH, device=DEVICE)
y0, ty = torch.randn(4, WIDTH, device=DEVICE), torch.randn(4, WIDTH, device=DEVICE)
weight = torch.randn(WIDTH, WIDTH, device=DEVICE, requires_grad=True)
bias = torch.randn(WIDTH, device=DEVICE, requires_grad=True)
linear = torch.nn.Linear(WIDTH, WIDTH, device=DEVICE)  # its weight and bias are parameters
F = torch.nn.functional

# op name -> (op of the running dual x and the dual y, whether an operand has no tangent)
OPS = {
    "x + y": (lambda x, y: x + y, False),
    "x * y": (lambda x, y: x * y, False),
    "x @ weight": (lambda x, y: x @ weight, True),
    "x + bias": (lambda x, y: x + bias, True),
    "x * bias": (lambda x, y: x * bias, True),
    "x + 1.0": (lambda x, y: x + 1.0, True),
    "x * 2.0": (lambda x, y: x * 2.0, True),
    "x / 2.0": (lambda x, y: x / 2.0, True),
    "F.linear(x, weight)": (lambda x, y: F.linear(x, weight), True),
    "F.linear(x, weight, bias)": (lambda x, y: F.linear(x, weight, bias), True),
    "nn.Linear(x)": (lambda x, y: linear(x), True),
    "F.layer_norm(x)": (lambda x, y: F.layer_norm(x, (WIDTH,)), False),
    "F.layer_norm(x, bias, bias)": (lambda x, y: F.layer_norm(x, (WIDTH,), bias, bias), True),
    "F.rms_norm(x, bias)": (lambda x, y: F.rms_norm(x, (WIDTH,), bias), True),
}


def chain(op, length: int):
    """`length` applications of `op` to a dual, in one dual level; the last output's tangent."""
    with fwad.dual_level():
        x, y = fwad.make_dual(x0, tx), fwad.make_dual(y0, ty)
        for _ in range(length):
            x = op(x, y)
        return fwad.unpack_dual(x).tangent


def best_seconds(fn, calls: int, repeats: int = 5) -> float:
    """Seconds per call of `fn`: the best of `repeats` groups of `calls` calls, after one
    call to warm up, with the GPU's queue drained at both ends of each group."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def host_us_per_op(op) -> float:
    """Microseconds per op: chains of 9 against chains of 1."""
    long, short = (best_seconds(lambda n=n: chain(op, n), calls=40) for n in (9, 1))
    return (long - short) / 8 * 1e6


def measure_ops() -> dict[str, float]:
    return {name: host_us_per_op(op) for name, (op, _) in OPS.items()}


pytorch_us = measure_ops()
for name, us in pytorch_us.items():
    print(f"{name:26} {us:7.1f} us{'   (an operand without a tangent)' if OPS[name][1] else ''}")

# %% [markdown]
# Ops whose operands both carry tangents take a few to a few tens of microseconds, as any
# PyTorch op with its tangent does. An elementwise op with an operand that has none takes
# one to two orders of magnitude longer: most of its time goes to the Python meta kernels,
# a few hundred Python calls per zero tangent met (a product's formula meets the zero
# tangent twice: once in the product, once in the sum). A Linear layer with a bias pays it
# for the bias alone; the weight's zero tangent goes through a matrix product, which costs
# the host little and the device a whole product ("Zero factors in products" below). A
# norm with learned weights (LayerNorm's affine, RMSNorm's scale, as in the query-key norms
# of recent DiTs) meets several.
#
# A DiT block under `torch.func.jvp` has five biased Linear layers (the attention's
# projections in and out, the MLP's two and the adaptive norm's modulation) and two
# `x * (1 + scale)` modulations, each meeting a zero tangent; the embeddings add more (a
# buffer of positions, a number scaling the time). "What it saves" below counts them in a
# whole step.
#
# ## The shortcut
#
# What the zero-tensor kernels compute from the meta tensor is only its shape, dtype and
# device, and for ordinary tensors all three follow from the operands by PyTorch's public
# rules: the shape by broadcasting (as `torch.broadcast_shapes` does, without its checks
# for symbolic sizes, which ordinary tensors do not have), the dtype by type promotion
# (`torch.result_type`), the device as the kernels choose it (the first operand's, unless
# that one is on the CPU, as a number is). The values are fixed by arithmetic, as PyTorch's kernels answer them:
#
# | op | $a$ zero | $b$ zero | both zero |
# |---|---|---|---|
# | $a \cdot b$ | 0 | 0 | 0 |
# | $a / b$ | 0 | $+\infty$ | NaN |
# | $a + \alpha b$, $a - \alpha b$ | $\pm\alpha b$ | $a$ | 0 |
#
# where a sum returns a new tensor: the other operand broadcast to the result's shape and
# cast to its dtype. So the lean kernels below read shape, dtype and device off the
# operands and return what PyTorch's would. They keep PyTorch's own route (the op on the
# meta device) for anything else: a tensor subclass, such as the fake tensors that
# `torch.compile` traces with, or a sparse one; integer or boolean results, whose
# promotion rules (true division, an integer `alpha`) are the op's business; and a number
# that could promote the tensor beside it, which PyTorch's kernels, unlike the op, promote
# as a 0-dimensional tensor of its widest type (a float32 scalar tensor times `2.5` gives
# float64 there).

# %% tags=["export"]
"""Chapter 13: forward AD's zero tangents without the meta round trip or products of zeros.
Under torch.func.jvp, PyTorch's ZeroTensor kernels of add, sub, mul and div find their
result's shape and dtype by running the op on the meta device, where these ops have Python
kernels, and ops without such a kernel (mm, bmm, convolution, sum) run on zeros filled in
memory; `lean_zero_tangents` registers kernels that read shape and dtype off the operands
and return the same values, a product with a zero factor as a zero tensor.

`notebooks/13_zero_tangents.py` measures the cost and checks the kernels against PyTorch's.
"""

import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from numbers import Number

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

# The ops whose ZeroTensor kernels run the op again on the meta device to shape their result.
ARITHMETIC_OPS = ("add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor")

# A Python number stands for a scalar operand (a kernel receives one for `x * 2.0`).
Operand = torch.Tensor | Number

# Tensors whose shape and dtype are what they say: not a subclass with rules of its own
# (a parameter is a plain tensor that autograd treats as a leaf).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# The tensors torch.compile traces a step with: their shapes, dtypes and devices are those of
# the plain tensors they stand for, and what a kernel returns for them becomes the graph.
TRACED_TENSORS = (FakeTensor, FunctionalTensor)


# %% tags=["export"]
def is_zero(x: Operand) -> bool:
    """Whether `x` is one of forward AD's zero tangents (a number never is)."""
    return isinstance(x, torch.Tensor) and x._is_zerotensor()


def out_device(a: Operand, b: Operand) -> torch.device:
    """The device of a binary op's result with a zero operand, as PyTorch chooses it: `a`'s,
    unless `a` is on the CPU (or a number), then `b`'s."""
    if not isinstance(b, torch.Tensor):
        return a.device
    if not isinstance(a, torch.Tensor) or a.device.type == "cpu":
        return b.device
    return a.device


def read_off(a: Operand, b: Operand) -> tuple[torch.Size, torch.dtype] | None:
    """The broadcast shape and promoted dtype of a binary op on `a` and `b`, read off the
    operands; None where only the op itself knows: a tensor subclass (a fake tensor, say)
    or layout (sparse), an integer or boolean result, or a number that could promote the
    tensor beside it (PyTorch's kernels promote it as a 0-dimensional tensor of its widest
    type, unlike the op itself)."""
    if (type(a) is type(b) is torch.Tensor and a.dtype == b.dtype
            and (a.dtype.is_floating_point or a.dtype.is_complex)
            and a.layout == b.layout == torch.strided):  # the common case, asked first
        return broadcast(a.shape, b.shape), a.dtype
    tensors = [x for x in (a, b) if isinstance(x, torch.Tensor)]
    if any(type(x) not in PLAIN_TENSORS or x.layout != torch.strided for x in tensors):
        return None
    if len(tensors) == 1:  # beside a number, a float tensor keeps its dtype, unless the
        tensor = tensors[0]  # number is complex, or the tensor 0-dimensional
        keeps = tensor.dtype.is_complex or (tensor.dtype.is_floating_point and not any(
            isinstance(x, complex) for x in (a, b)))
        return (tensor.shape, tensor.dtype) if keeps and tensor.dim() > 0 else None
    dtype = promoted(a, b)
    if not (dtype.is_floating_point or dtype.is_complex):
        return None
    return broadcast(a.shape, b.shape), dtype


def promoted(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """`torch.result_type(a, b)`, from what it reads: each tensor's dtype and whether it is
    0-dimensional (a number arrives as a number, not as a tensor). Asked of a zero tensor
    inside a ZeroTensor kernel, `torch.result_type` would fill it with zeros in memory first."""
    return promoted_dtypes((a.dtype, a.dim() == 0), (b.dtype, b.dim() == 0))


@functools.cache
def promoted_dtypes(first: tuple[torch.dtype, bool], second: tuple[torch.dtype, bool]
                    ) -> torch.dtype:
    """`torch.result_type` of two empty meta tensors of these dtypes and ranks (0 or 1),
    once per combination."""
    return torch.result_type(*(torch.empty(() if scalar else (0,), dtype=dtype, device="meta")
                               for dtype, scalar in (first, second)))


def broadcast(first: torch.Size, second: torch.Size) -> torch.Size:
    """The shape two tensors broadcast to (`torch.broadcast_shapes` checks symbolic sizes
    too, which plain tensors do not have, at ten times the cost)."""
    if first == second:
        return first
    rank = max(len(first), len(second))
    first, second = ((1,) * (rank - len(s)) + tuple(s) for s in (first, second))
    shape = []
    for dim, (m, n) in enumerate(zip(first, second, strict=True)):
        if m != n and 1 not in (m, n):
            raise RuntimeError(f"The size of tensor a ({m}) must match the size of tensor b "
                               f"({n}) at non-singleton dimension {dim}")
        shape.append(n if m == 1 else m)
    return torch.Size(shape)


def result_of(op: Callable, a: Operand, b: Operand, **keywords) -> tuple[torch.Size, torch.dtype]:
    """The shape and dtype of `op(a, b, **keywords)`: read off the operands, or else from
    `op` run on the meta device, as PyTorch's own kernels find them."""
    known = read_off(a, b)
    if known is not None:
        return known
    meta = op(*(on_meta(x) for x in (a, b)), **keywords)
    return meta.shape, meta.dtype


def on_meta(x: Operand) -> torch.Tensor:
    """`x` on the meta device, a number as PyTorch's kernels move it there: a 0-dimensional
    tensor no longer marked as a number."""
    return (x if isinstance(x, torch.Tensor) else as_tensor(x)).to("meta")


def as_tensor(x: Number) -> torch.Tensor:
    """A number as PyTorch's ops hold one: a 0-dimensional CPU tensor of its widest type."""
    widest = {bool: torch.bool, int: torch.int64, float: torch.float64}
    return torch.tensor(x, dtype=widest.get(type(x), torch.complex128))


def like_result(x: Operand, shape: torch.Size, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """A new tensor holding `x` broadcast to `shape`, in `dtype`, on `device`."""
    x = x if isinstance(x, torch.Tensor) else as_tensor(x)
    if x.shape == shape and x.dtype == dtype and x.device == device:
        return torch.ops.aten._to_copy.default(x)  # the same copy, a third of the Python
    return torch.ops.aten._to_copy.default(x.expand(shape), dtype=dtype, device=device)


# %% tags=["export"]
def zero_mul(a: Operand, b: Operand) -> torch.Tensor:
    """`a * b` with a zero operand: zeros."""
    shape, dtype = result_of(torch.ops.aten.mul.Tensor, a, b)
    return torch._efficientzerotensor(shape, dtype=dtype, device=out_device(a, b))


def zero_div(a: Operand, b: Operand) -> torch.Tensor:
    """`a / b` with a zero operand: zeros for 0 / b, infinity for a / 0, NaN for 0 / 0."""
    shape, dtype = result_of(torch.ops.aten.div.Tensor, a, b)
    device = out_device(a, b)
    if not is_zero(b):
        return torch._efficientzerotensor(shape, dtype=dtype, device=device)
    return torch.full(shape, float("nan") if is_zero(a) else float("inf"), dtype=dtype,
                      device=device)


def zero_add(a: Operand, b: Operand, *, alpha: Number = 1) -> torch.Tensor:
    """`a + alpha * b` with a zero operand: the other one's share, broadcast and cast to the
    result's dtype in a new tensor; zeros if both are zero."""
    shape, dtype = result_of(torch.ops.aten.add.Tensor, a, b, alpha=alpha)
    device = out_device(a, b)
    if is_zero(a) and is_zero(b):
        return torch._efficientzerotensor(shape, dtype=dtype, device=device)
    if is_zero(a):
        scaled = like_result(b, shape, dtype, device)
        return scaled if alpha == 1 else scaled.mul(alpha)
    return like_result(a, shape, dtype, device)


def zero_sub(a: Operand, b: Operand, *, alpha: Number = 1) -> torch.Tensor:
    """`a - alpha * b` with a zero operand."""
    return zero_add(a, b, alpha=-alpha)


ARITHMETIC_KERNELS = dict(zip(ARITHMETIC_OPS, (zero_add, zero_sub, zero_mul, zero_div),
                              strict=True))

# %% [markdown]
# ## Zero factors in products
#
# These four ops have zero-tensor kernels of their own. Most ops have none, and for them
# PyTorch's *fallback* for the `ZeroTensor` key (`aten/src/ATen/ZeroTensorFallback.cpp`)
# fills each zero tensor with zeros in memory and runs the op on them. For an elementwise op
# on a small tensor that costs little. For a product it costs the product. The tangent of
# a linear layer,
#
# $$\frac{d}{d\epsilon}\big(x W^\top + b\big) = \dot x\, W^\top + x\, \dot W^\top + \dot b ,$$
#
# has $\dot W = 0$ and $\dot b = 0$ when the weights carry no tangent, and PyTorch's formula
# for the product (`addmm`, or `mm` without a bias) runs $x\,\dot W^\top$ all the same: a
# weight-sized tensor of zeros, then a matrix product as large as the layer's forward, to
# add nothing. The same happens in a batched product (`bmm`) with an operand that has no
# tangent, in a convolution with a learned kernel (a DiT's patch embedding), and in the
# sums that a norm's formula takes of its weight's tangent.
#
# One `torch.func.jvp` of a linear layer, timed, with the tensors of zeros it fills counted
# by the profiler: DiT-B/2's first MLP layer (width 768 to 3072) on a batch of 32 images
# of 256 tokens in bf16 on a GPU, on 1024 tokens in float32 on a CPU. Beside it, the time
# of the two products the JVP needs, the layer's own and its tangent's:

# %%
from torch.profiler import ProfilerActivity, profile  # noqa: E402

MLP_IN, MLP_OUT = 768, 3072
TOKENS, MLP_DTYPE = (32 * 256, torch.bfloat16) if DEVICE == "cuda" else (1024, torch.float32)
mlp = torch.nn.Linear(MLP_IN, MLP_OUT, device=DEVICE, dtype=MLP_DTYPE)
tokens = torch.randn(TOKENS, MLP_IN, device=DEVICE, dtype=MLP_DTYPE)
token_tangents = torch.randn_like(tokens)


def linear_jvp() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.func.jvp(mlp, (tokens,), (token_tangents,))


def zeros_filled(fn) -> int:
    """Tensors of zeros made in memory during one call of `fn` (the fallback's)."""
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        fn()
    return sum(event.name == "aten::zeros" for event in trace.events())


def kernel_ms(fn, calls: int = 10) -> float | None:
    """The GPU's time in `fn`'s kernels and copies per call, from the profiler (a call may
    take longer on the host than on the GPU, and then its wall time is the host's); None on
    a CPU, where the wall time is the work's."""
    if DEVICE != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    on_gpu = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in on_gpu) / calls / 1e3


def timed(fn) -> tuple[float, float | None]:
    """Wall time per call (ms, best of five groups) and the GPU's time in its kernels."""
    return best_seconds(fn, calls=5) * 1e3, kernel_ms(fn)


def needed_products() -> tuple[torch.Tensor, torch.Tensor]:
    """The two products the tangent needs: x W^T + b and its tangent's."""
    weight_t = mlp.weight.t()
    with torch.no_grad():
        return torch.addmm(mlp.bias, tokens, weight_t), token_tangents @ weight_t


def report_linear(label: str, times: tuple[float, float | None], note: str = "") -> None:
    wall, gpu = times
    on_gpu = "" if gpu is None else f", {gpu:.3f} ms on the GPU"
    print(f"{label:26} {wall:7.2f} ms per call{on_gpu}{note}")


needed = timed(needed_products)
pytorch_linear = timed(linear_jvp), zeros_filled(linear_jvp)
print(f"torch.func.jvp of Linear({MLP_IN}, {MLP_OUT}) on {TOKENS} tokens ({DEVICE}, "
      f"{str(MLP_DTYPE).removeprefix('torch.')})")
report_linear("PyTorch's zero tangents", pytorch_linear[0],
              f"; {pytorch_linear[1]} tensors of zeros filled")
report_linear("the two products needed", needed)

# %% [markdown]
# The difference is the third product, on zeros filled for it (`addmm`'s formula calls
# `mm` for each factor's tangent), and the sums around it. On a GPU the profiler's time in
# kernels shows it best: a call this size spends longer on the host than on the GPU. The lean kernels answer a product with a zero factor
# with a zero tensor of the product's shape, computing nothing:
#
# | op | a zero operand gives |
# |---|---|
# | `mm`, `bmm` | a zero tensor $(\dots, n, p)$ |
# | `convolution` | the bias broadcast over the output (a zero tensor without a bias); the convolution without its bias where the bias alone is zero |
# | `sum` | a zero tensor of the reduced shape |
#
# The shape comes from the operands (a matrix product's) or from the op on empty meta
# tensors (a convolution's, a sum's: a few tens of microseconds of Python against a
# kernel). Anything PyTorch must judge itself, such as operands of different dtypes or
# devices, mismatched shapes, integer products or tensor subclasses, takes PyTorch's route:
# zeros in memory, then the op, which raises what it raises. The exceptions are the fake
# and functional tensors that `torch.compile` traces a step with, which stand for plain
# ones: for them the zero tensor goes into the compiled graph in place of the product
# ("Under torch.compile" below).

# %% tags=["export"]
def plain(*tensors: torch.Tensor) -> bool:
    """Whether these are plain strided tensors (or torch.compile's stand-ins for them) of
    one floating dtype, on one device."""
    first = tensors[0]
    return (first.dtype.is_floating_point or first.dtype.is_complex) and all(
        stands_for_plain(x) and x.dtype == first.dtype and x.device == first.device
        for x in tensors)


def stands_for_plain(x: torch.Tensor) -> bool:
    """A plain strided tensor, or a traced one standing for it."""
    return type(x) in PLAIN_TENSORS + TRACED_TENSORS and x.layout == torch.strided


def meta_like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor on the meta device with `x`'s shape, strides and dtype (made, not
    moved: moving a zero tensor would dispatch on it)."""
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def zeros_in_memory(op: Callable, *arguments: object, **keywords: object) -> torch.Tensor:
    """`op` with each zero tensor among `arguments` filled with zeros in memory: PyTorch's
    own route for an op without a zero-tensor kernel."""
    filled = [torch.zeros(x.shape, dtype=x.dtype, device=x.device) if is_zero(x) else x
              for x in arguments]
    return op(*filled, **keywords)


def matrix_product(op: Callable, a: torch.Tensor, b: torch.Tensor, rank: int) -> torch.Tensor:
    """`op(a, b)`, a product of (..., n, m) and (..., m, p) matrices of rank `rank`, with a
    zero operand: a zero tensor (..., n, p)."""
    if not (plain(a, b) and a.dim() == b.dim() == rank and a.shape[:-2] == b.shape[:-2]
            and a.shape[-1] == b.shape[-2]):
        return zeros_in_memory(op, a, b)
    return torch._efficientzerotensor((*a.shape[:-1], b.shape[-1]), dtype=a.dtype,
                                      device=a.device)


def zero_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` of matrices with a zero operand: zeros."""
    return matrix_product(torch.ops.aten.mm.default, a, b, rank=2)


def zero_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` of batches of matrices with a zero operand: zeros."""
    return matrix_product(torch.ops.aten.bmm.default, a, b, rank=3)


def zero_convolution(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     *geometry: object) -> torch.Tensor:
    """A convolution with a zero operand. Its input or weight zero: the bias broadcast over
    the output, or zeros without one (or with a zero one). Its bias alone zero: the
    convolution without a bias. `geometry` is the op's stride, padding, dilation,
    transposed, output padding and groups."""
    convolution = torch.ops.aten.convolution.default
    if not plain(*(x for x in (input, weight, bias) if x is not None)):
        return zeros_in_memory(convolution, input, weight, bias, *geometry)
    if not (is_zero(input) or is_zero(weight)):
        return convolution(input, weight, None, *geometry)
    out = convolution(meta_like(input), meta_like(weight), None, *geometry)
    if bias is None or is_zero(bias):
        return torch._efficientzerotensor(out.shape, dtype=out.dtype, device=input.device)
    per_channel = bias.view(-1, *(1,) * (out.dim() - 2))
    return like_result(per_channel, out.shape, out.dtype, input.device)


def zero_sum(x: torch.Tensor, dim: Sequence[int] | None = None, keepdim: bool = False, *,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """A sum of a zero tensor over `dim`: zeros of the reduced shape."""
    sum_over = torch.ops.aten.sum.dim_IntList
    if not stands_for_plain(x):
        return zeros_in_memory(sum_over, x, dim, keepdim, dtype=dtype)
    out = sum_over(meta_like(x), dim, keepdim, dtype=dtype)
    return torch._efficientzerotensor(out.shape, dtype=out.dtype, device=x.device)


def zero_sum_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sum of all of a zero tensor: a 0-dimensional zero."""
    return zero_sum(x, None, False, dtype=dtype)


# Keyed as torch.library names them: an op's default overload by the op's name alone.
PRODUCT_KERNELS = {"mm": zero_mm, "bmm": zero_bmm, "convolution": zero_convolution,
                   "sum.dim_IntList": zero_sum, "sum": zero_sum_all}
LEAN_KERNELS = ARITHMETIC_KERNELS | PRODUCT_KERNELS

# %% [markdown]
# ## Turning them on
#
# `torch.library` registers a Python function as an op's kernel for one dispatch key,
# here `ZeroTensor`, over PyTorch's C++ kernel or fallback, and removing the registration
# brings PyTorch's back. `lean_zero_tangents(True)` registers all of the above for the
# whole process;
# as a context manager it restores the previous state on leaving. Only zero tangents take
# the new kernels: every other tensor dispatches as before, and the meta kernels that
# `torch.compile` traces with stay PyTorch's.

# %% tags=["export"]
_lock = threading.Lock()
_library: torch.library.Library | None = None


def _register(enabled: bool) -> None:
    """Register LEAN_KERNELS as their ops' ZeroTensor kernels, or remove them, and key
    torch.compile's caches by the setting (`tag_compile_caches`)."""
    global _library
    with _lock:
        if enabled and _library is None:
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():  # "Overriding a previously registered kernel"
                warnings.simplefilter("ignore", UserWarning)
                for name, kernel in LEAN_KERNELS.items():
                    library.impl(name, kernel, "ZeroTensor")
            _library = library
        elif not enabled and _library is not None:
            _library._destroy()
            _library = None
        tag_compile_caches(enabled)


# Appended to torch.compile's cache key tag while the lean kernels are on.
LEAN_CACHE_TAG = "|jvp_attention.lean_zero_tangents"


def tag_compile_caches(enabled: bool) -> None:
    """Put the setting in the keys of torch.compile's caches, keeping any tag of the user's:
    the AOTAutograd cache keys a step on the graph Dynamo captured, which the lean kernels
    do not change, and would serve a step compiled with the other setting."""
    config = torch.compiler.config
    tag = config.cache_key_tag.replace(LEAN_CACHE_TAG, "")
    config.cache_key_tag = tag + LEAN_CACHE_TAG if enabled else tag


def lean_zero_tangents_enabled() -> bool:
    """Whether the lean zero-tangent kernels of `lean_zero_tangents` are in force."""
    return _library is not None


class lean_zero_tangents:
    """Forward AD's zero tangents without PyTorch's meta round trip.

    Under `torch.func.jvp` or `torch.autograd.forward_ad`, an op whose operands mix a tensor
    with a tangent and one without (a bias, a parameter, a buffer, a Python number) meets a
    zero tangent. PyTorch's kernels for `add`, `sub`, `mul` and `div` of zero tangents
    shape their result by running the op on the meta device, whose kernels for these ops
    are Python: of the order of 0.1 ms of host time per op (chapter 13). The lean kernels
    read the shape, dtype and device off the operands and return the same tensors. Matrix
    products, convolutions and sums, which PyTorch runs on zeros filled in memory (a
    linear layer's JVP multiplies by its weight's zero tangent), return a zero tensor of
    the result's shape instead (a convolution, its bias broadcast). They change no other
    tensor's dispatch.

    Called, it turns the lean kernels on (or off) for the whole process; as a context
    manager, it restores the previous state on leaving.

    Example:
        >>> import torch, jvp_attention
        >>> x, w = torch.randn(3), torch.randn(3)
        >>> with jvp_attention.lean_zero_tangents():
        ...     out, tangent = torch.func.jvp(lambda x: x * w + 1.0, (x,), (torch.ones(3),))
        >>> torch.equal(tangent, w)
        True

    Args:
        enabled: True for the lean kernels, False for PyTorch's own.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.previous = lean_zero_tangents_enabled()
        _register(enabled)

    def __enter__(self) -> "lean_zero_tangents":
        return self

    def __exit__(self, *exc_info: object) -> None:
        _register(self.previous)


# %% [markdown]
# ## Same tensors
#
# The lean kernels must return what PyTorch's return: the same values (NaN where PyTorch
# has NaN), shape, dtype, device and strides, and a zero tensor exactly where PyTorch
# returns one. The check calls each op directly on zero tensors (`torch._efficientzerotensor`)
# with PyTorch's kernels and then with the lean ones, over broadcasting shapes, mixed
# dtypes (half, bfloat16, float, double, complex, and integers, which take the meta route),
# a Python number on either side and `alpha`. The products come after: the same values,
# shape, dtype and device as PyTorch's fallback gives, as a zero tensor where that one
# fills zeros in memory.

# %%
def zero(shape, dtype, device=DEVICE):
    return torch._efficientzerotensor(shape, dtype=dtype, device=device)


def operand_cases():
    """(a, b, keywords) triples in which at least one operand is a zero tensor."""
    shapes = [((4, 1, 3), (5, 3)), ((), (2, 3)), ((2, 3), ()), ((2, 3), (4, 3))]
    dtypes = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
              (torch.float16, torch.float64), (torch.float32, torch.complex64),
              (torch.int64, torch.int64), (torch.int32, torch.float16)]
    for (sa, sb) in shapes:
        for (da, db) in dtypes:
            real_a = torch.randn(sa, device=DEVICE).to(da)
            real_b = (torch.randn(sb, device=DEVICE) + 3).to(db)
            for a, b in ((zero(sa, da), real_b), (real_a, zero(sb, db)),
                         (zero(sa, da), zero(sb, db))):
                yield a, b, {}
                if not da.is_complex and not db.is_complex and da.is_floating_point:
                    yield a, b, {"alpha": 0.5}
        yield zero(sa, torch.float32), 2.5, {}  # a Python number as the other operand
        yield zero(sa, torch.bfloat16), 3, {}


def described(result: torch.Tensor) -> tuple:
    """What must agree: shape, dtype, device, strides, zero-tensor-ness and the values."""
    values = torch.zeros(result.shape, dtype=result.dtype) if result._is_zerotensor() else result
    return (result.shape, result.dtype, result.device, result.stride(),
            result._is_zerotensor(), values.cpu())


def same(first: tuple, second: tuple) -> bool:
    *meta1, v1 = first
    *meta2, v2 = second
    return meta1 == meta2 and torch.equal(v1.isnan(), v2.isnan()) and torch.equal(
        torch.nan_to_num(v1), torch.nan_to_num(v2))


def outcome(op, a, b, keywords):
    try:
        return described(op(a, b, **keywords))
    except RuntimeError as error:
        return ("raises", type(error))


OPS_TO_CHECK = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}
cases = list(operand_cases())
checked = mismatches = 0
for name, op in OPS_TO_CHECK.items():
    for a, b, keywords in cases:
        if name in ("mul", "div") and keywords:
            continue
        with lean_zero_tangents(False):
            theirs = outcome(op, a, b, keywords)
        with lean_zero_tangents():
            ours = outcome(op, a, b, keywords)
        agree = ours == theirs if theirs[0] == "raises" else (
            ours[0] != "raises" and same(ours, theirs))
        checked += 1
        if not agree:
            mismatches += 1
            print(f"{name}{tuple(getattr(x, 'shape', x) for x in (a, b))} {keywords}: "
                  f"PyTorch {theirs[:5]}, lean {ours[:5]}")
print(f"{checked} calls checked against PyTorch's kernels, {mismatches} differ")
assert mismatches == 0


def zero_operand_products():
    """(name, op, arguments) of products with a zero operand, as forward-AD formulas call
    them, and a few that PyTorch must judge (dtypes or shapes that do not match)."""
    bf16, stride_pad = torch.bfloat16, ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    image, kernel, bias = (torch.randn(s, device=DEVICE) for s in ((2, 3, 8, 8), (4, 3, 3, 3), (4,)))
    mm, bmm = torch.ops.aten.mm.default, torch.ops.aten.bmm.default
    convolution, sum_over = torch.ops.aten.convolution.default, torch.ops.aten.sum.dim_IntList
    return [
        ("x @ 0", mm, (torch.randn(5, 4, device=DEVICE), zero((4, 3), torch.float32))),
        ("0 @ w, bf16", mm, (zero((5, 4), bf16), torch.randn(4, 3, device=DEVICE).to(bf16))),
        ("dtypes differ", mm, (zero((5, 4), torch.float32), torch.randn(4, 3, device=DEVICE,
                                                                        dtype=torch.float64))),
        ("shapes differ", mm, (zero((5, 4), torch.float32), torch.randn(3, 3, device=DEVICE))),
        ("batched", bmm, (torch.randn(2, 5, 4, device=DEVICE), zero((2, 4, 3), torch.float32))),
        ("conv, zero kernel", convolution, (image, zero(kernel.shape, torch.float32), bias,
                                            *stride_pad)),
        ("conv, zero input", convolution, (zero(image.shape, torch.float32), kernel, bias,
                                           *stride_pad)),
        ("conv, zero bias", convolution, (image, kernel, zero((4,), torch.float32),
                                          *stride_pad)),
        ("sum", sum_over, (zero((2, 3, 4), torch.float32), [0, 2], True)),
    ]


def product_outcome(op, arguments) -> tuple:
    """What must agree: shape, dtype, device and the values (or the error raised), and
    whether the result is a zero tensor."""
    try:
        out = op(*arguments)
    except RuntimeError as error:
        return ("raises", type(error)), None
    values = torch.zeros(out.shape, dtype=out.dtype) if out._is_zerotensor() else out.cpu()
    return (out.shape, out.dtype, out.device, values), out._is_zerotensor()


product_mismatches = 0
for name, op, arguments in zero_operand_products():
    with lean_zero_tangents(False):
        (theirs, _) = product_outcome(op, arguments)
    with lean_zero_tangents():
        (ours, zero_tensor) = product_outcome(op, arguments)
    agree = (ours == theirs if theirs[0] == "raises" else ours[0] != "raises"
             and ours[:3] == theirs[:3] and torch.allclose(ours[3], theirs[3], rtol=0, atol=0))
    product_mismatches += not agree
    print(f"{name:18} {'agrees' if agree else 'DIFFERS'}"
          f"{'' if zero_tensor is None else ', a zero tensor' if zero_tensor else ', in memory'}"
          f"{'' if theirs[0] != 'raises' else ' (both raise)'}")
assert product_mismatches == 0

# %% [markdown]
# And on a model: chapter 9's DiT (a small one here) under the MeanFlow loss, which takes
# `torch.func.jvp` through the whole network and a backward through its primal output.
# The loss and every parameter's gradient must come out bit for bit the same: the lean
# kernels change which Python runs, not one number (on a GPU, whose kernels may sum in
# another order from one run to the next, no further apart than PyTorch's step from
# itself).

# %%
# examples/ beside notebooks/, as the notebooks run from their own folder (chapter 9).
sys.path.insert(0, str(Path.cwd().parent / "examples"))
import meanflow_dit as mf  # noqa: E402

# On a GPU, the model calls this library's attention; on a CPU, PyTorch's math path (the
# interpreter would run our kernels far slower than the host work being timed).
ATTENTION = "jvp_attention" if DEVICE == "cuda" else "math"
config = mf.DiTConfig(image_size=8, patch_size=2, width=64, depth=4, heads=4)
torch.manual_seed(0)
model = mf.MeanFlow(config).to(DEVICE)
batch = [torch.randn(8, config.channels, 8, 8, device=DEVICE) for _ in range(2)]
times = torch.rand(8, device=DEVICE)
batch += [times, times * torch.rand(8, device=DEVICE)]


def meanflow_step() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One MeanFlow loss and backward: the loss and the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    with mf.attention_context(ATTENTION):
        loss, _ = model(*batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def largest_difference(first, second) -> float:
    """The largest absolute difference between two steps' loss and gradients."""
    return max((a - b).abs().max().item() for a, b in zip(
        (first[0], *first[1]), (second[0], *second[1]), strict=True))


with lean_zero_tangents(False):
    theirs, theirs_again = meanflow_step(), meanflow_step()
with lean_zero_tangents():
    ours = meanflow_step()
# A GPU's kernels may sum in another order from run to run (atomics); then the lean step
# must differ from PyTorch's by no more than PyTorch's step differs from itself.
spread = largest_difference(theirs, theirs_again)
difference = largest_difference(ours, theirs)
print(f"loss {ours[0].item():.6f}; loss and {len(ours[1])} gradients: largest difference "
      f"from PyTorch's zero tangents {difference:.3g} (PyTorch's step against itself: "
      f"{spread:.3g}){'; bit for bit the same' if difference == 0 else ''}")
assert difference <= spread

# %% [markdown]
# ## What it saves
#
# The same ops timed again with the lean kernels, the linear layer's JVP of "Zero factors
# in products", then the small DiT's whole MeanFlow step (forward with its JVP and
# backward), best of five groups of five steps each way.

# %%
with lean_zero_tangents():
    lean_us = measure_ops()
    lean_linear = timed(linear_jvp), zeros_filled(linear_jvp)
print(f"{'op':26} {'PyTorch':>9} {'lean':>9}")
for name in OPS:
    print(f"{name:26} {pytorch_us[name]:7.1f} us {lean_us[name]:7.1f} us")
print(f"\ntorch.func.jvp of Linear({MLP_IN}, {MLP_OUT}) on {TOKENS} tokens")
for label, (times, filled) in (("PyTorch's zero tangents", pytorch_linear),
                               ("lean_zero_tangents", lean_linear)):
    report_linear(label, times, f"; {filled} tensors of zeros filled")
report_linear("the two products needed", needed)


# %% tags=["hide_input"]
import matplotlib.pyplot as plt  # noqa: E402


def draw_op_costs() -> None:
    """Host time per op under forward AD, PyTorch's zero tangents against the lean ones."""
    names = list(OPS)[::-1]
    rows = range(len(names))
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(names) + 1.2))
    # Okabe-Ito colours, distinct under the common colour-vision deficiencies.
    ax.barh([r + 0.2 for r in rows], [pytorch_us[n] for n in names], height=0.4,
            color="#E69F00", label="PyTorch's zero tangents")
    ax.barh([r - 0.2 for r in rows], [lean_us[n] for n in names], height=0.4,
            color="#0072B2", label="lean_zero_tangents")
    ax.set_yticks(list(rows), [f"{n}{' *' if OPS[n][1] else ''}" for n in names],
                  fontfamily="monospace", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(f"host time per op under forward AD, µs ({DEVICE}; log scale)")
    ax.set_title("* an operand without a tangent", fontsize=8, loc="left")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    plt.show()


draw_op_costs()


# The two kinds of step alternate, group by group, so that a drift in the host's speed
# (another process, a clock) falls on both.
step_ms = {False: float("inf"), True: float("inf")}
for _ in range(5):
    for lean in (False, True):
        with lean_zero_tangents(lean):
            group_ms = best_seconds(meanflow_step, calls=5, repeats=1) * 1e3
            step_ms[lean] = min(step_ms[lean], group_ms)
step_pytorch, step_lean = step_ms[False], step_ms[True]
print(f"small DiT MeanFlow step ({ATTENTION} attention, {DEVICE}): PyTorch's zero tangents "
      f"{step_pytorch:.1f} ms, lean {step_lean:.1f} ms ({step_pytorch / step_lean:.2f}x)")

# %% [markdown]
# The lean kernels are Python too, so each zero tangent still costs a Python call through
# the dispatcher, a few tens of microseconds: several times less than PyTorch's route
# rather than nothing. With the meta kernels in C++, as they are for other ops, the same
# ops would take a few microseconds; that is PyTorch's to change. For the products the
# trade runs the other way: PyTorch's route is C++ and quick for the host, the lean one a
# Python call (`x @ weight` and `F.linear(x, weight)` above take longer on tiny tensors),
# but it takes a whole product, and the tensor of zeros, off the device: the linear
# layer's JVP is left with its two products and a copy of the tangent where the bias's zero
# tangent is added to it (an add returns a new tensor, as PyTorch's own zero tensors do).
#
# How many zero tangents does a real step meet? The count depends on the layers, not on
# their width, so a DiT with DiT-B/2's twelve blocks but a small width answers for DiT-B/2:
# the lean kernels, wrapped to count their calls, run one MeanFlow step, first those of
# `add`, `sub`, `mul` and `div` alone (the products on PyTorch's route, as without the
# lean kernels), then the products'. One zero tangent in an elementwise op costs about
# what `x + bias` costs over `x + y` (its formula meets exactly one).

# %%
def counting(name: str, kernel, counts: Counter):
    def run(*args, **kwargs):
        counts[name] += 1
        return kernel(*args, **kwargs)
    return run


def zero_tangents_per_step(depth: int, kernels: dict[str, Callable]) -> Counter:
    """Zero tangents that these lean kernels meet in one MeanFlow step of a small DiT with
    `depth` blocks, by op."""
    counts = Counter()
    library = torch.library.Library("aten", "IMPL")
    with lean_zero_tangents(False), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name, kernel in kernels.items():
            library.impl(name, counting(name, kernel, counts), "ZeroTensor")
        try:
            torch.manual_seed(0)
            deep = mf.MeanFlow(replace(config, depth=depth)).to(DEVICE)
            with mf.attention_context(ATTENTION):
                loss, _ = deep(*batch)
            loss.backward()
        finally:
            library._destroy()
    return counts


def by_op(counts: Counter) -> str:
    return ", ".join(f"{n} in {op}" for op, n in counts.most_common())


met = zero_tangents_per_step(12, ARITHMETIC_KERNELS)
products = zero_tangents_per_step(12, PRODUCT_KERNELS)
one_pytorch, one_lean = (us["x + bias"] - us["x + y"] for us in (pytorch_us, lean_us))
print(f"one MeanFlow step of a 12-block DiT meets {met.total()} zero tangents in elementwise "
      f"ops ({by_op(met)}): about {met.total() * one_pytorch / 1e3:.1f} ms of host time per "
      f"step with PyTorch's kernels, {met.total() * one_lean / 1e3:.1f} ms with the lean ones; "
      f"and {products.total()} in products ({by_op(products)}), each a product of zeros "
      f"on the device with PyTorch's kernels")

# %% [markdown]
# ## Under torch.compile
#
# A compiled step runs no Python per op, so the host has nothing to gain there; the device
# does. `torch.compile` traces the step's forward-AD formulas with fake tensors, and with
# PyTorch's kernels the trace records the fallback as it runs: a tensor of zeros, then the
# product. Inductor keeps both. With the lean kernels on while the step is traced, the
# trace records the zero tensor instead, and the sums around it become copies, elementwise
# work that Inductor can fuse with its neighbours. The linear layer's JVP once more, compiled
# both ways, with the matrix products in Inductor's generated code counted (on a GPU, the
# time in kernels again tells the work; a compiled call this small still waits on the host):

# %%
from torch._inductor.utils import run_and_get_code  # noqa: E402

PRODUCT_CALL = re.compile(r"extern_kernels\.(?:mm|addmm|bmm|convolution)\(")


def compiled_linear_jvp(lean: bool) -> tuple[int, tuple[float, float | None]]:
    """Matrix products in the compiled code of the linear layer's JVP, and its times."""
    torch._dynamo.reset()
    with lean_zero_tangents(lean):
        compiled = torch.compile(lambda x, t: torch.func.jvp(mlp, (x,), (t,)))
        _, sources = run_and_get_code(compiled, tokens, token_tangents)
    products = sum(len(PRODUCT_CALL.findall(source)) for source in sources)
    return products, timed(lambda: compiled(tokens, token_tangents))


print(f"torch.compile of torch.func.jvp of Linear({MLP_IN}, {MLP_OUT}) on {TOKENS} tokens "
      f"({DEVICE})")
for lean, label in ((False, "PyTorch's zero tangents"), (True, "lean_zero_tangents")):
    count, times = compiled_linear_jvp(lean)
    report_linear(label, times, f"; {count} matrix products")

# %% [markdown]
# In a MeanFlow step each linear layer's JVP loses its product of zeros this way: a fifth
# of the step's matrix products, whose others are the forward's, its tangent's and the
# backward's two (the backward runs through the primal output only). A convolution's
# tangent loses its convolution of zeros alike. The compiled graph is traced once, so the
# lean kernels' Python costs nothing per step (the tests check that a compiled step gives
# the same results with them as without). One more difference shows in the trace: with
# torch 2.13, a JVP through RMSNorm's weight (the query-key norms of recent DiTs) fails to
# compile with PyTorch's kernels alone (an internal assert while tracing), and
# compiles with the lean ones (torch 2.14 and 2.15 compile it both ways).
#
# A whole training step compiled for a GPU has not been measured with them yet, though.
# On an H100 (torch 2.11, bf16 autocast), a MeanFlow step of a 2-block DiT of DiT-B/2's
# width at 1024 tokens, batch 16, compiled with its backward, ran the same 82 GEMM kernels
# (3.57 ms) with PyTorch's zero tangents as with the lean ones (a diagnostic profile, not
# saved), and the lean setting's step compiled in 3.4 s after the first setting's 59 s. On
# this book's CPU machine the same step at width 64 compiles to 80 products with PyTorch's
# kernels and 64 with the lean ones (float32; 97 and 82 in bf16 autocast). The difference
# is torch.compile's caches: the AOTAutograd cache keys a step on the graph Dynamo
# captured, which the lean kernels do not change (they act below it, as the step is traced
# into ATen ops), and torch 2.11 caches graphs that hold `torch.func.jvp` (torch 2.13 passes
# them by, which is why this machine traced each setting anew). So the lean step on the H100
# got the graph just compiled with PyTorch's zero tangents, and so did the lean rows of
# DiT-B/2's compiled MeanFlow steps (`examples/results/bench_dit_b2_zero_tangents_h100.json`,
# 57.7 against 58.0 ms with CUDA graphs at 1024 tokens), each compiled in seconds after its
# PyTorch row's minutes. So `lean_zero_tangents` puts itself in the caches' keys while it
# is on (`tag_compile_caches`, below: it appends to `torch.compiler.config.cache_key_tag`,
# keeping any tag of the user's), and `benchmarks/compiled_products.py` compiles each
# setting without caches. With the key in place the DiT-B/2 lean rows compiled afresh (139
# and 96 s) and the default mode's step at 1024 tokens took 53.7 ms against 61.2 with this
# library's attention, 80.4 against 84.7 with the math path (same file, same H100 kind,
# another run), and with CUDA graphs 50.9 against 57.7 and 72.4 against 78.8 (a later
# session: compiled afresh in 73 and 61 s). Dynamo's own compiled code is another matter: a function already
# compiled in this process keeps its graph until `torch._dynamo.reset()`. Measured so
# far, the products of zeros they take out of compiled code are those of the linear layer's
# JVP above, compiled for the GPU (it ran no backward, and the cache keeps a step's graph
# only once its backward has been compiled, so each setting traced it anew), and of steps
# compiled for the CPU.

# %% [markdown]
# ## Using it
#
# ```python
# import jvp_attention
#
# jvp_attention.lean_zero_tangents(True)     # for the whole process, or
# with jvp_attention.lean_zero_tangents():   # for a block
#     loss = meanflow_loss(model, batch)
# ```
#
# It helps any step that runs `torch.func.jvp` or `torch.autograd.forward_ad` through a
# model with parameters, whichever attention the model calls: an eager step in host time
# and in the device's products of zeros, a compiled graph without a backward (turned on
# before it is traced, with its own compile-cache key: see above) in the products alone. It costs nothing where no zero tangent appears. It does not change
# `jvp_attention.attention`, whose own calls meet no zero tangents (chapter 7 unpacks the
# duals and runs one fused kernel; a test counts them).
