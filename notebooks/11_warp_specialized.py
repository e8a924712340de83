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
# # Chapter 11: warp specialisation on Hopper, written in Gluon
#
# Chapter 4 ended on what bounds our kernels, and one item there is out of reach for Triton's
# ordinary language: on Hopper, the same warps issue the copies, the matrix products and
# the exponentials, so a tile's softmax waits for its products and the tensor cores wait
# for the softmax. FlashAttention-3 (Shah et al., 2024, section 3) removes both waits on the
# H100 with **warp specialisation**: a *producer* warp does nothing but hand tiles to the
# copy engine, and two *consumer* warpgroups (4 warps each) run the attention, taking turns
# at the tensor cores so that one group's softmax runs while the other group's products do
# ("ping-pong"). Triton 3.6 cannot express this through `tl.range(..., warp_specialize=True)`
# on our forward (chapter 4), but it ships **Gluon** (`triton.experimental.gluon`), a layer
# below the Triton language where layouts, shared-memory buffers, barriers, the copy engine
# (TMA) and Hopper's warpgroup products (`wgmma`) are written out, and where
# `gl.warp_specialize` gives each partition of warps its own function and register budget.
#
# This chapter builds the primal forward that way and measures it against chapter 2's and
# against SDPA's best backend (cuDNN on the H200): the smallest kernel that says whether
# the schedule pays, and the one a drop-in SDPA user runs. Then it carries chapter 3's
# tangent into the same schedule, the forward with its JVP that this library exists for.
# Chapter 2's launcher takes both on an sm_90 GPU for long unmasked rows.
#
# ## The schedule
#
# One program owns a tile of 128 query rows of one head and sweeps its keys in tiles of
# $B_N = 128$. Its warps split in three partitions:
#
# * the **loader** (one warp, 24 registers a thread) copies the two 64-row query tiles once,
#   then each key tile and value tile into a **ring** of `STAGES` shared-memory slots;
# * **compute group 0 and group 1** (a warpgroup each, 240 registers a thread) own 64 of the
#   query rows each and run the online softmax of chapter 1 on them.
#
# Partitions share nothing but shared memory, so they meet at **mbarriers**: 64-bit
# counters in shared memory that complete a *phase* when the expected arrivals (or, for a
# copy, the expected bytes) are in, after which the phase's parity flips. A waiter names the
# parity it waits for. Each ring slot has three: *keys ready* and *values ready* (the copy
# engine arrives, with the byte count announced by `mbarrier.expect`) and *slot free* (each
# compute group arrives once it has read the slot, so it expects 2). Pass $j$ uses slot
# $j \bmod S$ in phase $\lfloor j/S \rfloor \bmod 2$; a fresh barrier counts as having
# completed the phase before its first, which lets the loader's first sweep of the ring go
# without waiting.
#
# Within a group, pass $j$ issues two asynchronous products back to back: the scores of key
# tile $j$, $S_j = Q K_j^\top$ (both operands in shared memory), and the value product of
# the previous tile, $O \mathrel{+}= \tilde P_{j-1} V_{j-1}$ (the probabilities straight
# from registers, the values from shared memory). Products complete in the order they were
# issued, so waiting until at most one is outstanding waits for the scores alone; the
# softmax of $S_j$ then runs while the value product still does (FlashAttention-3's
# "intra-warpgroup pipelining", `PIPELINE`), and only then does the group wait for it,
# free the slot and rescale $O$ by the new maxima. Across groups, the **turn barriers**
# order the issue of products: a group waits for its turn, issues its two products and
# hands the turn over (`PINGPONG`). Group 0 goes first. So while group 0 computes the
# exponentials of tile $j$, group 1's products of tile $j$ occupy the tensor cores, and the
# other way round one step later.
#
# ## The budget
#
# Registers decide whether this fits. A Hopper SM has 65,536 32-bit registers; a program of
# 12 warps (8 compute, the loader rounded up to a warpgroup) may start with 168 a thread.
# `gl.warp_specialize` then moves them with `setmaxnreg`: the loader drops to 24 and each
# compute group rises to 240. A compute thread holds a quarter-warp's share of a 64 × 128
# fp32 tile per accumulator: 64 registers for $S$, 64 for $O$, 32 for the 16-bit $\tilde P$
# (two while the value product reads the previous one), and the row statistics: about 230.
# Shared memory: the two query tiles take 32 KB at $d = 128$ and each ring slot 64 KB (a key
# and a value tile), so three slots fill 224 KB of the 227 KB a block may have. The tables
# below come from compiling the kernel for sm_90 with ptxas on a machine without a GPU, as
# chapter 4 did for the Triton kernels.

# %%
import json
import os
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
RESULTS = Path("../benchmarks/results/warp_specialized_h200.json")
JVP_RESULTS = Path("../benchmarks/results/warp_specialized_jvp_h200.json")
print(f"device: {DEVICE}, sm_90: {HOPPER}")

# %% [markdown]
# ## Building it
#
# The module starts with the imports. Gluon is experimental: where a Triton lacks its Hopper
# layer, a stand-in lets the definitions below load as plain functions, and the launcher
# never takes them; and two names changed after Triton 3.6 (the copy engine's load and
# store, and shared-memory views' `reinterpret`), so the module picks whichever this Triton
# has. Compiled for sm_90 with Triton 3.9.0, the newest release, the kernel takes the same
# registers and shared memory as with 3.6 (it has not run on a GPU with 3.9).

# %% tags=["export"]
"""Chapter 11: Hopper forwards with warp specialisation, written in Gluon.

One warp issues the copy engine's loads; two warpgroups run the online softmax on the
warpgroup tensor cores and take turns at them (FlashAttention-3's ping-pong schedule), so that
one group's softmax runs while the other's products do. Two kernels: the primal forward, and
the forward with its JVP (the tangent's tiles loaded beside the inputs', three products a
turn). Chapter 2's launcher takes them on an sm_90 GPU for long unmasked rows
(`takes_warp_specialized`); `notebooks/11_warp_specialized.py` derives them, budgets them and
times them.
"""

import functools
import math
import os
import warnings

import torch
import triton

from jvp_attention.launch import cached, carries, head_group, interpreting, on_device
from jvp_attention.reference import AttentionOutputs
from jvp_attention.tiles import query_program

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without Gluon's Hopper layer
    GLUON = False

    class _Unavailable:
        """Stands in for every Gluon name: decorators return the function undecorated."""

        def __getattr__(self, name: str) -> "_Unavailable":
            return self

        def __call__(self, *args, **kwargs):
            return args[0] if len(args) == 1 and callable(args[0]) else self

    gluon = gl = mbarrier = tma = _Unavailable()
    fence_async_shared = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = gl
else:
    GLUON = True
# The copy engine's load and store: Triton 3.6 names them async_copy_global_to_shared and
# async_copy_shared_to_global, later releases async_load and async_store.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# %% [markdown]
# The wgmma accumulator layout stacks the warps along the rows, 16 rows a warp (so a
# warpgroup's product is 64 rows), and takes the whole tile width as the instruction's $n$.
# The loader is short: every copy names its barrier, and `mbarrier.expect` announces the
# bytes that complete it. The tensors are addressed as 4-D, $(B, H, N, D)$ with their own
# strides, in blocks of $(1, 1, \text{rows}, D)$: so a head's last tile stops at its own end
# (the copy engine writes zeros past it) and a $(B, N, H, D)$ layout needs no copy.

# %% tags=["export"]
LOADER_REGS = gl.constexpr(24)  # registers a loader thread keeps: addresses and phases
COMPUTE_REGS = gl.constexpr(240)  # a compute thread: what the loader gave up


@gluon.constexpr_function
def mma_layout(cols: int, num_warps: int):
    """The wgmma accumulator layout of a tile `cols` wide over `num_warps` warps
    stacked along the rows (16 rows each)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, cols, 16])


@gluon.jit
def _load_with_tangent(desc, t_desc, batch, head, row, barrier, tile, t_tile,
                       TANGENT: gl.constexpr):
    """Copy the block of `desc` at (batch, head, row) into `tile` and, with TANGENT, the
    same block of `t_desc` into `t_tile`; `barrier` completes when all their bytes are in."""
    COPIES: gl.constexpr = 2 if TANGENT else 1
    mbarrier.expect(barrier, COPIES * desc.block_type.nbytes)
    tma_load(desc, [batch, head, row, 0], barrier, tile)
    if TANGENT:
        tma_load(t_desc, [batch, head, row, 0], barrier, t_tile)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, tq_desc, tk_desc, tv_desc, q_tiles, tq_tiles,
                    k_ring, tk_ring, v_ring, tv_ring, q_ready, k_ready, v_ready, slot_free,
                    batch, head, kv_head, q_start, n_blocks, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, TANGENT: gl.constexpr):
    """One warp: the query tiles, then each key and value tile into the next free slot
    of the ring, as soon as every compute group has freed it. With TANGENT (the forward
    with its JVP, below) each tile's tangent comes with it, on the same barrier."""
    GROUPS: gl.constexpr = q_tiles.shape[0]
    GROUP_M: gl.constexpr = q_desc.block_type.shape[2]
    COPIES: gl.constexpr = 2 if TANGENT else 1
    mbarrier.expect(q_ready, COPIES * GROUPS * q_desc.block_type.nbytes)
    for g in gl.static_range(GROUPS):
        tma_load(q_desc, [batch, head, q_start + g * GROUP_M, 0],
                 q_ready, q_tiles.index(g))
        if TANGENT:
            tma_load(tq_desc, [batch, head, q_start + g * GROUP_M, 0],
                     q_ready, tq_tiles.index(g))
    for j in range(n_blocks):
        slot = j % STAGES
        # A fresh barrier counts as having completed the phase before its first, so the
        # first pass over the ring does not wait.
        mbarrier.wait(slot_free.index(slot), ((j // STAGES) & 1) ^ 1)
        _load_with_tangent(k_desc, tk_desc, batch, kv_head, j * BLOCK_N, k_ready.index(slot),
                           k_ring.index(slot), tk_ring.index(slot), TANGENT)
        _load_with_tangent(v_desc, tv_desc, batch, kv_head, j * BLOCK_N, v_ready.index(slot),
                           v_ring.index(slot), tv_ring.index(slot), TANGENT)

# %% [markdown]
# The score tile's mask and the online softmax step are chapter 1's, in log2 units. Scores
# past the last key must be masked (the copy engine's zeros would give them weight), as must,
# with `is_causal`, those of keys after their query; only the tiles that reach either pay
# for the compare.

# %% tags=["export"]
@gluon.jit
def _masked(s, start_n, first_row, n_k, CAUSAL: gl.constexpr):
    """Scores of keys past the last one (the copy engine fills them with zeros) or, with
    CAUSAL, after their query, set to -inf; only tiles that reach those pay the compare."""
    if (start_n + s.shape[1] > n_k) or (CAUSAL and start_n + s.shape[1] > first_row):
        rows = first_row + gl.arange(0, s.shape[0], gl.SliceLayout(1, s.type.layout))
        cols = start_n + gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
        keep = gl.expand_dims(cols < n_k, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s = gl.where(keep, s, -float("inf"))
    return s


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale):
    """Fold one tile of scores into the row maxima and sums (log2 units); return the
    probabilities (fp32), the factor that rescales the accumulators, and the new maxima
    and sums."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, p_layout: gl.constexpr, dtype: gl.constexpr):
    """`_online_softmax`, with the probabilities as the value product's register operand."""
    p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i, qk_scale)
    return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_i

# %% [markdown]
# Turns are two barriers, one per group, each completing one phase per turn: a group waits on
# its own barrier and arrives on the other's. Group 0's first wait names the phase before
# the first, so it passes at once; group 1's first wait needs group 0's first arrival.

# %% tags=["export"]
@gluon.jit
def _take_turn(turns, turn, GROUP: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the other group has issued its products (group 0 goes
    first); returns the count of turns taken."""
    if PINGPONG:
        mbarrier.wait(turns.index(GROUP), (turn & 1) ^ (1 - GROUP))
    return turn + 1


@gluon.jit
def _pass_turn(turns, GROUP: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: let the other group issue its products."""
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - GROUP), count=1)

# %% [markdown]
# A compute group: the pass over the key tiles as described above, then the epilogue. The
# output leaves through shared memory and the copy engine, in the query tile's slot (no
# product reads it any more); with `STORE_RESIDUAL` it is followed by its rounding residual,
# the part of the fp32 output that the 16-bit one dropped, which chapter 5's accurate
# backward reads.

# %% tags=["export"]
@gluon.jit
def _store_rows(desc, tile, block, values, batch, head, row):
    """Stage `values` in shared memory (`tile`, and `block`: the same bytes, shaped as
    the descriptor's block) and copy them to global memory; the copy engine drops the
    rows past the sequence's end."""
    tile.store(values)
    fence_async_shared()
    tma_store(desc, [batch, head, row, 0], block)
    tma.store_wait(0)


@gluon.jit
def _store_rounded(desc, r_desc, tile, block, values, batch, head, row,
                   STORE_RESIDUAL: gl.constexpr):
    """Store fp32 `values` rounded to the output's dtype and, with STORE_RESIDUAL, through
    `r_desc`, the part of them that the rounding dropped."""
    rounded = values.to(desc.dtype)
    _store_rows(desc, tile, block, rounded, batch, head, row)
    if STORE_RESIDUAL:
        _store_rows(r_desc, tile, block, (values - rounded.to(gl.float32)).to(desc.dtype),
                    batch, head, row)


@gluon.jit
def _compute_partition(q_blocks, q_tiles, k_ring, v_ring, q_ready, k_ready, v_ready, slot_free,
                       turns, o_desc, r_desc, lse_ptr, batch, head, lse_row, q_start,
                       n_q, n_k, n_blocks, qk_scale, GROUP: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       PIPELINE: gl.constexpr, PINGPONG: gl.constexpr,
                       CAUSAL: gl.constexpr, STORE_RESIDUAL: gl.constexpr,
                       num_warps: gl.constexpr):
    """One group of compute warps, GROUP_M query rows: the online softmax over the key
    tiles, then the output (and its rounding residual) and the LSE.

    Each pass issues the scores of key tile j and the value product of tile j-1 back to
    back. With PIPELINE it waits for the scores only (issued first, so done first) and
    computes their softmax while the value product runs; else it waits for both."""
    GROUP_M: gl.constexpr = o_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = o_desc.block_type.shape[3]
    dtype: gl.constexpr = q_tiles.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N, num_warps)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, num_warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_smem = q_tiles.index(GROUP)
    first_row = q_start + GROUP * GROUP_M  # this group's first query within the head

    m_i = gl.full([GROUP_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([GROUP_M], gl.float32, row_layout)
    acc = gl.zeros([GROUP_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([GROUP_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_ready, 0)

    mbarrier.wait(k_ready.index(0), 0)
    turn = _take_turn(turns, 0, GROUP, PINGPONG)
    s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    _pass_turn(turns, GROUP, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s,))
    s = _masked(s, 0, first_row, n_k, CAUSAL)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, p_layout, dtype)
    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        turn = _take_turn(turns, turn, GROUP, PINGPONG)
        s = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        p_read = p  # the value product reads these registers until it is done
        acc = warpgroup_mma(p_read, v_ring.index(prev), acc, is_async=True)
        _pass_turn(turns, GROUP, PINGPONG)
        s = warpgroup_mma_wait(1 if PIPELINE else 0, deps=(s,))
        s = _masked(s, j * BLOCK_N, first_row, n_k, CAUSAL)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, p_layout, dtype)
        acc, p_read = warpgroup_mma_wait(0, deps=(acc, p_read))
        mbarrier.arrive(slot_free.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    turn = _take_turn(turns, turn, GROUP, PINGPONG)
    acc = warpgroup_mma(p, v_ring.index(last), acc, is_async=True)
    _pass_turn(turns, GROUP, PINGPONG)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(slot_free.index(last), count=1)

    # Every product is done, so the query tile is free: the output goes out through it.
    out = acc / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
    _store_rounded(o_desc, r_desc, q_smem, q_blocks.index(GROUP), out, batch, head, first_row,
                   STORE_RESIDUAL)
    rows = first_row + gl.arange(0, GROUP_M, row_layout)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # log2 units to natural ones
    gl.store(lse_ptr + lse_row + rows, lse, mask=rows < n_q)

# %% [markdown]
# The kernel allocates the buffers and barriers, views the 4-D blocks as the 2-D matrices the
# products read, and forks the partitions. Causal programs run in reverse order, so that the
# tiles with the most keys start first.

# %% tags=["export"]
if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # Triton 3.7 and newer

    @gluon.jit
    def _as_matrices(buffers, desc):
        """A stack of (1, 1, rows, D) blocks viewed as a stack of (rows, D) matrices."""
        rows: gl.constexpr = desc.block_type.shape[2]
        cols: gl.constexpr = desc.block_type.shape[3]
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([rows, cols], desc.dtype)
        return buffers.reinterpret(desc.dtype, [buffers.shape[0], rows, cols], layout)

else:  # Triton 3.6 names it _reinterpret

    @gluon.jit
    def _as_matrices(buffers, desc):
        """A stack of (1, 1, rows, D) blocks viewed as a stack of (rows, D) matrices."""
        rows: gl.constexpr = desc.block_type.shape[2]
        cols: gl.constexpr = desc.block_type.shape[3]
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([rows, cols], desc.dtype)
        return buffers._reinterpret(desc.dtype, [buffers.shape[0], rows, cols], layout)


@gluon.jit
def _program_tile(n_heads, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr, HEAD_GROUP: gl.constexpr):
    """This program's first query row, batch x head, batch and head, and how many key
    tiles it sweeps. Causal programs take chapter 2's order (`query_program`): in groups
    of HEAD_GROUP heads, the tiles with the most keys first."""
    tile, bh = query_program(CAUSAL, HEAD_GROUP)
    q_start = tile * BLOCK_M
    if CAUSAL:  # top-left causal: keys up to the tile's last query
        n_blocks = gl.cdiv(gl.minimum(q_start + BLOCK_M, n_k), BLOCK_N)
    else:
        n_blocks = gl.cdiv(n_k, BLOCK_N)
    return q_start, bh, bh // n_heads, bh % n_heads, n_blocks


@gluon.jit
def _blocks(desc, count: gl.constexpr):
    """Shared memory for `count` blocks of `desc`."""
    return gl.allocate_shared_memory(desc.dtype, [count] + desc.block_type.shape, desc.layout)


@gluon.jit
def _barrier(count: gl.constexpr, arrivals: gl.constexpr):
    """`count` mbarriers, each completing a phase after `arrivals` arrivals."""
    barriers = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(count):
        mbarrier.init(barriers.index(i), count=arrivals)
    return barriers


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, GROUPS: gl.constexpr):
    """Queries ready; per ring slot keys ready, values ready and slot free (every compute
    group frees it); the two groups' turns."""
    return (_barrier(1, 1).index(0), _barrier(STAGES, 1), _barrier(STAGES, 1),
            _barrier(STAGES, GROUPS), _barrier(2, 1))


@gluon.jit
def warp_specialized_forward_kernel(
        q_desc, k_desc, v_desc, o_desc, r_desc, lse_ptr, n_heads, n_q, n_k, group_size,
        qk_scale, STAGES: gl.constexpr, PIPELINE: gl.constexpr, PINGPONG: gl.constexpr,
        CAUSAL: gl.constexpr, STORE_RESIDUAL: gl.constexpr, HEAD_GROUP: gl.constexpr,
        num_warps: gl.constexpr):
    """Grid (cdiv(Nq, BLOCK_M), B·Hq): one tile of BLOCK_M query rows of one head per
    program, in `_program_tile`'s order. The descriptors address (B, H, N, D) tensors
    with any strides; their blocks are (1, 1, rows, D). With PINGPONG two groups of 4
    warps take 64 rows each and alternate their products; without, one group of 8 warps
    takes all 128."""
    GROUP_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    GROUPS: gl.constexpr = 2 if PINGPONG else 1
    q_start, bh, batch, head, n_blocks = _program_tile(n_heads, n_k, GROUPS * GROUP_M,
                                                       BLOCK_N, CAUSAL, HEAD_GROUP)
    q_tiles, k_ring, v_ring = _blocks(q_desc, GROUPS), _blocks(k_desc, STAGES), _blocks(
        v_desc, STAGES)
    q_ready, k_ready, v_ready, slot_free, turns = _ring_barriers(STAGES, GROUPS)
    # The products read 2-D tiles: the same bytes, the (1, 1) block dimensions dropped
    # (the swizzle depends on the row's bytes alone, so it is the same).
    q_2d = _as_matrices(q_tiles, q_desc)
    k_2d = _as_matrices(k_ring, k_desc)
    v_2d = _as_matrices(v_ring, v_desc)

    lse_row = bh.to(gl.int64) * n_q
    kv_head = head // group_size
    # The argument tuples are written out: adding tuples would turn constexprs to tensors.
    # Without the tangent the loader's tangent arguments repeat the primal ones, unread.
    if PINGPONG:
        gl.warp_specialize([
            (_compute_partition, (q_tiles, q_2d, k_2d, v_2d, q_ready, k_ready, v_ready, slot_free,
                                  turns, o_desc, r_desc, lse_ptr, batch, head, lse_row,
                                  q_start, n_q, n_k, n_blocks, qk_scale, 0, BLOCK_N,
                                  STAGES, PIPELINE, PINGPONG, CAUSAL, STORE_RESIDUAL,
                                  num_warps)),
            (_compute_partition, (q_tiles, q_2d, k_2d, v_2d, q_ready, k_ready, v_ready, slot_free,
                                  turns, o_desc, r_desc, lse_ptr, batch, head, lse_row,
                                  q_start, n_q, n_k, n_blocks, qk_scale, 1, BLOCK_N,
                                  STAGES, PIPELINE, PINGPONG, CAUSAL, STORE_RESIDUAL,
                                  num_warps)),
            (_load_partition, (q_desc, k_desc, v_desc, q_desc, k_desc, v_desc, q_tiles, q_tiles,
                               k_ring, k_ring, v_ring, v_ring, q_ready, k_ready, v_ready,
                               slot_free, batch, head, kv_head, q_start, n_blocks, BLOCK_N,
                               STAGES, False)),
        ], [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_compute_partition, (q_tiles, q_2d, k_2d, v_2d, q_ready, k_ready, v_ready, slot_free,
                                  turns, o_desc, r_desc, lse_ptr, batch, head, lse_row,
                                  q_start, n_q, n_k, n_blocks, qk_scale, 0, BLOCK_N,
                                  STAGES, PIPELINE, PINGPONG, CAUSAL, STORE_RESIDUAL,
                                  num_warps)),
            (_load_partition, (q_desc, k_desc, v_desc, q_desc, k_desc, v_desc, q_tiles, q_tiles,
                               k_ring, k_ring, v_ring, v_ring, q_ready, k_ready, v_ready,
                               slot_free, batch, head, kv_head, q_start, n_blocks, BLOCK_N,
                               STAGES, False)),
        ], [1], [LOADER_REGS])

# %% [markdown]
# ## The tangent in the same schedule
#
# Chapter 3's forward with its JVP fits the same frame. The loader copies each tile's
# tangent with it, on the same barrier: $\dot Q$ beside $Q$, $\dot K_j$ beside $K_j$ (the
# tangent scores need both) and $\dot V_j$ beside $V_j$. A compute group takes two turns a
# key tile. In the first it issues the three score products,
# $$S_j = Q K_j^\top, \qquad \dot S_j = \dot Q K_j^\top + Q \dot K_j^\top,$$
# then, off the tensor cores, folds $S_j$ into the online softmax and the running mean
# $\mu$ of the tangent scores (chapter 3: $\mu_i = \sum_j \tilde P_{ij} \dot S_{ij} / \ell_i$,
# updated with the same rescaling as $\ell$). In the second turn it issues the three value
# products,
# $$O \mathrel{+}= \tilde P_j V_j, \qquad
#   \dot O \mathrel{+}= \bigl(\tilde P_j \circ (\dot S_j - \mu)\bigr) V_j + \tilde P_j \dot V_j,$$
# with $\dot O$ kept centred on the running $\mu$ as in chapter 2's kernel (when $\mu$
# moves by $\delta$, $\dot O$ loses $\delta\, O$), so the epilogue has no cancellation
# left: $\dot O / \ell$ is the tangent output. The pipelining within a group is dropped
# (the primal forward showed it gains nothing); ping-pong keeps the tensor cores busy.
#
# **The budget decides the tile.** A compute thread now holds $S$ and $\dot S$ (64 rows
# by $B_N$ keys, fp32), $O$ and $\dot O$ (64 by $d$, fp32), and two 16-bit operands,
# $\tilde P$ and $\tilde P \circ (\dot S - \mu)$. At $d = 128$ with 128-key tiles that is
# $64 + 64 + 64 + 64 + 32 + 32 = 320$ registers, far past 240; with 64-key tiles,
# $32 + 32 + 64 + 64 + 16 + 16 = 224$, which fits (compiled: no spills; 128-key tiles spill
# 3 KB and run at 40% of the speed). At $d = 64$, 128-key tiles fit. Shared memory: the
# query tiles and their tangents take 64 KB at $d = 128$ and a ring slot holds four
# tiles (64 KB with 64 keys), so two slots, 192 KB in all with the barriers.
#
# **Precision.** "fast" rounds $\tilde P$ and the centred probabilities to the inputs'
# type, as chapter 3's fast path does. "accurate", for bf16, takes chapter 2's carry: the
# value products read exact fp16 copies of $V$ and $\dot V$ scaled by powers of two
# (`jvp_operands`), the two register operands are rounded to fp16 (three more bits than
# bf16), the tangent scores are computed in the units of the shift $w$ that keeps them in
# fp16's range, and the epilogue multiplies the shifts out. The kernel reads the four
# factors from the device (`CARRY`), so nothing waits for the host. fp16 "accurate" splits
# its products into hi + lo halves (chapter 3), which needs two more 16-bit operands than
# these registers hold; those calls stay on chapter 2's kernel.

# %% tags=["export"]
@gluon.jit
def _carry_factor(factors_ptr, index: gl.constexpr, CARRY: gl.constexpr):
    """Entry `index` of chapter 2's carry factors (`jvp_operands`: w, then the factors of
    O, tO and mu); 1 without CARRY."""
    if CARRY:
        factor = gl.load(factors_ptr + index)
    else:
        factor = 1.0
    return factor


@gluon.jit
def _jvp_compute_partition(q_blocks, tq_blocks, q_tiles, tq_tiles, k_ring, tk_ring, v_ring,
                           tv_ring, q_ready, k_ready, v_ready, slot_free, turns, o_desc,
                           t_desc, r_desc, tr_desc, lse_ptr, mu_ptr, factors_ptr, batch, head,
                           lse_row, q_start, n_q, n_k, n_blocks, qk_scale, scale,
                           GROUP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           CAUSAL: gl.constexpr, CARRY: gl.constexpr,
                           STORE_RESIDUAL: gl.constexpr, num_warps: gl.constexpr):
    """One compute group with the tangent: per key tile a turn for the three score
    products, the softmax and mu, a turn for the three value products; then out,
    tangent_out (and their residuals), lse and mu."""
    GROUP_M: gl.constexpr = o_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = o_desc.block_type.shape[3]
    operand: gl.constexpr = v_ring.dtype  # the probabilities' type: the values' (fp16 carried)
    s_layout: gl.constexpr = mma_layout(BLOCK_N, num_warps)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, num_warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_smem = q_tiles.index(GROUP)
    tq_smem = tq_tiles.index(GROUP)
    first_row = q_start + GROUP * GROUP_M
    scale = scale * _carry_factor(factors_ptr, 0, CARRY)  # tS, and so mu, in units of w

    m_i = gl.full([GROUP_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([GROUP_M], gl.float32, row_layout)
    mu_i = gl.zeros([GROUP_M], gl.float32, row_layout)
    acc_o = gl.zeros([GROUP_M, HEAD_DIM], gl.float32, o_layout)
    acc_t = gl.zeros([GROUP_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([GROUP_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_ready, 0)
    turn = 0
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        turn = _take_turn(turns, turn, GROUP, True)
        k_t = k_ring.index(slot).permute((1, 0))
        s = warpgroup_mma(q_smem, k_t, s_zero, use_acc=False, is_async=True)
        ts = warpgroup_mma(tq_smem, k_t, s_zero, use_acc=False, is_async=True)
        ts = warpgroup_mma(q_smem, tk_ring.index(slot).permute((1, 0)), ts, is_async=True)
        _pass_turn(turns, GROUP, True)
        s, ts = warpgroup_mma_wait(0, deps=(s, ts))
        # Masked scores get p = 0, so their tangent scores never count.
        s = _masked(s, j * BLOCK_N, first_row, n_k, CAUSAL)
        p, alpha, m_new, l_new = _online_softmax(s, m_i, l_i, qk_scale)
        ts = ts * scale
        mu_new = (mu_i * l_i * alpha + gl.sum(p * ts, axis=1)) / l_new
        p_centred = p * (ts - gl.expand_dims(mu_new, 1))
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        shift = gl.expand_dims(gl.convert_layout(mu_new - mu_i, o_rows), 1)
        acc_o = acc_o * alpha_o
        acc_t = acc_t * alpha_o - shift * acc_o  # tO stays centred on the running mu
        p_op = gl.convert_layout(p.to(operand), p_layout)
        pc_op = gl.convert_layout(p_centred.to(operand), p_layout)
        mbarrier.wait(v_ready.index(slot), phase)
        turn = _take_turn(turns, turn, GROUP, True)
        acc_o = warpgroup_mma(p_op, v_ring.index(slot), acc_o, is_async=True)
        acc_t = warpgroup_mma(pc_op, v_ring.index(slot), acc_t, is_async=True)
        acc_t = warpgroup_mma(p_op, tv_ring.index(slot), acc_t, is_async=True)
        _pass_turn(turns, GROUP, True)
        acc_o, acc_t, p_op, pc_op = warpgroup_mma_wait(0, deps=(acc_o, acc_t, p_op, pc_op))
        mbarrier.arrive(slot_free.index(slot), count=1)
        m_i, l_i, mu_i = m_new, l_new, mu_new

    inv_l = gl.convert_layout(1.0 / l_i, o_rows)
    o_factor = gl.expand_dims(inv_l * _carry_factor(factors_ptr, 1, CARRY), 1)
    t_factor = gl.expand_dims(inv_l * _carry_factor(factors_ptr, 2, CARRY), 1)
    _store_rounded(o_desc, r_desc, q_smem, q_blocks.index(GROUP), acc_o * o_factor, batch,
                   head, first_row, STORE_RESIDUAL)
    _store_rounded(t_desc, tr_desc, tq_smem, tq_blocks.index(GROUP), acc_t * t_factor, batch,
                   head, first_row, STORE_RESIDUAL)
    rows = first_row + gl.arange(0, GROUP_M, row_layout)
    gl.store(lse_ptr + lse_row + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453,
             mask=rows < n_q)
    gl.store(mu_ptr + lse_row + rows, mu_i * _carry_factor(factors_ptr, 3, CARRY),
             mask=rows < n_q)


@gluon.jit
def warp_specialized_jvp_kernel(
        q_desc, k_desc, v_desc, tq_desc, tk_desc, tv_desc, o_desc, t_desc, r_desc, tr_desc,
        lse_ptr, mu_ptr, factors_ptr, n_heads, n_q, n_k, group_size, qk_scale, scale,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, CARRY: gl.constexpr,
        STORE_RESIDUAL: gl.constexpr, HEAD_GROUP: gl.constexpr, num_warps: gl.constexpr):
    """The forward with its JVP: grid (cdiv(Nq, 128), B·Hq) as the primal kernel's, always
    two groups in ping-pong, the tangents' descriptors beside the inputs'."""
    GROUP_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    q_start, bh, batch, head, n_blocks = _program_tile(n_heads, n_k, 2 * GROUP_M, BLOCK_N,
                                                       CAUSAL, HEAD_GROUP)
    q_tiles, tq_tiles = _blocks(q_desc, 2), _blocks(tq_desc, 2)
    k_ring, tk_ring = _blocks(k_desc, STAGES), _blocks(tk_desc, STAGES)
    v_ring, tv_ring = _blocks(v_desc, STAGES), _blocks(tv_desc, STAGES)
    q_ready, k_ready, v_ready, slot_free, turns = _ring_barriers(STAGES, 2)
    q_2d, tq_2d = _as_matrices(q_tiles, q_desc), _as_matrices(tq_tiles, tq_desc)
    k_2d, tk_2d = _as_matrices(k_ring, k_desc), _as_matrices(tk_ring, tk_desc)
    v_2d, tv_2d = _as_matrices(v_ring, v_desc), _as_matrices(tv_ring, tv_desc)
    lse_row = bh.to(gl.int64) * n_q
    kv_head = head // group_size
    gl.warp_specialize([
        (_jvp_compute_partition, (q_tiles, tq_tiles, q_2d, tq_2d, k_2d, tk_2d, v_2d, tv_2d,
                                  q_ready, k_ready, v_ready, slot_free, turns, o_desc, t_desc,
                                  r_desc, tr_desc, lse_ptr, mu_ptr, factors_ptr, batch, head,
                                  lse_row, q_start, n_q, n_k, n_blocks, qk_scale, scale, 0,
                                  BLOCK_N, STAGES, CAUSAL, CARRY, STORE_RESIDUAL, num_warps)),
        (_jvp_compute_partition, (q_tiles, tq_tiles, q_2d, tq_2d, k_2d, tk_2d, v_2d, tv_2d,
                                  q_ready, k_ready, v_ready, slot_free, turns, o_desc, t_desc,
                                  r_desc, tr_desc, lse_ptr, mu_ptr, factors_ptr, batch, head,
                                  lse_row, q_start, n_q, n_k, n_blocks, qk_scale, scale, 1,
                                  BLOCK_N, STAGES, CAUSAL, CARRY, STORE_RESIDUAL, num_warps)),
        (_load_partition, (q_desc, k_desc, v_desc, tq_desc, tk_desc, tv_desc, q_tiles, tq_tiles,
                           k_ring, tk_ring, v_ring, tv_ring, q_ready, k_ready, v_ready,
                           slot_free, batch, head, kv_head, q_start, n_blocks, BLOCK_N, STAGES,
                           True)),
    ], [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])

# %% [markdown]
# ## Launching it
#
# The host side builds one descriptor per tensor (Gluon's `TensorDescriptor`: base, shape,
# strides, block and swizzle, encoded by the launcher) and decides eligibility: an sm_90
# GPU, 16-bit inputs, $D = D_v \in \{64, 128\}$, strides the copy engine accepts, rows
# long enough for the schedule to pay (see the timings below), and enough work to hide the
# launch. A launch's host time is kept down as chapter 2's are: each block's shared-memory
# layout is made once (making one costs about 12 µs, and the forward with its JVP describes
# ten tensors), and the kernels launch through chapter 2's `CachedLauncher`, which matches a
# descriptor by what Triton compiles for it (dtype, block, layout) and skips Triton's
# per-launch Python. On the H200 that took a call of `attention` at (1, 1, 4096, 64), bf16,
# from 0.28 to 0.15 ms of host time (chapter 2's kernel: 0.27), and of
# `torch.func.jvp(attention)` from 0.91 to 0.61 ms (chapter 2's: 0.89). That moved the
# line from which the kernels pay to 2³⁵ of work counted as the FLOPs are, half when causal,
# with the tangent or without (`WARP_SPECIALIZED_MIN_WORK`, with the timings that set it);
# one measured call stays on the wrong side of it: the forward alone at (2, 16, 4096, 128)
# causal, 0.43 ms against chapter 2's 0.35, where the tangent's call gains (0.99 against
# 1.22). With tangents the tangents must match their inputs' shapes, dtypes and strides'
# rules, and "accurate" mode needs bf16 (the carry). Any other call runs chapter 2's
# kernel, as does every call if this Triton cannot compile the Gluon ones (warned once).

# %% tags=["export"]
# Launch: registers a thread may hold at launch, 65,536 per SM over 12 warps (the compute
# groups' 8 and the loader's one, rounded up to a warpgroup); then the loader gives up all
# but 24 and the compute groups take them (`setmaxnreg`).
LAUNCH_REGS = 168
GROUP_ROWS = 64  # query rows per compute group (a warpgroup's wgmma is 64 rows)
KEY_BLOCK = 128  # keys per tile
RING_STAGES = 3  # key/value tiles in flight: 3 x 64 KB at d = 128, with 32 KB of queries
# Below this many keys the Triton forward of chapter 2 is as fast or faster (H200, bf16,
# benchmarks/results/warp_specialized_h200.json: 0.97x of it at (32, 12, 1024, 64)).
WARP_SPECIALIZED_MIN_KEYS = 4096
# Work, counted as the FLOPs are (B·Hq·Nq·Nk·D, half when causal), from which the kernels
# are taken, with or without the tangent: below it a call's pace is its host time, which
# chapter 2's kernels keep as low. H200, bf16, calls back to back, these kernels against
# chapter 2's: with the tangent 0.97 against 1.16 ms at (4, 16, 4096, 64) causal (2**35),
# 0.91 against 1.01 at (2, 16, 4096, 64), 0.74 against 1.23 at (1, 16, 4096, 128), but
# 0.72 against 0.69 at (2, 16, 4096, 64) causal (2**34) and 1.19 against 1.02 at
# (1, 8, 4096, 128); the forward alone 0.27 against 0.29 ms at (1, 16, 4096, 128), 0.32
# against 0.35 at (2, 16, 4096, 64), 0.37 against 0.39 at (4, 16, 4096, 64) causal, but
# 0.33 against 0.21 at (2, 16, 4096, 64) causal and 0.38 against 0.24 at (1, 8, 4096, 128).
WARP_SPECIALIZED_MIN_WORK = 2**35
# With the tangent: keys per tile by head dim, what fits the 240 registers (see above), and
# two ring slots of four tiles each.
JVP_KEY_BLOCKS = {64: 128, 128: 64}
JVP_RING_STAGES = 2


@functools.cache
def _hopper(index: int | None) -> bool:
    """Device `index` is an sm_90 GPU: the warpgroup products (wgmma) are Hopper's alone."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(index) == (9, 0)


def _describable(t: torch.Tensor) -> bool:
    """The copy engine can address `t` as a 4-D tensor: unit last stride, positive other
    strides that are multiples of 16 bytes, a 16-byte aligned base."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1]))


_failed = False  # set when this Triton cannot compile the kernel: the Triton forward runs


def fits_warp_specialized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          tangents: tuple[torch.Tensor, ...] | None = None,
                          is_causal: bool = False) -> bool:
    """Whether (B, H, N, D) q, k, v (and their tangents) suit this chapter's kernels,
    wherever they live: fp16 or bf16 alike, D = Dv in (64, 128), at least
    WARP_SPECIALIZED_MIN_KEYS keys and WARP_SPECIALIZED_MIN_WORK of work (halved when
    causal), tensors the copy engine can address,
    tangents shaped and typed as their inputs."""
    batch, n_heads, n_q, d = q.shape
    tensors = (q, k, v) if tangents is None else (q, k, v, *tangents)
    work = batch * n_heads * n_q * k.shape[2] * d
    enough = work // (2 if is_causal else 1) >= WARP_SPECIALIZED_MIN_WORK
    return (q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
            and d == v.shape[-1] in (64, 128) and k.shape[2] >= WARP_SPECIALIZED_MIN_KEYS
            and enough and (tangents is None or all(t.shape == x.shape and t.dtype == x.dtype
                                         for t, x in zip(tangents, (q, k, v), strict=True)))
            and all(_describable(t) for t in tensors))


def takes_warp_specialized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           tangents: tuple[torch.Tensor, ...] | None = None,
                           exact: bool = True, is_causal: bool = False) -> bool:
    """Whether the forward of unmasked q, k, v (with `tangents`, its JVP too, in "accurate"
    mode when `exact`) runs this chapter's kernels: they fit (`fits_warp_specialized`) and
    live on an sm_90 GPU, outside the interpreter, with a Triton that compiles them, and an
    accurate tangent can carry (bf16: fp16's split products stay on chapter 2's kernel).
    JVP_ATTENTION_WARP_SPECIALIZED=0 turns them off. The device is asked last: a traced
    graph's fake CUDA tensors, on a machine without CUDA, stop at the shapes."""
    if not GLUON or _failed or os.environ.get("JVP_ATTENTION_WARP_SPECIALIZED", "1") == "0":
        return False
    if not q.is_cuda or interpreting() or not fits_warp_specialized(q, k, v, tangents,
                                                                    is_causal):
        return False
    if tangents is not None and exact and not carries(q, k.shape[2]):
        return False
    return _hopper(q.device.index)


def _descriptor(t: torch.Tensor, rows: int, cols: int | None = None):
    """A descriptor over (B, H, N, D) `t` whose blocks are (1, 1, rows, cols), D columns
    unless given, swizzled as the warpgroup products read them."""
    cols = t.shape[-1] if cols is None else cols
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols],
                            _shared_layout(rows, cols, t.dtype))


@functools.cache
def _shared_layout(rows: int, cols: int, dtype: torch.dtype):
    """The shared-memory layout of a (1, 1, rows, cols) block of `dtype`, made once: making
    one costs the host about 12 µs, and a call with the tangent describes ten tensors."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], gl_dtype)


def launch_warp_specialized(q, k, v, out, out_residual, lse, is_causal: bool, scale: float,
                            *, stages: int = RING_STAGES, key_block: int = KEY_BLOCK,
                            pipeline: bool = True, pingpong: bool = True) -> None:
    """Launch the kernel: `out` and `lse` (and `out_residual` unless None) are written.
    The keyword options choose the schedule (the chapter times each)."""
    batch, n_heads, n_q, _ = q.shape
    group_rows = GROUP_ROWS if pingpong else 2 * GROUP_ROWS
    residual = out_residual is not None
    descriptors = (_descriptor(q, group_rows), _descriptor(k, key_block),
                   _descriptor(v, key_block), _descriptor(out, group_rows),
                   _descriptor(out_residual if residual else out, group_rows))
    grid = (triton.cdiv(n_q, 2 * GROUP_ROWS), batch * n_heads)
    cached(warp_specialized_forward_kernel)[grid](
        *descriptors, lse, n_heads, n_q, k.shape[2], n_heads // k.shape[1],
        scale * math.log2(math.e), STAGES=stages, PIPELINE=pipeline, PINGPONG=pingpong,
        CAUSAL=is_causal, STORE_RESIDUAL=residual,
        HEAD_GROUP=head_group(is_causal, k, v, queries_per_head=n_heads // k.shape[1]),
        num_warps=4 if pingpong else 8,
        maxnreg=LAUNCH_REGS)


def launch_warp_specialized_jvp(q, k, v, tangents, outputs, residuals, lse, mu,
                                is_causal: bool, scale: float, carry=None, *,
                                key_block: int | None = None,
                                stages: int = JVP_RING_STAGES) -> None:
    """Launch the forward with its JVP: `outputs` (out, tangent_out), `lse` and `mu` are
    written, and `residuals` (theirs) unless None. `carry` is chapter 2's `jvp_operands`
    for "accurate" bf16 (None: products in the inputs' type). `key_block` defaults to
    JVP_KEY_BLOCKS of the head dim."""
    batch, n_heads, n_q, d = q.shape
    tq, tk, tv = tangents
    factors = lse  # not read without the carry
    if carry is not None:
        v, tv, factors = carry(q, k, v, tq, tk, tv, scale)
    key_block = JVP_KEY_BLOCKS[d] if key_block is None else key_block
    stored = residuals is not None
    residuals = residuals if stored else outputs  # unread stand-ins
    descriptors = [_descriptor(t, rows) for t, rows in (
        (q, GROUP_ROWS), (k, key_block), (v, key_block), (tq, GROUP_ROWS), (tk, key_block),
        (tv, key_block), (outputs[0], GROUP_ROWS), (outputs[1], GROUP_ROWS),
        (residuals[0], GROUP_ROWS), (residuals[1], GROUP_ROWS))]
    grid = (triton.cdiv(n_q, 2 * GROUP_ROWS), batch * n_heads)
    cached(warp_specialized_jvp_kernel)[grid](
        *descriptors, lse, mu, factors, n_heads, n_q, k.shape[2], n_heads // k.shape[1],
        scale * math.log2(math.e), scale, STAGES=stages, CAUSAL=is_causal,
        CARRY=carry is not None, STORE_RESIDUAL=stored,
        HEAD_GROUP=head_group(is_causal, k, v, tk, tv, queries_per_head=n_heads // k.shape[1]),
        num_warps=4, maxnreg=LAUNCH_REGS)


def warp_specialized_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             is_causal: bool, scale: float, residuals: bool = False,
                             tangents: tuple[torch.Tensor, ...] | None = None,
                             carry=None):
    """The forward (with `tangents`, and its JVP) through this chapter's kernels, returning
    what chapter 2's `flash_attention_forward` returns for the same call, or None when this
    Triton cannot compile them (warned once; the caller runs the Triton forward). `carry`:
    see `launch_warp_specialized_jvp`."""
    global _failed
    out = torch.empty(q.shape[:-1] + v.shape[-1:], device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    out_residual = torch.empty_like(out) if residuals else None
    t_out = mu = t_residual = None
    try:
        with on_device(q):
            if tangents is None:
                launch_warp_specialized(q, k, v, out, out_residual, lse, is_causal, scale)
            else:
                t_out, mu = torch.empty_like(out), torch.empty_like(lse)
                t_residual = torch.empty_like(out) if residuals else None
                launch_warp_specialized_jvp(
                    q, k, v, tangents, (out, t_out),
                    (out_residual, t_residual) if residuals else None, lse, mu, is_causal,
                    scale, carry)
    except triton.CompilationError as error:
        _failed = True
        warnings.warn(f"jvp_attention: the warp-specialised forward does not compile with "
                      f"Triton {triton.__version__} ({type(error).__name__}); the Triton "
                      f"forward runs instead", RuntimeWarning, stacklevel=2)
        return None
    outputs = AttentionOutputs(out, lse, t_out, mu)
    return (outputs, (out_residual, t_residual)) if residuals else outputs

# %% [markdown]
# ## What it costs: registers and shared memory
#
# Compiled for sm_90 with Triton 3.6 on a CPU machine (`python benchmarks/warp_specialized.py
# --resources`): `regs` is the launch's 168; the partitions then set theirs (`setmaxnreg`:
# 240 for a compute group, 24 for the loader). No variant spills.

# %% tags=["hide_input"]
record = json.loads(RESULTS.read_text())
print(f"{'variant':20} {'d':>4} {'causal':>6} {'regs':>5} {'spills':>6} {'shared (KB)':>11}"
      f" {'wgmma':>6}")
for row in record["resources_sm90"]["rows"]:
    print(f"{row['variant']:20} {row['d']:>4} {str(row['causal']):>6} {row['regs']:>5} "
          f"{row['spills']:>6} {row['shared'] / 1024:>11.1f} {row['wgmma']:>6}")

# %% [markdown]
# ## Same numbers
#
# On an sm_90 GPU the kernel is checked here against float64 attention (chapter 1's
# reference), on lengths that are not multiples of the tiles, GQA, a $(B, N, H, D)$ layout,
# causal rows and the residual, next to PyTorch's math path in the same dtype: the criterion
# of every kernel test, the error as a multiple of the math path's. Elsewhere the cell says
# so and checks nothing; `tests/library/test_warp_specialized.py` runs the same checks on
# the GPU, and on the CPU compiles the kernel for sm_90 and checks who takes it.

# %%
from jvp_attention.reference import reference_attention
from jvp_attention.warp_specialized import takes_warp_specialized, warp_specialized_forward


def sdpa_math(q, k, v, is_causal):
    """PyTorch's math path in the inputs' dtype: the floor the kernels are judged by."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                                enable_gqa=True)


def random_heads(batch, heads, n, d, layout):
    """bf16 (B, H, N, D) noise, stored as (B, H, N, D) or as a view of (B, N, H, D)."""
    if layout == "bnhd":
        return torch.randn(batch, n, heads, d, device=DEVICE,
                           dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn(batch, heads, n, d, device=DEVICE, dtype=torch.bfloat16)


CASES = [  # (B, Hq, Hkv, N, d, causal, layout)
    (2, 16, 16, 4096, 128, False, "bhnd"), (2, 16, 4, 4160, 64, True, "bnhd"),
    (1, 32, 32, 4097, 128, True, "bnhd"), (2, 16, 2, 5000, 64, False, "bhnd"),
]
if HOPPER:
    torch.manual_seed(0)
    for B, HQ, HKV, N, D, causal, layout in CASES:
        q = random_heads(B, HQ, N, D, layout)
        k, v = (random_heads(B, HKV, N, D, layout) for _ in range(2))
        assert takes_warp_specialized(q, k, v)
        (ours, lse, _, _), (residual, _) = warp_specialized_forward(q, k, v, causal, D**-0.5,
                                                                    residuals=True)
        exact = reference_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                    enable_gqa=True)
        floor = (sdpa_math(q, k, v, causal).double() - exact.out).abs().max().item()
        error = (ours.double() - exact.out).abs().max().item()
        lse_error = (lse.double() - exact.lse).abs().max().item()
        kept = (ours.double() + residual.double() - exact.out).abs().max().item()
        print(f"({B}, {HQ}/{HKV}, {N}, {D}) {layout} causal={causal!s:5}: error "
              f"{error / floor:.2f}x the math path's, LSE {lse_error:.1e}, "
              f"out + residual {kept:.1e}")
else:
    print("no sm_90 GPU here: the kernel is checked by the GPU tests and the executed chapter")

# %% [markdown]
# ## Does it pay?
#
# Timed on the H200 (bf16; `python benchmarks/warp_specialized.py`), each schedule against
# chapter 2's forward (`ours`, autotuned) and SDPA's flash and cuDNN backends, with FLOPs
# credited as $4BHN^2d$ (half of it when causal). The variants switch one thing at a time:
# `ws_serial` is one group of 8 warps that waits for each product; `ws_pipelined` adds the
# intra-group overlap; `ws_pingpong` splits the rows between two groups that take turns;
# `ws_pingpong_s3` deepens the ring to three slots (the library's choice);
# `ws_pingpong_n64` uses 64-key tiles.

# %% tags=["hide_input"]
import matplotlib.pyplot as plt  # noqa: E402


def plot_speeds(rows, title):
    """A table and a bar chart of TFLOP/s by shape (and causal) and implementation."""
    rows = [row for row in rows if "tflops" in row]
    shapes = list(dict.fromkeys((tuple(row["shape"]), row["causal"]) for row in rows))
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    speed = {(tuple(row["shape"]), row["causal"], row["impl"]): row["tflops"] for row in rows}
    print(f"{'(B, H, N, d)':22} {'causal':>6} " + " ".join(f"{name[:14]:>14}" for name in impls))
    for shape, causal in shapes:
        print(f"{str(shape):22} {str(causal):>6} "
              + " ".join(f"{speed.get((shape, causal, name), float('nan')):>14.0f}"
                         for name in impls))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(impls)
    for i, name in enumerate(impls):
        ax.bar([x + i * width for x in range(len(shapes))],
               [speed.get((shape, causal, name), 0) for shape, causal in shapes], width,
               label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))],
                  [f"{shape}\n{'causal' if causal else 'full'}" for shape, causal in shapes],
                  fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=3)
    plt.tight_layout()
    plt.show()


plot_speeds(record["rows"], "Primal forward on the H200, bf16")

# %% [markdown]
# What the numbers say (one run; runs on this machine differ by a few percent):
#
# * **Ping-pong is what pays.** At $d = 128$ two groups taking turns are 5 to 14% faster than
#   one group of 8 warps, and the third ring slot adds 1 to 17% more: at (4, 16, 4096, 128)
#   616 TFLOP/s against chapter 2's 492 (1.25x) and cuDNN's 600; causal 549 against 430 and
#   533. At (1, 16, 16384, 128), 576 against 514 and cuDNN's 619; causal 610 against 505 and
#   569. Through the library's call (`ours`, which takes this kernel from 4096 keys) that is
#   1.01x cuDNN at (4, 16, 4096, 128), 0.99x causal, and 1.00x and 1.04x at 16384 tokens.
# * **The overlap within a group does not.** `ws_pipelined` is within 3% of `ws_serial`
#   everywhere: with the value product issued right after the scores, the tensor cores are
#   already busy while the softmax runs, and a second group does that better.
# * **$d = 64$ gains less**: 432 against 416 TFLOP/s at (4, 16, 4096, 64) (cuDNN 463), 375
#   against 363 causal (cuDNN 411). A 64-wide tile halves the products per exponential, so
#   the softmax weighs more and one extra group cannot hide all of it; FlashAttention-3 runs
#   $d = 64$ with 192-row tiles, three groups, for that reason. Swept later at
#   (4, 16, 4096, 64) (H200, bf16, the kernel alone under CUDA graphs, one session), the
#   schedule in use stays the best: 0.655 ms full and 0.374 causal with 128-key tiles,
#   ping-pong and three slots, against 0.653 and 0.372 with four, 0.720 and 0.428 with
#   256-key tiles (which fit two or three slots), 0.733 and 0.414 at best with 64-key tiles,
#   and about 20% more without ping-pong; cuDNN took 0.618 and 0.350 ms in that session
#   (0.94x and 0.93x).
# * **Short rows lose.** At (32, 12, 1024, 64) every variant trails chapter 2's kernel
#   without the mask (354 against 366 TFLOP/s), whose autotuned tiles suit eight key tiles
#   better than a fixed 128 × 128 tile and a three-deep ring; hence
#   `WARP_SPECIALIZED_MIN_KEYS = 4096` (causal, there, it was ahead: 253 against 195).
#
# The errors match the math path's wherever the Triton kernels' do (the `err_ratio` column of
# the results file): the same products in the same precision, in another order.
#
# ## The forward with its JVP
#
# The kernel of "The tangent in the same schedule" above runs where the primal one does, for
# calls with tangents (`WARP_SPECIALIZED_MIN_WORK`, in "Launching it"): chapter 2's
# launcher hands it fp16 and bf16 in "fast" mode and bf16 in "accurate" mode (carried).
# Checked here as the primal kernel was, called directly on the same cases, out and
# tangent_out against float64 next to PyTorch math's `torch.func.jvp` in the same dtype, in
# each precision it takes.

# %%
from jvp_attention.forward import jvp_operands  # noqa: E402


def math_jvp(q, k, v, tangents, is_causal):
    """PyTorch's math path under torch.func.jvp, in the inputs' dtype."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.func.jvp(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, is_causal=is_causal, enable_gqa=True), (q, k, v), tangents)


def jvp_errors(q, k, v, tangents, causal, carry):
    """out's and tangent_out's max errors against float64, as multiples of the math path's."""
    ours = warp_specialized_forward(q, k, v, causal, q.shape[-1] ** -0.5, False, tangents,
                                    carry)
    exact = reference_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                enable_gqa=True, tangents=tuple(t.double() for t in tangents))
    floor = math_jvp(q, k, v, tangents, causal)
    return [(mine.double() - truth).abs().max().item()
            / (low.double() - truth).abs().max().item()
            for mine, low, truth in ((ours.out, floor[0], exact.out),
                                     (ours.tangent_out, floor[1], exact.tangent_out))]


if HOPPER:
    torch.manual_seed(0)
    for B, HQ, HKV, N, D, causal, layout in CASES:
        q = random_heads(B, HQ, N, D, layout)
        k, v = (random_heads(B, HKV, N, D, layout) for _ in range(2))
        tangents = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))
        for dtype, mode in ((torch.bfloat16, "accurate"), (torch.bfloat16, "fast"),
                            (torch.float16, "fast")):
            inputs = [x.to(dtype) for x in (q, k, v)]
            moved = tuple(t.to(dtype) for t in tangents)
            out_ratio, tangent_ratio = jvp_errors(*inputs, moved, causal,
                                                  jvp_operands if mode == "accurate" else None)
            print(f"({B}, {HQ}/{HKV}, {N}, {D}) {layout} causal={causal!s:5} "
                  f"{str(dtype)[6:]:8} {mode:8}: out {out_ratio:.2f}x, tangent_out "
                  f"{tangent_ratio:.2f}x the math path's error")
else:
    print("no sm_90 GPU here: the kernel is checked by the GPU tests and the executed chapter")

# %% [markdown]
# Registers and shared memory, compiled for sm_90 (`python benchmarks/warp_specialized_jvp.py
# --resources`): the 64-key tiles at $d = 128$ and the 128-key tiles at $d = 64$ fit the
# 240 registers without spilling, carried and with residuals too; 128-key tiles at
# $d = 128$ spill.

# %% tags=["hide_input"]
jvp_record = json.loads(JVP_RESULTS.read_text())
print(f"{'tile':14} {'causal':>6} {'carry':>6} {'regs':>5} {'spills':>6} {'shared (KB)':>11}"
      f" {'wgmma':>6}")
for row in jvp_record["resources_sm90"]["rows"]:
    print(f"{row['tile']:14} {str(row['causal']):>6} {str(row['carry']):>6} {row['regs']:>5} "
          f"{row['spills']:>6} {row['shared'] / 1024:>11.1f} {row['wgmma']:>6}")

# %% [markdown]
# Timed on the H200 (bf16; `python benchmarks/warp_specialized_jvp.py`), as users call it,
# `torch.func.jvp(attention)`: `ours_*` is the library (this kernel), `triton_*` chapter 2's
# kernel (`JVP_ATTENTION_WARP_SPECIALIZED=0`), each in both precisions; `ws_*` are direct
# launches of this kernel with other tiles ("fast"). FLOPs are credited as three forwards,
# as chapter 8 does.

# %% tags=["hide_input"]
plot_speeds(jvp_record["rows"], "Forward with its JVP on the H200, bf16")

# %% [markdown]
# What the numbers say (one run, H200, bf16):
#
# * **The tangent gains more than the primal did.** As users call it,
#   `torch.func.jvp(attention)` in "accurate" mode runs at 581 TFLOP/s at (4, 16, 4096, 128)
#   against chapter 2's 412 (1.41x), and at 616 against 441 at (1, 16, 16384, 128) (1.40x);
#   causal 506 against 374 and 598 against 426. "fast" reaches 624 and 632. At $d = 64$,
#   531 against 421. The forward with its JVP now runs at the primal forward's speed per
#   FLOP: three products where the primal has two, each of them waiting on the same
#   softmax, so the tensor cores see more work per exponential.
# * **"accurate" costs 3 to 8% over "fast" at these shapes without the mask** (581 against
#   624, 616 against 632, 531 against 575): the carry's two copy kernels (about 0.17 ms at
#   (4, 16, 4096, 128)) and nothing in the kernel itself, whose fp16 operands are as wide
#   as bf16's. Its errors stay at the math path's (`out_err_ratio` 1.00 to 1.03,
#   `tangent_out_err_ratio` 1.00 to 1.01 in the results file), where "fast" is at 1.0 to
#   1.2x and 1.1 to 1.4x, as chapter 3's fast path.
# * **The shortest call, (4, 16, 4096, 64) causal,** is taken since the launches go through
#   `CachedLauncher` ("Launching it"): "fast" 507 TFLOP/s against chapter 2's 401, as fast
#   as the kernel launched directly (500). "accurate" gains less, 388 against 367: its
#   call, 1.06 ms against "fast"'s 0.81, adds the carry's range pass and copies to a call
#   whose GPU time is now close to its host time, so that is what the row measures. In GPU
#   time (H100, the profiler) the carried kernel is as fast as "fast"'s, 0.773 against
#   0.768 ms; the range pass (0.072 ms, six tensors read) and the copies (0.044 ms) are the
#   difference, 0.889 against 0.768 ms, and both run at the memory's bandwidth.
# * **Causal against full, in the kernel alone** (GPU time in a CUDA graph): the causal
#   forward with its JVP runs at 0.90x the full call's speed per FLOP at (4, 16, 4096, 128)
#   (1.51 ms against half of 2.73), 0.88x at $d = 64$ (0.83 against half of 1.47) and 0.98x
#   at 16384 tokens; the wider gaps in the table come from the call around the kernel. The
#   diagonal tiles' masking and the last wave's short tiles are what is left. Ordering the
#   programs heads-fastest instead (grid (B·Hq, query tiles), so every head's longest tile
#   starts in the first wave) was slower at every shape we timed it: causal 1.57 ms against
#   1.51 at (4, 16, 4096, 128), 0.85 against 0.83 at $d = 64$, 5.59 against 5.42 at 16384
#   tokens, and full calls 6 to 17% slower. Programs side by side then read different
#   heads' keys, where in `_program_tile`'s order they read one head's keys and values
#   together, so each key tile is fetched from memory once and served to the others by L2.
#   Chapter 2's grouped order (`query_program`) keeps both: heads in groups whose keys and
#   values fit 16 MiB, each group's tiles longest first. Timed on the H100 (bf16,
#   "accurate", the kernel's GPU time from the profiler) against the order above: 1.277
#   against 1.339 ms at (4, 16, 4096, 128) causal, 0.746 against 0.774 at $d = 64$, 1.401
#   against 1.458 at (2, 16, 8192, 64), and 4.735 against 4.746 at (1, 16, 16384, 128),
#   whose 16 MiB a head leave groups of one; full calls, 2.498 ms at (4, 16, 4096, 128),
#   do not change. Per FLOP the causal call then runs at 0.98x the full one at
#   (4, 16, 4096, 128) (646 against 660 TFLOP/s) and 0.92x at $d = 64$ (552 against 603).
#   Groups of 4, 8 and 16 heads at (1, 16, 16384, 128) took 5.23, 5.12 and 5.20 ms: a
#   group whose keys outgrow L2 (50 MB) fetches them again.
# * **Tiles.** 64-key tiles at $d = 128$: 609 TFLOP/s launched directly, where 128-key
#   tiles, spilling 3 KB a thread, run at 252. At $d = 64$, 128-key tiles beat 64-key ones
#   with three slots (577 against 511).
# * **Side by side with rcm** (NVlabs' Triton FlashAttention-2 JVP kernel, `bench.py
#   --rcm-kernel`, chapter 8), in one run on the same H200: ours 577 against rcm's 411
#   TFLOP/s at (4, 16, 4096, 128) (1.40x) and 607 against 419 at (1, 16, 16384, 128)
#   (1.45x), at the math path's error where rcm's is 1.7 to 2.8x it.
#
# Chapter 12 puts the first-order backward in the same schedule; the second-order backward
# still runs chapter 6's kernels.
