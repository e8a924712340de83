"""The tensor-descriptor (TMA) path of chapter 4: the same kernels with USE_TMA on.

On CPU, Triton's interpreter emulates descriptors (zero-filled out-of-bounds reads), so the
path is forced with JVP_ATTENTION_TMA=1 and must give the pointer path's results bit for bit.
On the GPU, descriptors are chosen automatically on Hopper for aligned inputs: there both
paths are checked against float64 at realistic sizes.
"""

import os
from contextlib import contextmanager

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
    kernel_second_order,
    make_problem,
)

from jvp_attention import backward as backward_module
from jvp_attention import forward as forward_module
from jvp_attention.backward import BACKWARD_TMA_MIN_TOKENS
from jvp_attention.forward import FORWARD_TMA_MIN_KEYS
from jvp_attention.launch import descriptor_compatible, tma_eligible

CPU_DTYPES = [torch.float16, torch.float32]
# Ragged lengths (descriptor reads past each head's end must be zeros), GQA, d_qk != d_v
# with a head dim that is not a power of two, masks, causal with Nq != Nk.
CPU_SPECS = [
    Spec(batch=2, hq=4, hkv=2, nq=45, nk=37, d=80, dv=48, mask="keypad"),
    Spec(batch=1, hq=2, hkv=2, nq=50, nk=33, d=16, causal=True, layout="bnhd"),
    Spec(batch=1, hq=2, hkv=1, nq=33, nk=70, d=32, mask="additive", causal=True),
]


@contextmanager
def descriptors(setting: str):
    before = os.environ.get("JVP_ATTENTION_TMA")
    os.environ["JVP_ATTENTION_TMA"] = setting
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("JVP_ATTENTION_TMA")
        else:
            os.environ["JVP_ATTENTION_TMA"] = before


def both_paths(run, p):
    with descriptors("1"):
        tma = run(p)
    with descriptors("0"):
        pointers = run(p)
    return tma, pointers


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("spec", CPU_SPECS, ids=lambda s: s.id)
@pytest.mark.parametrize("run", [kernel_forward, kernel_backward, kernel_second_order],
                         ids=["forward", "backward", "second_order"])
def test_descriptor_path_equals_pointer_path(run, spec: Spec, dtype: torch.dtype) -> None:
    if DEVICE != "cpu":
        pytest.skip("the interpreter's descriptors; the GPU test below covers the hardware")
    p = make_problem(spec, dtype)
    tma, pointers = both_paths(run, p)
    for name in pointers:
        assert torch.equal(tma[name], pointers[name]), f"{name} [{p.label}] differs"


def test_descriptor_rules() -> None:
    x = torch.randn(2, 4, 64, 80)
    assert descriptor_compatible(x)
    assert descriptor_compatible(x.transpose(1, 2).contiguous().transpose(1, 2))  # (B, N, H, D)
    assert not descriptor_compatible(x.transpose(-1, -2))  # rows not contiguous
    assert not descriptor_compatible(torch.randn(2, 4, 64, 84, dtype=torch.float16)[..., :81])  # 168-byte rows
    assert not descriptor_compatible(torch.ones(1, 1, 1, 80).expand(2, 4, 64, 80))  # stride 0
    with descriptors("0"):
        assert not tma_eligible(x)
    with descriptors("1"):
        assert tma_eligible(x)
        assert tma_eligible(x, long_enough=False)  # forced means forced
    with descriptors("auto"):
        assert not tma_eligible(x.to(DEVICE), long_enough=False)
    if DEVICE == "cpu":
        with descriptors("auto"):
            assert not tma_eligible(x)  # never on CPU tensors unless forced


@pytest.mark.parametrize("n_k", [FORWARD_TMA_MIN_KEYS - 1, FORWARD_TMA_MIN_KEYS])
def test_forward_takes_descriptors_from_its_minimum_keys(monkeypatch, n_k: int) -> None:
    """Short rows read their tiles through pointers: the forward asks for descriptors only
    when its rows are long enough to repay building them."""
    asked = []

    def recorded(*tensors, long_enough=True):
        asked.append(long_enough)
        return False

    monkeypatch.setattr(forward_module, "tma_eligible", recorded)
    q = torch.randn(1, 1, 16, 16, device=DEVICE, dtype=torch.float16)
    k = torch.randn(1, 1, n_k, 16, device=DEVICE, dtype=torch.float16)
    forward_module.flash_attention_forward(q, k, k)
    assert asked == [n_k >= FORWARD_TMA_MIN_KEYS]


@pytest.mark.parametrize("n_q, n_k", [(BACKWARD_TMA_MIN_TOKENS - 1, BACKWARD_TMA_MIN_TOKENS),
                                      (BACKWARD_TMA_MIN_TOKENS, BACKWARD_TMA_MIN_TOKENS - 1),
                                      (BACKWARD_TMA_MIN_TOKENS, BACKWARD_TMA_MIN_TOKENS)])
def test_backward_takes_descriptors_when_both_loops_are_long(monkeypatch, n_q: int,
                                                            n_k: int) -> None:
    """The dQ kernel loops over the keys and the dK/dV kernel over the queries: the
    first-order backward reads through descriptors only when both are long enough
    (`long_backward_rows`). (The call stops at the question: these lengths would take
    minutes in the interpreter.)"""
    verdicts = []
    chosen = backward_module.long_backward_rows

    class Asked(Exception):
        pass

    def recorded(q, n_q, n_k):
        verdicts.append(chosen(q, n_q, n_k))
        raise Asked

    monkeypatch.setattr(backward_module, "long_backward_rows", recorded)
    q = torch.randn(1, 1, n_q, 16, device=DEVICE, dtype=torch.float16)
    k = torch.randn(1, 1, n_k, 16, device=DEVICE, dtype=torch.float16)
    lse = torch.zeros(1, 1, n_q, device=DEVICE)
    with pytest.raises(Asked):
        backward_module.flash_attention_backward(q, k, k, q, lse, torch.ones_like(q))
    assert verdicts == [min(n_q, n_k) >= BACKWARD_TMA_MIN_TOKENS]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
def test_descriptor_path_on_the_gpu(dtype: torch.dtype) -> None:
    """N = 4250 (ragged against every tile), GQA, key padding, causal: the automatic choice
    (descriptors on Hopper) and the pointer path, both against float64."""
    p = make_problem(Spec(batch=1, hq=8, hkv=2, nq=4250, nk=4250, d=128, mask="keypad",
                          causal=True), dtype, device="cuda")
    if torch.cuda.get_device_capability()[0] >= 9:
        with descriptors("auto"):
            assert tma_eligible(p.q, p.k, p.v, *p.tangents)
    truth, floor = expected_forward(p)
    for setting in ("auto", "0"):
        with descriptors(setting):
            assert_accurate(kernel_forward(p), truth, floor, dtype, p.label,
                            f"forward, JVP_ATTENTION_TMA={setting}")
    truth, floor = expected_backward(p)
    for setting in ("auto", "0"):
        with descriptors(setting):
            assert_accurate(kernel_backward(p), truth, floor, dtype, p.label,
                            f"backward, JVP_ATTENTION_TMA={setting}")
