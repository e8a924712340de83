"""The fused forward kernel (`flash_attention_forward`): O and LSE, and with tangents tO and mu,
against the float64 reference, within twice PyTorch's own error (see tests/helpers.py).

On CPU the kernel runs in Triton's interpreter on tiny shapes (fp32 and fp16); the tests
marked `gpu` repeat the grid at realistic sizes in fp16, bf16 and fp32.
"""


import pytest
import torch
import triton
import triton.language as tl
from helpers import (
    BF16,
    COMMON_GPU_CASES,
    CPU_CASES,
    DEVICE,
    F16,
    F32,
    FUZZ_STRATEGIES,
    GPU_BIAS_CASES,
    MASK_KINDS,
    OTHER_PATH_CASES,
    Spec,
    assert_accurate,
    assert_deterministic,
    assert_empty_rows_are_zero,
    assert_every_tile_reproducible,
    bias_params,
    check_with_bias,
    cpu_grid,
    dtype_name,
    expected_forward,
    expected_with_bias,
    fuzz_settings,
    fuzz_spec,
    gpu_params,
    kernel_forward,
    kernel_with_bias,
    make_bias,
    make_problem,
    poisoned_allocations,
    precision,
)
from hypothesis import given

import jvp_attention.forward
import jvp_attention.launch
from jvp_attention.forward import flash_attention_forward
from jvp_attention.tiles import query_program

# Tiny tensors: one intra-op thread is ~10x faster than a contended pool (conftest).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_forward(spec: Spec, dtype: torch.dtype, seed: int = 0, device: str = DEVICE,
                  with_plain: bool = True) -> None:
    """The whole forward contract on one problem: accuracy of every output with and without
    tangents, zeros (not NaN) on rows that see no key, and every output entry written."""
    p = make_problem(spec, dtype, seed, device)
    truth, floor = expected_forward(p)
    ours = kernel_forward(p)
    assert_accurate(ours, truth, floor, dtype, p.label, "forward with tangents")
    assert_empty_rows_are_zero(p, ours)
    if with_plain:  # HAS_TANGENT=False is a separately compiled kernel: check it too
        plain = kernel_forward(p, with_tangents=False)
        names = ("out", "lse")
        assert_accurate(plain, {n: truth[n] for n in names}, {n: floor[n] for n in names},
                        dtype, p.label, "forward without tangents")
        assert_empty_rows_are_zero(p, plain)


# --- the CPU grid -------------------------------------------------------------------------


@pytest.mark.parametrize("spec, dtype", cpu_grid())
def test_forward_grid(spec: Spec, dtype: torch.dtype) -> None:
    check_forward(spec, dtype)


def test_grid_covers_every_feature() -> None:
    """Guards the grid itself against losing a case the brief asks for."""
    masks = {s.mask for s in CPU_CASES}
    assert masks == set(MASK_KINDS)
    lengths = {n for s in CPU_CASES for n in (s.nq, s.nk)}
    assert {1, 17, 33, 40} <= lengths
    assert any(s.nq > s.nk for s in CPU_CASES) and any(s.nq < s.nk for s in CPU_CASES)
    assert {(4, 2), (4, 1), (2, 2)} <= {(s.hq, s.hkv) for s in CPU_CASES}
    assert {16, 40, 64, 72, 80} <= {s.d for s in CPU_CASES}
    assert any(s.dv is not None and s.dv != s.d for s in CPU_CASES)
    assert {"bnhd"} <= {s.layout for s in CPU_CASES}
    assert {"expanded", "bnhd", "tangent_only"} <= {s.cotangent for s in CPU_CASES}
    assert any(s.scale is not None for s in CPU_CASES)
    # head dims cut into two tiles (72 = 64 + 16), for q/k and for v
    tiles = [jvp_attention.launch.column_tiles(s.d, s.dv or s.d) for s in CPU_CASES]
    assert any(t["D_TAIL"] for t in tiles) and any(t["DV_TAIL"] for t in tiles)


def test_column_tiles_skip_most_of_the_padding() -> None:
    column_tiles = jvp_attention.launch.column_tiles
    cuts = {d: (column_tiles(d, d)["BLOCK_D"], column_tiles(d, d)["D_TAIL"])
            for d in (13, 16, 24, 40, 64, 72, 96, 100, 128, 160, 256)}
    assert cuts == {13: (16, 0), 16: (16, 0), 24: (32, 0), 40: (32, 16), 64: (64, 0),
                    72: (64, 16), 96: (64, 32), 100: (128, 0), 128: (128, 0), 160: (128, 32),
                    256: (256, 0)}
    assert column_tiles(128, 72) == {"BLOCK_D": 128, "D_TAIL": 0, "BLOCK_DV": 64,
                                     "DV_TAIL": 16}


def test_tails_pair_when_they_fill_at_most_half_their_tile() -> None:
    launch = jvp_attention.launch
    flags = {(d, dv): launch.pair_tails(launch.column_tiles(d, dv), d, dv, True)
             for d, dv in ((72, 72), (40, 40), (80, 80), (96, 96), (64, 64), (72, 80))}
    assert flags == {
        (72, 72): {"PAIR_D": True, "PAIR_DV": True}, (40, 40): {"PAIR_D": True, "PAIR_DV": True},
        (80, 80): {"PAIR_D": False, "PAIR_DV": False}, (96, 96): {"PAIR_D": False, "PAIR_DV": False},
        (64, 64): {"PAIR_D": False, "PAIR_DV": False}, (72, 80): {"PAIR_D": True, "PAIR_DV": False}}
    # without the tangent, or through descriptors, nothing pairs
    assert launch.pair_tails(launch.column_tiles(72, 72), 72, 72, False) == {
        "PAIR_D": False, "PAIR_DV": False}


@pytest.mark.parametrize("d, dv", [(72, 72), (40, 72), (72, 40), (80, 72)])
def test_paired_tails_give_the_unpaired_result(monkeypatch, d: int, dv: int) -> None:
    """The paired tail products (`pair_tails`) change which products run, not their sums:
    fp16 in accurate precision (split products, where tails pair), against the same launch
    with pairing off, to within one fp16 rounding of the outputs."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 45, d, device=DEVICE, dtype=torch.float16)
    k, tk = (torch.randn(2, 2, 37, d, device=DEVICE, dtype=torch.float16) for _ in range(2))
    v, tv = (torch.randn(2, 2, 37, dv, device=DEVICE, dtype=torch.float16) for _ in range(2))
    tq = torch.randn_like(q)
    keep = torch.rand(2, 1, 45, 37, device=DEVICE) > 0.2
    chosen = []
    pair_tails = jvp_attention.forward.pair_tails

    def spy(*args):
        chosen.append(pair_tails(*args))
        return chosen[-1]

    def run():
        with jvp_attention.precision("accurate"):
            return flash_attention_forward(q, k, v, keep, True, None, (tq, tk, tv))

    monkeypatch.setattr(jvp_attention.forward, "pair_tails", spy)
    paired = run()
    assert chosen == [{"PAIR_D": d != 80, "PAIR_DV": dv != 80}]
    monkeypatch.setattr(jvp_attention.forward, "pair_tails",
                        lambda tiles, *_: {"PAIR_D": False, "PAIR_DV": False})
    unpaired = run()
    for name in ("out", "tangent_out"):
        torch.testing.assert_close(getattr(paired, name), getattr(unpaired, name),
                                   rtol=2**-10, atol=2**-12, msg=name)
    for name in ("lse", "mu"):
        torch.testing.assert_close(getattr(paired, name), getattr(unpaired, name),
                                   rtol=1e-5, atol=1e-5, msg=name)


def test_tails_pair_only_where_products_split(monkeypatch) -> None:
    """Fast precision (one product each) and fp32 inputs leave the tails unpaired."""
    chosen = []
    pair_tails = jvp_attention.forward.pair_tails
    monkeypatch.setattr(jvp_attention.forward, "pair_tails",
                        lambda *args: chosen.append(pair_tails(*args)) or chosen[-1])
    for dtype, mode in ((torch.float16, "fast"), (torch.float32, "accurate")):
        q, k, v, tq, tk, tv = (torch.randn(1, 2, 20, 72, device=DEVICE, dtype=dtype)
                               for _ in range(6))
        with jvp_attention.precision(mode):
            flash_attention_forward(q, k, v, None, False, None, (tq, tk, tv))
    assert chosen == [{"PAIR_D": False, "PAIR_DV": False}] * 2


# --- properties of the kernel beyond accuracy ---------------------------------------------


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
def test_lse_dtype_follows_the_mask(mask: str | None) -> None:
    """LSE is fp32, and fp64 with an additive mask, whose bias can put a row's scores near
    the lowest score (chapter 2's `LOWEST_SCORE`), where fp32 could not hold log2 of the
    row's sum beside them; mu stays fp32."""
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(3))
    attn_mask = {None: None, "bool": torch.rand(9, 9, device=DEVICE) > 0.3,
                 "additive": torch.randn(9, 9, device=DEVICE)}[mask]
    result = flash_attention_forward(q, k, v, attn_mask, tangents=(q, k, v))
    assert result.lse.dtype == (torch.float64 if mask == "additive" else torch.float32)
    assert result.lse.dtype == jvp_attention.forward.lse_dtype(attn_mask)  # the fakes' rule
    assert result.mu.dtype == torch.float32


@pytest.mark.parametrize("spec", [
    Spec(hq=2, hkv=1, nq=33, nk=17, d=40, mask="empty_rows", causal=True),
    Spec(batch=2, nq=17, nk=40, d=64, mask="additive4d", layout="bnhd"),
], ids=lambda s: s.id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
def test_forward_is_deterministic_and_writes_every_output(spec: Spec, dtype) -> None:
    """Two runs whose outputs start as different garbage (NaN, then 7.0) agree bit for bit:
    the kernel writes every entry, and writes it the same way each time."""
    p = make_problem(spec, dtype, seed=3)
    assert_deterministic(kernel_forward, p)


def test_the_accuracy_rule_catches_a_small_error() -> None:
    """The tolerance has teeth: the kernel's own result, off by 1e-2 in one entry, fails."""
    for dtype in (torch.float32, torch.float16):
        p = make_problem(Spec(hq=4, hkv=2, nq=17, nk=33, d=64, mask="keypad", batch=2), dtype)
        truth, floor = expected_forward(p)
        ours = kernel_forward(p)
        assert_accurate(ours, truth, floor, dtype, p.label)
        for name in ours:
            off = dict(ours)
            off[name] = ours[name].clone()
            off[name][0, 0, 0, ...] += 1e-2
            with pytest.raises(AssertionError, match=f"{name}: max error"):
                assert_accurate(off, truth, floor, dtype, p.label)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("spec", OTHER_PATH_CASES, ids=lambda s: s.id)
def test_forward_in_fast_precision(spec: Spec, dtype: torch.dtype) -> None:
    """precision "fast": one 16-bit rounding per product, as FlashAttention does."""
    with precision("fast"):
        check_forward(spec, dtype, with_plain=False)


def test_poison_reaches_the_launchers() -> None:
    """The launchers allocate through `torch.empty(_like)` of the torch module they import:
    inside `poisoned_allocations` those return NaN, so an entry no kernel writes stays NaN."""
    import jvp_attention.backward

    original = torch.empty, torch.empty_like
    with poisoned_allocations():
        assert jvp_attention.forward.torch.empty(3, 2).isnan().all()
        assert jvp_attention.backward.torch.empty_like(torch.zeros(4)).isnan().all()
        assert jvp_attention.forward.torch.empty(3, dtype=torch.int32).dtype == torch.int32
    assert (torch.empty, torch.empty_like) == original, "the patch must be undone"


def test_large_scores_do_not_overflow() -> None:
    """Scores of +-1e3 (an unnormalised model): the online softmax must stay exact."""
    p = make_problem(Spec(hq=2, hkv=1, nq=33, nk=40, d=16, scale=60.0), torch.float32, seed=5)
    truth, floor = expected_forward(p)
    assert_accurate(kernel_forward(p), truth, floor, torch.float32, p.label)


def test_shifted_key_tangent_keeps_the_tangent_accurate() -> None:
    """A large common offset on tK shifts tS row-wise; the epilogue tO = G/l - mu O then
    cancels two large terms (notebook 03). fp32 must still be within the rule."""
    p = make_problem(Spec(nq=40, nk=40, d=64), torch.float32, seed=6)
    tq, tk, tv = p.tangents
    p.tangents = (tq, tk + 4.0, tv)
    truth, floor = expected_forward(p)
    assert_accurate(kernel_forward(p), truth, floor, torch.float32, p.label)


def test_columns_at_other_strides_give_the_same_results() -> None:
    """The kernels read columns at unit stride: operands whose last dimension is not
    contiguous are copied by the launcher and give the contiguous operands' results bit for
    bit, with tangents and without. A dimension of one entry (any stride) is used as it is,
    and stride-0 dimensions stay broadcast in the copy."""
    p = make_problem(Spec(batch=2, hq=4, hkv=2, nq=33, nk=17, d=16, dv=24, mask="keypad",
                          causal=True), torch.float32)
    contiguous = kernel_forward(p), kernel_forward(p, with_tangents=False)
    p.q, p.k, p.v = (x.mT.contiguous().mT for x in (p.q, p.k, p.v))
    p.tangents = tuple(x.mT.contiguous().mT for x in p.tangents)
    assert all(x.stride(-1) != 1 for x in (p.q, p.k, p.v, *p.tangents))
    strided = kernel_forward(p), kernel_forward(p, with_tangents=False)
    for ours, theirs in zip(strided, contiguous, strict=True):
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), name
    column = torch.randn(2, 3, 5, 1).transpose(0, 1)
    assert jvp_attention.launch.unit_last_stride(column) is column
    ones = torch.ones(()).expand(2, 3, 5, 4)
    assert jvp_attention.launch.unit_last_stride(ones).stride() == (0, 0, 0, 1)


def test_tuned_tiles_are_looked_up_by_key(monkeypatch) -> None:
    """`KeyedAutotuner` times the candidates once per key (Triton's: the key arguments and
    the tensors' dtypes) and then launches the chosen tile without timing again; another
    length bucket or dtype is a new key. Timings are stubbed: the interpreter cannot time."""
    from triton import Config

    configs = [Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1),
               Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    tuner = jvp_attention.launch.KeyedAutotuner(
        jvp_attention.forward._attention_forward.fn, configs, jvp_attention.launch.AUTOTUNE_KEYS)
    timed = []

    def bench(*args, config, **kwargs):
        timed.append(config)
        return [1.0 if config is configs[1] else 2.0]

    monkeypatch.setattr(tuner, "_bench", bench)
    monkeypatch.setattr(tuner, "cache_results", False)  # on a GPU: not the disk's timings
    monkeypatch.delenv("JVP_ATTENTION_AUTOTUNE", raising=False)  # every candidate
    monkeypatch.setattr(jvp_attention.forward, "_attention_forward", tuner)
    p = make_problem(Spec(nq=40, nk=24), torch.float32)
    first = kernel_forward(p, with_tangents=False)
    assert timed == configs and tuner.best_config is configs[1]
    again = kernel_forward(p, with_tangents=False)
    assert len(timed) == 2 and tuner.best_config is configs[1]
    for name in first:
        assert torch.equal(first[name], again[name]), name
    kernel_forward(make_problem(Spec(nq=80, nk=24), torch.float32), with_tangents=False)
    kernel_forward(make_problem(Spec(nq=40, nk=24), torch.float16), with_tangents=False)
    assert len(timed) == 6
    assert len(tuner.tuned) == len(tuner.cache) == 3



def test_candidates_are_timed_briefly(monkeypatch) -> None:
    """Every `KeyedAutotuner` times a candidate with `time_candidate`: Triton's do_bench
    for TUNING_REP_MS after TUNING_WARMUP_MS, not Triton's default 100 and 25 ms."""
    import triton

    launch = jvp_attention.launch
    assert launch.TUNING_REP_MS < 100 and launch.TUNING_WARMUP_MS < 25
    for tuner in (jvp_attention.forward._attention_forward,
                  jvp_attention.backward._backward_dkdv):
        assert isinstance(tuner, launch.KeyedAutotuner)
        assert tuner.do_bench is launch.time_candidate
    seen = {}
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda call, **options: seen.update(options) or [0.1])
    assert launch.time_candidate(lambda: None, quantiles=(0.5,)) == [0.1]
    assert seen == {"warmup": launch.TUNING_WARMUP_MS, "rep": launch.TUNING_REP_MS,
                    "quantiles": (0.5,)}

# --- fuzzing ------------------------------------------------------------------------------

@fuzz_settings("JVP_FUZZ_EXAMPLES", 120)
@given(**FUZZ_STRATEGIES)
def test_forward_fuzz(batch, hkv, group, nq, nk, d, dv, causal, mask, dtype, seed) -> None:
    spec = fuzz_spec(batch, hkv, group, nq, nk, d, dv, causal, mask)
    check_forward(spec, dtype, seed, with_plain=False)


# --- GPU: realistic sizes -----------------------------------------------------------------
# One dtype and causal setting per case (every combination would compile and autotune a
# kernel per case: minutes on the GPU); together they cover fp16/bf16/fp32, causal or not,
# N = 1000/4250/8191 (and 16384 below), Nq != Nk, GQA and MQA, every mask kind, head dims
# 64/96/128/192/256 with d_v != d_qk, the (B, N, H, D) layout and an explicit scale.
GPU_CASES = COMMON_GPU_CASES + [
    (Spec(batch=1, hq=8, hkv=2, nq=4250, nk=4250, d=128, mask="keypad", causal=True), BF16),
    (Spec(batch=1, hq=8, hkv=2, nq=4250, nk=4250, d=128), F16),
    (Spec(batch=1, hq=4, hkv=1, nq=1000, nk=4250, d=96, mask="keypad"), F32),
    (Spec(batch=2, hq=4, hkv=4, nq=1000, nk=1000, d=192, dv=128, mask="additive4d",
          causal=True), BF16),
    (Spec(batch=1, hq=4, hkv=4, nq=1000, nk=1000, d=256, mask="empty_rows"), F16),
    (Spec(batch=1, hq=2, hkv=2, nq=8191, nk=8191, d=128, mask="bool", layout="bnhd"), BF16),
    (Spec(batch=2, hq=4, hkv=2, nq=4250, nk=1000, d=64, mask="empty_batch", causal=True,
          scale=0.2), F16),
    (Spec(batch=1, hq=4, hkv=4, nq=1000, nk=1000, d=128, mask="additive"), BF16),
]


FORWARD_TUNERS = ["_attention_forward", "_attention_forward_jvp"]


@pytest.mark.parametrize("name", FORWARD_TUNERS)
def test_every_forward_tile_is_reproducible(name: str, monkeypatch) -> None:
    """The check below at a small shape, wherever the tests run (under the interpreter the
    list is its one tile)."""
    p = make_problem(Spec(nq=40, nk=40, d=16), F16 if DEVICE == "cpu" else BF16, seed=1)
    assert_every_tile_reproducible(getattr(jvp_attention.forward, name),
                                   lambda: kernel_forward(p, name.endswith("_jvp")),
                                   monkeypatch, calls=2)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 72, 64])
@pytest.mark.parametrize("name", FORWARD_TUNERS)
def test_every_forward_tile_is_reproducible_gpu(name: str, head_dim: int, monkeypatch) -> None:
    """Each tile of the forward's lists (the Triton kernels: chapter 11's warp-specialized
    ones switched off), forced in turn, gives bitwise the same outputs and row statistics
    in five calls (bf16 "accurate": carried at 1024 keys), as chapter 6's racing tile did
    not."""
    monkeypatch.setenv("JVP_ATTENTION_WARP_SPECIALIZED", "0")
    p = make_problem(Spec(batch=2, hq=8, hkv=8, nq=1024, nk=1024, d=head_dim), BF16, seed=1,
                     device="cuda")
    assert_every_tile_reproducible(getattr(jvp_attention.forward, name),
                                   lambda: kernel_forward(p, name.endswith("_jvp")),
                                   monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("spec, dtype", gpu_params(GPU_CASES))
def test_forward_gpu(spec: Spec, dtype: torch.dtype) -> None:
    check_forward(spec, dtype, device="cuda", with_plain=False)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_gpu_16k(causal: bool) -> None:
    """N = 16384, B1 H4 d128: the references run one head at a time (2 GB of float64 scores)."""
    check_forward(Spec(batch=1, hq=4, hkv=4, nq=16384, nk=16384, d=128, causal=causal),
                  torch.bfloat16, device="cuda", with_plain=False)


@pytest.mark.gpu
def test_forward_gpu_without_tangents() -> None:
    check_forward(Spec(batch=1, hq=8, hkv=2, nq=4250, nk=4250, d=128, mask="keypad",
                       causal=True), torch.bfloat16, device="cuda")


@pytest.mark.gpu
def test_forward_gpu_is_deterministic() -> None:
    p = make_problem(Spec(batch=1, hq=8, hkv=2, nq=4250, nk=4250, d=128, mask="keypad",
                          causal=True), torch.bfloat16, device="cuda")
    assert_deterministic(kernel_forward, p)


# --- bf16 tangents through exact fp16 operands (notebook 02) -------------------------------
# (tq, tk, tv) multipliers: each of the two limits on the tangent's shift binds in one case.
TANGENT_SCALES = {
    "balanced": (1.0, 1.0, 1.0),
    "large-scores-small-tv": (1e3, 1e-3, 1e-2),
    "tv-only": (0.0, 0.0, 1.0),
    "scores-only": (1e-2, 1e-2, 0.0),
}


def check_carried_tangents(scales, dtype: torch.dtype, device: str, n: int, d: int) -> None:
    p = make_problem(Spec(hq=2, hkv=1, nq=n, nk=n + 3, d=d, causal=True), dtype, seed=7,
                     device=device)
    p.tangents = tuple(t * s for t, s in zip(p.tangents, scales, strict=True))
    truth, floor = expected_forward(p)
    assert_accurate(kernel_forward(p), truth, floor, dtype, p.label, f"tangent x {scales}")


@pytest.mark.parametrize("scales", TANGENT_SCALES.values(), ids=TANGENT_SCALES)
def test_carried_tangents_forced_in_fp16(scales, monkeypatch) -> None:
    """The shifts and the factors that undo them. The interpreter multiplies bf16 bits
    wrongly (it multiplies raw bf16 bits), so here fp16 inputs are forced down the carrying
    path; carried fp16 is as accurate as "fast", within the rule."""
    monkeypatch.setattr(jvp_attention.forward, "carries", lambda q, n_keys: True)
    check_carried_tangents(scales, torch.float16, DEVICE, 40, 32)


def uneven_magnitudes(p, block: int) -> None:
    """Scales p's v and tv by a different power of ten in each key-value head and in each
    block of `block` keys, and each row of tq by its own, so that the carried kernel's
    tangent units differ from row to row and from block to block."""
    keys = torch.arange(p.k.shape[2], device=p.k.device) // block
    rows = torch.arange(p.q.shape[2], device=p.q.device)
    heads = torch.arange(p.k.shape[1], device=p.k.device)
    tq, tk, tv = p.tangents
    by_head = (10.0 ** (-2 * heads)).to(p.v.dtype)[:, None, None]
    p.v = p.v * (10.0 ** (keys % 3 - 1).to(p.v.dtype))[:, None] * 8 * by_head
    tv = tv * (10.0 ** (1 - keys % 3).to(tv.dtype))[:, None] / 8 / by_head
    tq = tq * (10.0 ** (rows % 3 - 2).to(tq.dtype))[:, None]
    p.tangents = (tq, tk, tv)


@pytest.mark.parametrize("scales", TANGENT_SCALES.values(), ids=TANGENT_SCALES)
def test_carried_heads_of_uneven_magnitudes(scales, monkeypatch) -> None:
    """Each query row keeps its tangent in units of its own, chosen again at each key
    block: heads and blocks a hundred times apart, rows as far, are as accurate as the rule
    asks."""
    monkeypatch.setattr(jvp_attention.forward, "carries", lambda q, n_keys: True)
    p = make_problem(Spec(hq=4, hkv=2, nq=40, nk=75, d=32, causal=True), torch.float16,
                     seed=11, device=DEVICE)
    uneven_magnitudes(p, 16)
    p.tangents = tuple(t * s for t, s in zip(p.tangents, scales, strict=True))
    truth, floor = expected_forward(p)
    assert_accurate(kernel_forward(p), truth, floor, torch.float16, p.label,
                    f"uneven heads and blocks, tangent x {scales}")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 72], ids=["d128", "d72"])
@pytest.mark.parametrize("carried", [False, True], ids=["split", "carried"])
@pytest.mark.parametrize("scales", TANGENT_SCALES.values(), ids=TANGENT_SCALES)
def test_carried_tangents_gpu(scales, carried: bool, head_dim: int) -> None:
    """bf16 tangents in accurate mode: split below CARRY_MIN_KEYS keys, carried above, with
    one column tile (d = 128) or two (72 = 64 + 16)."""
    limit = jvp_attention.launch.carry_min_keys(head_dim)
    n = limit + 50 if carried else limit - 100  # the problem has n + 3 keys
    q = torch.empty(0, head_dim, dtype=torch.bfloat16)
    assert jvp_attention.launch.carries(q, n + 3) == carried
    check_carried_tangents(scales, torch.bfloat16, "cuda", n, head_dim)


@pytest.mark.parametrize("head_dim", [64, 128, 72])
def test_carrying_starts_at_long_rows(head_dim: int) -> None:
    """From CARRY_MIN_KEYS keys, at one column tile and at two (72 = 64 + 16) alike."""
    bf16 = torch.empty(0, head_dim, dtype=torch.bfloat16)
    fp16 = torch.empty(0, head_dim, dtype=torch.float16)
    limit = jvp_attention.launch.CARRY_MIN_KEYS
    assert jvp_attention.launch.carry_min_keys(head_dim) == limit
    assert jvp_attention.launch.carries(bf16, limit)
    assert not jvp_attention.launch.carries(bf16, limit - 1)
    assert not jvp_attention.launch.carries(fp16, 10 * limit)


# --- an additive mask with a tangent (learnable biases: tS gains tB; notebook 02) ----------
# (spec, shape of the bias): a per-head bias shared by a batch of 3, an (Nq, Nk) bias with
# causal, a bias per batch and head with GQA; each in fp32 and fp16.
FORWARD_BIAS_CASES = [
    (Spec(batch=3, hq=2, hkv=2, nq=17, nk=33, d=16), "head"),
    (Spec(batch=2, hq=2, hkv=2, nq=33, nk=17, d=16, causal=True), "2d"),
    (Spec(batch=2, hq=4, hkv=2, nq=40, nk=40, d=16), "full"),
]


@pytest.mark.parametrize("spec, shape, dtype", bias_params(FORWARD_BIAS_CASES))
def test_forward_with_mask_tangent(spec: Spec, shape: str, dtype: torch.dtype) -> None:
    check_with_bias(spec, shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
def test_mask_tangent_on_rows_that_see_no_key(dtype: torch.dtype) -> None:
    """Rows whose bias is -inf throughout: out, tangent_out, mu zero (not NaN), lse -inf."""
    check_with_bias(Spec(hq=2, hkv=1, nq=33, nk=17, d=16, causal=True), "full", dtype,
                    empty_rows=True)


def test_mask_tangent_of_another_shape_and_dtype() -> None:
    """fp16 inputs with an fp32 (Nq, Nk) bias whose tangent is per head: the launcher reads
    the pair at their common shape and dtype."""
    check_with_bias(Spec(batch=2, hq=2, hkv=2, nq=17, nk=33, d=16), "2d", torch.float16,
                    mask_dtype=torch.float32, tangent_shape="head")


def test_the_mask_tangent_check_catches_a_wrong_sign() -> None:
    """The check has teeth: the kernel run with -tB (or without tB) fails it."""
    spec = Spec(batch=2, hq=2, hkv=2, nq=33, nk=17, d=16, causal=True)
    p = make_problem(spec, torch.float32)
    bias, t_bias = make_bias(spec, "2d")
    truth, floor = expected_with_bias(p, bias, t_bias)
    assert_accurate(kernel_with_bias(p, bias, t_bias), truth, floor, torch.float32, p.label)
    for wrong in (-t_bias, torch.zeros_like(t_bias)):
        with pytest.raises(AssertionError, match="tangent_out: max error"):
            assert_accurate(kernel_with_bias(p, bias, wrong), truth, floor, torch.float32,
                            p.label)


@pytest.mark.parametrize("t_bias_scale", [1.0, 1e3], ids=["tB", "tB_x1000"])
def test_carried_mask_tangent_forced_in_fp16(t_bias_scale: float, monkeypatch) -> None:
    """A mask's tangent joins tS in the carried kernel (fp16 forced down the carrying path,
    as above), and the tangent's units bound tS + tB: a bias tangent a thousand times the
    scores' tangent stays inside float16 (bounded by tS alone, P~ (tS + tB) overflows)."""
    monkeypatch.setattr(jvp_attention.forward, "carries", lambda q, n_keys: True)
    carried = []
    value_operands = jvp_attention.forward.carried_value_operands
    monkeypatch.setattr(jvp_attention.forward, "carried_value_operands",
                        lambda *args: carried.append(1) or value_operands(*args))
    spec = Spec(batch=2, hq=2, hkv=1, nq=33, nk=40, d=16, causal=True)
    p = make_problem(spec, torch.float16, seed=3)
    bias, t_bias = make_bias(spec, "full", torch.float16, seed=3)
    p.attn_mask, t_bias = bias, t_bias * t_bias_scale
    truth, floor = expected_with_bias(p, bias, t_bias)
    ours = kernel_with_bias(p, bias, t_bias)
    assert carried, "the call did not carry"
    assert_accurate(ours, truth, floor, torch.float16, p.label,
                    f"carried with a mask tangent x {t_bias_scale}")
    assert_empty_rows_are_zero(p, ours)


def test_mask_pairs_store_each_distinct_row_once() -> None:
    """A per-head bias expanded to the batch (as `attention` hands it over) is stored once
    for the whole batch, each row's biases then their tangents at unit stride; a tangent
    that varies over the batch stores it B times; the pair takes the common dtype."""
    batch, heads, n = 3, 2, 5
    bias = torch.randn(1, heads, n, n)
    cases = [(torch.randn(1, heads, n, n).expand(batch, heads, n, n), heads),
             (torch.randn(batch, 1, n, n, dtype=torch.float16), batch * heads)]
    for tangent, rows_stored in cases:
        full = (batch, heads, n, n)
        pairs = jvp_attention.launch.mask_pairs(bias.expand(full), tangent, full)
        assert pairs.shape == (batch, heads, n, 2, n) and pairs.stride()[-2:] == (n, 1)
        assert pairs.dtype == torch.float32
        assert pairs.untyped_storage().nbytes() == rows_stored * n * 2 * n * 4
        assert torch.equal(pairs[:, :, :, 0], bias.expand(full))
        assert torch.equal(pairs[:, :, :, 1], tangent.float().expand(full))


def test_learnable_bias_through_attention_is_stored_once_for_the_batch(monkeypatch) -> None:
    """`attention` under torch.func.jvp hands a per-head bias and its tangent over expanded
    to the batch; the kernels' operand still stores each head's pairs once (a copy at the
    batch's size made such calls 4 to 6 times slower on the GPU)."""
    stored = []

    def noting(attn_mask, shape, mask_tangent=None):
        result = mask_operand(attn_mask, shape, mask_tangent)
        if mask_tangent is not None:
            stored.append(result[0].untyped_storage().nbytes())
        return result

    mask_operand = jvp_attention.forward.mask_operand
    monkeypatch.setattr(jvp_attention.forward, "mask_operand", noting)
    batch, heads, n, d = 3, 2, 24, 16
    q, k, v, tq, tk, tv = (torch.randn(batch, heads, n, d, device=DEVICE) for _ in range(6))
    bias, t_bias = (torch.randn(1, heads, n, n, device=DEVICE) for _ in range(2))
    torch.func.jvp(lambda *x: jvp_attention.attention(*x), (q, k, v, bias),
                   (tq, tk, tv, t_bias))
    assert stored == [heads * n * 2 * n * 4]  # (1, H, Nq, 2, Nk) fp32: not B times that


def test_mask_tangent_needs_an_additive_mask_and_tangents() -> None:
    p = make_problem(Spec(nq=17, nk=17, d=16), torch.float32)
    bias = torch.randn(17, 17)
    cases = [
        ({"attn_mask": None}, "additive"),
        ({"attn_mask": bias > 0}, "additive"),
        ({"attn_mask": bias, "tangents": None}, "tangents"),
        ({"attn_mask": bias, "mask_tangent": torch.randn(3, 17)}, "broadcast"),
        ({"attn_mask": bias, "mask_tangent": torch.ones(17, 17, dtype=torch.int32)},
         "floating point"),
    ]
    for options, message in cases:
        options = {"tangents": p.tangents, "mask_tangent": torch.randn(17, 17), **options}
        with pytest.raises(ValueError, match=message):
            flash_attention_forward(p.q, p.k, p.v, **options)


def test_zero_mask_tangent_changes_nothing() -> None:
    """tB = 0 gives the additive mask's own tangent, bit for bit (one tile in the
    interpreter; the interleaved operand reads the same biases)."""
    p = make_problem(Spec(batch=2, hq=2, hkv=1, nq=33, nk=40, d=16, mask="additive4d"),
                     torch.float32)
    plain = kernel_forward(p)
    with_zero = flash_attention_forward(p.q, p.k, p.v, **p.options, tangents=p.tangents,
                                        mask_tangent=torch.zeros_like(p.attn_mask))
    for name in plain:
        assert torch.equal(plain[name], getattr(with_zero, name)), name


def test_precision_argument_overrides_the_global_mode() -> None:
    """precision="fast" on one call equals the global "fast" mode bit for bit (and differs
    from "accurate" in fp16); a bad mode is a ValueError."""
    p = make_problem(Spec(hq=2, hkv=1, nq=33, nk=40, d=16, causal=True), torch.float16)
    with precision("accurate"):
        per_call = flash_attention_forward(p.q, p.k, p.v, **p.options, tangents=p.tangents,
                                           precision="fast")
        accurate = flash_attention_forward(p.q, p.k, p.v, **p.options, tangents=p.tangents)
    with precision("fast"):
        global_fast = flash_attention_forward(p.q, p.k, p.v, **p.options, tangents=p.tangents)
        per_call_accurate = flash_attention_forward(p.q, p.k, p.v, **p.options,
                                                    tangents=p.tangents, precision="accurate")
    assert torch.equal(per_call.tangent_out, global_fast.tangent_out)
    assert torch.equal(per_call_accurate.tangent_out, accurate.tangent_out)
    assert not torch.equal(per_call.tangent_out, accurate.tangent_out)
    with pytest.raises(ValueError, match="precision"):
        flash_attention_forward(p.q, p.k, p.v, precision="exact")




@pytest.mark.gpu
@pytest.mark.parametrize("spec, shape, dtype", bias_params(GPU_BIAS_CASES, (F16, BF16, F32)))
def test_forward_with_mask_tangent_gpu(spec: Spec, shape: str, dtype: torch.dtype) -> None:
    """bf16 with a mask tangent, split below carry_min_keys keys (notebook 02)."""
    check_with_bias(spec, shape, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 72], ids=["d128", "d72"])
@pytest.mark.parametrize("t_bias_scale", [1.0, 1e3], ids=["tB", "tB_x1000"])
def test_carried_mask_tangent_gpu(t_bias_scale: float, head_dim: int) -> None:
    """bf16 with a mask tangent from carry_min_keys keys: carried, tB inside the bound."""
    n = jvp_attention.launch.carry_min_keys(head_dim) + 70
    spec = Spec(batch=1, hq=4, hkv=2, nq=n, nk=n, d=head_dim, causal=True)
    assert jvp_attention.launch.carries(torch.empty(0, head_dim, dtype=torch.bfloat16), n)
    p = make_problem(spec, torch.bfloat16, seed=5, device="cuda")
    bias, t_bias = make_bias(spec, "2d", torch.bfloat16, seed=5, device="cuda")
    p.attn_mask, t_bias = bias, t_bias * t_bias_scale
    truth, floor = expected_with_bias(p, bias, t_bias)
    assert_accurate(kernel_with_bias(p, bias, t_bias), truth, floor, torch.bfloat16,
                    p.label, f"carried with a mask tangent x {t_bias_scale}")


@triton.jit
def _record_causal_order(out_ptr, HEAD_GROUP: tl.constexpr):
    """Write this program's (query tile, batch x head) under the causal order at its launch
    rank (program_id(0) fastest)."""
    tile, bh = query_program(True, HEAD_GROUP)
    launched = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(out_ptr + 2 * launched, tile)
    tl.store(out_ptr + 2 * launched + 1, bh)


@pytest.mark.parametrize("tiles, heads, group", [(5, 12, 8), (4, 6, 3), (3, 4, 1), (2, 3, 16)])
def test_causal_order_takes_every_tile_once_longest_first_by_group(tiles, heads, group):
    """The causal launch order (`query_program`): every (tile, head) exactly once; heads in
    groups of `group` (the last one smaller), each group's tiles longest first with its heads
    side by side; a group of one is each head's tiles last first, head after head."""
    order = torch.full((tiles * heads, 2), -1, dtype=torch.int32)
    _record_causal_order[(tiles, heads)](order, HEAD_GROUP=group)
    taken = [tuple(pair) for pair in order.tolist()]
    assert sorted(taken) == [(t, h) for t in range(tiles) for h in range(heads)]
    expected = []
    for first in range(0, heads, group):
        members = range(first, min(first + group, heads))
        expected += [(t, h) for t in reversed(range(tiles)) for h in members]
    assert taken == expected


def test_head_group_keeps_a_group_of_keys_within_its_bytes():
    """`head_group`: 1 without a causal mask; with one, the most heads (a power of two up to
    CAUSAL_HEAD_GROUP) whose keys and values fit CAUSAL_GROUP_BYTES, per query head."""
    from jvp_attention.launch import CAUSAL_GROUP_BYTES, CAUSAL_HEAD_GROUP, head_group

    def keys(n, d, count=2, dtype=torch.bfloat16):
        return [torch.empty(1, 1, n, d, dtype=dtype, device="meta")] * count

    assert head_group(False, *keys(4096, 128)) == 1
    assert head_group(True, *keys(4096, 128, 4)) == 4  # 4 MiB a head
    assert head_group(True, *keys(4096, 128, 2)) == 8
    assert head_group(True, *keys(16384, 128, 4)) == 1  # 16 MiB: groups of one
    assert head_group(True, *keys(65536, 128, 4)) == 1
    assert head_group(True, *keys(1024, 64, 4)) == CAUSAL_HEAD_GROUP
    assert head_group(True, *keys(4096, 128, 4), queries_per_head=4) == 16  # GQA shares keys
    assert head_group(True, *keys(4096, 128, 4, torch.float32)) == 2
    for n in (256, 1000, 4096, 12345, 32768):
        group, per_head = head_group(True, *keys(n, 64, 4)), n * 64 * 2 * 4
        assert group in (1, 2, 4, 8, 16) and group <= CAUSAL_HEAD_GROUP
        assert group == 1 or group * per_head <= CAUSAL_GROUP_BYTES  # fits
        assert group == CAUSAL_HEAD_GROUP or 2 * group * per_head > CAUSAL_GROUP_BYTES  # most


@pytest.mark.parametrize("spec", [
    Spec(batch=2, hq=6, hkv=2, nq=130, nk=130, d=16, causal=True),
    Spec(batch=3, hq=2, hkv=2, nq=130, nk=260, d=16, causal=True, layout="bnhd"),
], ids=lambda s: s.id)
def test_causal_order_changes_no_output(spec: Spec, monkeypatch) -> None:
    """Chapter 2's forward with its JVP under the causal mask gives the same bits whatever
    the heads per group of its launch order (`head_group`): the order moves programs, never
    a row's arithmetic, and every program still writes its own rows."""
    p = make_problem(spec, torch.float16)
    runs = []
    for group in (1, 4, None):  # None: the library's own choice
        if group is not None:
            monkeypatch.setattr(jvp_attention.forward, "head_group",
                                lambda is_causal, *keys, queries_per_head=1, g=group:
                                g if is_causal else 1)
        else:
            monkeypatch.undo()
        runs.append(flash_attention_forward(p.q, p.k, p.v, is_causal=True,
                                            tangents=p.tangents, precision="accurate"))
    for run in runs[1:]:
        for name, first, value in zip(run._fields, runs[0], run, strict=True):
            assert torch.equal(first, value), name
