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
# # Chapter 5: the backward pass
#
# Training needs $dQ$, $dK$, $dV$ given the cotangent $dO$ of the output. The forward kept
# only $O$ and one number per row, $\mathrm{LSE}$; the backward recomputes every
# probability from it, tile by tile, exactly as the forward did, so the $N_q \times N_k$
# matrix is never stored here either.
#
# ## The formulas (chapter 1 checked them in float64)
#
# With $P_{ij} = \exp(S_{ij} - \mathrm{LSE}_i)$ rebuilt from the stored statistic,
#
# $$dV = P^\top dO,\qquad dP = dO\,V^\top,\qquad \Delta_i = \sum_j P_{ij}\,dP_{ij} =
# \sum_d dO_{id}\,O_{id},\qquad dS = P \circ (dP - \Delta),$$
#
# $$dQ = s\,dS\,K,\qquad dK = s\,dS^\top Q.$$
#
# $\Delta$ is the softmax's correction term. Computed as $\mathrm{rowsum}(P \circ dP)$ it
# would need a whole row of $P$ before any $dS$; computed as $\mathrm{rowsum}(dO \circ O)$
# it needs only the stored output, so a tiny kernel computes it for all rows first.
#
# ## Why two kernels
#
# $dK$ and $dV$ are sums over query rows; $dQ$ is a sum over key rows. One kernel that
# walks key blocks in its outer loop can keep $dK$, $dV$ in registers, but then each
# program contributes a piece of every $dQ$ row: atomic adds, which are slow in fp32 and
# make the result depend on the order programs finish. We run two kernels instead:
#
# * **dK/dV**: one program per key block, looping over every query block that sees it. For
#   GQA the same program also loops over the query heads of its group, so the group's sum
#   happens in registers and the program is the only writer of its rows.
# * **dQ**: one program per query block, looping over key blocks like the forward.
#
# Each recomputes $P$ (one extra $QK^\top$ per tile) in exchange for no atomics and
# bit-for-bit deterministic gradients.
#
# Both kernels share one tile helper, `_backward_tile`, which returns $P$ and $dS$ of a
# (query block × key block) tile. Like the forward, the kernels carry a `HAS_TANGENT`
# switch: switched on, they also backpropagate through the tangent output $t_O$ (chapter 6).
# Switched off, Triton compiles those lines away.

# %%
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
FULL_SIZE = DEVICE == "cuda"

# %% [markdown]
# ## Row statistics
#
# One small kernel reads $O$ and $dO$ once and writes $\Delta$ per row. With the tangent on
# it also writes $c = \mathrm{rowsum}(dt_O \circ O)$ and folds
# $\mathrm{rowsum}(dt_O \circ t_O) - \mu c$ into $\Delta$ (chapter 6 derives these). The
# cotangents come from autograd with whatever strides it chose (`loss = out.sum()` gives a
# stride-0 tensor), so they are read through their batch, head and row strides; like every
# operand, at unit stride along the last dimension (`unit_last_stride` of chapter 2 copies
# one whose last stride is not 1, keeping its stride-0 dimensions broadcast).

# %% tags=["export"]
"""Chapter 5: the backward kernels (dQ, dK, dV; with a constexpr, also through the tangent).

`notebooks/05_backward.py` derives them and checks them against chapter 1's references.
"""

import torch
import triton
import triton.language as tl

from jvp_attention.launch import (
    AUTOTUNE_KEYS,
    CallReplay,
    KeyedAutotuner,
    Recording,
    accurate,
    autotuned,
    call_facts,
    carried_fakes,
    carried_operands,
    carries,
    cdiv,
    check_kernel_shapes,
    check_mask_tangent,
    cut_in_two,
    graph_carry,
    graph_takes_pointers,
    host_bound_graph,
    interpreting,
    kernel_meta,
    launch_column_tiles,
    launchable,
    length_bucket,
    mask_operand,
    next_power_of_2,
    note_untraced_launch,
    on_device,
    prepare_descriptors,
    remember,
    replay_table,
    row_alignment,
    row_strides,
    scratch_tensor,
    tile_configs,
    tma_eligible,
    traceable_launches,
    unit_last_stride,
)
from jvp_attention.tiles import (
    ADDITIVE_MASK,
    LOG2E,
    add_mask_tangent,
    aligned,
    aligned_operands,
    batch_and_head,
    carry_factor,
    dot_rounded,
    head_base,
    in_fp32,
    key_block_ranges,
    load_head_rows,
    load_head_tail_rows,
    load_rows,
    load_tail_rows,
    load_tile,
    masked_scores,
    power_of_two,
    query_block_start,
    shift_exponent,
    store_rows,
    tail_accumulator,
    tail_source,
    tile_source,
    vector_entry,
    with_entry,
)


@triton.jit
def _load_fp32_rows(ptr, residual_ptr, head_rows, rows, dims, n_rows, n_dims,
                    HAS_RESIDUAL: tl.constexpr):
    """Rows of a contiguous forward output in fp32, with its rounding residual added back."""
    x = load_tile(ptr + head_rows * n_dims, rows, dims, n_dims, 1, n_rows, n_dims)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        x += load_tile(residual_ptr + head_rows * n_dims, rows, dims, n_dims, 1, n_rows,
                        n_dims).to(tl.float32)
    return x


@triton.jit
def _row_statistics_kernel(
    o_ptr, do_ptr, to_ptr, dto_ptr, mu_ptr, delta_ptr, c_ptr, o_residual_ptr, to_residual_ptr,
    stride_dob, stride_doh, stride_dom, stride_dtob, stride_dtoh, stride_dtom,
    n_heads, n_rows, value_dim,
    HAS_TANGENT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr, ALIGN: tl.constexpr,
):
    """delta = rowsum(dO*O); with the tangent, c = rowsum(dtO*O) and
    delta += rowsum(dtO*tO) - mu*c. Row strides and value_dim are multiples of ALIGN."""
    stride_dom, stride_dtom = aligned(stride_dom, ALIGN), aligned(stride_dtom, ALIGN)
    value_dim = aligned(value_dim, ALIGN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_DV)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // n_heads, bh % n_heads
    head_rows = bh * n_rows
    o = _load_fp32_rows(o_ptr, o_residual_ptr, head_rows, rows, dims, n_rows, value_dim,
                        HAS_RESIDUAL)
    do = load_tile(head_base(do_ptr, batch, head, stride_dob, stride_doh, ALIGN), rows, dims,
                    stride_dom, 1, n_rows, value_dim)
    delta = tl.sum(do.to(tl.float32) * o, 1)
    if HAS_TANGENT:
        t_o = _load_fp32_rows(to_ptr, to_residual_ptr, head_rows, rows, dims, n_rows,
                              value_dim, HAS_RESIDUAL)
        dto = load_tile(head_base(dto_ptr, batch, head, stride_dtob, stride_dtoh, ALIGN), rows, dims,
                         stride_dtom, 1, n_rows, value_dim).to(tl.float32)
        c = tl.sum(dto * o, 1)
        mu = tl.load(mu_ptr + head_rows + rows, mask=rows < n_rows, other=0.0)
        delta += tl.sum(dto * t_o, 1) - mu * c
        tl.store(c_ptr + head_rows + rows, c, mask=rows < n_rows)
    tl.store(delta_ptr + head_rows + rows, delta, mask=rows < n_rows)


# %% [markdown]
# ## One tile of the backward
#
# The probabilities come back as $P = 2^{S_2 - \log_2(e)\,\mathrm{LSE}}$ with the same
# log2-unit scores and the same masks as the forward. Two edge cases need care, because
# here nothing rescales a row after the fact:
#
# * a row that saw no key has $\mathrm{LSE} = -\infty$ and all scores $-\infty$, and
#   $-\infty - (-\infty)$ is NaN. Reading its LSE as $+\infty$ instead makes $P = 0$ and
#   its gradients zero;
# * rows past the end of the sequence read $\mathrm{LSE} = +\infty$ for the same reason, and
#   key columns past the end are masked to $-\infty$ in the boundary tiles (a zero-padded
#   key could otherwise meet a very negative LSE and overflow);
# * with an additive mask a row's scores can lie near chapter 2's `LOWEST_SCORE`
#   ($-2^{31}$, a bias at the dtype's lowest number), where fp32 cannot hold the LSE: it
#   arrives in fp64 (`lse_dtype`) and is read as an fp32 pair, $\mathrm{hi} + \mathrm{lo}$,
#   so that $P = 2^{(S_2 - \mathrm{hi}) - \mathrm{lo}}$, whose first difference is exact
#   there (one subtraction more per entry, in such calls only).
#
# $P$ and $dS$ are rounded to the input dtype right before the products that consume them;
# all accumulation is fp32. In the default "accurate" precision mode (chapter 3) each such
# operand is split into two 16-bit parts, $a = a_{hi} + a_{lo}$, one more product each; for
# bf16 inputs a cheaper way to the same accuracy follows below.
#
# One more source of error hides in $\Delta = \mathrm{rowsum}(dO \circ O)$. Computed from the
# *stored* 16-bit $O$, it is off by $O$'s rounding, and $dS = P \circ (dP - \Delta)$ subtracts
# two nearly equal numbers wherever one key dominates a row (the first rows of causal
# attention, peaked attention in trained models): that rounding comes back amplified in
# $dQ$ and $dK$. On the H200, before the fix below, causal bf16 gradients measured up to 1.9x
# (first order) and 2.3x (second order) the floor while non-causal ones sat at 1.0x. The
# forward therefore also writes the *rounding residual* $O - \mathrm{round}(O)$ (one more
# output-sized 16-bit tensor, kept for the backward), and the row-statistics kernel adds it
# back: $\Delta$ is then computed from $O$ to about 16 more bits.

# %% tags=["export"]
@triton.jit
def _load_delta(delta_ptr, rows, n_q):
    """A query tile's Delta, as the kernel that computed it stored it."""
    return tl.load(delta_ptr + rows, mask=rows < n_q, other=0.0)


@triton.jit
def _delta_rows(o_ptr, o_residual_ptr, head_rows, rows, dims, n_rows, value_dim, do,
                HAS_RESIDUAL: tl.constexpr):
    """rowsum(dO * O) over the columns `dims` of a block of rows whose dO is in hand, O in
    fp32 with its rounding residual added back."""
    o = _load_fp32_rows(o_ptr, o_residual_ptr, head_rows, rows, dims, n_rows, value_dim,
                        HAS_RESIDUAL)
    return tl.sum(do.to(tl.float32) * o, 1)


@triton.jit
def _delta_of_block(o_ptr, o_residual_ptr, do_base, stride_dom, head_rows, rows, n_rows,
                    value_dim, BLOCK_DV: tl.constexpr, DV_TAIL: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr):
    """Delta of a block of query rows, from dO (one head's rows at `do_base`) and the
    contiguous O, over BLOCK_DV columns and then DV_TAIL more."""
    dims = tl.arange(0, BLOCK_DV)
    delta = _delta_rows(o_ptr, o_residual_ptr, head_rows, rows, dims, n_rows, value_dim,
                        load_tile(do_base, rows, dims, stride_dom, 1, n_rows, value_dim),
                        HAS_RESIDUAL)
    if DV_TAIL > 0:
        dims = BLOCK_DV + tl.arange(0, DV_TAIL)
        delta += _delta_rows(o_ptr, o_residual_ptr, head_rows, rows, dims, n_rows, value_dim,
                             load_tile(do_base, rows, dims, stride_dom, 1, n_rows, value_dim),
                             HAS_RESIDUAL)
    return delta


@triton.jit
def _load_row_statistics(lse_ptr, delta, mu_ptr, c_ptr, rows, n_q, delta_factor,
                         p_exponent, factors_ptr, HAS_TANGENT: tl.constexpr,
                         CARRY: tl.constexpr, MASK_KIND: tl.constexpr):
    """LSE (in log2 units, less `p_exponent`, so that P comes out times 2**p_exponent),
    the tile's `delta` times `delta_factor` (and mu, c, in the carried units with CARRY) of
    a query tile. Rows past the end and rows that saw no key read LSE = +inf, so that their
    P is exactly 0. With an additive mask the LSE is fp64 (chapter 2's `lse_dtype`) and
    comes back as its fp32 (hi, lo) pair, joined: a bias can put it near LOWEST_SCORE."""
    in_range = rows < n_q
    lse = tl.load(lse_ptr + rows, mask=in_range, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E - p_exponent
    if MASK_KIND >= ADDITIVE_MASK:
        seen = lse2 != float("inf")
        finite = tl.where(seen, lse2, 0.0)
        hi = finite.to(tl.float32)
        lo = (finite - hi.to(finite.dtype)).to(tl.float32)
        lse2 = tl.join(tl.where(seen, hi, float("inf")), lo)
    delta = delta * delta_factor
    if HAS_TANGENT:
        mu = tl.load(mu_ptr + rows, mask=in_range, other=0.0)
        c = tl.load(c_ptr + rows, mask=in_range, other=0.0)
        if CARRY:  # mu in the tangent copies' units, c in dtS's (`second_order_shifts`)
            mu = mu * tl.load(factors_ptr + 10)
            c = c * tl.load(factors_ptr + 11)
    else:
        mu = delta
        c = delta
    return lse2, delta, mu, c


@triton.jit
def _backward_tile(
    q, k, v, tq, tk, tv, do, dto, lse2, delta, mu, c, rows, cols,
    mask_ptr, stride_mask_m, stride_mask_n, n_q, n_k, qk_scale, t_scale, ds_factor, dts_factor,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_TANGENT: tl.constexpr,
    CHECK_BOUNDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    q2, k2, v2, do2, D_TAIL: tl.constexpr, DV_TAIL: tl.constexpr,
):
    """P and dS of one (query block x key block) tile, recomputed from LSE; with the tangent
    also tP and dtS (chapter 6), tS scaled by `t_scale` and dS, dtS by `ds_factor`,
    `dts_factor` (`_carried_units`). q2, k2 (v2, do2) are the second column tiles of a head
    dim cut in two (chapter 2's `column_tiles`), which only the first-order backward uses."""
    tl.static_assert(not (HAS_TANGENT and (D_TAIL > 0 or DV_TAIL > 0)))
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if D_TAIL > 0:
        s = tl.dot(q2, tl.trans(k2), acc=s, input_precision=DOT_PRECISION)
    s = masked_scores(s * qk_scale, rows, cols, mask_ptr, stride_mask_m, stride_mask_n, n_q,
                       n_k, IS_CAUSAL, MASK_KIND, CHECK_BOUNDS)
    if MASK_KIND >= ADDITIVE_MASK:  # (hi, lo): s - hi is exact near LOWEST_SCORE too
        hi, lo = tl.split(lse2)
        p = tl.exp2((s - hi[:, None]) - lo[:, None])
    else:
        p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if DV_TAIL > 0:
        dp = tl.dot(do2, tl.trans(v2), acc=dp, input_precision=DOT_PRECISION)
    if HAS_TANGENT:
        ts = tl.dot(tq, tl.trans(k), input_precision=DOT_PRECISION)
        ts = tl.dot(q, tl.trans(tk), acc=ts, input_precision=DOT_PRECISION) * t_scale
        ts = add_mask_tangent(ts, rows, cols, mask_ptr, stride_mask_m, stride_mask_n, n_q,
                               n_k, MASK_KIND)
        g = tl.dot(dto, tl.trans(v), input_precision=DOT_PRECISION)
        dp = tl.dot(dto, tl.trans(tv), acc=dp, input_precision=DOT_PRECISION)
        centred = ts - mu[:, None]
        dp += g * centred - c[:, None] * ts
        tp = p * centred
        dts = p * (g - c[:, None]) * dts_factor
        ds = p * (dp - delta[:, None]) * ds_factor
    else:
        tp = p
        dts = p
        ds = p * (dp - delta[:, None])
    return p, ds, tp, dts


# %% [markdown]
# ## bf16 gradients through exact fp16 operands
#
# The hi + lo split costs three products where "fast" spends two (dK/dV), two where it spends
# one (dQ): about 1.4x the backward's time. For bf16 inputs there is a cheaper way to the
# same accuracy. A bf16 number has 8 significant bits and float16 has 11, so every bf16 value
# times a power of two is *exactly* a float16 value, as long as the product lands inside
# float16's range. If the four inputs of the backward are carried as exact rescaled fp16
# copies,
#
# $$\hat Q = 2^{e_q} Q,\quad \hat K = 2^{e_k} K,\quad \hat V = 2^{e_v} V,\quad
# \widehat{dO} = 2^{e_o}\, dO,$$
#
# every product runs on fp16 tensor cores with fp32 accumulation, and the fp32 operands
# $P$ and $dS$ are rounded once, to fp16: an error $2^{-11}$ instead of bf16's $2^{-8}$, eight
# times below the output's own rounding, at the cost of "fast" plus four elementwise passes.
# The powers of two cancel exactly in fp32 (the scores' factor $2^{-e_q-e_k}$ joins the
# softmax scale, the gradients' factors multiply the accumulators once at the end), so the
# rescaling itself adds no error. What must be chosen is the range:
#
# * $\hat Q, \hat K, \hat V$ get their largest entry in $[1/2, 1)$: float16 then holds every
#   entry exactly down to $2^{-25}$ of the largest, below which a value is flushed, an absolute
#   error far under any output's rounding.
# * $P \le 1$, but in long rows most entries are near $1/N$ (below fp16's normal range at
#   $N = 2^{15}$), so the kernels use $\hat P = 2^8 P$: exponents shift by 8 inside the
#   `exp2`, free, and $\hat P$ is a normal fp16 number for every $P \ge 2^{-22}$.
# * $dS$ must not overflow. With $\max|\hat V| < 1$ and $\max|\widehat{dO}| < 2^{t}$,
#   $|\widehat{dP}_{ij}| \le d_v 2^{t}$ and $|\hat\Delta_i| = |\sum_j P_{ij}\widehat{dP}_{ij}|
#   \le d_v 2^t$, so $|\widehat{dS}| \le 2^8 \cdot 2 d_v 2^t$. Taking
#   $t = 5 - \lceil\log_2 d_v\rceil$ bounds it by $2^{14}$, a quarter of float16's largest
#   value, whatever the data.
#
# The machinery is chapter 2's `carried_operands`, two launches: a range pass finds the four
# largest magnitudes, then each program of the copy kernel turns them into shifts and into
# the factors that undo them (`backward_shifts` below; a small device tensor the kernels read
# once) and writes its tile of a copy straight to float16; nothing waits for the host. The
# copies are O(N) memory, like the inputs. fp16
# inputs have no wider 16-bit type to go to and keep the split. The backward through the
# tangent (chapter 6) carries too, with eight copies and ranges of its own ("Through the
# tangent" below).
#
# The copy kernel holds every row of dO in registers for a moment, so it also computes
# $\Delta = \mathrm{rowsum}(dO \circ O)$ there, from the original dO and O with its
# rounding residual (an *epilogue*, a small @triton.jit function the copy kernel calls after
# each block: `delta_epilogue`): the carried backward then needs no row-statistics launch,
# and takes four launches in all (range pass, copies, dK/dV, dQ) against two when it splits
# (three where O's rows are not 16-element aligned). $\Delta$ is an fp32 sum of the
# unshifted products, as the row-statistics kernel computes it; the kernels scale it into
# the carried units with the factor of $\Delta$. Where chapter 12's dK/dV kernel sums dQ
# in an fp32 buffer, the same epilogue writes that buffer's zeros as it passes over $Q$'s
# rows (`delta_and_dq_sum_epilogue`), in place of a fill launch before that kernel.
# Only the copies whose rows an epilogue reads are made row by row (dO, and $Q$ where the
# dQ sum is zeroed: `DELTA_ROWS`, `DELTA_AND_DQ_SUM_ROWS`); the others, where contiguous,
# are copied as flat arrays (chapter 2's `carried_operands`, `row_copies`), which at
# $d = 72$ spares the 56 padded columns of every row and the row arithmetic. Measured on
# one H200 machine (bf16, a MeanFlow step's attention, `carry_cost.py --backward`, before
# and after in one session, `benchmarks/results/carry_cost_backward_h200.json`), at
# (16, 16, 1024, 72) the copy launch went from 0.168 to 0.124 ms and the step's GPU time
# from 2.063 to 2.023 ms (causal 1.426 to 1.381): accurate mode's step is 1.13x fast's
# (1.18x causal) where it was 1.15x (1.22x). Rows of a power-of-two length carry no
# padding, so there the flat copies spare only the row arithmetic.
# Having the range pass also write $Q$'s and $K$'s copies as it reads them, unshifted
# wherever their own scale is exact (as chapter 2's `value_operands` does for $V$ and
# $t_V$), spares the copy launch one read of each, but slows the range pass by about as
# much: on one H100 machine (same measurement, two runs of each version in one session) at
# (16, 16, 1024, 72) the copy launch fell from 0.140 to 0.107 ms and the range pass rose
# from 0.104 to 0.130 ms, 0.007 ms less in all (carry 0.245 against 0.237 ms), too little
# for the extra code, so the backward's copies are all made by the copy launch.
#
# As in the forward, the range pass pays back only on long enough rows, and the launcher
# carries from chapter 2's `carry_min_keys` (1024 keys per row). Measured on the H200 with
# the first, PyTorch-operation version of the carry (bf16, GPU time in ms of the primal
# backward after a forward+JVP, B·H = 196608 / N; carry / split / fast):
# at d = 64, N = 256: 0.45 / 0.32 / 0.22, N = 1024: 0.72 / 0.83 / 0.48, N = 2048:
# 1.09 / 1.51 / 0.84; at d = 128, N = 1024: 1.23 / 1.10 / 0.81, N = 2048: 1.81 / 1.96 / 1.39.
# With the two-launch carry, at 1024 keys, carrying takes 1.19x (d = 64) and 1.22x
# (d = 128) the time of "fast" where the split takes 1.67x and 1.37x (chapter 8).
#
# ### Through the tangent
#
# The backward through the tangent has eight 16-bit inputs, $Q, K, V, t_Q, t_K, t_V, dO,
# dt_O$, and four rounded fp32 operands, $P$, $t_P$, $dS$, $dt_S$ (chapter 6 has the
# formulas). Carried, each input gets a power of two and each product its unit, and the
# units must agree wherever two products share an accumulator. Write $\hat Q = 2^a Q$,
# $\hat K = 2^b K$, $\hat V = 2^e V$, $\widehat{dO} = 2^g dO$, $\widehat{dt_O} = 2^h dt_O$,
# $\hat t_Q = 2^{a+l} t_Q$, $\hat t_K = 2^{b+l} t_K$, and $\widehat{dS} = 2^{e_{dS}} dS$,
# $\widehat{dt_S} = 2^{e_{dtS}} dt_S$:
#
# * $t_S$ adds $\hat t_Q \hat K^\top$ and $\hat Q \hat t_K^\top$, both in units $2^{a+b+l}$;
#   its scale factor brings it to units $2^{g-h}$, and $\mu$ with it;
# * $dP$ adds $\widehat{dO}\,\hat V^\top$ (units $2^{g+e}$), $\widehat{dt_O}\,\hat t_V^\top$,
#   which asks for $\hat t_V = 2^{e+g-h} t_V$, and $G \circ (t_S - \mu) - c \circ t_S$
#   with $G = \widehat{dt_O}\hat V^\top$ in units $2^{h+e}$ and $c$ scaled to match;
# * $dV$ adds $\hat P^\top \widehat{dO}$ and $\hat t_P^\top \widehat{dt_O}$, so
#   $\hat t_P = \hat P \circ (t_S - \mu)$ in units $2^{8+g-h}$ fits as it stands;
# * $dK$ adds $\widehat{dS}^\top \hat Q$ (units $2^{e_{dS}+a}$) and
#   $\widehat{dt_S}^\top \hat t_Q$ (units $2^{e_{dtS}+a+l}$), and $dQ$ the same with $K$.
#
# Every unit above but the last pair is a scalar factor that the kernels already apply (the
# scores' scale, $\mu$, $c$, $\Delta$, the outputs'), so it costs nothing per tile. The last
# pair would tie $l$ to $e_{dS} - e_{dtS}$, and an attempt that let it (one shift for the whole
# tangent side) failed the floor (chapter 6 has the numbers). Here each keeps its own range
# at a small price per tile: $dS$ and $dt_S$ are multiplied by their own powers of two before
# their rounding, and dK's and dQ's accumulators step into the units of the tangent's
# product before it and back after it (`to_tangent`, `from_tangent`: exact, two multiplies
# of the accumulator per tile). The ranges (`second_order_shifts`):
#
# * $\hat Q, \hat K, \hat V, \widehat{dO}, \widehat{dt_O}$ in $[1/2, 1)$, and the larger of
#   $\hat t_Q, \hat t_K$ too ($t_S$ sums their terms; with one of them a million times
#   smaller than the other, relative to $Q$ and $K$, the tests still find every gradient at
#   the floor);
# * $\widehat{dS}$ and $\widehat{dt_S}$ below $2^{14}$ from bounds on $|dP|$ and on
#   $|G - c| \le 2\,d_v \max|dt_O|\max|V|$, with $|t_S| \le s\,d\,(\max|t_Q|\max|K| +
#   \max|Q|\max|t_K|)$ in the first;
# * $\hat t_P$ and $\hat t_V$ inside float16's range: $h$ rises above $dt_O$'s own range until
#   they fit (dtO has fifteen bits of headroom), and past that $g$ comes down, which is safe
#   because $dO$ only ever enters sums in which the tangent's terms then dominate.
#
# The CPU tests scale each input in turn by up to $10^{\pm 6}$ and check every gradient at
# the floor (`test_bf16_second_order_through_fp16_operands_on_cpu`); the GPU tests do the
# same at 1100 keys. On the H200 (bf16, the whole backward through both outputs after the
# forward with the tangent, `benchmarks/results/second_order_h200.json`) "accurate" went
# from 193 to 228 TFLOP/s at (4, 16, 4096, 128) (180 to 206 causal), from 174 to 214 at
# (4, 32, 4096, 64) (159 to 193 causal), and at 16384 tokens from 193 to 229 (d = 128) and
# 172 to 227 (d = 64): 1.07x to 1.15x the time of "fast", against 1.29x to 1.45x with the
# split. The copies cost memory: 898 MB at peak against 386 MB at (4, 16, 4096, 128).

# %% tags=["export"]
P_EXPONENT = tl.constexpr(8)  # carried probabilities are P * 2**8: normal fp16 for P >= 2**-22


@triton.jit
def _power(exponent):
    """2**exponent for a carry factor, the exponent kept inside fp32's normal range."""
    return power_of_two(tl.minimum(tl.maximum(exponent, -126), 127))


@triton.jit
def _with_first_order_factors(values, at: tl.constexpr, e_q, e_k, e_v, e_o, e_ds):
    """`values` with the first-order kernels' six factors from entry `at` on: scores
    2**-(e_q + e_k), Delta 2**(e_o + e_v), dQ 2**-(e_ds + e_k), dK 2**-(e_ds + e_q), dV
    2**-(8 + e_o) and P's exponent 8, where dS is carried times 2**e_ds."""
    values = with_entry(values, at, _power(-e_q - e_k))
    values = with_entry(values, at + 1, _power(e_o + e_v))
    values = with_entry(values, at + 2, _power(-e_ds - e_k))
    values = with_entry(values, at + 3, _power(-e_ds - e_q))
    values = with_entry(values, at + 4, _power(-e_o - P_EXPONENT))
    return with_entry(values, at + 5, P_EXPONENT)


@triton.jit
def backward_shifts(maxima, do_top):
    """From max |q|, |k|, |v|, |dO|: their shifts (2**e_q, 2**e_k, 2**e_v, 2**e_o, with
    max |dO| below 2**do_top), then the kernels' factors: scores 2**-(e_q + e_k), Delta
    2**(e_o + e_v), dQ 2**-(e_ds + e_k), dK 2**-(e_ds + e_q), dV 2**-(8 + e_o), P's 8 and
    the mask's gradient 2**-e_ds, where dS is carried times 2**e_ds = 2**(8 + e_o + e_v)."""
    e_q = shift_exponent(vector_entry(maxima, 0), 0)
    e_k = shift_exponent(vector_entry(maxima, 1), 0)
    e_v = shift_exponent(vector_entry(maxima, 2), 0)
    e_o = shift_exponent(vector_entry(maxima, 3), do_top)
    e_ds = e_o + e_v + P_EXPONENT
    values = tl.zeros([16], tl.float32)
    values = with_entry(values, 0, power_of_two(e_q))
    values = with_entry(values, 1, power_of_two(e_k))
    values = with_entry(values, 2, power_of_two(e_v))
    values = with_entry(values, 3, power_of_two(e_o))
    values = with_entry(values, 10, _power(-e_ds))
    return _with_first_order_factors(values, 4, e_q, e_k, e_v, e_o, e_ds)


QUERY_COPY = tl.constexpr(0)  # q is the first tensor `backward_operands` copies
GRAD_OUT_COPY = tl.constexpr(3)  # dO is the fourth
# The copies whose rows the epilogues below read (the others are copied as flat arrays)
DELTA_ROWS = (GRAD_OUT_COPY.value,)
DELTA_AND_DQ_SUM_ROWS = (QUERY_COPY.value, GRAD_OUT_COPY.value)


@triton.jit
def _delta_of_grad_out(copy_index: tl.constexpr, d_out, rows, cols, args,
                       HAS_RESIDUAL: tl.constexpr):
    """Delta = rowsum(dO * O) for a block of dO's rows that the copy kernel holds in fp32,
    as `_row_statistics_kernel` computes it (O with its rounding residual added back)."""
    if copy_index == GRAD_OUT_COPY:
        out_ptr, residual_ptr, delta_ptr, n_rows, value_dim, _, _ = args
        delta = _delta_rows(out_ptr, residual_ptr, 0, rows, cols, n_rows, value_dim, d_out,
                            HAS_RESIDUAL)
        tl.store(delta_ptr + rows, delta, mask=rows < n_rows)


@triton.jit
def _zero_dq_sum(copy_index: tl.constexpr, x, rows, cols, args):
    """Zeros over a block of q's rows in the fp32 sum that chapter 12's dK/dV kernel adds
    dQ into (contiguous, q's shape)."""
    if copy_index == QUERY_COPY:
        _, _, _, n_rows, _, sum_ptr, head_dim = args
        offsets = rows.to(tl.int64)[:, None] * head_dim + cols[None, :]
        in_range = (rows < n_rows)[:, None] & (cols < head_dim)[None, :]
        tl.store(sum_ptr + offsets, tl.zeros_like(x), mask=in_range)


@triton.jit
def delta_epilogue(copy_index: tl.constexpr, x, rows, cols, args):
    """The copy kernel's epilogue for the backward: Delta from the stored O."""
    _delta_of_grad_out(copy_index, x, rows, cols, args, False)


@triton.jit
def delta_epilogue_with_residual(copy_index: tl.constexpr, x, rows, cols, args):
    """The copy kernel's epilogue for the backward: Delta from O and its residual."""
    _delta_of_grad_out(copy_index, x, rows, cols, args, True)


@triton.jit
def delta_and_dq_sum_epilogue(copy_index: tl.constexpr, x, rows, cols, args):
    """`delta_epilogue`, and zeros in chapter 12's dQ sum (`_zero_dq_sum`)."""
    _delta_of_grad_out(copy_index, x, rows, cols, args, False)
    _zero_dq_sum(copy_index, x, rows, cols, args)


@triton.jit
def delta_and_dq_sum_epilogue_with_residual(copy_index: tl.constexpr, x, rows, cols, args):
    """`delta_epilogue_with_residual`, and zeros in chapter 12's dQ sum."""
    _delta_of_grad_out(copy_index, x, rows, cols, args, True)
    _zero_dq_sum(copy_index, x, rows, cols, args)


# The copy kernel's epilogue by (a rounding residual of O, a dQ sum to zero).
DELTA_EPILOGUES = {(False, False): delta_epilogue, (True, False): delta_epilogue_with_residual,
                   (False, True): delta_and_dq_sum_epilogue,
                   (True, True): delta_and_dq_sum_epilogue_with_residual}


def backward_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      grad_out: torch.Tensor, out: torch.Tensor, out_residual: torch.Tensor | None,
                      delta: torch.Tensor, dq_sum: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, ...]:
    """Exact fp16 copies of q, k, v, dO for the first-order backward of bf16 inputs, and the
    factors that undo their shifts (fp32, on the device): scores, Delta, dQ, dK, dV, the
    log2 of P's shift and dS's factor (for the mask's gradient), in the order the kernels
    read them. The copy kernel also writes `delta`, rowsum(dO * O), from the contiguous
    forward output `out` (plus its rounding residual `out_residual`, if any), in place of
    the row-statistics launch, and zeros in `dq_sum` (fp32, contiguous, q's shape), the sum
    chapter 12's dK/dV kernel adds dQ into, in place of a fill launch."""
    ceil_log2_dv = next_power_of_2(v.shape[-1]).bit_length() - 1
    epilogue = DELTA_EPILOGUES[out_residual is not None, dq_sum is not None]
    n_rows, value_dim = out.shape[:3].numel(), out.shape[3]
    # max |dO| below 2**(5 - ceil(log2 d_v)) bounds |dS| by 2**14
    copies, factors = carried_operands(
        (q, k, v, grad_out), (), backward_shifts, 5 - ceil_log2_dv, 7, epilogue,
        (out, out if out_residual is None else out_residual, delta, n_rows, value_dim,
         delta if dq_sum is None else dq_sum, q.shape[-1]),
        row_copies=DELTA_ROWS if dq_sum is None else DELTA_AND_DQ_SUM_ROWS)
    return (*copies, factors)


def backward_operands_and_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                grad_out: torch.Tensor, out: torch.Tensor,
                                out_residual: torch.Tensor | None, zero_dq_sum: bool = False,
                                ) -> tuple[torch.Tensor, ...]:
    """`backward_operands` writing a Delta of its own and, with `zero_dq_sum`, a zeroed dQ
    sum, returned last (as an operator must: it cannot write its inputs; without it an
    empty placeholder)."""
    delta, dq_sum = _delta_and_dq_sum(q, out, zero_dq_sum)
    return (*backward_operands(q, k, v, grad_out, out, out_residual, delta,
                               dq_sum if zero_dq_sum else None), delta, dq_sum)


def _delta_and_dq_sum(q: torch.Tensor, out: torch.Tensor, dq_sum: bool,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised Delta (fp32, out's rows) and dQ sum (fp32, q's shape, or empty)."""
    return (scratch_tensor(out.shape[:3], out.device, torch.float32),
            scratch_tensor(q.shape if dq_sum else (0,), q.device, torch.float32))


carried_backward_operands = graph_carry(
    "backward_operands",
    "(Tensor q, Tensor k, Tensor v, Tensor grad_out, Tensor out, Tensor? out_residual,"
    " bool zero_dq_sum) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    backward_operands_and_delta,
    lambda q, k, v, grad_out, out, out_residual, zero_dq_sum: (
        *carried_fakes((q, k, v, grad_out), 7), *_delta_and_dq_sum(q, out, zero_dq_sum)))


@triton.jit
def second_order_shifts(maxima, bounds):
    """From max |q|, |k|, |v|, |tq|, |tk|, |tv|, |dO|, |dtO| and `bounds` = (|s| d, d_v):
    the eight copies' shifts 2**a, 2**b, 2**e, 2**(a + l), 2**(b + l), 2**(e + g - h),
    2**g, 2**h, then the kernels' factors (see the derivation above): scores, Delta, dQ,
    dK, dV, P's exponent, dtQ, dtK, dtV, tS, mu, c, dS, dtS, and the steps of dK's and dQ's
    accumulators into the units of dtS^ tq^ and back."""
    m_q, m_k, m_v = vector_entry(maxima, 0), vector_entry(maxima, 1), vector_entry(maxima, 2)
    m_tq, m_tk, m_tv = (vector_entry(maxima, 3), vector_entry(maxima, 4),
                        vector_entry(maxima, 5))
    m_do, m_dto = vector_entry(maxima, 6), vector_entry(maxima, 7)
    value_dim = bounds[1]
    e_q, e_k, e_v, e_o = (shift_exponent(m_q, 0), shift_exponent(m_k, 0),
                          shift_exponent(m_v, 0), shift_exponent(m_do, 0))
    t_bound = in_fp32(bounds[0]) * (m_tq * m_k + m_q * m_tk)  # above |tS| and |mu|
    # h: dtO's own range, raised (up to float16's) until tP^ = 2**(8 + g - h) tP and
    # tV^ = 2**(e + g - h) tV fit in float16; past that, g comes down (dO only ever enters
    # sums with the tangent's terms, which then outweigh it)
    tp_room = shift_exponent(2 * t_bound, 7)
    tv_room = shift_exponent(power_of_two(e_v) * m_tv, 15)
    e_to = tl.maximum(shift_exponent(m_dto, 0), e_o - tl.minimum(tp_room, tv_room))
    e_to = tl.minimum(e_to, shift_exponent(m_dto, 15))
    e_o = tl.minimum(e_o, e_to + tl.minimum(tp_room, tv_room))
    # dS^ = 2**e_ds dS below 2**14: 2 max|dP|, dP's four terms bounded in units 2**(g + e)
    dp_bound = power_of_two(e_o + e_v) * value_dim * (
        m_do * m_v + m_dto * (m_tv + 3 * t_bound * m_v))
    e_ds = e_o + e_v + shift_exponent(dp_bound, 5) + P_EXPONENT
    # dtS^ = 2**e_dts dtS below 2**14 (|dtS| <= 2 d_v max|dtO| max|V|)
    e_dts = shift_exponent(2 * value_dim * m_dto * m_v, 14)
    # l: the larger of the tangent copies tq^, tk^ in [1/2, 1)
    tangent_shift = tl.minimum(shift_exponent(power_of_two(e_q) * m_tq, 0),
                               shift_exponent(power_of_two(e_k) * m_tk, 0))
    # dK's and dQ's accumulators add dS^ q^ (units 2**(e_ds + a)) and dtS^ tq^ (units
    # 2**(e_dts + l + a)): they step between the two units by this power of two
    e_sum = e_dts + tangent_shift - e_ds
    values = tl.zeros([32], tl.float32)
    values = with_entry(values, 0, _power(e_q))
    values = with_entry(values, 1, _power(e_k))
    values = with_entry(values, 2, _power(e_v))
    values = with_entry(values, 3, _power(e_q + tangent_shift))
    values = with_entry(values, 4, _power(e_k + tangent_shift))
    values = with_entry(values, 5, _power(e_v + e_o - e_to))
    values = with_entry(values, 6, _power(e_o))
    values = with_entry(values, 7, _power(e_to))
    values = _with_first_order_factors(values, 8, e_q, e_k, e_v, e_o, e_ds)
    values = with_entry(values, 14, _power(-e_dts - e_k))
    values = with_entry(values, 15, _power(-e_dts - e_q))
    values = with_entry(values, 16, _power(-e_to - P_EXPONENT))
    values = with_entry(values, 17, _power(e_o - e_to - e_q - e_k - tangent_shift))
    values = with_entry(values, 18, _power(e_o - e_to))
    values = with_entry(values, 19, _power(e_to + e_v))
    values = with_entry(values, 20, _power(e_ds - e_o - e_v - P_EXPONENT))
    values = with_entry(values, 21, _power(e_dts - e_to - e_v - P_EXPONENT))
    values = with_entry(values, 22, _power(e_sum))
    return with_entry(values, 23, _power(-e_sum))


SECOND_ORDER_FACTORS = 16  # how many factors `second_order_shifts` gives after the shifts


def second_order_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          tq: torch.Tensor, tk: torch.Tensor, tv: torch.Tensor,
                          grad_out: torch.Tensor, grad_tangent_out: torch.Tensor,
                          scale: float) -> tuple[torch.Tensor, ...]:
    """Exact fp16 copies of q, k, v, tq, tk, tv, dO, dtO for the backward through the tangent
    of bf16 inputs, and the factors that undo their shifts (fp32, on the device): those of
    `backward_operands`, then those of `second_order_shifts`."""
    copies, factors = carried_operands(
        (q, k, v, tq, tk, tv, grad_out, grad_tangent_out), (), second_order_shifts,
        (abs(scale) * q.shape[-1], v.shape[-1]), SECOND_ORDER_FACTORS)
    return (*copies, factors)


carried_second_order_operands = graph_carry(
    "second_order_operands",
    "(Tensor q, Tensor k, Tensor v, Tensor tq, Tensor tk, Tensor tv, Tensor grad_out,"
    " Tensor grad_tangent_out, float scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,"
    " Tensor, Tensor, Tensor)", second_order_operands,
    lambda q, k, v, tq, tk, tv, grad_out, grad_tangent_out, scale: carried_fakes(
        (q, k, v, tq, tk, tv, grad_out, grad_tangent_out), SECOND_ORDER_FACTORS))


# %% [markdown]
# ## The dK/dV kernel
#
# A program owns one block of keys of one (batch, key head). Its outer loop runs over the
# query heads that share the key head (one head without GQA), its inner loop over query
# blocks. With top-left causal masking, query rows above the key block see none of its keys
# and are skipped. The tile loop always checks bounds here: every tile of a program shares
# its key columns, so the last key block needs the column mask on every query block anyway.
#
# Each gradient of a key block is a sum over query blocks of a transposed product,
# $dV \mathrel{+}= \tilde P^\top dO$, $dK \mathrel{+}= dS^\top Q$. The kernel can hold the
# accumulator as it is stored, BLOCK_N × d, or transposed, d × BLOCK_N, computing
# $dV^\top \mathrel{+}= dO^\top \tilde P$: the same products with the roles of the tensor cores'
# operands swapped, and one transpose at the store. Which is faster depends on how many
# query blocks a program visits (`TRANSPOSED_MAX_KEYS` below). Timed on the H200 (bf16,
# the whole first-order backward under a CUDA graph, bitwise equal gradients), transposed
# against stored in "accurate" precision: 0.237 against 0.258 ms at (64, 12, 256, 64),
# 0.245 against 0.261 at (32, 16, 256, 72), 0.400 against 0.441 at (32, 12, 512, 64) and
# 0.793 against 0.844 at (32, 16, 512, 72), but 1.201 against 1.135 at (32, 12, 1024, 64);
# in "fast" 0.182 against 0.199 at (64, 12, 256, 64) and 0.287 against 0.319 at
# (32, 12, 512, 64), while at $d = 72$ the two layouts are within 2% (0.180 against 0.177
# at 256 keys, 0.561 against 0.551 at 512). So rows of up to 512 keys accumulate
# transposed; from 1024 keys on a program's many query blocks favour the stored layout.
# The second order's key-side passes (chapter 6) hold two accumulators, each wide as the
# head dim: transposed, their products take the head dim as the rows `wgmma` needs, 64
# a warpgroup, where a narrow key block would fall back to `mma.sync`. There the autotuner
# chooses the layout with the tile (`laid_out` below).

# %% tags=["export"]
@triton.jit
def _key_gradient(a, b, acc, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                  TRANSPOSED: tl.constexpr):
    """acc + aᵀ b for an fp32 (query × key) tile `a` and a (query × d) input tile `b`
    (`dot_rounded`, chapter 2), or with TRANSPOSED its transpose, acc + bᵀ a."""
    if TRANSPOSED:
        hi = a.to(b.dtype)
        acc = tl.dot(tl.trans(b), hi, acc=acc, input_precision=DOT_PRECISION)
        if SPLIT:
            lo = (a - hi.to(tl.float32)).to(b.dtype)
            acc = tl.dot(tl.trans(b), lo, acc=acc, input_precision=DOT_PRECISION)
    else:
        acc = dot_rounded(tl.trans(a), b, acc, DOT_PRECISION, SPLIT)
    return acc


@triton.jit
def _key_accumulator(keys: tl.constexpr, dims: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A key block's fp32 gradient accumulator: keys × dims, or dims × keys TRANSPOSED."""
    if TRANSPOSED:
        acc = tl.zeros([dims, keys], dtype=tl.float32)
    else:
        acc = tl.zeros([keys, dims], dtype=tl.float32)
    return acc


@triton.jit
def _store_key_rows(ptr, acc, key_rows, cols, dims, n_k, n_dims, TRANSPOSED: tl.constexpr):
    """`store_rows` of a key block's gradient from either layout of `_key_accumulator`."""
    if TRANSPOSED:
        acc = tl.trans(acc)
    store_rows(ptr, acc, key_rows, cols, dims, n_k, n_dims)


@triton.jit
def _carried_units(factors_ptr, qk_scale, scale, CARRY: tl.constexpr,
                   HAS_TANGENT: tl.constexpr):
    """Both backward kernels' prologue: the scales of the scores and of the tangent scores
    (in fp32, `in_fp32`), the factor of delta, the exponent shift of P and the factors of dS
    and dtS, in the units of the carried fp16 copies, and the steps of dK's and dQ's
    accumulators between the units of their two products (identities without CARRY; see
    `second_order_shifts`)."""
    qk_scale = in_fp32(qk_scale) * carry_factor(factors_ptr, 0, CARRY, 1.0)
    delta_factor = carry_factor(factors_ptr, 1, CARRY, 1.0)
    p_exponent = carry_factor(factors_ptr, 5, CARRY, 0.0)
    t_scale = in_fp32(scale)
    ds_factor = 1.0
    dts_factor = 1.0
    to_tangent = 1.0
    from_tangent = 1.0
    if HAS_TANGENT:
        t_scale *= carry_factor(factors_ptr, 9, CARRY, 1.0)
        ds_factor = carry_factor(factors_ptr, 12, CARRY, 1.0)
        dts_factor = carry_factor(factors_ptr, 13, CARRY, 1.0)
        to_tangent = carry_factor(factors_ptr, 14, CARRY, 1.0)
        from_tangent = carry_factor(factors_ptr, 15, CARRY, 1.0)
    return (qk_scale, t_scale, delta_factor, p_exponent, ds_factor, dts_factor, to_tangent,
            from_tangent)


@triton.jit
def _aligned_backward_operands(stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn,
                               stride_tvn, stride_dom, stride_dtom, head_dim, value_dim,
                               ALIGN: tl.constexpr):
    """`aligned_operands` (chapter 2) and the row strides of dO and dtO."""
    (stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn, stride_tvn, head_dim,
     value_dim) = aligned_operands(stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn,
                                   stride_tvn, head_dim, value_dim, ALIGN)
    return (stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn, stride_tvn,
            aligned(stride_dom, ALIGN), aligned(stride_dtom, ALIGN), head_dim, value_dim)


@triton.jit
def _attention_backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, tq_ptr, tk_ptr, tv_ptr, mask_ptr, do_ptr, dto_ptr,
    lse_ptr, delta_ptr, mu_ptr, c_ptr, factors_ptr, dk_ptr, dv_ptr, dtk_ptr, dtv_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_tqb, stride_tqh, stride_tqm,
    stride_tkb, stride_tkh, stride_tkn, stride_tvb, stride_tvh, stride_tvn,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_dob, stride_doh, stride_dom, stride_dtob, stride_dtoh, stride_dtom,
    n_kv_heads, n_q, n_k, head_dim, value_dim, group_size, qk_scale, scale,
    n_q_bucket, n_k_bucket,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_TANGENT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    USE_TMA: tl.constexpr, CARRY: tl.constexpr, ALIGN: tl.constexpr,
    KEYS: tl.constexpr, VALUES: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    """dK (and dtK) with KEYS, dV (and dtV) with VALUES, of one key block, summed over all
    query heads of its GQA group, accumulated transposed with TRANSPOSED (`_key_gradient`).
    Row strides and head dims are multiples of ALIGN."""
    (stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn, stride_tvn, stride_dom,
     stride_dtom, head_dim, value_dim) = _aligned_backward_operands(
        stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn, stride_tvn, stride_dom,
        stride_dtom, head_dim, value_dim, ALIGN)
    (qk_scale, t_scale, delta_factor, p_exponent, ds_factor, dts_factor, to_tangent,
     from_tangent) = _carried_units(factors_ptr, qk_scale, scale, CARRY, HAS_TANGENT)
    scale = in_fp32(scale)
    start_n = tl.program_id(0) * BLOCK_N
    batch, kv_head = batch_and_head(tl.program_id(1), n_kv_heads, stride_mask_b,
                                    stride_mask_h, MASK_KIND)  # a per-head bias: L2 serves it
    cols = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    k = load_head_rows(head_base(k_ptr, batch, kv_head, stride_kb, stride_kh, ALIGN), start_n, stride_kn,
                        n_k, head_dim, BLOCK_N, BLOCK_D, USE_TMA)
    v = load_head_rows(head_base(v_ptr, batch, kv_head, stride_vb, stride_vh, ALIGN), start_n, stride_vn,
                        n_k, value_dim, BLOCK_N, BLOCK_DV, USE_TMA)
    acc_dk = _key_accumulator(BLOCK_N, BLOCK_D, TRANSPOSED)
    acc_dv = _key_accumulator(BLOCK_N, BLOCK_DV, TRANSPOSED)
    if HAS_TANGENT:
        tk = load_head_rows(head_base(tk_ptr, batch, kv_head, stride_tkb, stride_tkh, ALIGN), start_n,
                             stride_tkn, n_k, head_dim, BLOCK_N, BLOCK_D, USE_TMA)
        tv = load_head_rows(head_base(tv_ptr, batch, kv_head, stride_tvb, stride_tvh, ALIGN), start_n,
                             stride_tvn, n_k, value_dim, BLOCK_N, BLOCK_DV, USE_TMA)
        acc_dtk = _key_accumulator(BLOCK_N, BLOCK_D, TRANSPOSED)
        acc_dtv = _key_accumulator(BLOCK_N, BLOCK_DV, TRANSPOSED)
    else:
        tk, tv = k, v
        acc_dtk = tl.zeros([1, 1], dtype=tl.float32)
        acc_dtv = tl.zeros([1, 1], dtype=tl.float32)
    first_m = (start_n // BLOCK_M) * BLOCK_M if IS_CAUSAL else 0
    for member in range(group_size):
        head = kv_head * group_size + member
        stats = (batch * n_kv_heads * group_size + head) * n_q
        q_src = tile_source(head_base(q_ptr, batch, head, stride_qb, stride_qh, ALIGN), n_q, head_dim,
                             stride_qm, BLOCK_M, BLOCK_D, USE_TMA)
        do_src = tile_source(head_base(do_ptr, batch, head, stride_dob, stride_doh, ALIGN), n_q,
                              value_dim, stride_dom, BLOCK_M, BLOCK_DV, USE_TMA)
        if HAS_TANGENT:
            tq_src = tile_source(head_base(tq_ptr, batch, head, stride_tqb, stride_tqh, ALIGN), n_q,
                                  head_dim, stride_tqm, BLOCK_M, BLOCK_D, USE_TMA)
            dto_src = tile_source(head_base(dto_ptr, batch, head, stride_dtob, stride_dtoh, ALIGN), n_q,
                                   value_dim, stride_dtom, BLOCK_M, BLOCK_DV, USE_TMA)
        else:
            tq_src, dto_src = q_src, do_src
        head_mask = head_base(mask_ptr, batch, head, stride_mask_b, stride_mask_h)
        for start_m in range(first_m, n_q, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            q = load_rows(q_src, start_m, stride_qm, n_q, head_dim, BLOCK_M, BLOCK_D, USE_TMA)
            do = load_rows(do_src, start_m, stride_dom, n_q, value_dim, BLOCK_M, BLOCK_DV,
                            USE_TMA)
            if HAS_TANGENT:
                tq = load_rows(tq_src, start_m, stride_tqm, n_q, head_dim, BLOCK_M, BLOCK_D,
                                USE_TMA)
                dto = load_rows(dto_src, start_m, stride_dtom, n_q, value_dim, BLOCK_M,
                                 BLOCK_DV, USE_TMA)
            else:
                tq, dto = q, do
            lse2, delta, mu, c = _load_row_statistics(
                lse_ptr + stats, _load_delta(delta_ptr + stats, rows, n_q), mu_ptr + stats,
                c_ptr + stats, rows, n_q, delta_factor, p_exponent, factors_ptr, HAS_TANGENT,
                CARRY, MASK_KIND)
            p, ds, tp, dts = _backward_tile(
                q, k, v, tq, tk, tv, do, dto, lse2, delta, mu, c, rows, cols,
                head_mask, stride_mask_m, stride_mask_n, n_q, n_k, qk_scale, t_scale,
                ds_factor, dts_factor,
                IS_CAUSAL, MASK_KIND, HAS_TANGENT, True, DOT_PRECISION, q, k, v, do, 0, 0)
            if VALUES:
                acc_dv = _key_gradient(p, do, acc_dv, DOT_PRECISION, SPLIT, TRANSPOSED)
            if KEYS:
                acc_dk = _key_gradient(ds, q, acc_dk, DOT_PRECISION, SPLIT, TRANSPOSED)
            if HAS_TANGENT and VALUES:
                acc_dv = _key_gradient(tp, dto, acc_dv, DOT_PRECISION, SPLIT, TRANSPOSED)
                acc_dtv = _key_gradient(p, dto, acc_dtv, DOT_PRECISION, SPLIT, TRANSPOSED)
            if HAS_TANGENT and KEYS:
                acc_dk = _key_gradient(dts, tq, acc_dk * to_tangent, DOT_PRECISION, SPLIT,
                                       TRANSPOSED) * from_tangent
                acc_dtk = _key_gradient(dts, q, acc_dtk, DOT_PRECISION, SPLIT, TRANSPOSED)
    key_rows = (batch * n_kv_heads + kv_head) * n_k + cols
    dk_factor = scale * carry_factor(factors_ptr, 3, CARRY, 1.0)
    if KEYS:
        _store_key_rows(dk_ptr, acc_dk * dk_factor, key_rows, cols, dims, n_k, head_dim,
                        TRANSPOSED)
    dv_factor = carry_factor(factors_ptr, 4, CARRY, 1.0)
    if VALUES:
        _store_key_rows(dv_ptr, acc_dv * dv_factor, key_rows, cols, dims_v, n_k, value_dim,
                        TRANSPOSED)
    if HAS_TANGENT and KEYS:
        dtk_factor = scale * carry_factor(factors_ptr, 7, CARRY, 1.0)
        _store_key_rows(dtk_ptr, acc_dtk * dtk_factor, key_rows, cols, dims, n_k, head_dim,
                        TRANSPOSED)
    if HAS_TANGENT and VALUES:
        _store_key_rows(dtv_ptr, acc_dtv * carry_factor(factors_ptr, 8, CARRY, 1.0), key_rows,
                        cols, dims_v, n_k, value_dim, TRANSPOSED)


# %% [markdown]
# ## The dQ kernel
#
# A program owns one query block and walks the key blocks it sees, with the same split into
# whole blocks and masked tail as the forward (`key_block_ranges`), and under a causal mask
# the grid takes the last query blocks first, as the forward does (`query_block_start`).
# (The dK/dV grid needs no such order: its first key blocks are the ones most query blocks
# see.)
#
# Like the forward, the first-order dQ kernel multiplies a heavily padded head dim in two
# column tiles (chapter 2's `column_tiles`: 72 = 64 + 16): the scores and $dP$ take a second
# product each, and dQ a second accumulator. Compiled for Hopper at $d = 72$ in bf16 its
# tiles need 82 to 157 registers instead of 174 to 206. The dK/dV kernel keeps one padded
# tile: with two, every one of its 8-warp tiles spills (580 to 1796 bytes per thread), and
# the second-order kernels are at the register ceiling already
# (`tools/kernel_resources.py --head-dim 72`). Read through tensor descriptors (chapter
# 4), a dK/dV kernel with two column tiles does compile without spills (169 to 241
# registers), but it bought nothing: timed
# on the H200 in one process against the padded kernel, a MeanFlow call at
# (16, 16, 1024, 72) in bf16 took 2.70 ms either way.

# %% tags=["export"]
@triton.jit
def _dq_key_block(
    acc_dq, acc_dq2, acc_dtq, q, q2, tq, do, do2, dto, lse2, delta, mu, c, rows, start_n,
    k_src, k2_src, stride_kn, v_src, v2_src, stride_vn, tk_src, stride_tkn, tv_src,
    stride_tvn, mask_ptr, stride_mask_m, stride_mask_n, dmask_ptr, dtmask_ptr,
    n_q, n_k, head_dim, value_dim, qk_scale, t_scale, ds_factor, dts_factor, to_tangent,
    from_tangent, natural_ds, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_TANGENT: tl.constexpr, CHECK_BOUNDS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr, USE_TMA: tl.constexpr, MASK_GRAD: tl.constexpr, D_TAIL: tl.constexpr,
    DV_TAIL: tl.constexpr,
):
    """Fold the key block starting at `start_n` into dQ (and dtQ); with MASK_GRAD, store
    its tile of dS (times `natural_ds`, back from the carried units) and dtS as the
    gradients of the additive mask and of its tangent."""
    cols = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(k_src, start_n, stride_kn, n_k, head_dim, BLOCK_N, BLOCK_D, USE_TMA)
    v = load_rows(v_src, start_n, stride_vn, n_k, value_dim, BLOCK_N, BLOCK_DV, USE_TMA)
    k2 = load_tail_rows(k2_src, start_n, stride_kn, n_k, head_dim, BLOCK_N, BLOCK_D, D_TAIL,
                        USE_TMA)
    v2 = load_tail_rows(v2_src, start_n, stride_vn, n_k, value_dim, BLOCK_N, BLOCK_DV,
                        DV_TAIL, USE_TMA)
    if HAS_TANGENT:
        tk = load_rows(tk_src, start_n, stride_tkn, n_k, head_dim, BLOCK_N, BLOCK_D, USE_TMA)
        tv = load_rows(tv_src, start_n, stride_tvn, n_k, value_dim, BLOCK_N, BLOCK_DV,
                        USE_TMA)
    else:
        tk, tv = k, v
    p, ds, tp, dts = _backward_tile(
        q, k, v, tq, tk, tv, do, dto, lse2, delta, mu, c, rows, cols,
        mask_ptr, stride_mask_m, stride_mask_n, n_q, n_k, qk_scale, t_scale, ds_factor,
        dts_factor, IS_CAUSAL, MASK_KIND, HAS_TANGENT, CHECK_BOUNDS, DOT_PRECISION, q2, k2, v2,
        do2,
        D_TAIL, DV_TAIL)
    if MASK_GRAD:  # the launcher carries with MASK_GRAD only without the tangent
        wide_rows = rows.to(tl.int64)  # a head's Nq x Nk entries can pass 2**31
        store_rows(dmask_ptr, ds * natural_ds, wide_rows, rows, cols, n_q, n_k)
        if HAS_TANGENT:
            store_rows(dtmask_ptr, dts, wide_rows, rows, cols, n_q, n_k)
    acc_dq = dot_rounded(ds, k, acc_dq, DOT_PRECISION, SPLIT)
    if D_TAIL > 0:
        acc_dq2 = dot_rounded(ds, k2, acc_dq2, DOT_PRECISION, SPLIT)
    if HAS_TANGENT:
        acc_dq = dot_rounded(dts, tk, acc_dq * to_tangent, DOT_PRECISION, SPLIT) * from_tangent
        acc_dtq = dot_rounded(dts, k, acc_dtq, DOT_PRECISION, SPLIT)
    return acc_dq, acc_dq2, acc_dtq


@triton.jit
def _store_zero_mask_grads(dmask_ptr, dtmask_ptr, rows, start, n_q, n_k,
                           HAS_TANGENT: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    """Store dS = 0 (and dtS = 0) in this program's rows from key `start` on, the tiles
    above the causal band that it never visits: the mask's gradient is not zeroed first."""
    wide_rows = rows.to(tl.int64)
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start_n in range(start, n_k, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        store_rows(dmask_ptr, zeros, wide_rows, rows, cols, n_q, n_k)
        if HAS_TANGENT:
            store_rows(dtmask_ptr, zeros, wide_rows, rows, cols, n_q, n_k)


@triton.jit
def _attention_backward_dq_kernel(
    q_ptr, k_ptr, v_ptr, tq_ptr, tk_ptr, tv_ptr, mask_ptr, do_ptr, dto_ptr, o_ptr, o_residual_ptr,
    lse_ptr, delta_ptr, mu_ptr, c_ptr, factors_ptr, dq_ptr, dtq_ptr, dmask_ptr, dtmask_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_tqb, stride_tqh, stride_tqm,
    stride_tkb, stride_tkh, stride_tkn, stride_tvb, stride_tvh, stride_tvn,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_dob, stride_doh, stride_dom, stride_dtob, stride_dtoh, stride_dtom,
    n_heads, n_q, n_k, head_dim, value_dim, group_size, qk_scale, scale,
    n_q_bucket, n_k_bucket,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_TANGENT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    USE_TMA: tl.constexpr, CARRY: tl.constexpr, MASK_GRAD: tl.constexpr,
    D_TAIL: tl.constexpr, DV_TAIL: tl.constexpr, DELTA_HERE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, ALIGN: tl.constexpr,
):
    """dQ (and dtQ) of one query block of one (batch, head); with MASK_GRAD also its rows of
    the mask's gradient dS (and dtS), contiguous (B, H, Nq, Nk) in the mask's dtype. With
    DELTA_HERE it computes its rows' Delta from dO and the contiguous forward output O (plus
    its residual with HAS_RESIDUAL) and stores it for the dK/dV kernel, launched after it. Row strides and
    head dims are multiples of ALIGN."""
    (stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn, stride_tvn, stride_dom,
     stride_dtom, head_dim, value_dim) = _aligned_backward_operands(
        stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn, stride_tvn, stride_dom,
        stride_dtom, head_dim, value_dim, ALIGN)
    (qk_scale, t_scale, delta_factor, p_exponent, ds_factor, dts_factor, to_tangent,
     from_tangent) = _carried_units(factors_ptr, qk_scale, scale, CARRY, HAS_TANGENT)
    scale = in_fp32(scale)
    start_m = query_block_start(BLOCK_M, IS_CAUSAL)  # causal: longest tiles first
    batch, head = batch_and_head(tl.program_id(1), n_heads, stride_mask_b, stride_mask_h,
                                 MASK_KIND)  # a per-head bias: L2 serves it to the batch
    kv_head = head // group_size
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_base = head_base(q_ptr, batch, head, stride_qb, stride_qh, ALIGN)
    do_base = head_base(do_ptr, batch, head, stride_dob, stride_doh, ALIGN)
    stats = (batch * n_heads + head) * n_q
    if DELTA_HERE:  # first thing, while no other tile holds registers
        delta = _delta_of_block(o_ptr, o_residual_ptr, do_base, stride_dom, stats, rows, n_q,
                                value_dim, BLOCK_DV, DV_TAIL, HAS_RESIDUAL)
        tl.store(delta_ptr + stats + rows, delta, mask=rows < n_q)
    q = load_head_rows(q_base, start_m, stride_qm, n_q, head_dim, BLOCK_M, BLOCK_D, USE_TMA)
    do = load_head_rows(do_base, start_m, stride_dom, n_q, value_dim, BLOCK_M, BLOCK_DV,
                         USE_TMA)
    q2 = load_head_tail_rows(q_base, start_m, stride_qm, n_q, head_dim, BLOCK_M, BLOCK_D,
                             D_TAIL, USE_TMA)
    do2 = load_head_tail_rows(do_base, start_m, stride_dom, n_q, value_dim, BLOCK_M, BLOCK_DV,
                              DV_TAIL, USE_TMA)
    if HAS_TANGENT:
        tq = load_head_rows(head_base(tq_ptr, batch, head, stride_tqb, stride_tqh, ALIGN), start_m,
                             stride_tqm, n_q, head_dim, BLOCK_M, BLOCK_D, USE_TMA)
        dto = load_head_rows(head_base(dto_ptr, batch, head, stride_dtob, stride_dtoh, ALIGN), start_m,
                              stride_dtom, n_q, value_dim, BLOCK_M, BLOCK_DV, USE_TMA)
        acc_dtq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    else:
        tq, dto = q, do
        acc_dtq = tl.zeros([1, 1], dtype=tl.float32)
    if not DELTA_HERE:
        delta = _load_delta(delta_ptr + stats, rows, n_q)
    lse2, delta, mu, c = _load_row_statistics(lse_ptr + stats, delta, mu_ptr + stats,
                                              c_ptr + stats, rows, n_q, delta_factor,
                                              p_exponent, factors_ptr, HAS_TANGENT, CARRY,
                                              MASK_KIND)
    k_base = head_base(k_ptr, batch, kv_head, stride_kb, stride_kh, ALIGN)
    v_base = head_base(v_ptr, batch, kv_head, stride_vb, stride_vh, ALIGN)
    k_src = tile_source(k_base, n_k, head_dim, stride_kn, BLOCK_N, BLOCK_D, USE_TMA)
    v_src = tile_source(v_base, n_k, value_dim, stride_vn, BLOCK_N, BLOCK_DV, USE_TMA)
    k2_src = tail_source(k_base, n_k, head_dim, stride_kn, BLOCK_N, BLOCK_D, D_TAIL, USE_TMA)
    v2_src = tail_source(v_base, n_k, value_dim, stride_vn, BLOCK_N, BLOCK_DV, DV_TAIL,
                         USE_TMA)
    if HAS_TANGENT:
        tk_src = tile_source(head_base(tk_ptr, batch, kv_head, stride_tkb, stride_tkh, ALIGN), n_k,
                              head_dim, stride_tkn, BLOCK_N, BLOCK_D, USE_TMA)
        tv_src = tile_source(head_base(tv_ptr, batch, kv_head, stride_tvb, stride_tvh, ALIGN), n_k,
                              value_dim, stride_tvn, BLOCK_N, BLOCK_DV, USE_TMA)
    else:
        tk_src, tv_src = k_src, v_src
    mask_ptr = head_base(mask_ptr, batch, head, stride_mask_b, stride_mask_h)
    natural_ds = 1.0
    if not HAS_TANGENT:  # carried first-order dS is 2**e_ds dS (`backward_shifts`)
        natural_ds = carry_factor(factors_ptr, 6, CARRY, 1.0)
    dmask_ptr += stats * n_k  # this program's (batch, head); it alone writes its rows
    dtmask_ptr += stats * n_k
    acc_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc_dq2 = tail_accumulator(BLOCK_M, D_TAIL)
    full_end, end = key_block_ranges(start_m, n_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        acc_dq, acc_dq2, acc_dtq = _dq_key_block(
            acc_dq, acc_dq2, acc_dtq, q, q2, tq, do, do2, dto, lse2, delta, mu, c, rows,
            start_n, k_src, k2_src, stride_kn, v_src, v2_src, stride_vn, tk_src, stride_tkn,
            tv_src, stride_tvn, mask_ptr, stride_mask_m, stride_mask_n, dmask_ptr, dtmask_ptr,
            n_q, n_k, head_dim, value_dim, qk_scale, t_scale, ds_factor, dts_factor, to_tangent,
            from_tangent, natural_ds, IS_CAUSAL, MASK_KIND, HAS_TANGENT, False, BLOCK_N, BLOCK_D,
            BLOCK_DV, DOT_PRECISION, SPLIT, USE_TMA, MASK_GRAD, D_TAIL, DV_TAIL)
    for start_n in range(full_end, end, BLOCK_N):
        acc_dq, acc_dq2, acc_dtq = _dq_key_block(
            acc_dq, acc_dq2, acc_dtq, q, q2, tq, do, do2, dto, lse2, delta, mu, c, rows,
            start_n, k_src, k2_src, stride_kn, v_src, v2_src, stride_vn, tk_src, stride_tkn,
            tv_src, stride_tvn, mask_ptr, stride_mask_m, stride_mask_n, dmask_ptr, dtmask_ptr,
            n_q, n_k, head_dim, value_dim, qk_scale, t_scale, ds_factor, dts_factor, to_tangent,
            from_tangent, natural_ds, IS_CAUSAL, MASK_KIND, HAS_TANGENT, True, BLOCK_N, BLOCK_D,
            BLOCK_DV, DOT_PRECISION, SPLIT, USE_TMA, MASK_GRAD, D_TAIL, DV_TAIL)
    if MASK_GRAD and IS_CAUSAL:
        _store_zero_mask_grads(dmask_ptr, dtmask_ptr, rows, end, n_q, n_k, HAS_TANGENT,
                               BLOCK_M, BLOCK_N)
    flat_rows = stats + rows
    dq_factor = scale * carry_factor(factors_ptr, 2, CARRY, 1.0)
    store_rows(dq_ptr, acc_dq * dq_factor, flat_rows, rows, dims, n_q, head_dim)
    if D_TAIL > 0:
        store_rows(dq_ptr, acc_dq2 * dq_factor, flat_rows, rows, BLOCK_D + tl.arange(0, D_TAIL),
                   n_q, head_dim)
    if HAS_TANGENT:
        dtq_factor = scale * carry_factor(factors_ptr, 6, CARRY, 1.0)
        store_rows(dtq_ptr, acc_dtq * dtq_factor, flat_rows, rows, dims, n_q, head_dim)


# %% [markdown]
# ## The launcher
#
# The first-order backward is two launches: dQ, then dK/dV. $\Delta_i = \sum_d dO_{id} O_{id}$
# belongs to a query row, and the dQ kernel holds each query row's $dO$ exactly once, so it
# computes its rows' $\Delta$ before anything else (`_delta_of_block`, from $O$ plus its
# rounding residual, as the row-statistics kernel does) and stores it; the dK/dV kernel,
# launched after it on the same stream, reads it. That is one launch fewer than a separate
# row-statistics pass: at DiT's short rows each launch costs the host about 100 µs on the
# H200 (chapter 8, "Inside the host time"), more than the pass's GPU time. Two cases keep the
# row-statistics launch: the backward through the tangent (it needs $c$ and $\mu$ terms too),
# and rows of $O$ that are not 16-element aligned ($d = 72$): their loads do not vectorise,
# and compiled for Hopper the dQ kernel then needed up to twice the registers (99 to 190 on
# a 128 × 32 tile; `tools/kernel_resources.py --kernels _backward_dq --head-dim 72`), where at
# $d = 64$ and $128$ its registers stay as they were. Carried (bf16, long rows), the copy
# kernel writes $\Delta$ and the launches are the range pass, the copies, dQ and dK/dV.
# The gradients come back contiguous, in the inputs' dtypes; dK and dV have the key heads'
# shape (the GQA sum is already done). On an sm_90 GPU, unmasked first-order calls with long
# rows hand their dQ and dK/dV to chapter 12's warp-specialised kernels (in "fast" mode the
# row-statistics kernel then computes $\Delta$ first), whose dK/dV kernel sums dQ as well
# where `fuses_dq` says so.
#
# The backward through the tangent (chapter 6) runs its key side in two passes over the
# queries rather than one: the dK/dV kernel with `VALUES` only makes $dV$ and $dt_V$ (it
# needs $P$ and $t_P$, so three score products: $S$ and the two halves of $t_S$), then with
# `KEYS` only $dK$ and $dt_K$ (all six score products, for $dS$ and $dt_S$). One pass holds
# four fp32 accumulators of a key block, so at $d = 128$ only 16 × 32 tiles fit in
# registers without spilling, and with 16 query rows the products run on Ampere-style
# tensor-core instructions; each pass holds two, like the first-order kernel, and takes
# larger tiles. The cost is the three score products done twice: 24 products of a tile's
# size instead of 21, counting the dQ kernel's nine (chapter 6). On the H200 (bf16, (4, 16,
# 4096, 128), the whole second-order backward, in one session): 22.49 ms in one pass
# against 21.39 in two in "accurate" precision (183 against 193 TFLOP/s), 18.62 against
# 16.21 ms in "fast" (221 against 254); at (4, 32, 4096, 64) 23.75 ms "accurate" and 16.76 "fast", where the one
# pass took 26.68 and 22.22 in an earlier run (`benchmarks/results/second_order_h200.json`).
#
# A training loop calls the backward with the same shapes step after step, so, like the
# forward (chapter 2, "Replaying a call"), it replays a call at a key seen before. Its
# launches are several (the row statistics where they run, dQ, one or two key-side
# passes), and each takes tensors the call allocates (the gradients, $\Delta$, $c$) as
# well as its inputs. So the buffers come from one function (`backward_buffers`), the call
# is recorded as chapter 2's forward is (`Recording`), and `launch_slots` finds each
# launch's tensor arguments among the inputs, those buffers and the scratch tensors of a
# carry (its copies, factors and $\Delta$, from `scratch_tensor`) by identity. A replay
# allocates new buffers and scratch tensors and calls each compiled kernel with the tensors
# at those places. A call none of whose launches went through Triton's own path, and whose
# tensors all come from there, is replayable: carried ones too, not chapter 12's kernels
# (their descriptors hold addresses), and masked ones, unless the mask has a tangent
# (PyTorch's operations pair the two in a new tensor). A mask that takes a gradient (a
# learnable bias) is replayed too: the buffers of its gradients come from one function as
# well (`mask_grad_buffers`, allocated before the launches, never filled: the dQ programs
# write every entry), and the key holds whether the call asks for them. Under the
# interpreter the recorded launches are the interpreter's, which a replay calls with the
# new tensors the same way.
# On the H200's host, in a MeanFlow call at DiT-B/2's (64, 12, 256, 64) in bf16 (the
# forward with its tangent, then the primal backward: two replayed launches), the backward
# launcher took 136 µs (median of five runs; 109 to 179) against 344 (219 to 399) in runs
# of the code before the replay alternating with them, and the whole call 868 µs (670 to
# 1078) against PyTorch's own 263 for a clone
# (`benchmarks/results/host_breakdown_replay_h200.json`). The clone pays PyTorch's share,
# the autograd engine's hand-over of the backward to its device thread among it (0.2 to
# 0.3 ms a call, which running the backward on the calling thread saves: chapter 8, "The
# autograd engine's thread"); ours adds the launchers and the Python around our Function
# (functorch's lift, `Function.apply`, the backward node).
# `SPLIT_KEY_SIDE = False` brings back the one pass. On an sm_90 GPU, unmasked calls through
# the tangent that chapter 12's first-order kernels would take hand its three passes to
# that chapter's warp-specialised forms (`SECOND_ORDER_PASSES` there says which).

# %% tags=["export"]
from jvp_attention.hopper_backward import (  # noqa: E402  (chapter 12)
    fuses_dq,
    launch_warp_specialized_dkdv,
    launch_warp_specialized_dq,
    launched,
    launched_tangent_pass,
    warp_specialized_backward_kernels,
    warp_specialized_tangent_passes,
)

# Tiles that compile for Hopper without register spills at d = 128 (tools/kernel_resources.py):
# the dK/dV kernel holds two fp32 accumulators the size of a key block, four with the tangent.
_backward_dkdv = KeyedAutotuner(_attention_backward_dkdv_kernel, tile_configs([
    (64, 32, 8, 2), (128, 32, 8, 1), (128, 16, 8, 2), (32, 32, 8, 2), (128, 32, 8, 2),
    (64, 64, 4, 2), (32, 32, 4, 1)]), [*AUTOTUNE_KEYS, "TRANSPOSED"])
# Keys per row up to which the first-order dK/dV kernel accumulates transposed
# (`_key_gradient`). H200, bf16, the kernel alone, best tile of each layout (64 x 64 on 4
# warps): 0.150 against 0.171 ms at (64, 12, 256, 64), 0.219 against 0.241 at
# (32, 16, 256, 72), but 0.704 against 0.610 at (32, 12, 1024, 64); at 512 keys the whole
# backward gains 9% (d = 64) or stays within 2% (d = 72). The second-order passes choose
# their layout with their tile (`laid_out`).
TRANSPOSED_MAX_KEYS = 512


def with_layout(configs: list[triton.Config], transposed: bool) -> list[triton.Config]:
    """`configs` whose dK/dV kernel accumulates dims x keys (`transposed`) or keys x dims."""
    return [triton.Config({**config.kwargs, "TRANSPOSED": transposed},
                          num_warps=config.num_warps, num_stages=config.num_stages)
            for config in configs]


def laid_out(stored: list[tuple[int, int, int, int]],
             transposed: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """A second-order key-side pass's candidates: the `stored` tiles accumulating keys x
    dims, the `transposed` ones dims x keys, so that the autotuner chooses the layout with
    the tile (under the interpreter, the one stored tile)."""
    configs = with_layout(tile_configs(stored), False)
    return configs if interpreting() else configs + with_layout(tile_configs(transposed), True)


# 16 x 32 on 4 warps, 2 stages: the one spill-free dK/dV tangent tile at d = 128 that was
# faster, on the H200 at (4, 16, 4096, 128) bf16: 15.9 ms against 17.6 ms for the best tile
# before it (tools/tile_sweep.py --kernel backward_dkdv_tangent). The one-pass form was
# slower transposed at every tile tried, so it stays stored.
_backward_dkdv_tangent = KeyedAutotuner(_attention_backward_dkdv_kernel, laid_out([
    (32, 32, 8, 2), (128, 16, 8, 2), (32, 32, 4, 1), (64, 32, 8, 2), (16, 32, 4, 2)], []),
    AUTOTUNE_KEYS)
# Not 32 x 64 on 4 warps: compiled for sm_90 by Triton 3.6 it multiplies on `wgmma` from
# shared memory that its threads wrote without the proxy fence those reads need (the one
# tile of every list with that pattern, tools/kernel_resources.py's `unfenced_wgmma`), and
# in the dK pass at d = 128 it returned a dtK that differed from call to call, at times
# with 3.5x PyTorch's error (H100, bf16, (2, 8, 1024, 128); chapter 6). Every other tile
# of both passes and of the dQ kernel gave bitwise the same gradients in 8 calls.
_KEY_SIDE_TILES = [(64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2),
                   (128, 16, 8, 2), (64, 32, 8, 2), (32, 32, 4, 1), (16, 32, 4, 2)]
# Transposed, these multiply on Hopper's wgmma alone without spills (tools/kernel_resources.py
# --key-layout transposed, chapter 6): at d = 128 and at d = 64, but for the dK pass's
# 64 x 32 on 8 warps, which spills 24 bytes at d = 128.
_backward_dv_tangent = KeyedAutotuner(_attention_backward_dkdv_kernel, laid_out(
    _KEY_SIDE_TILES, [(64, 32, 8, 2), (64, 32, 4, 2), (128, 16, 8, 1), (64, 16, 8, 2)]),
    [*AUTOTUNE_KEYS, "KEYS", "VALUES"])
_backward_dk_tangent = KeyedAutotuner(_attention_backward_dkdv_kernel, laid_out(
    _KEY_SIDE_TILES, [(64, 16, 8, 2), (64, 16, 4, 2), (128, 16, 8, 1), (64, 32, 8, 2)]),
    [*AUTOTUNE_KEYS, "KEYS", "VALUES"])
# The second-order dK/dV work in one pass (four accumulators) or in two (dV and dtV, then
# dK and dtK: two accumulators each, at the cost of the score products done twice).
SPLIT_KEY_SIDE = True
_backward_dq = autotuned(_attention_backward_dq_kernel, [
    (128, 32, 8, 2), (64, 64, 8, 2), (128, 16, 8, 2), (64, 32, 8, 2), (128, 64, 8, 2),
    (64, 64, 4, 2), (32, 32, 4, 1)])
# 64 x 64 on 4 warps: at d = 64 the dQ kernel through the tangent took 2.33 ms against 3.29
# ms for the best tile before it (H100, bf16 "accurate", (4, 16, 4096, 64), tools/tile_sweep.py
# --kernel backward_dq_tangent); at d = 128 it loses (10.1 against 5.9 ms for 128 x 32).
_backward_dq_tangent = autotuned(_attention_backward_dq_kernel, [
    (32, 32, 8, 2), (128, 16, 8, 2), (32, 32, 4, 1), (128, 32, 8, 2), (64, 64, 4, 2)])
_ROW_BLOCK = 64
# The first-order kernels read through tensor descriptors (chapter 4) only when both loops
# are long: the dQ kernel's runs over the keys, the dK/dV kernel's over the queries, and
# each program builds its descriptors before its first block. H200, bf16, the GPU time of
# the primal backward's kernels in a MeanFlow call, pointers against descriptors: 0.26
# against 0.31 ms at (64, 12, 256, 64), 0.66 against 0.71 at (48, 12, 512, 64); from 1024
# tokens descriptors lead, 1.12 against 1.31 ms at (32, 12, 1024, 64), 2.20 against 2.78
# at (4, 16, 4096, 64).
BACKWARD_TMA_MIN_TOKENS = 1024
# A compiled graph that runs its launches from Python traces pointer kernels below this many
# tokens rather than keep an opaque operator for the descriptors (`host_bound_graph`).
GRAPH_TMA_MIN_TOKENS = 4096


def backward_tma_min_tokens(q: torch.Tensor) -> int:
    """Tokens (queries and keys alike) from which the first-order kernels read through
    tensor descriptors: BACKWARD_TMA_MIN_TOKENS, or GRAPH_TMA_MIN_TOKENS in a compiled graph
    that runs its launches from Python (`host_bound_graph`)."""
    return GRAPH_TMA_MIN_TOKENS if host_bound_graph(q) else BACKWARD_TMA_MIN_TOKENS


def long_backward_rows(q: torch.Tensor, n_q: int, n_k: int) -> bool:
    """Whether the first-order kernels read `n_q` queries and `n_k` keys through tensor
    descriptors (given tensors that allow them): from `backward_tma_min_tokens` of both,
    unless the call is one that a compiled graph traces through pointers at any length
    (`graph_takes_pointers`). (The first test spares short calls two function calls: this
    runs on every backward.)"""
    tokens = min(n_q, n_k)
    return (tokens >= BACKWARD_TMA_MIN_TOKENS and tokens >= backward_tma_min_tokens(q)
            and not graph_takes_pointers(q, n_k))


def traceable_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       has_tangent: bool) -> bool:
    """Whether the backward's launches may enter a compiled graph (`traceable_launches`):
    the first-order one reads through descriptors on `long_backward_rows` and cuts head dims
    in its dQ kernel; the one through the tangent does neither."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    if has_tangent:
        return traceable_launches(q, n_k, long_rows=False, cut=False)
    return traceable_launches(q, n_k, long_rows=long_backward_rows(q, n_q, n_k),
                              cut=cut_in_two(q.shape[-1], v.shape[-1]))


def flash_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    tangents: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    tangent_out: torch.Tensor | None = None,
    mu: torch.Tensor | None = None,
    grad_tangent_out: torch.Tensor | None = None,
    out_residual: torch.Tensor | None = None,
    tangent_out_residual: torch.Tensor | None = None,
    *,
    mask_tangent: torch.Tensor | None = None,
    mask_grad: bool = False,
    precision: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of attention on (B, H, N, D) tensors, from the forward's saved outputs.

    Args:
        q, k, v: The forward's inputs (see `flash_attention_forward`).
        out, lse: The forward's contiguous output and fp32 log-sum-exp.
        grad_out: Cotangent of `out`, any strides (as q, k, v, the tangents and
            grad_tangent_out); a last dimension that is not contiguous is copied.
        attn_mask, is_causal, scale: As in the forward.
        tangents, tangent_out, mu, grad_tangent_out: For the backward through the tangent
            (chapter 6): the forward's tangents (tq, tk, tv), its tO and mu, and the
            cotangent of tO. With `grad_tangent_out=None` the plain backward runs.
        out_residual, tangent_out_residual: The forward's rounding residuals
            (`flash_attention_forward(..., residuals=True)`): with them the row statistics
            use the fp32 outputs, which keeps 16-bit gradients at PyTorch's accuracy.
        mask_tangent: The forward's tangent of an additive attn_mask: the backward through
            the tangent needs it (it changes tS); the first-order backward ignores it.
        mask_grad: Also return the gradient of the additive (float) attn_mask, dS, as a
            (B, Hq, Nq, Nk) tensor in the mask's dtype (and, through the tangent, that of
            `mask_tangent`, dtS, in its dtype), rounded once from fp32; the caller sums it
            over the dimensions its mask was broadcast along.
        precision: "accurate" or "fast" for this call; None uses the global mode
            (`set_precision`). Pass the mode the forward ran in.

    Returns:
        (dq, dk, dv), or (dq, dk, dv, dtq, dtk, dtv) when `grad_tangent_out` is given;
        with `mask_grad`, followed by dmask (and dmask_tangent).

    Raises:
        ValueError: For mismatched shapes, a bad `precision`, missing tangent inputs, or a
            `mask_tangent` or `mask_grad` without an additive attn_mask.
    """
    exact = accurate(precision)
    has_tangent = grad_tangent_out is not None
    inputs = (q, k, v, out, lse, grad_out, *(tangents or (None, None, None)), tangent_out, mu,
              grad_tangent_out, out_residual, tangent_out_residual, attn_mask)
    key = None
    if mask_tangent is None:  # replayable (PyTorch's operations pair a mask's tangent with
        # the mask, which a replay would skip)
        key = backward_key(inputs, is_causal, scale, exact, mask_grad)
        replay = BACKWARD_REPLAYS.get(key) if key is not None else None
        if replay is not None and replay.usable():
            buffers = (*backward_buffers(q, k, v, lse, has_tangent),
                       *mask_grad_buffers(attn_mask, None, q, k, has_tangent, mask_grad))
            replay((*inputs, *buffers))
            return backward_results(buffers, has_tangent)
    check_kernel_shapes(q, k, v)
    batch, n_heads, n_q, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    scores_shape = (batch, n_heads, n_q, k.shape[2])
    check_mask_tangent(attn_mask, mask_tangent, scores_shape)
    if mask_grad and (attn_mask is None or not attn_mask.is_floating_point()):
        raise ValueError("mask_grad needs an additive (float) attn_mask: a boolean mask or "
                         "no mask has no gradient")
    if has_tangent and (tangents is None or tangent_out is None or mu is None):
        raise ValueError("the backward through the tangent needs tangents, tangent_out and mu")
    q, k, v, grad_out = (unit_last_stride(x) for x in (q, k, v, grad_out))
    tq, tk, tv = (unit_last_stride(x) for x in tangents) if has_tangent else (q, k, v)
    dto = unit_last_stride(grad_tangent_out) if has_tangent else grad_out
    t_out = tangent_out if has_tangent else out
    mu = mu if has_tangent else lse
    residual = out if out_residual is None else out_residual
    if has_tangent and out_residual is not None and tangent_out_residual is None:
        raise ValueError("pass tangent_out_residual along with out_residual")
    t_residual = tangent_out_residual if has_tangent and out_residual is not None else residual
    buffers = (*backward_buffers(q, k, v, lse, has_tangent),
               *mask_grad_buffers(attn_mask, mask_tangent, q, k, has_tangent, mask_grad))
    with Recording((*inputs, *buffers), key is not None) as recording:  # for a replay
        _launch_backward(
            q, k, v, out, lse, grad_out, attn_mask, is_causal, scale, tq, tk, tv, t_out, mu,
            dto, out_residual, residual, t_residual, mask_tangent, mask_grad, exact,
            has_tangent, buffers)
    if recording.replay is not None:
        remember(BACKWARD_REPLAYS, key, recording.replay)
    return backward_results(buffers, has_tangent)


def mask_grad_buffer(mask: torch.Tensor, scores_shape: tuple[int, ...]) -> torch.Tensor:
    """An unfilled (B, Hq, Nq, Nk) buffer for the gradient of `mask`, in its dtype: the
    kernels round their fp32 dS once into it, the values `.to(mask.dtype)` of an fp32
    buffer would give, without that copy and, for a 16-bit bias, at half the bytes."""
    return torch.empty(scores_shape, device=mask.device, dtype=mask.dtype)


def mask_grad_buffers(attn_mask: torch.Tensor | None, mask_tangent: torch.Tensor | None,
                      q: torch.Tensor, k: torch.Tensor, has_tangent: bool,
                      mask_grad: bool) -> tuple[torch.Tensor, ...]:
    """With `mask_grad`, the buffers of the mask's gradients (`mask_grad_buffer`): dmask
    and, through the tangent, dmask_tangent in the dtype of the mask's tangent (the mask's
    where it has none); else none. Allocated before the launches, so that they are among a
    recorded call's tensors and a replay writes buffers of its own."""
    if not mask_grad:
        return ()
    scores_shape = (*q.shape[:3], k.shape[2])
    dmask = mask_grad_buffer(attn_mask, scores_shape)
    if not has_tangent:
        return (dmask,)
    tangent_like = attn_mask if mask_tangent is None else mask_tangent
    return dmask, mask_grad_buffer(tangent_like, scores_shape)


def backward_results(buffers: tuple[torch.Tensor, ...],
                     has_tangent: bool) -> tuple[torch.Tensor, ...]:
    """What `flash_attention_backward` returns, from its buffers (`backward_buffers`, then
    `mask_grad_buffers`): dQ, dK, dV, their tangent twins where the call has the tangent,
    then the mask's gradients where it asked for them."""
    return (*buffers[:6 if has_tangent else 3], *buffers[8:])


def _launch_backward(q, k, v, out, lse, grad_out, attn_mask, is_causal, scale, tq, tk, tv,
                     t_out, mu, dto, out_residual, residual, t_residual, mask_tangent,
                     mask_grad, exact, has_tangent, buffers):
    """`flash_attention_backward`'s launches, on its checked arguments and `buffers`."""
    batch, n_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    scores_shape = (batch, n_heads, n_q, n_k)
    dq, dk, dv, dtq, dtk, dtv, delta, c, *mask_grads = buffers
    grad_tangent = dto  # the row statistics read the cotangents themselves
    mask, mask_strides, mask_kind = mask_operand(attn_mask, scores_shape,
                                                 mask_tangent if has_tangent else None)
    # The mask's gradients in the masks' own dtypes (not written without MASK_GRAD): the dQ
    # programs write every entry, zeros above the causal band included, so no fill first.
    dmask = mask_grads[0] if mask_grad else lse
    dmask_tangent = mask_grads[-1] if mask_grad and has_tangent else dmask
    # bf16 gradients in "accurate" mode: exact fp16 copies instead of the split. The dQ
    # kernel brings carried first-order dS back to natural units for the mask's gradient;
    # through the tangent (dS and dtS in units of their own) that gradient takes the split
    # (as accurate), and so does a mask's tangent, which would enter tS in natural units.
    carry = (exact and not (mask_grad and has_tangent) and carries(q, n_k)
             and not (has_tangent and mask_tangent is not None)
             and min(q.numel(), k.numel(), grad_out.numel()) > 0)
    if carry and not has_tangent:  # carried first-order, the copy operator returns Delta
        delta = c = None
    # Chapter 12's warp-specialised kernels take unmasked first-order calls on Hopper; they
    # read descriptors, so not in a graph that takes pointers.
    long_rows = not has_tangent and long_backward_rows(q, n_q, n_k)
    ws_dq, ws_dkdv = ((False, False) if attn_mask is not None or has_tangent or mask_grad
                      or graph_takes_pointers(q, n_k)
                      else warp_specialized_backward_kernels(q, k, v, grad_out, exact))
    # Through the tangent, chapter 12's passes where its first-order kernels fit.
    ws_tangent = (has_tangent and attn_mask is None and not mask_grad
                  and not graph_takes_pointers(q, n_k)
                  and warp_specialized_tangent_passes(q, k, v, (tq, tk, tv), grad_out, dto,
                                                      exact))
    if ws_dq or ws_dkdv or ws_tangent:
        # Not replayed: chapter 12's launchers allocate and fill buffers of their own (a
        # replay sees only the launches it recorded).
        note_untraced_launch()
    # Where its dK/dV kernel sums dQ as well, no dQ kernel runs; not under deterministic
    # algorithms, since the order of that sum's adds varies from run to run.
    fused_dq = (ws_dkdv and fuses_dq(head_dim, is_causal, carry)
                and not torch.are_deterministic_algorithms_enabled())
    grad_operand, factors = grad_out, lse  # `factors` is not read without CARRY
    dq_sum = None  # chapter 12's fp32 dQ sum, where the copy kernel zeros it
    if carry and has_tangent:
        with on_device(q):
            q, k, v, tq, tk, tv, grad_operand, dto, factors = carried_second_order_operands(
                q, k, v, tq, tk, tv, grad_out, dto, scale)
    elif carry:  # the copy kernel writes delta too, and zeros chapter 12's dQ sum
        with on_device(q):
            q, k, v, grad_operand, factors, delta, dq_sum = carried_backward_operands(
                q, k, v, grad_out, out, out_residual, fused_dq)
        tq, tk, tv, dto, c = q, k, v, grad_operand, delta
        dq_sum = dq_sum if fused_dq else None
    meta = kernel_meta(q, head_dim, value_dim, split=exact and not carry)
    # The first-order dQ kernel cuts a padded head dim into two column tiles, as the forward
    # does. The dK/dV kernel keeps one: with two it spills on every 8-warp tile for sm_90
    # (tools/kernel_resources.py), and so would the second-order kernels, whose registers
    # are full already.
    dq_meta = {**meta, **({"D_TAIL": 0, "DV_TAIL": 0} if has_tangent
                          else launch_column_tiles(q, n_k, head_dim, value_dim))}
    strides = (*row_strides(q, k, v, tq, tk, tv),
               *mask_strides,
               *row_strides(grad_operand, dto))
    sizes = (n_q, n_k, head_dim, value_dim, n_heads // n_kv_heads, scale * LOG2E.value, scale,
             length_bucket(n_q), length_bucket(n_k))
    # Descriptors (chapter 4) for the first-order kernels only: compiled for sm_90, the
    # second-order kernels spill hundreds of bytes per thread with them (tools/kernel_resources.py).
    use_tma = long_rows and tma_eligible(q, k, v, grad_operand)
    switches = {"IS_CAUSAL": is_causal, "MASK_KIND": mask_kind, "HAS_TANGENT": has_tangent,
                "USE_TMA": use_tma, "CARRY": carry,
                "ALIGN": row_alignment((q, k, v, tq, tk, tv, grad_operand, dto),
                                       (head_dim, value_dim))}
    mask_arg = q if mask is None else mask
    # Delta = rowsum(dO * O): carried, the first-order copy kernel wrote it. In the first-order backward
    # the dQ kernel computes it, launched first, when O's rows are 16-element aligned (else
    # its loads would not vectorise, and at d = 72 the dQ kernel needs up to twice the
    # registers); otherwise, and with the tangent, the row-statistics kernel does.
    delta_in_dq = not (carry or has_tangent or ws_dq or fused_dq) and value_dim % 16 == 0
    delta_in_copies = carry and not has_tangent
    ws_args = (q, k, v, grad_operand, lse, delta, factors if carry else None)
    with on_device(q):
        prepare_descriptors(use_tma)
        if not (delta_in_copies or delta_in_dq):
            launchable(_row_statistics_kernel, q)[(cdiv(n_q, _ROW_BLOCK), batch * n_heads)](
                out, grad_out, t_out, grad_tangent, mu, delta, c, residual, t_residual,
                *row_strides(grad_out, grad_tangent), n_heads, n_q, value_dim,
                HAS_TANGENT=has_tangent, HAS_RESIDUAL=out_residual is not None,
                BLOCK_M=_ROW_BLOCK, BLOCK_DV=meta["BLOCK_DV"], ALIGN=switches["ALIGN"])
        fused_dq = fused_dq and launched(launch_warp_specialized_dkdv, *ws_args, dk, dv,
                                         is_causal, scale, dq, dq_sum, summing=True)
        dq_kernel = _backward_dq_tangent if has_tangent else _backward_dq
        tangent_args = (q, k, v, tq, tk, tv, grad_operand, dto, lse, delta, mu, c,
                        factors if carry else None, dq, dk, dv, dtq, dtk, dtv, is_causal,
                        scale)
        if not (fused_dq or ws_dq and launched(launch_warp_specialized_dq, *ws_args, dq,
                                               is_causal, scale)
                or ws_tangent and launched_tangent_pass("dq", *tangent_args)):
            launchable(dq_kernel, q)[lambda m: (cdiv(n_q, m["BLOCK_M"]), batch * n_heads)](
                q, k, v, tq, tk, tv, mask_arg, grad_operand, dto, out, residual, lse, delta, mu,
                c, factors, dq, dtq, dmask, dmask_tangent, *strides, n_heads, *sizes,
                **switches, **dq_meta, MASK_GRAD=mask_grad, DELTA_HERE=delta_in_dq,
                HAS_RESIDUAL=out_residual is not None)
        if not (fused_dq or ws_dkdv and launched(launch_warp_specialized_dkdv, *ws_args, dk,
                                                 dv, is_causal, scale)):
            # The first order's layout follows the keys; the second order's is tuned.
            layout = {} if has_tangent else {"TRANSPOSED": n_k <= TRANSPOSED_MAX_KEYS}
            if not has_tangent:
                passes = ((_backward_dkdv, True, True),)
            elif SPLIT_KEY_SIDE:
                passes = ((_backward_dv_tangent, False, True),
                          (_backward_dk_tangent, True, False))
            else:
                passes = ((_backward_dkdv_tangent, True, True),)
            for dkdv, keys, values in passes:
                if ws_tangent and keys != values and launched_tangent_pass(
                        "dk" if keys else "dv", *tangent_args):
                    continue
                launchable(dkdv, q)[lambda m: (cdiv(n_k, m["BLOCK_N"]), batch * n_kv_heads)](
                    q, k, v, tq, tk, tv, mask_arg, grad_operand, dto, lse, delta, mu, c,
                    factors, dk, dv, dtk, dtv, *strides, n_kv_heads, *sizes, **switches,
                    **meta, KEYS=keys, VALUES=values, **layout)


# Replays of earlier calls (chapter 2's "Replaying a call"), by what their decisions read.
BACKWARD_REPLAYS: dict[tuple, CallReplay] = replay_table()


def backward_key(inputs: tuple, is_causal: bool, scale: float | None, exact: bool,
                 mask_grad: bool = False) -> tuple | None:
    """What the backward's decisions read of a call (without a mask's tangent): its tensors
    (`call_facts`), which of the optional ones (the mask among them) are given, its options
    (the mask's gradient among them) and the settings that choose kernels (deterministic
    algorithms, the key-side split, the layout bound)."""
    facts = call_facts(*[x for x in inputs if x is not None])
    if facts is None:
        return None
    absent = tuple([x is None for x in inputs])  # (a list: one step, where a generator is many)
    return (is_causal, scale, exact, mask_grad, torch.are_deterministic_algorithms_enabled(),
            SPLIT_KEY_SIDE, TRANSPOSED_MAX_KEYS, absent, *facts)


def backward_buffers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                     has_tangent: bool) -> tuple[torch.Tensor, ...]:
    """The backward's outputs and row statistics, uninitialised: dQ, dK, dV, their tangent
    twins (dQ, dK, dV themselves without the tangent), Delta and c (Delta without it)."""
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=q.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=q.device, dtype=v.dtype)
    dtq, dtk, dtv = ((torch.empty_like(dq), torch.empty_like(dk), torch.empty_like(dv))
                     if has_tangent else (dq, dk, dv))
    delta = torch.empty_like(lse, dtype=torch.float32)
    return dq, dk, dv, dtq, dtk, dtv, delta, torch.empty_like(delta) if has_tangent else delta


# %% [markdown]
# ## Checking it against chapter 1
#
# `reference_backward` of chapter 1 applies the formulas above in float64 (and chapter 1
# checked them against autograd). The seed's backward was right only with causal masking;
# here both, with lengths that are not multiples of any tile, GQA, masks, and $d_{qk} \ne d_v$.

# %%
from jvp_attention.forward import flash_attention_forward
from jvp_attention.reference import reference_attention, reference_backward

torch.manual_seed(0)
N = 1000 if FULL_SIZE else 40


def backward_errors(batch, hq, hkv, n_q, n_k, d, dv, dtype, **options):
    """Max |grad - grad_ref| of dQ, dK, dV against the float64 reference."""
    q = torch.randn(batch, hq, n_q, d, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, hkv, n_k, d, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, hkv, n_k, dv, device=DEVICE, dtype=dtype)
    grad_out = torch.randn(batch, hq, n_q, dv, device=DEVICE, dtype=dtype)
    fwd = flash_attention_forward(q, k, v, **options)
    grads = flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out, **options)
    q64, k64, v64 = q.double(), k.double(), v.double()
    ref = reference_attention(q64, k64, v64, enable_gqa=hq != hkv, **options)
    ref_grads = reference_backward(q64, k64, v64, ref.out, ref.lse, grad_out.double(),
                                   enable_gqa=hq != hkv, **options)
    return [(g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads, strict=True)]


padding = torch.rand(2, 1, 1, N, device=DEVICE) > 0.2
cases = {
    "non-causal": ((2, 4, 4, N, N + 7, 64, 64), {}),
    "causal": ((2, 4, 4, N, N, 64, 64), {"is_causal": True}),
    "causal, Nq != Nk": ((1, 2, 2, N + 9, N // 2, 64, 64), {"is_causal": True}),
    "GQA 8:2": ((1, 8, 2, N, N, 64, 64), {}),
    "key padding": ((2, 4, 4, N, N, 64, 64), {"attn_mask": padding}),
    "d_qk=72, d_v=40": ((1, 2, 2, N, N, 72, 40), {"is_causal": True}),
}
for dtype in (torch.float32, torch.float16):
    for name, (shape, options) in cases.items():
        errors = backward_errors(*shape, dtype, **options)
        print(f"{str(dtype):14} {name:18} max|d(dQ, dK, dV)| "
              + "  ".join(f"{e:.1e}" for e in errors))

# %% [markdown]
# ## Accuracy against PyTorch's math path
#
# Ratios of our error to the floor (PyTorch's math path in the same dtype, both against
# float64), in the two precision modes. "accurate" uses the rounding residual of $O$ and
# exact fp16 operands (bf16) or split products (fp16); "fast" rounds once to the input's
# type and uses the stored $O$, as FlashAttention does.

# %%
from jvp_attention.launch import set_precision
from jvp_attention.accuracy import accuracy_table, float64_truth, format_table, math_path

rows = {}
for dtype in [torch.bfloat16, torch.float16] if FULL_SIZE else [torch.float16]:
    for causal in (False, True):
        q, k, v, grad_out = (torch.randn(2, 4, N, 64, device=DEVICE, dtype=dtype)
                             for _ in range(4))
        floor = math_path(q, k, v, is_causal=causal, grad_out=grad_out)
        truth = float64_truth(q, k, v, is_causal=causal, grad_out=grad_out)
        for mode in ("fast", "accurate"):
            set_precision(mode)
            fwd, (out_residual, _) = flash_attention_forward(q, k, v, is_causal=causal,
                                                             residuals=True)
            grads = flash_attention_backward(
                q, k, v, fwd.out, fwd.lse, grad_out, is_causal=causal,
                out_residual=out_residual if mode == "accurate" else None)
            ours = dict(zip(("dq", "dk", "dv"), grads, strict=True))
            rows[f"{str(dtype)[6:]:9} causal={causal!s:5} {mode}"] = accuracy_table(
                ours, floor, truth)
set_precision("accurate")
print(format_table(rows))

# %% [markdown]
# No atomics means determinism: the same inputs give bitwise the same gradients. Chapter
# 12's dK/dV kernel on Hopper trades that for speed, summing dQ in fp32 through the copy
# engine's adds, in an order that varies from run to run; under
# `torch.use_deterministic_algorithms(True)` the launcher keeps this chapter's split there.

# %%
q, k, v = (torch.randn(1, 4, N, 64, device=DEVICE) for _ in range(3))
grad_out = torch.randn_like(q)
fwd = flash_attention_forward(q, k, v, is_causal=True)
first = flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out, is_causal=True)
second = flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out, is_causal=True)
assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
print("bitwise deterministic")

# %% [markdown]
# ## The gradient of a learnable bias
#
# An additive mask $B$ that is a parameter (a relative-position bias, ALiBi slopes) needs
# its gradient too. $S = s\,QK^\top + B$ is linear in $B$ with coefficient one, so
#
# $$\frac{\partial L}{\partial B} = dS = P \circ (dP - \Delta),$$
#
# exactly the tile `_backward_tile` already computes for $dQ$ and $dK$, in natural units. With
# `mask_grad=True` the dQ kernel stores each tile of $dS$, rounded once from fp32, into a
# buffer of shape $(B, H_q, N_q, N_k)$ in the mask's own dtype: each dQ program owns its
# query rows and visits every key block of them, so every entry has a single writer, no
# atomics. Above the causal band it visits no tiles, so it stores zeros there, their
# gradient: the buffer is allocated unfilled. Entries masked to $-\infty$ have $P = 0$ and
# so $dS = 0$. The buffer is $O(N^2)$, as the gradient of an $(N_q, N_k)$ parameter must be;
# for a bf16 bias, writing bf16 rather than fp32 and casting afterwards gives the same
# values, halves the bytes written and saves a fill and a copy (on an H100 at
# $(16, 16, 1024)$ those two took 0.32 and 0.52 ms of a 4.2 ms attention step). The caller
# sums the buffer over the dimensions its bias was broadcast along (autograd of `expand`
# does). The bf16 path through exact fp16 copies carries $dS$ times $2^{e_{dS}}$, so the
# dQ kernel multiplies each tile by $2^{-e_{dS}}$ (one more factor of `backward_shifts`,
# exact) before storing it; through the tangent, where $dS$ and $dt_S$ have units of their
# own, the launcher takes the split instead, which is just as accurate. The check: float64 autograd of attention written out
# with the bias as an input, an $(N_q, N_k)$ bias shared over batch and heads, causal.

# %%
import math


def biased_attention(q, k, v, bias, is_causal):
    """Softmax attention written out, the bias an input; rows with no key give zeros."""
    s = q @ k.mT * q.shape[-1] ** -0.5 + bias
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(),
                          -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - m.masked_fill(m == -math.inf, 0.0))
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total == 0, 1.0, total) @ v


q, k, v, grad_out = (torch.randn(2, 4, N, 64, device=DEVICE) for _ in range(4))
bias = torch.randn(N, N, device=DEVICE).masked_fill(torch.rand(N, N, device=DEVICE) < 0.2,
                                                    -math.inf)
bias[:, 0] = 0.0
wide = [x.double().requires_grad_() for x in (q, k, v, bias)]
biased_attention(*wide, True).backward(grad_out.double())
fwd, (out_residual, _) = flash_attention_forward(q, k, v, bias, True, residuals=True)
*grads, dmask = flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out, bias, True,
                                         out_residual=out_residual, mask_grad=True)
for name, ours, truth in zip(("dq", "dk", "dv", "dB"), [*grads, dmask.sum((0, 1))], wide,
                             strict=True):
    print(f"{name}: max error {(ours.double() - truth.grad).abs().max().item():.1e}")
assert (dmask.sum((0, 1)).double() - wide[3].grad).abs().max() < 1e-4
