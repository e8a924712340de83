"""jvp_attention.lean_zero_tangents (chapter 13): the lean ZeroTensor kernels of add, sub, mul
and div return what PyTorch's return, and those of the products (mm, bmm, convolution, sum)
the same values without computing a product of zeros, on single ops, through torch.func.jvp
and a backward, and under torch.compile; turning them on and off restores PyTorch's
kernels."""

import contextlib
import itertools
import warnings
from collections import Counter

import pytest
import torch
from functorch.compile import make_boxed_func
from helpers import DEVICE
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

import jvp_attention
from jvp_attention import zero_tangents as zt

OPS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}
SHAPES = [((3, 1, 4), (5, 4)), ((), (2, 4)), ((2, 4), ()), ((2, 4), (2, 4)), ((2, 4), (3, 4))]
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float64), (torch.complex64, torch.float32),
          (torch.int64, torch.int32), (torch.bool, torch.float16)]


def operand(shape, dtype, zero: bool, device=DEVICE):
    if zero:
        return torch._efficientzerotensor(shape, dtype=dtype, device=device)
    return (torch.randn(shape, device=device) * 3 + 1).to(dtype)


def run(op, a, b, keywords):
    """The op's result as everything that must agree (values with NaN made comparable), or
    the type of error it raised."""
    try:
        out = op(a, b, **keywords)
    except (RuntimeError, ValueError, TypeError) as error:
        return type(error)
    values = torch.zeros(out.shape, dtype=out.dtype) if out._is_zerotensor() else out.cpu()
    if values.is_complex():  # newer PyTorch's bf16 complex (bcomplex32) cannot be compared
        values = values.to(torch.complex128)
    nan = values.isnan() if values.is_floating_point() or values.is_complex() else None
    return (out.shape, out.dtype, out.device, out.stride(), out._is_zerotensor(),
            values if nan is None else torch.where(nan, 0, values), nan)


def agree(first, second) -> bool:
    if not isinstance(first, tuple) or not isinstance(second, tuple):
        return first == second
    return first[:5] == second[:5] and all(
        (x is None and y is None) or torch.equal(x, y) for x, y in zip(first[5:], second[5:], strict=True))


def pytorch_and_lean(op, a, b, keywords):
    with jvp_attention.lean_zero_tangents(False):
        theirs = run(op, a, b, keywords)
    with jvp_attention.lean_zero_tangents():
        ours = run(op, a, b, keywords)
    return theirs, ours


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", DTYPES, ids=str)
@pytest.mark.parametrize("zeros", [(True, False), (False, True), (True, True)], ids=str)
def test_lean_kernels_return_what_pytorch_returns(name, shapes, dtypes, zeros) -> None:
    torch.manual_seed(0)
    a, b = (operand(s, d, z) for s, d, z in zip(shapes, dtypes, zeros, strict=True))
    alphas = [{}] + ([{"alpha": 0.5}, {"alpha": 2}] if name in ("add", "sub") else [])
    for keywords in alphas:
        theirs, ours = pytorch_and_lean(OPS[name], a, b, keywords)
        assert agree(theirs, ours), (name, shapes, dtypes, zeros, keywords, theirs, ours)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("number", [2.5, 3, True, 1 + 2j], ids=repr)
@pytest.mark.parametrize("shape", [(), (2, 3)], ids=str)
def test_a_number_beside_a_zero_tangent(name, number, shape) -> None:
    """`x * 2.0` passes the number to the kernel as a Python number; beside a 0-dim tensor
    PyTorch's kernels promote it as a 0-dim tensor of its widest type, and so must ours."""
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        a = operand(shape, dtype, zero=True)
        theirs, ours = pytorch_and_lean(OPS[name], a, number, {})
        assert agree(theirs, ours), (name, number, shape, dtype, theirs, ours)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU: a CPU scalar beside it")
@pytest.mark.parametrize("name", OPS)
def test_the_result_goes_where_pytorch_puts_it(name) -> None:
    """A 0-dim CPU tensor beside a CUDA one: PyTorch's kernels put the result on the GPU."""
    for zeros in ((True, False), (False, True), (True, True)):
        a = operand((), torch.float32, zeros[0], device="cpu")
        b = operand((2, 3), torch.float32, zeros[1])
        for first, second in ((a, b), (b, a)):
            theirs, ours = pytorch_and_lean(OPS[name], first, second, {})
            assert agree(theirs, ours), (name, zeros, theirs, ours)


@pytest.mark.parametrize("name", OPS)
def test_a_parameter_is_read_off_like_a_tensor(name) -> None:
    """A parameter beside a zero tangent (`x * weight`) takes the lean route, and agrees."""
    weight = torch.nn.Parameter(torch.randn(4, device=DEVICE))
    zero = operand((3, 4), torch.bfloat16, zero=True)
    assert zt.read_off(zero, weight) == (torch.Size([3, 4]), torch.float32)
    for a, b in ((zero, weight), (weight, zero)):
        theirs, ours = pytorch_and_lean(OPS[name], a, b, {})
        assert agree(theirs, ours), (name, theirs, ours)


@pytest.mark.parametrize("name", OPS)
def test_fake_tensors_take_pytorch_route(name) -> None:
    """Tensor subclasses (the fake tensors torch.compile traces with) are shaped by the op on
    the meta device, as PyTorch's kernels do."""
    kernel = zt.LEAN_KERNELS[f"{name}.Tensor"]
    with FakeTensorMode() as mode:
        a = mode.from_tensor(torch._efficientzerotensor((3, 1), dtype=torch.float16))
        b = mode.from_tensor(torch.randn(4, dtype=torch.float32))
        out = kernel(a, b)
    assert out.shape == (3, 4) and out.dtype == torch.float32


class Block(torch.nn.Module):
    """A DiT-like block: biased Linear layers, a LayerNorm, modulation by a conditioning
    input, Python numbers, a division, and this library's attention."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.modulation = torch.nn.Linear(width, 2 * width)
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer("offset", torch.linspace(-1, 1, width))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(torch.nn.functional.silu(c))[:, None].chunk(2, -1)
        h = self.norm(x) * (1 + scale) + shift + self.offset
        b, n, width = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = jvp_attention.attention(q, k, v).transpose(1, 2).reshape(b, n, width)
        return x + self.proj(out) / 2.0 - 0.5 * x


def meanflow_like_step(block: Block, x, c, tx, tc):
    """torch.func.jvp through the block, a loss on the primal and a stop-gradient tangent,
    and a backward: the output, its tangent and the parameters' gradients."""
    block.zero_grad(set_to_none=True)
    out, tangent = torch.func.jvp(block, (x, c), (tx, tc))
    ((out - tangent.detach()) ** 2).mean().backward()
    return [out.detach(), tangent.detach()] + [p.grad for p in block.parameters()]


def test_a_jvp_step_is_bit_for_bit_the_same() -> None:
    torch.manual_seed(0)
    block = Block().to(DEVICE)
    x, c, tx = (torch.randn(s, device=DEVICE) for s in ((2, 8, 16), (2, 16), (2, 8, 16)))
    tc = torch.randn(2, 16, device=DEVICE)
    with jvp_attention.lean_zero_tangents(False):
        theirs = meanflow_like_step(block, x, c, tx, tc)
        again = meanflow_like_step(block, x, c, tx, tc)
    with jvp_attention.lean_zero_tangents():
        ours = meanflow_like_step(block, x, c, tx, tc)
    assert len(ours) == 2 + len(list(block.parameters()))
    assert all(torch.isfinite(t).all() for t in ours)
    for mine, pytorch, pytorch_again in zip(ours, theirs, again, strict=True):
        # Bit for bit, unless PyTorch's own step differs from itself (a GPU's atomics)
        spread = (pytorch - pytorch_again).abs().max()
        assert (mine - pytorch).abs().max() <= spread
        if DEVICE == "cpu":
            assert torch.equal(mine, pytorch)


def test_compiled_jvp_is_unchanged() -> None:
    """torch.compile traces with fake tensors: with the lean kernels on, a compiled JVP
    through biases and numbers gives the eager answer."""
    torch.manual_seed(0)
    weight, bias = torch.randn(4, 4), torch.randn(4)

    def f(x):
        return torch.nn.functional.linear(x, weight, bias) * 2.0 + 1.0

    assert_compiled_jvp_is_eagers(f, torch.randn(3, 4), torch.randn(3, 4))


def assert_compiled_jvp_is_eagers(f, x: torch.Tensor, tx: torch.Tensor) -> None:
    """torch.func.jvp of `f`, compiled (aot_eager) with the lean kernels on, gives eager's
    results with PyTorch's kernels exactly."""
    expected = torch.func.jvp(f, (x,), (tx,))
    with jvp_attention.lean_zero_tangents():
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, tx: torch.func.jvp(f, (x,), (tx,)),
                                 backend="aot_eager", fullgraph=True)
        got = compiled(x, tx)
    for mine, eager in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, eager, rtol=0, atol=0)


@contextlib.contextmanager
def fwad_dual(x: torch.Tensor):
    """`x` as a dual tensor with a random tangent, inside a dual level."""
    with torch.autograd.forward_ad.dual_level():
        yield torch.autograd.forward_ad.make_dual(x.detach(), torch.randn_like(x))


def test_under_vmap_and_forward_over_reverse() -> None:
    """Zero tangents met inside torch.func.vmap, and by a jvp of a gradient: the same."""
    torch.manual_seed(0)
    weight, bias = torch.randn(4, 4), torch.randn(4)

    def f(x):
        return torch.nn.functional.linear(x, weight, bias) * 2.0 + 1.0

    x, tx = torch.randn(5, 3, 4), torch.randn(5, 3, 4)
    calls = {
        "vmap of jvp": lambda: torch.func.vmap(lambda a, b: torch.func.jvp(f, (a,), (b,)))(x, tx),
        "jvp of vmap": lambda: torch.func.jvp(torch.func.vmap(f), (x,), (tx,)),
        "jvp of grad": lambda: torch.func.jvp(torch.func.grad(lambda a: f(a).pow(2).sum()),
                                              (x,), (tx,)),
    }
    for name, call in calls.items():
        with jvp_attention.lean_zero_tangents(False):
            theirs = call()
        with jvp_attention.lean_zero_tangents():
            ours = call()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), name


def registered_zero_tensor_kernels() -> set[str]:
    """The ops of LEAN_KERNELS whose ZeroTensor kernel in force is the lean one."""
    return {name for name in zt.LEAN_KERNELS
            if "zero_tangents" in next((line for line in torch._C._dispatch_dump(
                f"aten::{name}").splitlines() if line.startswith("ZeroTensor:")), "")}


def test_on_off_and_context_restore_pytorch_kernels() -> None:
    assert not zt.lean_zero_tangents_enabled()
    assert registered_zero_tensor_kernels() == set()
    with jvp_attention.lean_zero_tangents():
        assert zt.lean_zero_tangents_enabled()
        assert registered_zero_tensor_kernels() == set(zt.LEAN_KERNELS)
        with jvp_attention.lean_zero_tangents(False):
            assert registered_zero_tensor_kernels() == set()
        assert registered_zero_tensor_kernels() == set(zt.LEAN_KERNELS)
    assert registered_zero_tensor_kernels() == set()
    jvp_attention.lean_zero_tangents(True)
    jvp_attention.lean_zero_tangents(True)  # twice: still one registration
    try:
        assert registered_zero_tensor_kernels() == set(zt.LEAN_KERNELS)
    finally:
        jvp_attention.lean_zero_tangents(False)
    assert registered_zero_tensor_kernels() == set()


def test_the_setting_keys_compile_caches() -> None:
    """While the lean kernels are on, torch.compile's cache key tag says so (a step compiled
    with PyTorch's zero tangents must not be served from the cache to a lean one, nor the
    other way), and a tag of the user's is kept."""
    config = torch.compiler.config
    with config.patch(cache_key_tag="mine"):
        with jvp_attention.lean_zero_tangents():
            assert config.cache_key_tag == "mine" + zt.LEAN_CACHE_TAG
            with jvp_attention.lean_zero_tangents(False):
                assert config.cache_key_tag == "mine"
            assert config.cache_key_tag == "mine" + zt.LEAN_CACHE_TAG
        assert config.cache_key_tag == "mine"


def test_the_docstring_example() -> None:
    x, w = torch.randn(3), torch.randn(3)
    with jvp_attention.lean_zero_tangents():
        _, tangent = torch.func.jvp(lambda x: x * w + 1.0, (x,), (torch.ones(3),))
    assert torch.equal(tangent, w)


@pytest.mark.parametrize("first, second", list(itertools.product([(), (1,), (3, 1)],
                                                                  [(4,), (2, 1, 4)])), ids=str)
def test_broadcast_agrees_with_torch(first, second) -> None:
    assert zt.broadcast(torch.Size(first), torch.Size(second)) == torch.broadcast_shapes(
        first, second)
    with pytest.raises(RuntimeError, match="must match"):
        zt.broadcast(torch.Size(first) + (3,), torch.Size(second))


@pytest.fixture
def zero_tangent_count():
    """A Counter of the zero tangents that the ops of LEAN_KERNELS meet while the test runs
    (the lean kernels, wrapped to count)."""
    counts = {}
    library = torch.library.Library("aten", "IMPL")

    def counted(name, kernel):
        def run(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return kernel(*args, **kwargs)
        return run

    with jvp_attention.lean_zero_tangents(False), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name, kernel in zt.LEAN_KERNELS.items():
            library.impl(name, counted(name, kernel), "ZeroTensor")
        try:
            yield counts
        finally:
            library._destroy()


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
def test_attention_meets_no_zero_tangent(zero_tangent_count, mask) -> None:
    """`attention` under torch.func.jvp and a backward meets no zero tangent (chapter 8 reads
    its host time against a floor that meets none), even with a mask that has no tangent."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 32, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    attn_mask = {None: None, "bool": torch.rand(32, 32, device=DEVICE) > 0.2,
                 "additive": torch.randn(32, 32, device=DEVICE)}[mask]

    def f(q, k, v):
        return jvp_attention.attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)

    out, tangent = torch.func.jvp(f, (q, k, v), tuple(torch.randn_like(x) for x in (q, k, v)))
    (out.sum() + tangent.detach().sum()).backward()
    assert zero_tangent_count == {}
    with fwad_dual(q) as dual:  # and the counter counts: a bias without a tangent meets one
        dual + torch.randn(16, device=DEVICE)
    assert zero_tangent_count == {"add.Tensor": 1}


# Products: each call is (op, arguments), with at least one zero tensor among the arguments.
def zero(shape, dtype=torch.float32, device=DEVICE):
    return torch._efficientzerotensor(shape, dtype=dtype, device=device)


def real(shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(shape, device=device).to(dtype)


CONV_2D = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
PRODUCT_CALLS = {
    "mm a": (torch.ops.aten.mm.default, lambda: (zero((3, 4)), real((4, 5)))),
    "mm b": (torch.ops.aten.mm.default, lambda: (real((3, 4)), zero((4, 5)))),
    "mm both bf16": (torch.ops.aten.mm.default,
                     lambda: (zero((3, 4), torch.bfloat16), zero((4, 5), torch.bfloat16))),
    "mm complex": (torch.ops.aten.mm.default,
                   lambda: (zero((3, 4), torch.complex64), real((4, 5), torch.complex64))),
    "mm integers": (torch.ops.aten.mm.default,
                    lambda: (zero((3, 4), torch.int64), real((4, 5), torch.int64))),
    "mm shapes differ": (torch.ops.aten.mm.default, lambda: (zero((3, 4)), real((5, 5)))),
    "mm dtypes differ": (torch.ops.aten.mm.default,
                         lambda: (zero((3, 4)), real((4, 5), torch.float64))),
    "mm not matrices": (torch.ops.aten.mm.default, lambda: (zero((2, 3, 4)), real((4, 5)))),
    "bmm a": (torch.ops.aten.bmm.default, lambda: (zero((2, 3, 4)), real((2, 4, 5)))),
    "bmm b fp16": (torch.ops.aten.bmm.default,
                   lambda: (real((2, 3, 4), torch.float16), zero((2, 4, 5), torch.float16))),
    "bmm batches differ": (torch.ops.aten.bmm.default,
                           lambda: (zero((2, 3, 4)), real((3, 4, 5)))),
    "conv input, bias": (torch.ops.aten.convolution.default,
                         lambda: (zero((2, 3, 5, 5)), real((4, 3, 3, 3)), real(4), *CONV_2D)),
    "conv weight, no bias": (torch.ops.aten.convolution.default,
                             lambda: (real((2, 3, 5, 5)), zero((4, 3, 3, 3)), None, *CONV_2D)),
    "conv weight, zero bias": (torch.ops.aten.convolution.default,
                               lambda: (real((2, 3, 5, 5)), zero((4, 3, 3, 3)), zero(4),
                                        *CONV_2D)),
    "conv bias alone": (torch.ops.aten.convolution.default,
                        lambda: (real((2, 3, 5, 5)), real((4, 3, 3, 3)), zero(4), *CONV_2D)),
    "conv 1d strided grouped": (torch.ops.aten.convolution.default,
                                lambda: (zero((2, 4, 9)), real((6, 2, 3)), real(6), [2], [0],
                                         [2], False, [0], 2)),
    "conv transposed": (torch.ops.aten.convolution.default,
                        lambda: (real((2, 4, 3, 3)), zero((4, 3, 2, 2)), real(3), [2, 2],
                                 [0, 0], [1, 1], True, [1, 1], 1)),
    "conv channels differ": (torch.ops.aten.convolution.default,
                             lambda: (zero((2, 5, 5, 5)), real((4, 3, 3, 3)), None, *CONV_2D)),
    "sum dim": (torch.ops.aten.sum.dim_IntList, lambda: (zero((2, 3, 4)), [0, -1])),
    "sum keepdim": (torch.ops.aten.sum.dim_IntList, lambda: (zero((2, 3, 4)), [1], True)),
    "sum all dims": (torch.ops.aten.sum.dim_IntList, lambda: (zero((2, 3)), None)),
    "sum integers": (torch.ops.aten.sum.dim_IntList, lambda: (zero((2, 3), torch.int32), [1])),
    "sum dim out of range": (torch.ops.aten.sum.dim_IntList, lambda: (zero((2, 3)), [2])),
    "sum": (torch.ops.aten.sum.default, lambda: (zero((2, 3), torch.bfloat16),)),
}


# Calls whose result is a tensor in memory: a bias broadcast, a convolution without its zero
# bias, and an integer product (PyTorch's route: the lean kernels take floating dtypes).
COMPUTED = {"conv input, bias", "conv 1d strided grouped", "conv transposed", "conv bias alone",
            "mm integers"}


def product_outcome(op, arguments):
    """Shape, dtype, device and values of `op(*arguments)`, or the type of error raised."""
    try:
        out = op(*arguments)
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        return type(error)
    values = torch.zeros(out.shape, dtype=out.dtype) if out._is_zerotensor() else out.cpu()
    return out.shape, out.dtype, out.device, values


@pytest.mark.parametrize("name", PRODUCT_CALLS)
def test_products_return_pytorchs_values(name) -> None:
    """A product with a zero factor: PyTorch's values, shape, dtype and device (or its error),
    as a zero tensor where the product is zero (PyTorch's fallback returns zeros in memory)."""
    torch.manual_seed(0)
    op, make = PRODUCT_CALLS[name]
    arguments = make()
    with jvp_attention.lean_zero_tangents(False):
        theirs = product_outcome(op, arguments)
    with jvp_attention.lean_zero_tangents():
        ours = product_outcome(op, arguments)
        out = None if isinstance(ours, type) else op(*arguments)
    if isinstance(theirs, type) or isinstance(ours, type):
        assert theirs == ours, (name, theirs, ours)
        return
    assert ours[:3] == theirs[:3] and torch.equal(ours[3], theirs[3]), (name, theirs, ours)
    assert out._is_zerotensor() != (name in COMPUTED), name


def conv_block() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.GroupNorm(2, 4),
                               torch.nn.ConvTranspose2d(4, 2, 2, stride=2, groups=2))


MODULES = {
    "Linear 1-D": (lambda: torch.nn.Linear(8, 6), (8,)),
    "Linear 3-D": (lambda: torch.nn.Linear(8, 6), (2, 5, 8)),
    "Linear without bias": (lambda: torch.nn.Linear(8, 6, bias=False), (2, 5, 8)),
    "Conv, GroupNorm, ConvTranspose": (conv_block, (2, 3, 6, 6)),
    "Conv1d strided": (lambda: torch.nn.Conv1d(4, 6, 3, stride=2, groups=2), (2, 4, 9)),
    "LayerNorm, RMSNorm": (lambda: torch.nn.Sequential(torch.nn.LayerNorm(8),
                                                       torch.nn.RMSNorm(8)), (2, 5, 8)),
    "matmul by a constant": (lambda: MatmulByConstant(), (2, 3, 5, 8)),
}


class MatmulByConstant(torch.nn.Module):
    """`x @ w` with a 4-D `x` (bmm after broadcasting) and `w @ x^T` (a constant on the left)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("left", torch.randn(3, 5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left @ (x @ self.w)


def module_calls(module: torch.nn.Module, x: torch.Tensor, tx: torch.Tensor) -> list:
    """A jvp with a backward through both outputs, a Hessian-vector product over the
    parameters (jvp of grad) and a vmap of jvp: every tensor they return."""
    params = {name: p.detach() for name, p in module.named_parameters()}
    tangents = {name: torch.randn_like(p) for name, p in params.items()}

    def loss(params, x):
        return torch.func.functional_call(module, params, (x,)).square().sum()

    x = x.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, tangent = torch.func.jvp(module, (x,), (tx,))
    (out.square().sum() + tangent.square().sum()).backward()
    grads, hvp = torch.func.jvp(lambda p: torch.func.grad(loss)(p, x.detach()),
                                (params,), (tangents,))
    batched = torch.func.vmap(lambda t: torch.func.jvp(module, (x.detach(),), (t,))[1])(
        torch.stack([tx, -2 * tx]))
    return [out, tangent, x.grad, *[p.grad for p in module.parameters()], *grads.values(),
            *hvp.values(), batched]


@pytest.mark.parametrize("name", MODULES)
def test_products_in_modules_give_the_same_numbers(name) -> None:
    """First and second order through layers whose weights meet zero tangents: the same
    tensors with the lean kernels as with PyTorch's (bit for bit on a CPU; on a GPU, no
    further apart than PyTorch's own results from one run to the next)."""
    make, shape = MODULES[name]
    torch.manual_seed(0)
    module = make().to(DEVICE)
    x, tx = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
    runs = {}
    for label, lean in (("theirs", False), ("again", False), ("ours", True)):
        torch.manual_seed(1)
        with jvp_attention.lean_zero_tangents(lean):
            runs[label] = module_calls(module, x, tx)
    for mine, pytorch, pytorch_again in zip(runs["ours"], runs["theirs"], runs["again"],
                                            strict=True):
        spread = (pytorch - pytorch_again).abs().max()
        assert (mine - pytorch).abs().max() <= spread, name
        if DEVICE == "cpu":
            assert torch.equal(mine, pytorch), name


def zeros_filled(fn) -> int:
    """Tensors of zeros made while `fn` runs (PyTorch's fallback fills each zero tangent that
    meets an op without a zero-tensor kernel)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
        fn()
    return sum(event.name == "aten::zeros" for event in trace.events())


@pytest.mark.parametrize("name", ["Linear 3-D", "Linear without bias",
                                  "Conv, GroupNorm, ConvTranspose", "LayerNorm, RMSNorm",
                                  "matmul by a constant"])
def test_no_product_of_zeros(name) -> None:
    """With PyTorch's kernels, the jvp of a layer whose weights have no tangent fills their
    zero tangents with zeros in memory and multiplies by them; with the lean ones, nothing
    is filled."""
    make, shape = MODULES[name]
    module = make().to(DEVICE)
    x, tx = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
    with jvp_attention.lean_zero_tangents(False):
        assert zeros_filled(lambda: torch.func.jvp(module, (x,), (tx,))) > 0
    with jvp_attention.lean_zero_tangents():
        assert zeros_filled(lambda: torch.func.jvp(module, (x,), (tx,))) == 0


def test_compiled_jvp_through_products_is_unchanged() -> None:
    """The products' kernels under torch.compile's fake tensors: PyTorch's route, the same
    answer as eager."""
    torch.manual_seed(0)
    weight, kernel, bias = torch.randn(4, 4), torch.randn(2, 3, 3, 3), torch.randn(2)

    def f(x):
        image = torch.nn.functional.linear(x, weight).view(1, 3, 4, 4)
        return torch.nn.functional.conv2d(image, kernel, bias).sum(dim=(2, 3))

    assert_compiled_jvp_is_eagers(f, torch.randn(12, 4), torch.randn(12, 4))


def traced_products(f, x: torch.Tensor, tx: torch.Tensor, lean: bool) -> Counter:
    """The products in the forward graph that torch.compile (AOT autograd) traces for
    torch.func.jvp of `f`, by op."""
    graphs = []

    def keep(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    torch._dynamo.reset()
    with jvp_attention.lean_zero_tangents(lean):
        compiled = torch.compile(lambda x, tx: torch.func.jvp(f, (x,), (tx,)),
                                 backend=aot_autograd(fw_compiler=keep), fullgraph=True)
        compiled(x, tx)
    products = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default",
                "aten.convolution.default"}
    return Counter(str(node.target) for graph in graphs for node in graph.graph.nodes
                   if node.op == "call_function" and str(node.target) in products)


def test_a_compiled_jvp_traces_no_product_of_zeros() -> None:
    """Traced with PyTorch's kernels, a linear layer's JVP holds a third matrix product (on
    zeros) and a convolution's a second convolution; traced with the lean ones, neither."""
    linear = torch.nn.Linear(8, 6)
    conv = torch.nn.Conv2d(3, 4, 3)
    x, tx = torch.randn(5, 8), torch.randn(5, 8)
    image, t_image = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)
    assert traced_products(linear, x, tx, lean=False) == {"aten.addmm.default": 1,
                                                          "aten.mm.default": 2}
    assert traced_products(linear, x, tx, lean=True) == {"aten.addmm.default": 1,
                                                         "aten.mm.default": 1}
    assert traced_products(conv, image, t_image, lean=False) == {"aten.convolution.default": 3}
    assert traced_products(conv, image, t_image, lean=True) == {"aten.convolution.default": 2}


def test_a_compiled_meanflow_like_step_is_unchanged() -> None:
    """A compiled JVP with a backward through a small convolutional and linear model, its
    layers' zero tangents traced through the lean kernels: eager's numbers. (Its norm has
    no affine weights: torch.compile of a JVP through LayerNorm's affine weights fails
    with PyTorch's kernels alone, an internal assert in torch 2.13.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 2, stride=2), torch.nn.Flatten(2),
                                torch.nn.LayerNorm(9, elementwise_affine=False),
                                torch.nn.Linear(9, 9), torch.nn.GELU(),
                                torch.nn.Linear(9, 9, bias=False))
    x, tx = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)

    def step(fn):
        model.zero_grad(set_to_none=True)
        out, tangent = fn(x, tx)
        ((out - tangent.detach()) ** 2).mean().backward()
        return [out.detach(), tangent.detach()] + [p.grad for p in model.parameters()]

    eager = step(lambda x, tx: torch.func.jvp(model, (x,), (tx,)))
    torch._dynamo.reset()
    with jvp_attention.lean_zero_tangents():
        compiled = step(torch.compile(lambda x, tx: torch.func.jvp(model, (x,), (tx,)),
                                      backend="aot_eager", fullgraph=True))
    for mine, expected in zip(compiled, eager, strict=True):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)


def test_a_compiled_jvp_with_dynamic_shapes() -> None:
    """Traced with symbolic sizes (torch.compile's dynamic=True), the products' zero tensors
    take symbolic shapes: eager's numbers at every length."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                              torch.nn.Linear(16, 8, bias=False))
    conv = torch.nn.Conv1d(8, 8, 3, padding=1)

    def f(x):
        return conv(mlp(x).transpose(1, 2)).sum(dim=-1)

    torch._dynamo.reset()
    with jvp_attention.lean_zero_tangents():
        compiled = torch.compile(lambda x, tx: torch.func.jvp(f, (x,), (tx,)), dynamic=True,
                                 backend="aot_eager", fullgraph=True)
        for length in (5, 7, 11):
            x, tx = torch.randn(2, length, 8), torch.randn(2, length, 8)
            got, expected = compiled(x, tx), torch.func.jvp(f, (x,), (tx,))
            for mine, eager in zip(got, expected, strict=True):
                torch.testing.assert_close(mine, eager, rtol=0, atol=0)


def test_a_compiled_jvp_through_rmsnorm_weights() -> None:
    """RMSNorm's weight meets zero tangents in a sum and a product: compiled with the lean
    kernels on, eager's numbers. (With PyTorch's kernels alone torch 2.13 fails to compile
    it, an internal assert; torch 2.14 and 2.15 compile it both ways.)"""
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(8)
    torch.nn.init.normal_(norm.weight)
    assert_compiled_jvp_is_eagers(norm, torch.randn(2, 5, 8), torch.randn(2, 5, 8))
