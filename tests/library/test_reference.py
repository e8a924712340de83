"""jvp_attention.reference against PyTorch: SDPA, autograd and torch.func.jvp, in float64.

Each check compares the library with a few lines of softmax attention written here, apart from
the library, which PyTorch differentiates for us. The grid covers Nq != Nk, GQA, every mask
kind (with and without a row that sees no key), causal or not, and head dims 16 to 128 with
d_v != d_qk in some cases. Tolerances are tight (1e-10 in float64) so that a wrong formula fails.
"""

import ast
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jvp_attention.reference import (
    AttentionOutputs,
    attention_bias,
    expand_kv_heads,
    reference_attention,
    reference_backward,
    reference_backward_tangent,
    tiled_attention,
)

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "01_reference.py"
F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
BATCH = 2
LENGTHS = [(7, 13), (16, 5), (33, 33)]
HEADS = {"mha3": (3, 3, False), "gqa4-2": (4, 2, True), "mqa4-1": (4, 1, True)}
MASKS = ["nomask", "keypad", "additive", "emptyrow"]
DIMS = [(16, 16), (40, 24), (64, 64), (80, 48), (128, 128)]


# Tiny tensors: one intra-op thread is ~10x faster than a contended pool (conftest).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """torch.testing.assert_close in float64 with our tolerances (equal infinities pass)."""
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{name}: {m}")


# --- the independent implementation -------------------------------------------------------


def softmax_attention(q, k, v, bias, scale):
    """softmax(scale q kᵀ + bias) v with GQA by repetition; a row that sees no key gives 0."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = scale * q @ k.mT + bias
    empty = (scores == -math.inf).all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return probs @ v


def softmax_lse(q, k, bias, scale):
    """logsumexp of each row of scores; -inf on a row that sees no key."""
    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
    return torch.logsumexp(scale * q @ k.mT + bias, -1)


@dataclass
class Case:
    """One point of the grid: inputs, their tangents, the mask arguments, and the same mask
    as an additive bias of full shape (B, Hq, Nq, Nk) built without the library."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tangents: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    attn_mask: torch.Tensor | None
    is_causal: bool
    enable_gqa: bool
    scale: float | None
    bias: torch.Tensor

    @property
    def kwargs(self) -> dict:
        return {
            "attn_mask": self.attn_mask,
            "is_causal": self.is_causal,
            "scale": self.scale,
            "enable_gqa": self.enable_gqa,
        }

    @property
    def s(self) -> float:
        return self.q.shape[-1] ** -0.5 if self.scale is None else self.scale

    @property
    def empty(self) -> torch.Tensor:
        """(B, Hq, Nq): the rows that see no key."""
        return (self.bias == -math.inf).all(-1)

    def attention(self, q, k, v):
        return softmax_attention(q, k, v, self.bias, self.s)

    def lse(self, q, k):
        """softmax_lse with empty rows shifted to 0, so that its derivatives stay finite."""
        bias = self.bias.masked_fill(self.empty[..., None], 0.0)
        return softmax_lse(q, k, bias, self.s)


def make_case(lengths, heads, mask, causal, dims, seed) -> Case:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    (n_q, n_k), (h_q, h_kv, gqa), (d_qk, d_v) = lengths, HEADS[heads], dims
    q, k, v = (
        randn(BATCH, h_q, n_q, d_qk),
        randn(BATCH, h_kv, n_k, d_qk),
        randn(BATCH, h_kv, n_k, d_v),
    )
    tangents = (randn(*q.shape), randn(*k.shape), randn(*v.shape))
    visible = torch.ones(BATCH, h_q, n_q, n_k, dtype=torch.bool)
    added = torch.zeros(n_q, n_k, dtype=F64)
    attn_mask = None
    if mask == "keypad":  # (B, 1, 1, Nk): the second sequence is shorter; key 0 always visible
        lengths = torch.tensor([n_k, max(1, n_k // 2)])
        attn_mask = (torch.arange(n_k) < lengths[:, None])[:, None, None, :]
    elif mask == "additive":  # (Nq, Nk): random, a quarter -inf, key 0 always visible
        attn_mask = randn(n_q, n_k).masked_fill(
            torch.rand(n_q, n_k, generator=gen) < 0.25, -math.inf
        )
        attn_mask[:, 0] = 0.5
        added = attn_mask
    elif mask == "emptyrow":  # (Hq, Nq, Nk): random, key 0 visible except on one row of head 0
        attn_mask = torch.rand(h_q, n_q, n_k, generator=gen) < 0.7
        attn_mask[..., 0] = True
        attn_mask[0, n_q // 2] = False
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        visible = visible & attn_mask
    if causal:
        visible = visible & torch.ones(n_q, n_k, dtype=torch.bool).tril()
    bias = torch.zeros(visible.shape, dtype=F64).masked_fill(~visible, -math.inf) + added
    scale = None if seed % 3 else 0.37
    return Case(q, k, v, tangents, attn_mask, causal, gqa, scale, bias)


GRID = [
    pytest.param(
        (lengths, heads, mask, causal, DIMS[i % len(DIMS)], i),
        id=f"{lengths[0]}x{lengths[1]}-{heads}-{mask}-{'causal' if causal else 'full'}"
        f"-d{DIMS[i % len(DIMS)][0]}v{DIMS[i % len(DIMS)][1]}",
    )
    for i, (lengths, heads, mask, causal) in enumerate(
        itertools.product(LENGTHS, HEADS, MASKS, (False, True))
    )
]  # fmt: skip


@pytest.fixture(params=GRID)
def case(request) -> Case:
    return make_case(*request.param)


def jvp_of(case: Case, attention=None):
    """(out, tangent_out) of the independent implementation by torch.func.jvp."""
    return torch.func.jvp(attention or case.attention, (case.q, case.k, case.v), case.tangents)


# --- the forward and the JVP --------------------------------------------------------------


def test_reference_matches_softmax_attention(case: Case) -> None:
    result = reference_attention(case.q, case.k, case.v, **case.kwargs)
    assert isinstance(result, AttentionOutputs)
    assert result.tangent_out is None and result.mu is None
    assert_close(result.out, case.attention(case.q, case.k, case.v), "out")
    assert_close(result.lse, softmax_lse(case.q, case.k, case.bias, case.s), "lse")


def test_reference_matches_sdpa(case: Case) -> None:
    # SDPA refuses attn_mask together with is_causal, so it gets the combined bias; since
    # PyTorch 2.5 it also returns 0 on a row that sees no key.
    result = reference_attention(case.q, case.k, case.v, **case.kwargs)
    sdpa = F.scaled_dot_product_attention(
        case.q, case.k, case.v, attn_mask=case.bias, scale=case.scale, enable_gqa=case.enable_gqa
    )
    assert_close(result.out, sdpa, "out vs SDPA")


def test_reference_tangent_matches_jvp(case: Case) -> None:
    result = reference_attention(case.q, case.k, case.v, **case.kwargs, tangents=case.tangents)
    out, tangent_out = jvp_of(case)
    assert_close(result.out, out, "out")
    assert_close(result.tangent_out, tangent_out, "tangent_out")
    _, mu = torch.func.jvp(case.lse, (case.q, case.k), case.tangents[:2])
    assert_close(result.mu, mu.masked_fill(case.empty, 0.0), "mu vs jvp of logsumexp")


def test_tiled_matches_reference(case: Case) -> None:
    want = reference_attention(case.q, case.k, case.v, **case.kwargs, tangents=case.tangents)
    for block_n in (1, 3, 8, 64):
        got = tiled_attention(
            case.q, case.k, case.v, **case.kwargs, tangents=case.tangents, block_n=block_n
        )
        for field in AttentionOutputs._fields:
            assert_close(getattr(got, field), getattr(want, field), f"{field}, block_n={block_n}")
    plain = tiled_attention(case.q, case.k, case.v, **case.kwargs, block_n=5)
    assert plain.tangent_out is None and plain.mu is None
    assert_close(plain.out, want.out, "out without tangents")


# --- the backward -------------------------------------------------------------------------


def test_reference_backward_matches_autograd(case: Case) -> None:
    result = reference_attention(case.q, case.k, case.v, **case.kwargs)
    grad_out = torch.randn_like(result.out)
    grads = reference_backward(
        case.q, case.k, case.v, result.out, result.lse, grad_out, **case.kwargs
    )
    inputs = [x.clone().requires_grad_() for x in (case.q, case.k, case.v)]
    want = torch.autograd.grad(case.attention(*inputs), inputs, grad_out)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert_close(got, expected, name)


def test_autograd_and_forward_ad_through_reference(case: Case) -> None:
    """reference_attention itself is differentiable: its safe softmax has finite derivatives."""
    inputs = [x.clone().requires_grad_() for x in (case.q, case.k, case.v)]
    result = reference_attention(*inputs, **case.kwargs)
    grad_out, grad_lse = torch.randn_like(result.out), torch.randn_like(result.lse)
    lse = result.lse.masked_fill(case.empty, 0.0)
    got = torch.autograd.grad((result.out, lse), inputs, (grad_out, grad_lse))
    want_lse = case.lse(*inputs[:2]).masked_fill(case.empty, 0.0)
    want = torch.autograd.grad((case.attention(*inputs), want_lse), inputs, (grad_out, grad_lse))
    for name, g, expected in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_close(g, expected, f"autograd {name}")

    def forward(q, k, v):
        return reference_attention(q, k, v, **case.kwargs).out

    _, tangent_out = jvp_of(case, forward)
    _, want_tangent_out = jvp_of(case)
    assert_close(tangent_out, want_tangent_out, "torch.func.jvp through reference_attention")


def test_reference_backward_tangent_matches_autograd(case: Case) -> None:
    result = reference_attention(case.q, case.k, case.v, **case.kwargs, tangents=case.tangents)
    grad_out, grad_tangent_out = torch.randn_like(result.out), torch.randn_like(result.out)
    grads = reference_backward_tangent(
        case.q, case.k, case.v, case.tangents, result.out, result.lse, result.tangent_out, result.mu,
        grad_out, grad_tangent_out, **case.kwargs,
    )  # fmt: skip
    inputs = [x.clone().requires_grad_() for x in (case.q, case.k, case.v, *case.tangents)]
    out, tangent_out = torch.func.jvp(case.attention, tuple(inputs[:3]), tuple(inputs[3:]))
    want = torch.autograd.grad((out, tangent_out), inputs, (grad_out, grad_tangent_out))
    names = ("dq", "dk", "dv", "dt_query", "dt_key", "dt_value")
    for name, got, expected in zip(names, grads, want, strict=True):
        assert_close(got, expected, name)


@pytest.mark.parametrize("missing", ["grad_out", "grad_tangent_out"])
def test_backward_tangent_treats_missing_cotangents_as_zeros(missing: str) -> None:
    case = make_case((7, 13), "gqa4-2", "keypad", True, (40, 24), seed=1)
    result = reference_attention(case.q, case.k, case.v, **case.kwargs, tangents=case.tangents)
    cotangents = {
        "grad_out": torch.randn_like(result.out),
        "grad_tangent_out": torch.randn_like(result.out),
    }
    stored = (case.tangents, result.out, result.lse, result.tangent_out, result.mu)
    with_zeros = {**cotangents, missing: torch.zeros_like(result.out)}
    with_none = {**cotangents, missing: None}
    got = reference_backward_tangent(case.q, case.k, case.v, *stored, **with_none, **case.kwargs)
    want = reference_backward_tangent(case.q, case.k, case.v, *stored, **with_zeros, **case.kwargs)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    if missing == "grad_tangent_out":  # then only dO flows: the plain backward, no tangent grads
        plain = reference_backward(
            case.q, case.k, case.v, result.out, result.lse, cotangents["grad_out"], **case.kwargs
        )
        for g, w in zip(got[:3], plain, strict=True):
            assert_close(g, w, "plain backward")
        assert all(not g.any() for g in got[3:])


# --- rows that see no key -----------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_rows_without_visible_key_give_zeros_and_finite_gradients(causal: bool) -> None:
    case = make_case((16, 5), "gqa4-2", "emptyrow", causal, (16, 8), seed=2)
    empty = case.empty
    assert empty.any() and not empty.all()
    for result in (
        reference_attention(case.q, case.k, case.v, **case.kwargs, tangents=case.tangents),
        tiled_attention(case.q, case.k, case.v, **case.kwargs, tangents=case.tangents, block_n=2),
    ):
        assert not result.out[empty].any() and not result.tangent_out[empty].any()
        assert not result.mu[empty].any()
        assert (result.lse[empty] == -math.inf).all() and result.lse[~empty].isfinite().all()
        assert all(x.isfinite().all() for x in (result.out, result.tangent_out, result.mu))

    grad_out, grad_tangent_out = torch.randn_like(result.out), torch.randn_like(result.out)
    grads = reference_backward(
        case.q, case.k, case.v, result.out, result.lse, grad_out, **case.kwargs
    )
    grads_tangent = reference_backward_tangent(
        case.q, case.k, case.v, case.tangents, result.out, result.lse, result.tangent_out, result.mu,
        grad_out, grad_tangent_out, **case.kwargs,
    )  # fmt: skip
    assert all(g.isfinite().all() for g in (*grads, *grads_tangent))
    assert not grads[0][empty].any() and not grads_tangent[0][empty].any()
    assert not grads_tangent[3][empty].any()

    inputs = [x.clone().requires_grad_() for x in (case.q, case.k, case.v)]
    reference_attention(*inputs, **case.kwargs).out.backward(grad_out)
    assert all(x.grad.isfinite().all() for x in inputs) and not inputs[0].grad[empty].any()


def test_empty_row_convention_matches_sdpa_not_the_textbook() -> None:
    case = make_case((7, 13), "mha3", "emptyrow", False, (16, 16), seed=3)
    textbook = torch.softmax(case.s * case.q @ case.k.mT + case.bias, -1) @ case.v
    assert textbook[case.empty].isnan().all()
    ours = reference_attention(case.q, case.k, case.v, **case.kwargs).out
    sdpa = F.scaled_dot_product_attention(case.q, case.k, case.v, attn_mask=case.attn_mask)
    assert torch.equal(ours[case.empty], sdpa[case.empty])


# --- masks, heads, dtypes -----------------------------------------------------------------


@pytest.mark.parametrize("n_q, n_k", [(7, 13), (16, 5), (6, 6)])
def test_is_causal_is_top_left_like_sdpa(n_q: int, n_k: int) -> None:
    q, k, v = (torch.randn(1, 2, n, 8, dtype=F64) for n in (n_q, n_k, n_k))
    ours = reference_attention(q, k, v, is_causal=True).out
    assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True), "causal")
    bias = attention_bias(None, True, n_q, n_k, F64, "cpu")
    assert torch.equal(bias == 0, torch.ones(n_q, n_k, dtype=torch.bool).tril())


def test_attention_bias_keeps_the_mask_shape() -> None:
    assert attention_bias(None, False, 3, 5, F64, "cpu") is None
    key_padding = torch.tensor([[True] * 5, [True, True, False, False, False]])[:, None, None, :]
    bias = attention_bias(key_padding, False, 3, 5, F64, "cpu")
    assert bias.shape == (2, 1, 1, 5) and bias.dtype == F64
    assert torch.equal(bias == 0, key_padding)
    both = attention_bias(key_padding, True, 3, 5, F64, "cpu")
    assert both.shape == (2, 1, 3, 5)
    assert torch.equal(both == 0, key_padding & torch.ones(3, 5, dtype=torch.bool).tril())
    additive = torch.randn(3, 5, dtype=torch.float32)
    assert torch.equal(attention_bias(additive, False, 3, 5, F64, "cpu"), additive.to(F64))
    assert attention_bias(torch.zeros(5), False, 3, 5, F64, "cpu").shape == (1, 5)


def test_expand_kv_heads() -> None:
    x = torch.randn(2, 3, 5, 4)
    assert expand_kv_heads(x, 3) is x
    expanded = expand_kv_heads(x, 6)
    assert torch.equal(expanded[:, 0::2], x) and torch.equal(expanded[:, 1::2], x)
    with pytest.raises(ValueError, match=r"query heads \(4\).*key/value heads \(3\)"):
        expand_kv_heads(x, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_inputs_accumulate_in_float32(dtype: torch.dtype) -> None:
    case = make_case((7, 13), "gqa4-2", "keypad", True, (16, 8), seed=4)
    low = [x.to(dtype) for x in (case.q, case.k, case.v, *case.tangents)]
    want = reference_attention(case.q, case.k, case.v, **case.kwargs, tangents=case.tangents)
    for attention in (reference_attention, tiled_attention):
        got = attention(*low[:3], **case.kwargs, tangents=tuple(low[3:]))
        assert got.out.dtype == got.tangent_out.dtype == dtype
        assert got.lse.dtype == got.mu.dtype == torch.float32
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        for field in AttentionOutputs._fields:
            torch.testing.assert_close(
                getattr(got, field).double(), getattr(want, field), rtol=tol, atol=tol
            )
    grad_out = torch.randn_like(want.out).to(dtype)
    grads = reference_backward(
        *low[:3], want.out.to(dtype), want.lse.float(), grad_out, **case.kwargs
    )
    assert [g.dtype for g in grads] == [dtype] * 3


# --- bad inputs ---------------------------------------------------------------------------


def _inputs(h_q=4, h_kv=4, n_q=5, n_k=6, d=8, d_v=8, dtype=F64):
    return (
        torch.randn(2, h_q, n_q, d, dtype=dtype),
        torch.randn(2, h_kv, n_k, d, dtype=dtype),
        torch.randn(2, h_kv, n_k, d_v, dtype=dtype),
    )


def _swap(inputs, index, new):
    inputs = list(inputs)
    inputs[index] = new
    return tuple(inputs)


BAD_INPUTS = {
    "heads without enable_gqa": (_inputs(h_kv=2), {}, r"heads.*query \(2, 4, 5, 8\).*enable_gqa"),
    "heads not a multiple": (_inputs(h_kv=3), {"enable_gqa": True}, r"multiple"),
    "head dim of key": (
        _swap(_inputs(), 1, torch.randn(2, 4, 6, 7, dtype=F64)),
        {},
        r"key.*head dim",
    ),
    "length of value": (
        _swap(_inputs(), 2, torch.randn(2, 4, 5, 8, dtype=F64)),
        {},
        r"key and value",
    ),
    "leading dims": (_swap(_inputs(), 0, torch.randn(3, 4, 5, 8, dtype=F64)), {}, r"leading dims"),
    "too few dims": (
        _swap(_inputs(), 0, torch.randn(5, 8, dtype=F64)),
        {},
        r"query.*\(\.\.\., heads",
    ),

    "mask shape": (
        _inputs(),
        {"attn_mask": torch.ones(5, 7, dtype=torch.bool)},
        r"attn_mask.*\(5, 7\)",
    ),
    "mask extra dims": (
        _inputs(),
        {"attn_mask": torch.ones(3, 2, 4, 5, 6, dtype=torch.bool)},
        r"attn_mask",
    ),
}


@pytest.mark.parametrize("function", [reference_attention, tiled_attention, reference_backward])
@pytest.mark.parametrize("inputs, kwargs, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_inputs_raise_value_error(function, inputs, kwargs, message) -> None:
    extra = ()
    if function is reference_backward:
        q, _, v = inputs
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        extra = (out, q.new_zeros(q.shape[:-1]), out)  # out, lse, grad_out
    with pytest.raises(ValueError, match=message):
        function(*inputs, *extra, **kwargs)


BAD_TYPES = {
    "dtypes differ": (_swap(_inputs(), 2, torch.randn(2, 4, 6, 8)), {}, r"dtype"),
    "integer mask": (_inputs(), {"attn_mask": torch.ones(5, 6, dtype=torch.int64)}, r"attn_mask"),
}


@pytest.mark.parametrize("function", [reference_attention, tiled_attention])
@pytest.mark.parametrize("inputs, kwargs, message", BAD_TYPES.values(), ids=BAD_TYPES.keys())
def test_bad_types_raise_type_error(function, inputs, kwargs, message) -> None:
    """The references share the library's validator (`check_sdpa_arguments`): a wrong dtype
    or type is a TypeError there as in `attention`."""
    with pytest.raises(TypeError, match=message):
        function(*inputs, **kwargs)


def test_bad_tangents_and_block_n_raise_value_error() -> None:
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"tangents must be \(t_query, t_key, t_value\)"):
        reference_attention(q, k, v, tangents=(q, k))
    with pytest.raises(ValueError, match=r"t_key.*\(2, 4, 6, 7\)"):
        tiled_attention(q, k, v, tangents=(q, k[..., :7], v))
    with pytest.raises(ValueError, match=r"block_n"):
        tiled_attention(q, k, v, block_n=0)


# --- the notebook -------------------------------------------------------------------------


def test_notebook_checks_every_export_right_after_defining_it() -> None:
    """Static: the chapter shows and checks each exported name, and skips nothing.

    Running the notebook is tests/repository/test_notebooks.py's job; this makes sure that the cells it
    runs do check something: every public exported name is used by a later plain code cell
    that calls `check` or asserts, `check` itself asserts, and nothing is skipped.
    """
    jupytext = pytest.importorskip("jupytext")
    cells = [c for c in jupytext.read(NOTEBOOK).cells if c.cell_type == "code"]
    exported = [c for c in cells if "export" in c.metadata.get("tags", [])]
    shown = [c.source for c in cells if c not in exported]
    assert any("assert diff <= tol" in source for source in shown), "check() must assert"
    assert not any(re.search(r"\bskip\(|if False|pytest", source) for source in shown)
    assert sum(source.count("check(") for source in shown) >= 20

    for cell in exported:
        names = [
            node.name
            for node in ast.parse(cell.source).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
        ]
        later = [c.source for c in cells[cells.index(cell) + 1 :] if c not in exported]
        for name in names:
            assert (
                any(
                    re.search(rf"\b{name}\b", source) and ("check(" in source or "assert" in source)
                    for source in later
                )
                or name == "AttentionOutputs"
            ), f"{name} is never checked after its definition"
