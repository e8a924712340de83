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
# # Chapter 12: the backward in the warp-specialised schedule
#
# Chapter 11 moved the forwards into FlashAttention-3's schedule: a loader warp feeding the
# copy engine, two compute warpgroups taking turns at the tensor cores. This chapter does
# the same for the first-order backward of chapter 5, the pass every training step runs
# after the forward, and the one where chapter 5's kernels trail SDPA's cuDNN backend most
# (0.66x to 0.77x on the H200 at $d = 128$, chapter 8).
#
# Chapter 5 split the backward in two kernels so that no gradient needs atomic adds. This
# chapter builds that split first, then folds the dQ kernel into the dK/dV kernel, with the
# copy engine summing dQ in fp32 ("Summing dQ where dS is made", below):
#
# * **dK/dV.** A program owns 128 keys of one key/value head, 64 for each compute group.
#   The loader copies the program's $K$ and $V$ tiles once, then streams each query tile's
#   $Q$ and $dO$ through a ring, over every query head of the GQA group. With the keys as
#   the rows of every tile (the scores transposed), a group takes two turns per query tile:
#
#   $$S^\top = K Q^\top,\quad dP^\top = V\,dO^\top \qquad\text{(one turn: two products)}$$
#
#   $$P^\top = 2^{\,S^\top s \log_2 e \,-\, \mathrm{LSE}\log_2 e},\qquad
#   dS^\top = P^\top \circ (dP^\top - \Delta)$$
#
#   $$dV \mathrel{+}= P^\top dO,\quad dK \mathrel{+}= dS^\top Q \qquad\text{(the next turn)}$$
#
#   and at the end stores $s\,dK$ and $dV$. While one group computes its exponentials, the
#   other's products run.
# * **dQ.** A program owns 128 queries of one head, 64 per group; the loader streams $K$ and
#   $V$. Per key tile a group computes $S = QK^\top$ and $dP = dO\,V^\top$ in one turn, then
#   $dS$, and $dQ \mathrel{+}= dS\,K$ in the next; at the end it stores $s\,dQ$.
#
# The fused kernel computes the five products of one pass over the tiles where the split
# computes seven, and it is what the library runs (`fuses_dq`).
#
# $\Delta = \mathrm{rowsum}(dO \circ O)$ comes first, from chapter 5's kernels: the copy
# kernel that makes the exact fp16 operands of "accurate" bf16 writes it, and in "fast"
# precision the row-statistics kernel does.
#
# ## The budget
#
# A compute thread of the dK/dV kernel at $d = 128$ holds $dK$ and $dV$ (64 registers
# each: a quarter-warp's share of a 64 × 128 fp32 tile), $S^\top$ and $dP^\top$ for a
# 64-query tile (32 each), and the two 16-bit register operands $P^\top$ and $dS^\top$
# (16 each): 224 of the 240 that `setmaxnreg` gives it. That rules out 128-query tiles at
# $d = 128$, and it is tight enough that ptxas spills a few bytes (below). Shared memory:
# the program's $K$ and $V$ (64 KB at $d = 128$) and two ring slots of $Q$ and $dO$ (32 KB
# each), 128 KB. The dQ kernel holds one accumulator ($dQ$, 64) with $S$ and $dP$ for
# 128-key tiles (64 each), so its ring takes 128-key tiles. Summing $dQ$ in the dK/dV
# kernel adds a 64 × 64 fp32 part (32 registers, live only after $S^\top$ and $dP^\top$
# are spent) and 64 KB of shared memory: two visits' $dS^\top$ tiles for both groups
# (32 KB) and a staging tile per group (32 KB), 192 KB in all at $d = 128$.
#
# ## Precision
#
# Both precisions of chapter 5 run here. "fast" rounds each 16-bit operand once, as
# chapter 5's fast kernels do. "accurate" bf16 runs on chapter 5's carried operands
# (`backward_operands`): exact fp16 copies of $Q$, $K$, $V$, $dO$, each shifted by a power
# of two, and the factors that undo the shifts, read on the device: the scores' scale
# (entry 0), $\Delta$'s (1), those of $dQ$, $dK$, $dV$ (2, 3, 4) and the exponent of
# $P$'s shift (5: $P$ comes out times $2^8$, so that its small values stay normal fp16).
# The products see fp16 operands as wide as bf16's, so the schedule is the same; only the
# outputs' type differs from the operands', and they are staged for the copy engine in
# the same shared memory, viewed as the outputs' type. "accurate" fp16, which splits its
# products into a high and a low part, would need twice the operand registers: it stays on
# chapter 5's kernels, as chapter 11's forward leaves it to chapter 2's.

# %%
import json
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
RESULTS = Path("../benchmarks/results/warp_specialized_backward_h200.json")
RESOURCES = Path("../benchmarks/results/warp_specialized_backward_resources_sm90.json")
print(f"device: {DEVICE}, sm_90: {HOPPER}")

# %% [markdown]
# ## Building it
#
# The module borrows chapter 11's pieces: the accumulator layouts, the loader's paired
# loads, the turn barriers, the ring, the staged stores, the copy engine's names.

# %% tags=["export"]
"""Chapter 12: the first-order backward with warp specialisation, written in Gluon.

Two kernels, as chapter 5's: dK/dV (a program owns 128 keys, two warpgroups of 64 in
ping-pong over the query tiles a loader warp streams) and dQ (128 queries, two groups over
streamed key/value tiles). Chapter 5's launcher takes them on an sm_90 GPU for long
unmasked rows (`warp_specialized_backward_kernels`); `notebooks/12_hopper_backward.py`
derives them and times them.
"""

import math
import os
import warnings

import torch
import triton
import triton.language as tl

from jvp_attention.launch import cached, carries, head_group, interpreting
from jvp_attention.tiles import query_program
from jvp_attention.warp_specialized import (
    COMPUTE_REGS,
    GLUON,
    GROUP_ROWS,
    LAUNCH_REGS,
    LOADER_REGS,
    WARP_SPECIALIZED_MIN_KEYS,
    WARP_SPECIALIZED_MIN_WORK,
    _as_matrices,
    _barrier,
    _blocks,
    _describable,
    _descriptor,
    _hopper,
    _load_with_tangent,
    _masked,
    _pass_turn,
    _program_tile,
    _ring_barriers,
    _store_rows,
    _take_turn,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    mma_layout,
    tma,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)

# %% [markdown]
# The loader of the dK/dV kernel. Its query tiles run over the GQA group: visit $j$ is the
# query head `j // n_blocks` of the group and the tile `j % n_blocks` of that head, so one
# ring and one count of phases serve every head, and the program alone writes its keys'
# gradients, summed over the group in registers (chapter 5's rule).

# %% tags=["export"]
@gluon.jit
def _query_visit(j, kv_head, group_size, first_block, n_blocks, BLOCK_M: gl.constexpr):
    """Visit `j` of a dK/dV program: the query head and the first row of its tile."""
    return kv_head * group_size + j // n_blocks, (first_block + j % n_blocks) * BLOCK_M


@gluon.jit
def _load_group_tiles(desc, pair_desc, tiles, pair_tiles, barrier, batch, head, start):
    """Each compute group's tile of `desc` and of `pair_desc` (same block shape), from row
    `start` on, all on one barrier: what a program loads once before its ring starts."""
    GROUPS: gl.constexpr = tiles.shape[0]
    ROWS: gl.constexpr = desc.block_type.shape[2]
    mbarrier.expect(barrier, GROUPS * (desc.block_type.nbytes + pair_desc.block_type.nbytes))
    for g in gl.static_range(GROUPS):
        tma_load(desc, [batch, head, start + g * ROWS, 0], barrier, tiles.index(g))
        tma_load(pair_desc, [batch, head, start + g * ROWS, 0], barrier, pair_tiles.index(g))


@gluon.jit
def _stream_query_tiles(q_desc, tq_desc, do_desc, dto_desc, q_ring, tq_ring, do_ring, dto_ring,
                        q_ready, do_ready, slot_free, batch, kv_head, group_size, first_block,
                        n_blocks, STAGES: gl.constexpr, TANGENT: gl.constexpr):
    """Each visit's Q (and with TANGENT tQ) on one barrier and dO (and dtO) on another, into
    the next ring slot as soon as both compute groups have freed it."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    for j in range(group_size * n_blocks):
        slot = j % STAGES
        mbarrier.wait(slot_free.index(slot), ((j // STAGES) & 1) ^ 1)
        head, row = _query_visit(j, kv_head, group_size, first_block, n_blocks, BLOCK_M)
        _load_with_tangent(q_desc, tq_desc, batch, head, row, q_ready.index(slot),
                           q_ring.index(slot), tq_ring.index(slot), TANGENT)
        _load_with_tangent(do_desc, dto_desc, batch, head, row, do_ready.index(slot),
                           do_ring.index(slot), dto_ring.index(slot), TANGENT)


@gluon.jit
def _dkdv_load_partition(k_desc, v_desc, q_desc, do_desc, k_tiles, v_tiles, q_ring, do_ring,
                         kv_ready, q_ready, do_ready, slot_free, batch, kv_head, k_start,
                         group_size, first_block, n_blocks, STAGES: gl.constexpr):
    """One warp: both groups' K and V tiles once, then each visit's Q and dO into the ring,
    as soon as both groups have freed the slot."""
    _load_group_tiles(k_desc, v_desc, k_tiles, v_tiles, kv_ready, batch, kv_head, k_start)
    _stream_query_tiles(q_desc, q_desc, do_desc, do_desc, q_ring, q_ring, do_ring, do_ring,
                        q_ready, do_ready, slot_free, batch, kv_head, group_size, first_block,
                        n_blocks, STAGES, False)


# %% [markdown]
# The compute side. Both kernels start from the same units: the scores' scale, $\Delta$'s
# factor and the shift of $P$'s exponent, the carried factors where "accurate" carries
# and identities where it does not, as chapter 5's `_carried_units`. Causal masking in the
# transposed tiles compares a key row with a query column; as in chapter 11, only tiles
# that reach the diagonal pay for it.

# %% tags=["export"]
@gluon.jit
def _carried(factors_ptr, index: gl.constexpr, CARRY: gl.constexpr, identity: gl.constexpr):
    """Entry `index` of chapter 5's carried factors (`backward_operands`), or `identity`
    without CARRY."""
    if CARRY:
        value = gl.load(factors_ptr + index)
    else:
        value = identity
    return value


@gluon.jit
def _carried_units(factors_ptr, qk_scale, CARRY: gl.constexpr):
    """The scores' scale (log2 units), Delta's factor and P's exponent shift."""
    return (qk_scale * _carried(factors_ptr, 0, CARRY, 1.0),
            _carried(factors_ptr, 1, CARRY, 1.0), _carried(factors_ptr, 5, CARRY, 0.0))


@gluon.jit
def _causal_transposed(st, first_key, start_m, CAUSAL: gl.constexpr):
    """Sᵀ with the keys after their query set to -inf (top-left causal: query i sees keys
    j <= i)."""
    if CAUSAL and start_m < first_key + st.shape[0]:
        # key first_key + r sees query start_m + c iff first_key - start_m + r <= c: the
        # tile's own offsets, one shift per visit (fewer registers than absolute indices)
        keys = (first_key - start_m) + gl.arange(0, st.shape[0],
                                                 gl.SliceLayout(1, st.type.layout))
        queries = gl.arange(0, st.shape[1], gl.SliceLayout(0, st.type.layout))
        st = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(queries, 0), st,
                      -float("inf"))
    return st


@gluon.jit
def _load_row_statistics(lse_ptr, delta_ptr, rows, n_q):
    """A tile's LSE and Delta as stored. Rows past the end read LSE = +inf, so their P is
    exactly 0."""
    lse = gl.load(lse_ptr + rows, mask=rows < n_q, other=float("inf"))
    delta = gl.load(delta_ptr + rows, mask=rows < n_q, other=0.0)
    return lse, delta


@gluon.jit
def _row_statistics_in_units(lse, delta, delta_factor, p_exponent):
    """LSE in log2 units less P's shift, and Delta in the carried units."""
    return lse * LOG2E - p_exponent, delta * delta_factor


@gluon.jit
def _row_statistics(lse_ptr, delta_ptr, rows, n_q, delta_factor, p_exponent):
    """A tile's LSE in log2 units less P's shift, and its Delta in the carried units."""
    lse, delta = _load_row_statistics(lse_ptr, delta_ptr, rows, n_q)
    return _row_statistics_in_units(lse, delta, delta_factor, p_exponent)


# %% [markdown]
# ## Summing dQ where dS is made
#
# Split in two, the backward computes $S$ and $dP$ twice: the dK/dV kernel needs them for
# $dS^\top$, and the dQ kernel makes them again for $dS$, seven products where one pass
# over the tiles needs five. The dK/dV kernel already holds each tile's $dS^\top$, so it
# can add the fifth product itself,
#
# $$dQ_{i} \mathrel{+}= dS_{i,j} K_j \qquad\text{for every key block } j,$$
#
# but the sum over key blocks now runs across programs, which own different keys: no
# program can hold a query tile's $dQ$ in registers. It is summed in fp32 in global
# memory instead, by the copy engine's reduction (`cp.reduce.async.bulk.tensor ... .add`,
# the bulk add FlashAttention-3 uses for the same sum; Shah et al., 2024): a compute group
# stages its partial tile in shared memory and the copy engine adds it into an fp32 buffer
# in L2, with no atomics issued by the threads. A last elementwise pass scales the sum by
# $s$ (and the carried factor of $dQ$) and rounds it to the gradients' type. The sum starts
# at zero: where "accurate" bf16 carries, chapter 5's copy kernel, which passes over $Q$'s
# rows anyway, writes those zeros (`dq_sum`), so the call launches no fill of its own; the
# launcher fills it otherwise.
#
# **The traffic decides the shape.** Each reduction is a read-add-write of fp32 in L2. If
# each group added its own 64 keys' $dQ$ (64 × 128 fp32 per query tile), the call at
# (4, 16, 4096, 128) would move 8.6 GB through L2's adders: on the H200 that kernel took
# 3.34 ms, slower than the two split kernels together (3.10 ms, "fast"). Summing the two
# groups' keys first halves it: both groups put their $dS^\top$ tile in shared memory, and
# each then multiplies *both* tiles by the matching columns of $K$, so that one reduction
# per query tile carries all 128 of the program's keys:
#
# $$dQ_{i,\,c} \mathrel{+}= dS_{i,\,0{:}64}\,K_{0{:}64,\,c} + dS_{i,\,64{:}128}\,K_{64{:}128,\,c}$$
#
# with group 0 taking the columns $c$ = 0–63 and group 1 the columns 64–127 at $d = 128$;
# at $d = 64$ the groups take alternate query tiles whole. A group's part is a 64 × 64 fp32
# tile, 32 registers a thread; with $dK$ and $dV$ (128) it fits where a whole 64 × 128
# tile spilled.
#
# **The schedule.** A group cannot multiply by the other's $dS^\top$ before the other has
# made it, and in ping-pong the other is half a turn behind. So each group adds visit
# $j - 1$'s $dQ$ in visit $j$, after its own $dV$ and $dK$ products: by then both tiles of
# $dS^\top$ for $j - 1$ are long written. Two $dS^\top$ buffers (by visit parity) and two
# barriers keep the groups in step: *ready* (both groups have stored their tile) and *free*
# (both have finished reading it, so it may be written for visit $j + 1$). The last visit's
# part runs after the loop.

# %% tags=["export"]
# The copy engine's bulk add: Triton 3.9's Gluon names it `tma.async_atomic_add`; 3.6's
# builds the operation but has no Python wrapper for it yet. The barrier over a group's
# threads: `gl.barrier` in 3.9, `gl.thread_barrier` in 3.6.
_tma_reduce_add = getattr(tma, "async_atomic_add", None)
_group_barrier = getattr(gl, "barrier", None) or getattr(gl, "thread_barrier", None)
if _tma_reduce_add is None:
    try:
        from triton._C.libtriton import ir
        from triton.experimental.gluon.language._core import builtin

        @builtin
        def _tma_reduce_add(desc, coord, src, _semantic=None):
            """Add shared-memory block `src` into `desc`'s block at `coord` (fp32 adds in L2;
            completion as a store's, `tma.store_wait`)."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                                      desc.handle, coord, src.handle)
    except ImportError:  # pragma: no cover - a Triton without Gluon
        _tma_reduce_add = gl


@gluon.jit
def _share_ds(dst, ds_tiles, ds_ready, ds_free, visit, GROUP: gl.constexpr):
    """Store this group's dSᵀ tile of `visit` where the other group's dQ part reads it,
    once both groups have read that buffer's last tile."""
    buffer = visit % 2
    mbarrier.wait(ds_free.index(buffer), ((visit // 2) & 1) ^ 1)
    ds_tiles.index(2 * buffer + GROUP).store(dst)
    fence_async_shared()
    _group_barrier()  # every thread's part is stored before the group says so
    mbarrier.arrive(ds_ready.index(buffer), count=1)


@gluon.jit
def _dq_part(ds_tiles, k_2d, dq_tiles, ds_ready, ds_free, dq_desc, visit, kv_head,
             group_size, first_block, n_blocks, batch, GROUP: gl.constexpr,
             num_warps: gl.constexpr):
    """This group's part of visit `visit`'s dQ = dS K over the program's 128 keys, added
    into the fp32 sum: at d = 128 the 64 columns from 64·GROUP, at d = 64 all of them on
    the group's alternate visits."""
    COLS: gl.constexpr = dq_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = dq_desc.block_type.shape[2]
    PARTS: gl.constexpr = k_2d.shape[2] // COLS
    buffer = visit % 2
    mbarrier.wait(ds_ready.index(buffer), (visit // 2) & 1)
    if PARTS == 2 or visit % 2 == GROUP:
        col: gl.constexpr = GROUP * COLS if PARTS == 2 else 0
        dq = gl.zeros([BLOCK_M, COLS], gl.float32, mma_layout(COLS, num_warps))
        for g in gl.static_range(2):
            dq = warpgroup_mma(ds_tiles.index(2 * buffer + g).permute((1, 0)),
                               k_2d.index(g).slice(col, COLS, 1), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        _group_barrier()  # every warp's products have read both tiles
        mbarrier.arrive(ds_free.index(buffer), count=1)
        head, start_m = _query_visit(visit, kv_head, group_size, first_block, n_blocks,
                                     BLOCK_M)
        stage = _as_matrices(dq_tiles, dq_desc).index(GROUP)
        # The group's last addition has left the staging tile: one thread issued it and
        # waits for it, the others wait for that thread.
        tma.store_wait(0)
        _group_barrier()
        stage.store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [batch, head, start_m, col], dq_tiles.index(GROUP))
    else:
        mbarrier.arrive(ds_free.index(buffer), count=1)


# %% [markdown]
# A dK/dV compute group. It loads a query tile's $\mathrm{LSE}$ before its exponentials
# and $\Delta$ only after them, so that the two rows of statistics and the probabilities
# in fp32 are not live at once (at $d = 128$ this took the spills of the causal tile from
# 152 to 64 bytes a thread). With `FUSED_DQ` it shares each $dS^\top$ tile and adds the
# previous visit's part of $dQ$ after its $dV$ and $dK$ products. At the end its $K$ and
# $V$ tiles, read by no product any more, stage the gradients for the copy engine, viewed
# in the gradients' type.

# %% tags=["export"]
@gluon.jit
def _dkdv_compute_partition(k_tiles, v_tiles, k_2d, v_2d, q_ring, do_ring, kv_ready, q_ready,
                            do_ready, slot_free, turns, dk_desc, dv_desc, lse_ptr, delta_ptr,
                            factors_ptr, batch, kv_head, k_start, group_size, first_block,
                            n_blocks, n_heads, n_q, qk_scale, scale, ds_tiles, dq_tiles,
                            ds_ready, ds_free, dq_desc, GROUP: gl.constexpr,
                            STAGES: gl.constexpr, CAUSAL: gl.constexpr, CARRY: gl.constexpr,
                            FUSED_DQ: gl.constexpr, num_warps: gl.constexpr):
    """One group of 64 keys: per visit a turn for Sᵀ and dPᵀ, the probabilities and dSᵀ,
    a turn for dV and dK (and with FUSED_DQ the last visit's part of dQ); then s·dK and
    dV."""
    GROUP_N: gl.constexpr = dk_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = dk_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = q_ring.shape[1]
    dtype: gl.constexpr = q_ring.dtype
    st_layout: gl.constexpr = mma_layout(BLOCK_M, num_warps)
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM, num_warps)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    query_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    k_smem = k_2d.index(GROUP)
    v_smem = v_2d.index(GROUP)
    first_key = k_start + GROUP * GROUP_N
    n_visits = group_size * n_blocks

    dk = gl.zeros([GROUP_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([GROUP_N, HEAD_DIM], gl.float32, acc_layout)
    st_zero = gl.zeros([GROUP_N, BLOCK_M], gl.float32, st_layout)
    mbarrier.wait(kv_ready, 0)
    turn = 0
    for j in range(n_visits):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        head, start_m = _query_visit(j, kv_head, group_size, first_block, n_blocks, BLOCK_M)
        q_smem = q_ring.index(slot)
        do_smem = do_ring.index(slot)
        mbarrier.wait(q_ready.index(slot), phase)
        mbarrier.wait(do_ready.index(slot), phase)
        # The visit's LSE and Delta, one query a thread (two loads, not 2 x 16 in the
        # products' layout), issued before the products; the carried factors read and applied
        # per visit rather than held across the loop.
        head_rows = (batch * n_heads + head).to(gl.int64) * n_q
        lse_rows, delta_rows = _load_row_statistics(
            lse_ptr + head_rows, delta_ptr + head_rows,
            start_m + gl.arange(0, BLOCK_M, row_layout), n_q)
        st_scale, delta_factor, p_exponent = _carried_units(factors_ptr, qk_scale, CARRY)
        lse_rows, delta_rows = _row_statistics_in_units(lse_rows, delta_rows, delta_factor,
                                                        p_exponent)
        turn = _take_turn(turns, turn, GROUP, True)
        st = warpgroup_mma(k_smem, q_smem.permute((1, 0)), st_zero, use_acc=False,
                           is_async=True)
        dpt = warpgroup_mma(v_smem, do_smem.permute((1, 0)), st_zero, use_acc=False,
                            is_async=True)
        _pass_turn(turns, GROUP, True)
        st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
        lse = gl.convert_layout(lse_rows, query_layout)
        st = _causal_transposed(st, first_key, start_m, CAUSAL)
        pt = gl.exp2(st * st_scale - gl.expand_dims(lse, 0))
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        delta = gl.convert_layout(delta_rows, query_layout)
        dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        if FUSED_DQ:
            _share_ds(dst, ds_tiles, ds_ready, ds_free, j, GROUP)
        dst_op = gl.convert_layout(dst, op_layout)
        turn = _take_turn(turns, turn, GROUP, True)
        dv = warpgroup_mma(pt_op, do_smem, dv, is_async=True)
        dk = warpgroup_mma(dst_op, q_smem, dk, is_async=True)
        _pass_turn(turns, GROUP, True)
        dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
        mbarrier.arrive(slot_free.index(slot), count=1)
        if FUSED_DQ and j > 0:
            _dq_part(ds_tiles, k_2d, dq_tiles, ds_ready, ds_free, dq_desc, j - 1, kv_head,
                     group_size, first_block, n_blocks, batch, GROUP, num_warps)
    if FUSED_DQ:
        if n_visits > 0:
            last = n_visits - 1
            _dq_part(ds_tiles, k_2d, dq_tiles, ds_ready, ds_free, dq_desc, last, kv_head,
                     group_size, first_block, n_blocks, batch, GROUP, num_warps)
            # The other group's last part reads this group's K tile, which is about to
            # stage dK: wait until both have read it.
            mbarrier.wait(ds_free.index(last % 2), (last // 2) & 1)
        tma.store_wait(0)

    # Every product is done: the K and V tiles, viewed in the gradients' type, carry them out.
    dk = dk * (scale * _carried(factors_ptr, 3, CARRY, 1.0))
    dv = dv * _carried(factors_ptr, 4, CARRY, 1.0)
    _store_rows(dk_desc, _as_matrices(k_tiles, dk_desc).index(GROUP),
                _as_blocks(k_tiles, dk_desc).index(GROUP), dk.to(dk_desc.dtype), batch,
                kv_head, first_key)
    _store_rows(dv_desc, _as_matrices(v_tiles, dv_desc).index(GROUP),
                _as_blocks(v_tiles, dv_desc).index(GROUP), dv.to(dv_desc.dtype), batch,
                kv_head, first_key)


# %% [markdown]
# `_as_blocks` views a stack of shared-memory blocks in another 16-bit type: the bytes and
# the swizzle (which depends on the element's width alone) stay, so fp16 operands' tiles
# can stage bf16 gradients. Triton 3.6 names the view `_reinterpret`, later releases
# `reinterpret`, as chapter 11's `_as_matrices` notes.

# %% tags=["export"]
if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # Triton 3.7 and newer

    @gluon.jit
    def _as_blocks(buffers, desc):
        """A stack of blocks viewed as blocks of `desc` (16-bit types alike)."""
        return buffers.reinterpret(desc.dtype, buffers.shape, desc.layout)

else:  # Triton 3.6

    @gluon.jit
    def _as_blocks(buffers, desc):
        """A stack of blocks viewed as blocks of `desc` (16-bit types alike)."""
        return buffers._reinterpret(desc.dtype, buffers.shape, desc.layout)


# %% [markdown]
# The dK/dV kernel: the program's keys, its first query tile (causal: the tile holding its
# first key, since query $i$ sees keys $j \le i$), the $dS^\top$ buffers, staging tiles and
# barriers when it sums $dQ$ too, and the warps' three partitions. Under the causal mask a
# key tile sees fewer queries the later it sits, the mirror of chapter 2's query tiles, so
# the programs take chapter 2's grouped order (`query_program`) with the tiles reversed:
# in groups of key/value heads whose queries and output gradients fit the group's bytes,
# the first key tiles (the longest) first, the group's heads side by side.

# %% tags=["export"]
@gluon.jit
def _key_program(CAUSAL: gl.constexpr, HEAD_GROUP: gl.constexpr):
    """This dK/dV program's key tile and batch x key/value head: the grid's own order, or
    under a causal mask chapter 2's grouped order with the tiles reversed (longest first)."""
    tile, bh = query_program(CAUSAL, HEAD_GROUP)
    if CAUSAL:
        tile = gl.num_programs(0) - 1 - tile
    return tile, bh


def key_head_group(is_causal: bool, q: torch.Tensor, grad_out: torch.Tensor,
                   group_size: int) -> int:
    """Key/value heads per group of the dK/dV kernel's causal order: as many as keep the
    queries and output gradients their programs stream (`group_size` query heads each)
    within `head_group`'s bytes."""
    return max(1, head_group(is_causal, q, grad_out) // group_size)


@gluon.jit
def warp_specialized_dkdv_kernel(k_desc, v_desc, q_desc, do_desc, dk_desc, dv_desc, dq_desc,
                                 lse_ptr, delta_ptr, factors_ptr, n_kv_heads, n_q, group_size,
                                 qk_scale, scale, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                 CARRY: gl.constexpr, FUSED_DQ: gl.constexpr,
                                 HEAD_GROUP: gl.constexpr, num_warps: gl.constexpr):
    """Grid (cdiv(Nk, 128), B·Hkv): 128 keys of one key/value head per program, 64 per
    compute group, summed over the query heads of its GQA group; with FUSED_DQ each query
    tile's dQ over those keys is added into `dq_desc`'s fp32 sum. Causal programs go in
    groups of HEAD_GROUP key/value heads, the key tiles with the most queries first."""
    GROUP_N: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    tile, bh = _key_program(CAUSAL, HEAD_GROUP)
    k_start = tile * 2 * GROUP_N
    batch = bh // n_kv_heads
    kv_head = bh % n_kv_heads
    first_block = 0
    if CAUSAL:
        first_block = k_start // BLOCK_M
    n_blocks = gl.cdiv(n_q, BLOCK_M) - first_block
    k_tiles, v_tiles = _blocks(k_desc, 2), _blocks(v_desc, 2)
    q_ring, do_ring = _blocks(q_desc, STAGES), _blocks(do_desc, STAGES)
    kv_ready, q_ready, do_ready, slot_free, turns = _ring_barriers(STAGES, 2)
    if FUSED_DQ:  # dSᵀ: 2 visits x 2 groups; dQ's staging: one per group
        ds_tiles = gl.allocate_shared_memory(
            q_desc.dtype, [4, GROUP_N, BLOCK_M],
            gl.NVMMASharedLayout.get_default_for([GROUP_N, BLOCK_M], q_desc.dtype))
        dq_tiles = _blocks(dq_desc, 2)
        ds_ready, ds_free = _barrier(2, 2), _barrier(2, 2)
    else:  # unused
        ds_tiles, dq_tiles, ds_ready, ds_free = k_tiles, k_tiles, turns, turns
    k_2d, v_2d = _as_matrices(k_tiles, k_desc), _as_matrices(v_tiles, v_desc)
    q_2d, do_2d = _as_matrices(q_ring, q_desc), _as_matrices(do_ring, do_desc)
    n_heads = n_kv_heads * group_size
    gl.warp_specialize([
        (_dkdv_compute_partition, (k_tiles, v_tiles, k_2d, v_2d, q_2d, do_2d, kv_ready,
                                   q_ready, do_ready, slot_free, turns, dk_desc, dv_desc,
                                   lse_ptr, delta_ptr, factors_ptr, batch, kv_head, k_start,
                                   group_size, first_block, n_blocks, n_heads, n_q, qk_scale,
                                   scale, ds_tiles, dq_tiles, ds_ready, ds_free, dq_desc, 0,
                                   STAGES, CAUSAL, CARRY, FUSED_DQ, num_warps)),
        (_dkdv_compute_partition, (k_tiles, v_tiles, k_2d, v_2d, q_2d, do_2d, kv_ready,
                                   q_ready, do_ready, slot_free, turns, dk_desc, dv_desc,
                                   lse_ptr, delta_ptr, factors_ptr, batch, kv_head, k_start,
                                   group_size, first_block, n_blocks, n_heads, n_q, qk_scale,
                                   scale, ds_tiles, dq_tiles, ds_ready, ds_free, dq_desc, 1,
                                   STAGES, CAUSAL, CARRY, FUSED_DQ, num_warps)),
        (_dkdv_load_partition, (k_desc, v_desc, q_desc, do_desc, k_tiles, v_tiles, q_ring,
                                do_ring, kv_ready, q_ready, do_ready, slot_free, batch,
                                kv_head, k_start, group_size, first_block, n_blocks, STAGES)),
    ], [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])


# %% [markdown]
# The dQ kernel is the forward's shape with the backward's products: the loader copies the
# program's $Q$ and $dO$ tiles once (on one barrier), then each key tile's $K$ and $V$,
# from the query head's key/value head; causal programs run longest first, as chapter 11's
# (`_program_tile`), and scores of keys past the end or after their query are masked as
# there (`_masked`).

# %% tags=["export"]
@gluon.jit
def _stream_key_tiles(k_desc, tk_desc, v_desc, tv_desc, k_ring, tk_ring, v_ring, tv_ring,
                      k_ready, v_ready, slot_free, batch, kv_head, n_blocks,
                      STAGES: gl.constexpr, TANGENT: gl.constexpr):
    """Each key tile's K (and with TANGENT tK) on one barrier and V (and tV) on another,
    into the next ring slot as soon as both compute groups have freed it."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(slot_free.index(slot), ((j // STAGES) & 1) ^ 1)
        _load_with_tangent(k_desc, tk_desc, batch, kv_head, j * BLOCK_N, k_ready.index(slot),
                           k_ring.index(slot), tk_ring.index(slot), TANGENT)
        _load_with_tangent(v_desc, tv_desc, batch, kv_head, j * BLOCK_N, v_ready.index(slot),
                           v_ring.index(slot), tv_ring.index(slot), TANGENT)


@gluon.jit
def _dq_load_partition(q_desc, do_desc, k_desc, v_desc, q_tiles, do_tiles, k_ring, v_ring,
                       q_ready, k_ready, v_ready, slot_free, batch, head, kv_head, q_start,
                       n_blocks, STAGES: gl.constexpr):
    """One warp: both groups' Q and dO tiles once, then each key tile's K and V into the
    ring."""
    _load_group_tiles(q_desc, do_desc, q_tiles, do_tiles, q_ready, batch, head, q_start)
    _stream_key_tiles(k_desc, k_desc, v_desc, v_desc, k_ring, k_ring, v_ring, v_ring, k_ready,
                      v_ready, slot_free, batch, kv_head, n_blocks, STAGES, False)


@gluon.jit
def _dq_compute_partition(q_tiles, q_2d, do_2d, k_ring, v_ring, q_ready, k_ready, v_ready,
                          slot_free, turns, dq_desc, lse_ptr, delta_ptr, factors_ptr, batch,
                          head, q_start, n_q, n_k, n_blocks, qk_scale, scale,
                          GROUP: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                          CARRY: gl.constexpr, num_warps: gl.constexpr):
    """One group of 64 queries: per key tile a turn for S and dP, then dS, a turn for
    dQ += dS K; then s·dQ."""
    GROUP_M: gl.constexpr = dq_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = dq_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_ring.shape[1]
    dtype: gl.constexpr = q_2d.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N, num_warps)
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM, num_warps)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    qk_scale, delta_factor, p_exponent = _carried_units(factors_ptr, qk_scale, CARRY)
    q_smem = q_2d.index(GROUP)
    do_smem = do_2d.index(GROUP)
    first_row = q_start + GROUP * GROUP_M
    rows = first_row + gl.arange(0, GROUP_M, gl.SliceLayout(1, s_layout))
    head_rows = gl.program_id(1).to(gl.int64) * n_q
    lse, delta = _row_statistics(lse_ptr + head_rows, delta_ptr + head_rows, rows, n_q,
                                 delta_factor, p_exponent)

    dq = gl.zeros([GROUP_M, HEAD_DIM], gl.float32, acc_layout)
    s_zero = gl.zeros([GROUP_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_ready, 0)
    turn = 0
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.wait(v_ready.index(slot), phase)
        turn = _take_turn(turns, turn, GROUP, True)
        s = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        dp = warpgroup_mma(do_smem, v_ring.index(slot).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        _pass_turn(turns, GROUP, True)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        s = _masked(s, j * BLOCK_N, first_row, n_k, CAUSAL)
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 1))
        ds_op = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), op_layout)
        turn = _take_turn(turns, turn, GROUP, True)
        dq = warpgroup_mma(ds_op, k_ring.index(slot), dq, is_async=True)
        _pass_turn(turns, GROUP, True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
        mbarrier.arrive(slot_free.index(slot), count=1)

    dq = dq * (scale * _carried(factors_ptr, 2, CARRY, 1.0))
    _store_rows(dq_desc, _as_matrices(q_tiles, dq_desc).index(GROUP),
                _as_blocks(q_tiles, dq_desc).index(GROUP), dq.to(dq_desc.dtype), batch, head,
                first_row)


@gluon.jit
def warp_specialized_dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr,
                               factors_ptr, n_heads, n_q, n_k, group_size, qk_scale, scale,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                               CARRY: gl.constexpr, num_warps: gl.constexpr):
    """Grid (cdiv(Nq, 128), B·Hq): 128 queries of one head per program, 64 per group."""
    GROUP_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    # Causal: each head's tiles last first, head after head (groups of one head).
    q_start, _, batch, head, n_blocks = _program_tile(n_heads, n_k, 2 * GROUP_M, BLOCK_N,
                                                      CAUSAL, 1)
    q_tiles, do_tiles = _blocks(q_desc, 2), _blocks(do_desc, 2)
    k_ring, v_ring = _blocks(k_desc, STAGES), _blocks(v_desc, STAGES)
    q_ready, k_ready, v_ready, slot_free, turns = _ring_barriers(STAGES, 2)
    q_2d, do_2d = _as_matrices(q_tiles, q_desc), _as_matrices(do_tiles, do_desc)
    k_2d, v_2d = _as_matrices(k_ring, k_desc), _as_matrices(v_ring, v_desc)
    kv_head = head // group_size
    gl.warp_specialize([
        (_dq_compute_partition, (q_tiles, q_2d, do_2d, k_2d, v_2d, q_ready, k_ready, v_ready,
                                 slot_free, turns, dq_desc, lse_ptr, delta_ptr, factors_ptr,
                                 batch, head, q_start, n_q, n_k, n_blocks, qk_scale, scale, 0,
                                 STAGES, CAUSAL, CARRY, num_warps)),
        (_dq_compute_partition, (q_tiles, q_2d, do_2d, k_2d, v_2d, q_ready, k_ready, v_ready,
                                 slot_free, turns, dq_desc, lse_ptr, delta_ptr, factors_ptr,
                                 batch, head, q_start, n_q, n_k, n_blocks, qk_scale, scale, 1,
                                 STAGES, CAUSAL, CARRY, num_warps)),
        (_dq_load_partition, (q_desc, do_desc, k_desc, v_desc, q_tiles, do_tiles, k_ring,
                              v_ring, q_ready, k_ready, v_ready, slot_free, batch, head,
                              kv_head, q_start, n_blocks, STAGES)),
    ], [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])


# %% [markdown]
# ## Launching it
#
# One descriptor per tensor, as in chapter 11; the carried factors, when "accurate"
# carries, are a pointer the kernels read (without the carry they read nothing, and the
# LSE stands in). The split kernels' tiles come from the register budget and the timings
# below: 64-query tiles in two ring slots for dK/dV, 128-key tiles in two slots for dQ. At
# $d = 64$ without the causal mask the split dK/dV kernel streams 128-query tiles (unused
# by the library since $d = 64$ sums dQ, kept for the split): they spilled a few hundred
# bytes a thread (none since the change in "What it costs" below), and still took 2.40
# against 2.61 ms at (4, 32, 4096, 64) on the H200
# ("fast", the kernel alone); with the mask they spill more and took 2.71 against 1.41
# ms, so causal calls keep 64 rows.
# A third ring slot changed neither kernel by more than 2%.
# The dK/dV kernel sums $dQ$ as well (`fuses_dq`), and then takes 64-query tiles at every
# head dim (the 128-query tile at $d = 64$ spills 708 bytes a thread with the sum); the
# launcher zeroes the fp32
# sum first and scales it into `dq` after, two memory-bound passes (about 0.05 ms at
# (4, 16, 4096, 128)).
# Chapter 5's launcher asks `warp_specialized_backward_kernels` which of its two kernels
# to replace: calls without a mask or tangent, on an sm_90 GPU, with $D = D_v \in \{64,
# 128\}$, at least 4096 queries and keys and the primal forward's minimum of work
# (`WARP_SPECIALIZED_MIN_WORK`), in "fast" precision on tensors the copy engine can
# address, or in "accurate" precision where bf16 carries. dQ only at $d = 128$: at
# $d = 64$ chapter 5's dQ kernel was faster on the H200 (1.33 against 1.59 ms at
# (4, 32, 4096, 64)). If this Triton cannot compile a kernel, chapter 5's runs (warned once);
# if it cannot compile only the dK/dV kernel that sums dQ, the split kernels run (warned
# once too), since that form leans on the newest of Gluon's operations: Triton 3.6 builds
# the copy engine's add without a Python name for it, and 3.9 named it `async_atomic_add`.

# %% tags=["export"]
DKDV_QUERY_ROWS = 64  # query rows per streamed tile: 128 spill at d = 128
DKDV_WIDE_QUERY_ROWS = 128  # at d = 64 without the mask: 7% faster though it spills a little
DKDV_STAGES = 2  # ring slots of Q and dO: 2 x 32 KB at d = 128, with 64 KB of K and V
DQ_KEY_BLOCK = 128  # keys per streamed tile
DQ_STAGES = 2  # ring slots of K and V: 2 x 64 KB at d = 128, with 64 KB of Q and dO
DQ_HEAD_DIMS = (128,)  # at d = 64 chapter 5's dQ kernel is faster
DQ_SUM_COLS = 64  # columns of a dQ part the dK/dV kernel adds: 32 fp32 registers a thread
DQ_SUM_BLOCK = 1024  # elements per program of the pass that scales and rounds the sum

_failed = False  # set when this Triton cannot compile a kernel: chapter 5's run instead
_summing_failed = False  # set when it cannot compile the summing form: the split run


def fits_warp_specialized_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   grad_out: torch.Tensor, exact: bool) -> tuple[bool, bool]:
    """Which of the unmasked first-order backward's kernels, (dQ, dK/dV), suit (B, H, N, D)
    q, k, v and grad_out, wherever they live: fp16 or bf16 alike, D = Dv in (64, 128) (dQ:
    DQ_HEAD_DIMS), at least WARP_SPECIALIZED_MIN_KEYS queries and keys and
    WARP_SPECIALIZED_MIN_WORK of work, and in "accurate" precision (`exact`) inputs that
    chapter 5 carries (bf16), in "fast" tensors the copy engine can address."""
    batch, n_heads, n_q, d = q.shape
    n_k = k.shape[2]
    fits = (q.dtype in (torch.float16, torch.bfloat16)
            and k.dtype == v.dtype == grad_out.dtype == q.dtype
            and d == v.shape[-1] in (64, 128) and grad_out.shape == q.shape
            and min(n_q, n_k) >= WARP_SPECIALIZED_MIN_KEYS
            and batch * n_heads * n_q * n_k * d >= WARP_SPECIALIZED_MIN_WORK)
    # "accurate" runs on the carried copies, which are contiguous; "fast" on the inputs.
    # Asked only of calls that fit: short rows, the common case, stop at the shapes.
    fits = fits and (carries(q, n_k) if exact
                     else all(_describable(t) for t in (q, k, v, grad_out)))
    return fits and d in DQ_HEAD_DIMS, fits


def warp_specialized_backward_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      grad_out: torch.Tensor,
                                      exact: bool) -> tuple[bool, bool]:
    """Which of the unmasked first-order backward's kernels, (dQ, dK/dV), run this
    chapter's schedule: they fit (`fits_warp_specialized_backward`) and the tensors live on
    an sm_90 GPU, outside the interpreter, with a Triton that compiles the kernels.
    JVP_ATTENTION_WARP_SPECIALIZED=0 turns them off, as chapter 11's."""
    if (not GLUON or _failed or os.environ.get("JVP_ATTENTION_WARP_SPECIALIZED", "1") == "0"
            or not q.is_cuda or interpreting()):
        return False, False
    dq, dkdv = fits_warp_specialized_backward(q, k, v, grad_out, exact)
    if not (dkdv and _hopper(q.device.index)):
        return False, False
    return dq, dkdv


def fuses_dq(head_dim: int, is_causal: bool, carried: bool) -> bool:
    """Whether the dK/dV kernel also sums dQ (no dQ kernel runs): everywhere, once its
    row statistics load one query a thread (causal d = 128 on the carried operands spilled
    276 bytes a thread before, and took the two kernels); nowhere once this Triton has
    failed to compile the summing form."""
    return not _summing_failed


def dkdv_query_rows(head_dim: int, is_causal: bool) -> int:
    """Query rows per streamed dK/dV tile: DKDV_WIDE_QUERY_ROWS at d = 64 without the
    causal mask (whose 128-row tile spills enough to take twice as long), else
    DKDV_QUERY_ROWS."""
    return DKDV_WIDE_QUERY_ROWS if head_dim == 64 and not is_causal else DKDV_QUERY_ROWS


@triton.jit
def _scaled_sum_kernel(total_ptr, out_ptr, factors_ptr, scale, n, CARRY: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out = total · scale (· the carried factor of dQ), rounded to out's type; both
    contiguous, `n` elements."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    factor = scale
    if CARRY:
        factor = scale * tl.load(factors_ptr + 2)
    total = tl.load(total_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, (total * factor).to(out_ptr.dtype.element_ty),
             mask=offsets < n)


def launch_warp_specialized_dkdv(q, k, v, grad_out, lse, delta, factors, dk, dv,
                                 is_causal: bool, scale: float, dq=None, dq_sum=None, *,
                                 query_rows: int | None = None,
                                 stages: int = DKDV_STAGES) -> None:
    """Write dk and dv (contiguous, in the gradients' dtype) from the forward's `lse`
    (natural log) and `delta` = rowsum(dO ∘ O), fp32 (B, Hq, Nq); `factors` are chapter 5's
    carried factors when q, k, v, grad_out are its carried copies, else None. With `dq`
    (contiguous) the kernel sums dQ too, in 64-query tiles, and a last pass scales it into
    `dq`: into `dq_sum` (fp32, contiguous, q's shape) already zeroed, as chapter 5's copy
    kernel leaves it, or else into a sum zeroed here. `query_rows` defaults to
    `dkdv_query_rows`."""
    batch, n_heads, n_q, _ = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    fused = dq is not None
    query_rows = DKDV_QUERY_ROWS if fused else query_rows or dkdv_query_rows(q.shape[-1],
                                                                              is_causal)
    descriptors = [_descriptor(t, rows) for t, rows in (
        (k, GROUP_ROWS), (v, GROUP_ROWS), (q, query_rows), (grad_out, query_rows),
        (dk, GROUP_ROWS), (dv, GROUP_ROWS))]
    total = None if not fused else dq_sum if dq_sum is not None else torch.zeros(
        dq.shape, device=dq.device, dtype=torch.float32)
    descriptors.append(_descriptor(total, query_rows, DQ_SUM_COLS) if fused else descriptors[4])
    grid = (triton.cdiv(n_k, 2 * GROUP_ROWS), batch * n_kv_heads)
    cached(warp_specialized_dkdv_kernel)[grid](
        *descriptors, lse, delta, lse if factors is None else factors, n_kv_heads, n_q,
        n_heads // n_kv_heads, scale * math.log2(math.e), scale, STAGES=stages,
        CAUSAL=is_causal, CARRY=factors is not None, FUSED_DQ=fused,
        HEAD_GROUP=key_head_group(is_causal, q, grad_out, n_heads // n_kv_heads), num_warps=4,
        maxnreg=LAUNCH_REGS)
    if fused:
        cached(_scaled_sum_kernel)[(triton.cdiv(dq.numel(), DQ_SUM_BLOCK),)](
            total, dq, lse if factors is None else factors, scale, dq.numel(),
            CARRY=factors is not None, BLOCK=DQ_SUM_BLOCK)


def launch_warp_specialized_dq(q, k, v, grad_out, lse, delta, factors, dq, is_causal: bool,
                               scale: float, *, key_block: int = DQ_KEY_BLOCK,
                               stages: int = DQ_STAGES) -> None:
    """Write dq (contiguous, in the gradient's dtype); arguments as
    `launch_warp_specialized_dkdv`."""
    batch, n_heads, n_q, _ = q.shape
    descriptors = [_descriptor(t, rows) for t, rows in (
        (q, GROUP_ROWS), (k, key_block), (v, key_block), (grad_out, GROUP_ROWS),
        (dq, GROUP_ROWS))]
    grid = (triton.cdiv(n_q, 2 * GROUP_ROWS), batch * n_heads)
    cached(warp_specialized_dq_kernel)[grid](
        *descriptors, lse, delta, lse if factors is None else factors, n_heads, n_q,
        k.shape[2], n_heads // k.shape[1], scale * math.log2(math.e), scale, STAGES=stages,
        CAUSAL=is_causal, CARRY=factors is not None, num_warps=4, maxnreg=LAUNCH_REGS)


def launched(launch, *args, summing: bool = False) -> bool:
    """Run `launch(*args)`; False when this Triton cannot compile its kernel (warned once
    per form, and no later launch asks again): the caller runs chapter 5's kernel instead,
    or for the dK/dV kernel that sums dQ (`summing`) the split kernels."""
    global _failed, _summing_failed
    if _failed or summing and _summing_failed:
        return False
    try:
        launch(*args)
    except triton.CompilationError as error:
        form, instead = (("summing dK/dV kernel", "the split kernels") if summing
                         else ("backward", "chapter 5's kernels"))
        _summing_failed = True
        _failed = _failed or not summing
        warnings.warn(f"jvp_attention: the warp-specialised {form} does not compile with "
                      f"Triton {triton.__version__} ({type(error).__name__}); {instead} run "
                      f"instead", RuntimeWarning, stacklevel=2)
        return False
    return True


# %% [markdown]
# ## What it costs: registers and shared memory
#
# Compiled for sm_90 with Triton 3.6 on a CPU machine (`python
# benchmarks/warp_specialized_backward.py --resources`), in both precisions the library
# runs and causal or not. Every tile fits but two: the summing tile at $d = 128$, causal
# on the carried operands, spills 40 bytes a thread, three values stored before its main
# loop and read back after it (the SASS has no local loads or stores inside the loop), and
# the unused 128-row split tile at $d = 64$ spills 316 bytes with the causal mask.
#
# It took one change to get there. The loads of a visit's LSE and $\Delta$ were made in
# the products' layout, where each thread holds 16 queries' entries: 32 masked loads with
# their own addresses and predicates, which the compiler hoisted above the exponentials
# while $dK$, $dV$, $S^\top$ and $dP^\top$ already held 192 registers. Now they are two loads,
# one query a thread, issued before the visit's products and moved into the products'
# layout after them (`gl.convert_layout`, through shared memory); the carried factors are
# read each visit and applied to those 64 values, not held across the loop, and the causal
# mask compares offsets within the tile. The arithmetic is the same operations on the
# same values, so the gradients are bitwise those of before. Before it, the $d = 128$
# summing tile spilled 144 bytes carried, 196 causal and 276 causal and carried, and that
# last form ran the two split kernels instead (2.11 against 1.78 ms at (4, 16, 4096, 128));
# the 128-row split tile at $d = 64$ spilled 352 bytes (368 carried). Timed through the
# library's backward on the H200 in one process (bf16, best of three, before against
# after): causal $d = 128$ "accurate" 1.957 against 1.848 ms at (4, 16, 4096, 128), the
# split then against the summing kernel now, and 3.514 against 3.195 ms at (2, 16, 8192,
# 128); "fast" 1.770 against 1.649 and 3.252 against 3.042; at $d = 64$ (4, 32, 4096, 64)
# 4.114 against 3.968 ms and causal 2.362 against 2.238. Only $d = 128$ without the mask
# lost, 1.3% to 1.5% (3.158 against 3.206 ms "accurate", 2.969 against 3.008 "fast"): the
# two conversions a visit cost more there than the spills they remove. Every gradient's
# error ratio was the same as before to three digits.

# %% tags=["hide_input"]
resources = json.loads(RESOURCES.read_text())
print(f"{'tile':18} {'causal':>6} {'carry':>6} {'regs':>5} {'spills':>6} {'shared (KB)':>11}"
      f" {'wgmma':>6}")
for row in resources["rows"]:
    print(f"{row['tile']:18} {str(row['causal']):>6} {str(row.get('carry', False)):>6} "
          f"{row['regs']:>5} {row['spills']:>6} {row['shared'] / 1024:>11.1f} {row['wgmma']:>6}")

# %% [markdown]
# ## Same numbers
#
# On an sm_90 GPU the backward is checked here through the library's own call, chapter 5's
# `flash_attention_backward` (which hands the kernels the call), against float64 gradients
# (chapter 1's reference, through autograd) next to PyTorch's math path in the same dtype:
# GQA, a $(B, N, H, D)$ layout, lengths that are not multiples of the tiles, causal rows
# and $N_q \ne N_k$, in both precisions. Elsewhere the cell says so;
# `tests/library/test_hopper_backward.py` runs the same checks on the GPU.

# %%
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import jvp_attention  # noqa: E402
from jvp_attention.backward import flash_attention_backward  # noqa: E402
from jvp_attention.forward import flash_attention_forward  # noqa: E402


def math_gradients(q, k, v, grad_out, is_causal):
    """dq, dk, dv through PyTorch's math path, in the inputs' dtype."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                               enable_gqa=True)
    return torch.autograd.grad(out, (q, k, v), grad_out)


def gradient_errors(q, k, v, grad_out, is_causal, precision):
    """Max errors of the library's dq, dk, dv against float64, over the math path's."""
    forward, (residual, _) = flash_attention_forward(q, k, v, None, is_causal,
                                                     residuals=True, precision=precision)
    ours = flash_attention_backward(q, k, v, forward.out, forward.lse, grad_out, None,
                                    is_causal, out_residual=residual, precision=precision)
    exact = math_gradients(q.double(), k.double(), v.double(), grad_out.double(), is_causal)
    floor = math_gradients(q, k, v, grad_out, is_causal)
    return [(mine.double() - truth).abs().max().item()
            / (low.double() - truth).abs().max().item()
            for mine, low, truth in zip(ours, floor, exact, strict=True)]


def random_heads(batch, heads, n, d, layout, dtype):
    """(B, H, N, D) noise, stored as (B, H, N, D) or as a view of (B, N, H, D)."""
    if layout == "bnhd":
        return torch.randn(batch, n, heads, d, device=DEVICE, dtype=dtype).transpose(1, 2)
    return torch.randn(batch, heads, n, d, device=DEVICE, dtype=dtype)


CASES = [  # (B, Hq, Hkv, Nq, Nk, d, causal, layout)
    (2, 16, 16, 4096, 4096, 128, False, "bhnd"), (2, 16, 4, 4160, 4160, 64, True, "bnhd"),
    (1, 32, 8, 4097, 4097, 128, True, "bnhd"), (2, 16, 2, 5000, 4500, 64, False, "bhnd"),
    (1, 16, 16, 4500, 6000, 128, True, "bhnd"),
]
if HOPPER:
    torch.manual_seed(0)
    for B, HQ, HKV, NQ, NK, D, causal, layout in CASES:
        for dtype, precision in ((torch.bfloat16, "accurate"), (torch.bfloat16, "fast"),
                                 (torch.float16, "fast")):
            q, grad_out = (random_heads(B, HQ, NQ, D, layout, dtype) for _ in range(2))
            k, v = (random_heads(B, HKV, NK, D, layout, dtype) for _ in range(2))
            assert any(warp_specialized_backward_kernels(q, k, v, grad_out,
                                                         precision == "accurate"))
            ratios = gradient_errors(q, k, v, grad_out, causal, precision)
            print(f"({B}, {HQ}/{HKV}, {NQ}x{NK}, {D}) {layout} causal={causal!s:5} "
                  f"{str(dtype)[6:]:8} {precision:8}: dq {ratios[0]:.2f}x, dk {ratios[1]:.2f}x,"
                  f" dv {ratios[2]:.2f}x the math path's error")
            # "accurate" at the math path's error; "fast" rounds each operand once more
            assert max(ratios) < (1.5 if precision == "accurate" else 4.0), ratios
else:
    print("no sm_90 GPU here: the kernels are checked by the GPU tests and the executed "
          "chapter")

# %% [markdown]
# ## Does it pay?
#
# Timed on the H200 (bf16; `python benchmarks/warp_specialized_backward.py`): the whole
# first-order backward as the library runs it (`ours_*`: chapter 5's launcher with these
# kernels; `triton_*`: `JVP_ATTENTION_WARP_SPECIALIZED=0`, chapter 5's kernels alone) in
# both precisions, beside SDPA's cuDNN backend's backward, with FLOPs credited as five
# products, $10BHN^2d$ (half when causal); the chart shows cuDNN's time over each call's.
# The results file's `ws_*` rows time one kernel alone, launched directly with other tiles
# ("fast").

# %% tags=["hide_input"]
import matplotlib.pyplot as plt  # noqa: E402


def plot_against_cudnn(rows, title):
    """A table of each call's time (ms) and a chart of cuDNN's time over it (1: level with
    cuDNN; the dashed line is the 0.8x target) by shape and implementation."""
    ms = {(tuple(row["shape"]), row["causal"], row["impl"]): row["ms"] for row in rows
          if "ms" in row}
    shapes = list(dict.fromkeys((shape, causal) for shape, causal, _ in ms))
    impls = [name for name in dict.fromkeys(impl for _, _, impl in ms) if name != "sdpa_cudnn"]
    print(f"{'(B, H, N, d)':22} {'causal':>6} "
          + " ".join(f"{name[:15]:>15}" for name in [*impls, "sdpa_cudnn"]) + "   (ms)")
    for shape, causal in shapes:
        print(f"{str(shape):22} {str(causal):>6} "
              + " ".join(f"{ms.get((shape, causal, name), float('nan')):>15.2f}"
                         for name in [*impls, "sdpa_cudnn"]))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(impls)
    for i, name in enumerate(impls):
        ax.bar([x + i * width for x in range(len(shapes))],
               [ms[shape, causal, "sdpa_cudnn"] / ms[shape, causal, name]
                for shape, causal in shapes], width, label=name)
    ax.axhline(0.8, color="k", lw=1, ls="--")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))],
                  [f"{shape}\n{'causal' if causal else 'full'}" for shape, causal in shapes],
                  fontsize=7)
    ax.set_ylabel("cuDNN's time / this call's")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=4)
    plt.tight_layout()
    plt.show()


if RESULTS.exists():
    record = json.loads(RESULTS.read_text())
    print(f"command: {record['command']}")
    plot_against_cudnn([row for row in record["rows"] if not row["impl"].startswith("ws_")],
                       "First-order backward on the H200, bf16, against cuDNN's")
else:
    print(f"no saved run at {RESULTS}")

# %% [markdown]
# What the numbers say (H200, bf16; `benchmarks/results/warp_specialized_backward_h200.json`,
# whose rows also hold each kernel's GPU time from the profiler):
#
# * **With the dQ sum, "accurate" clears 0.8x cuDNN at every shape of the run**, $d = 64$
#   and $128$, 4096 to 32768 tokens, causal or not. At $d = 128$: 0.84x at (4, 16, 4096,
#   128) (3.22 ms against cuDNN's 2.72; chapter 5's kernels 3.67), 0.83x at 8192 tokens,
#   0.86x at 16384, 0.85x at 32768; causal 0.81x (1.85 against 1.50 ms), 0.84x, 0.88x,
#   0.89x. At $d = 64$: 0.81x, 0.84x, 0.87x, 0.86x; causal 0.82x, 0.85x, 0.90x, 0.93x.
#   "fast": 0.84x to 0.94x, up to 0.09x above "accurate" at 4096 tokens and within 0.02x
#   of it from 16384. Chapter 5's kernels alone (`triton_*`): 0.65x to 0.78x.
# * **What loading the row statistics one query a thread changed** ("What it costs"
#   above). In the run before it, causal $d = 128$ "accurate" ran the split kernels, at
#   0.76x to 0.79x cuDNN, and $d = 64$ was at or below the line up to 8192 tokens (0.77x
#   to 0.80x). Now causal $d = 128$ runs the summing kernel (1.85 against 2.01 ms at (4, 16,
#   4096, 128), 3.29 against 3.66 at (2, 16, 8192, 128), across the two runs), and at
#   $d = 64$ the kernel on the carried fp16 copies is level with the kernel on the bf16
#   inputs (3.67 against 3.66 ms at (4, 32, 4096, 64)), where it was 4% slower (3.77
#   against 3.63); at $d = 128$ it stays the faster one (2.85 against 2.89). What still
#   separates the precisions is the carried copies' pass, 0.07 ms for the range and 0.19
#   for the copies against 0.05 for "fast"'s row statistics: 8% of the call at (4, 16,
#   4096, 128), 1% at 32768 tokens.
# * **Where the time goes.** At (4, 16, 4096, 128) "accurate": the summing dK/dV kernel
#   2.85 ms, where the split kernels took 1.75 + 1.16 = 2.91 in an earlier run; then 0.26
#   ms for the range pass and the copies, 0.03 to zero the sum, 0.05 to scale it. Five
#   products in 2.85 ms are 0.57 ms a product, more than the split's 0.42: the sum costs
#   the kernel most of the two products it saves. Each visit now ends with a product that
#   waits on its result, a 16 KB store to shared memory and the copy engine's add; the other group's turn
#   hides part of that, not all of it. A first version in which each group added its own 64
#   keys' whole $dQ$ (twice the reduction traffic, a 64 × 128 fp32 part) took 3.34 ms for
#   the kernel alone in "fast", against 3.10 for the split: the traffic through L2's
#   adders, not the products, set its pace, hence one addition per 128 keys.
# * **Errors are chapter 5's**: the summed dQ is the same products in another order, and
#   the check above has every gradient within 1.16x the math path's error in "accurate"
#   and within 2x in "fast", as the split kernels. In the results file's rows (checked up
#   to 4096 tokens) the library's backward has chapter 5's ratios to the digit in both
#   precisions: 1.01x to 1.28x in "accurate", up to 2.21x in "fast" (dv at (4, 32, 4096,
#   64), where cuDNN's is 2.21x too). The first execution of this chapter found a race, fixed before the
#   kernel was taken: a group could stage $dK$ in its $K$ tile while the other group's last
#   $dQ$ part still read that tile, and the last query tile's $dQ$ came out wrong now and
#   then (42x the math path's error at (2, 16/4, 4160, 64) causal fp16). Each group now
#   waits for both last parts before it stages its gradients (`ds_free`), which changes no
#   product.
# * **Tried and left out: $dK$ from the shared $dS^\top$ tile.** The summing kernel stores
#   $dS^\top$ in shared memory anyway, so $dK$'s product can read it there instead of from
#   registers. Compiled, that cuts the carried $d = 128$ tile's spills from 144 to 40 bytes
#   (and leaves the causal forms as they are); timed through the library's backward on the
#   H200 it was 2% faster at $d = 128$ without the mask in "accurate" (3.14 against 3.20
#   ms at (4, 16, 4096, 128), 5.93 against 6.09 at (2, 16, 8192, 128)), level in "fast"
#   and 1% to 2.5% slower at $d = 64$: not worth a second form of the loop.
#
# So the first-order backward reaches 0.8x cuDNN in both precisions at every shape from
# 4096 to 32768 tokens at $d = 64$ and $128$, causal or not: 0.81x to 0.93x in "accurate"
# (closest to the line at 4096 tokens), 0.84x to 0.94x in "fast".
# What remains: the carried copies' pass (a conversion from bf16 tiles to fp16 in shared
# memory, inside the kernel, would remove the copies; in chapter 2's Triton forward, where
# the compute warps convert each tile themselves, it cost as much as the copies), and the end of each visit, whose
# product, store and addition a third partition could take over if the registers allowed
# one. The second-order backward's passes come next.

# %% [markdown]
# ## The backward through the tangent
#
# The backward through both outputs (chapter 6) runs three passes of Triton kernels: $dQ$
# and $dt_Q$, then on the key side $dV$ and $dt_V$, then $dK$ and $dt_K$. At (4, 16, 4096,
# 128), bf16 "accurate", they took 21.5 ms on an H100: 14.7 for the two key-side passes,
# about 260 TFLOP/s for their fourteen products a tile, and 6.0 for the $dQ$ kernel's nine,
# 415. Each pass holds two fp32 accumulators the size of its block; at $d = 128$ the $dK$
# pass's only spill-free Triton tiles take 16 or 32 queries and multiply on Ampere's
# `mma.sync` (chapter 6). This section writes the three passes in this chapter's form: a
# loader warp and two compute groups of 64 rows in ping-pong. On the key side the scores
# are transposed (keys as rows), so that every product takes 64 rows, `wgmma`'s shape,
# whatever the query tile. Per visit the $dK$ pass makes
#
# $$S^\top = K Q^\top,\quad t_S^\top = t_K Q^\top + K t_Q^\top,\quad
# dP_0^\top = V dO^\top + t_V dt_O^\top,\quad G^\top = V dt_O^\top,$$
#
# then per element, in the query's column, $P^\top$, $dP^\top = dP_0^\top + G^\top \circ
# (t_S^\top - \mu) - c \circ t_S^\top$, $dS^\top = P^\top \circ (dP^\top - \Delta_2)$,
# $dt_S^\top = P^\top \circ (G^\top - c)$, and the three accumulating products
#
# $$dK \mathrel{+}= dS^\top Q + dt_S^\top t_Q,\qquad dt_K \mathrel{+}= dt_S^\top Q.$$
#
# The $dQ$ pass is the same with the roles swapped: a group owns 64 queries, streams key
# tiles, makes $S$, $t_S$, $dP_0$, $G$ untransposed and adds $dQ \mathrel{+}= dS\,K +
# dt_S\,t_K$, $dt_Q \mathrel{+}= dt_S\,K$; its row statistics are loaded once. The $dV$
# pass is the lighter one: $S^\top$ and $t_S^\top$ (three products), then
#
# $$dV \mathrel{+}= P^\top dO + t_P^\top dt_O,\qquad dt_V \mathrel{+}= P^\top dt_O,
# \qquad t_P^\top = P^\top \circ (t_S^\top - \mu).$$
#
# **The budget.** Two accumulators of 64 × 128 fp32 take 128 of a compute thread's 240
# registers; the four score-sized tiles of a 32-row visit of the $dK$ or $dQ$ pass (64 × 32
# fp32) take 64 more, and the two operands in 16 bits 16. A 64-row visit would need 128
# for the four tiles: over the budget. So those visits take 32 queries (keys), and shared
# memory holds the program's own four tiles (128 rows, 128 KB at $d = 128$) and a two-slot
# ring of the streamed four (64 KB). The $dV$ pass has two score tiles and takes 64. Compiled
# for sm_90 (Triton 3.6) the 32-row visits still spill at $d = 128$: the $dK$ pass 36 to 108
# bytes a thread, depending on the mask and the carry, $dQ$ 4 to 36, after writing $dP$'s
# tangent terms as $(G - c) \circ (t_S - \mu) - c\mu$, so that $G - c$, which $dt_S$ needs
# too, replaces $G$ and $c\mu$ is a per-query term (the $dK$ pass spilled 84 to 120 bytes
# before). 16-row visits spill at most a word; $d = 64$ nothing. The spills pay: timed on an
# H100 inside the backward at (4, 16, 4096, 128) bf16 "accurate", the $dK$ pass took 5.48
# ms on 32-query visits against 8.90 on 16, $dQ$ 4.27 on 32-key visits against 6.59 on 16,
# $dV$ 2.38 on 64-query visits against 3.42 on 32. At $d = 64$ the $dQ$ pass's 64-key
# visits fit without spills and took 1.86 ms against 2.45 on 32 at (4, 16, 4096, 64); at
# $d = 128$ their ring is over the shared memory (257 KB). "Accurate" carries as chapter 6's
# kernels do: $dQ$'s and $dK$'s two products are in different units, and the accumulator
# steps into the second's units and back (powers of two, exact in fp32) around it.

# %% tags=["export"]
DK_TANGENT_QUERY_ROWS = 32  # queries a visit: four 64 x 32 fp32 score tiles fit the budget
DV_TANGENT_QUERY_ROWS = 64  # two score tiles a visit
TANGENT_PASS_STAGES = 2


def dq_tangent_key_block(head_dim: int) -> int:
    """Keys a visit of the dQ pass: 64 at d = 64, where its four score tiles fit without
    spills; 32 at d = 128, where a 64-key ring is over the shared memory."""
    return 64 if head_dim <= 64 else 32


@gluon.jit
def _key_side_program(n_kv_heads, n_q, GROUP_N: gl.constexpr, BLOCK_M: gl.constexpr,
                      CAUSAL: gl.constexpr):
    """A key-side program's first key, batch, key/value head, first query tile (causal: the
    tile holding its first key) and count of query tiles."""
    k_start = gl.program_id(0) * 2 * GROUP_N
    first_block = 0
    if CAUSAL:
        first_block = k_start // BLOCK_M
    return (k_start, gl.program_id(1) // n_kv_heads, gl.program_id(1) % n_kv_heads,
            first_block, gl.cdiv(n_q, BLOCK_M) - first_block)


@gluon.jit
def _load_program_tiles(a_desc, ta_desc, b_desc, tb_desc, a_tiles, ta_tiles, b_tiles,
                        tb_tiles, barrier, batch, head, start, PAIRS: gl.constexpr):
    """Both groups' tiles of `a_desc` and `ta_desc` (and with PAIRS == 2 of `b_desc` and
    `tb_desc`; all alike in shape), from row `start` on, on one barrier: what a program
    loads once before its ring starts (K, tK, V, tV of the keys; Q, tQ, dO, dtO of the
    queries)."""
    ROWS: gl.constexpr = a_desc.block_type.shape[2]
    mbarrier.expect(barrier, 2 * 2 * PAIRS * a_desc.block_type.nbytes)
    for g in gl.static_range(2):
        row = start + g * ROWS
        tma_load(a_desc, [batch, head, row, 0], barrier, a_tiles.index(g))
        tma_load(ta_desc, [batch, head, row, 0], barrier, ta_tiles.index(g))
        if PAIRS == 2:
            tma_load(b_desc, [batch, head, row, 0], barrier, b_tiles.index(g))
            tma_load(tb_desc, [batch, head, row, 0], barrier, tb_tiles.index(g))


@gluon.jit
def _tangent_load_partition(k_desc, tk_desc, v_desc, tv_desc, q_desc, tq_desc, do_desc,
                            dto_desc, k_tiles, tk_tiles, v_tiles, tv_tiles, q_ring, tq_ring,
                            do_ring, dto_ring, kv_ready, q_ready, do_ready, slot_free, batch,
                            kv_head, k_start, group_size, first_block, n_blocks,
                            STAGES: gl.constexpr, VALUES: gl.constexpr):
    """One warp: the key side's tiles once, then each visit's Q and tQ (one barrier) and
    dO and dtO (another) into the ring, as soon as both groups have freed the slot."""
    _load_program_tiles(k_desc, tk_desc, v_desc, tv_desc, k_tiles, tk_tiles, v_tiles,
                        tv_tiles, kv_ready, batch, kv_head, k_start, 2 if VALUES else 1)
    _stream_query_tiles(q_desc, tq_desc, do_desc, dto_desc, q_ring, tq_ring, do_ring, dto_ring,
                        q_ready, do_ready, slot_free, batch, kv_head, group_size, first_block,
                        n_blocks, STAGES, True)


@gluon.jit
def _scaled_rows(ptr, rows, n_q, factor):
    """A visit's row statistic, one query a thread, times `factor` (0 past the end)."""
    return gl.load(ptr + rows, mask=rows < n_q, other=0.0) * factor


@gluon.jit
def _lse_and_mu(lse_ptr, mu_ptr, factors_ptr, rows, n_q, CARRY: gl.constexpr):
    """A visit's LSE (log2 units, less P's shift; +inf past the end, so that P is 0 there)
    and mu in the carried units (chapter 5's `_load_row_statistics`)."""
    lse = gl.load(lse_ptr + rows, mask=rows < n_q, other=float("inf"))
    return (lse * LOG2E - _carried(factors_ptr, 5, CARRY, 0.0),
            _scaled_rows(mu_ptr, rows, n_q, _carried(factors_ptr, 10, CARRY, 1.0)))


@gluon.jit
def _in_columns(rows, layout: gl.constexpr):
    """Per-query values, one a thread, as a row broadcast over a transposed tile's keys."""
    return gl.expand_dims(gl.convert_layout(rows, layout), 0)


@gluon.jit
def _tangent_scores(k_smem, tk_smem, q_smem, tq_smem, st_zero):
    """Issue Sᵀ = K Qᵀ and tSᵀ = tK Qᵀ + K tQᵀ (asynchronous warpgroup products)."""
    st = warpgroup_mma(k_smem, q_smem.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    tst = warpgroup_mma(tk_smem, q_smem.permute((1, 0)), st_zero, use_acc=False,
                        is_async=True)
    tst = warpgroup_mma(k_smem, tq_smem.permute((1, 0)), tst, is_async=True)
    return st, tst


@gluon.jit
def _probabilities(s, ts, lse, mu, factors_ptr, qk_scale, scale, CARRY: gl.constexpr):
    """P (times its carried shift) and tS - mu in the tangent's carried units, from the
    masked scores, the raw tangent scores and the LSE and mu broadcast over the tile (either
    orientation)."""
    p = gl.exp2(s * (qk_scale * _carried(factors_ptr, 0, CARRY, 1.0)) - lse)
    return p, ts * (scale * _carried(factors_ptr, 9, CARRY, 1.0)) - mu


@gluon.jit
def _score_gradients(p, centred, dp, g, c, c_mu, delta, factors_ptr, CARRY: gl.constexpr):
    """dS and dtS (either orientation, fp32) in their carried units, from P, tS - mu, the raw
    dP0 = dO Vᵀ + dtO tVᵀ and G = dtO Vᵀ, and c, c·mu and Delta_2 broadcast over the tile:
    dP = dP0 + G (tS - mu) - c tS = dP0 + (G - c)(tS - mu) - c mu, so that G - c, which dtS
    needs too, replaces G, and c mu is a per-query term."""
    g = g - c
    dp = dp + g * centred - c_mu
    ds = p * (dp - delta) * _carried(factors_ptr, 12, CARRY, 1.0)
    dts = p * g * _carried(factors_ptr, 13, CARRY, 1.0)
    return ds, dts


@gluon.jit
def _issue_gradient_products(acc, t_acc, ds_op, dts_op, x_smem, tx_smem, factors_ptr,
                             CARRY: gl.constexpr):
    """Issue acc += dS X + dtS tX and t_acc += dtS X (X: Q for the keys, K for the
    queries); "accurate" steps acc into dtS tX's units before that product, and the caller
    steps it back (`_carried` 15) once the products are done."""
    acc = warpgroup_mma(ds_op, x_smem, acc, is_async=True)
    t_acc = warpgroup_mma(dts_op, x_smem, t_acc, is_async=True)
    if CARRY:
        acc = warpgroup_mma_wait(1, deps=(acc,)) * _carried(factors_ptr, 14, CARRY, 1.0)
    acc = warpgroup_mma(dts_op, tx_smem, acc, is_async=True)
    return acc, t_acc


@gluon.jit
def _store_group_gradients(desc, t_desc, tiles, t_tiles, grad, t_grad, batch, head,
                           first_row, GROUP: gl.constexpr):
    """A compute group's two gradients out through its own tiles of the program's operands
    (K and tK, or Q and tQ), which no product reads any more, viewed in the gradients'
    type."""
    _store_rows(desc, _as_matrices(tiles, desc).index(GROUP),
                _as_blocks(tiles, desc).index(GROUP), grad.to(desc.dtype), batch, head,
                first_row)
    _store_rows(t_desc, _as_matrices(t_tiles, t_desc).index(GROUP),
                _as_blocks(t_tiles, t_desc).index(GROUP), t_grad.to(t_desc.dtype), batch,
                head, first_row)


@gluon.jit
def _tangent_compute_partition(k_2d, tk_2d, v_2d, tv_2d, q_2d, tq_2d, do_2d, dto_2d, k_tiles,
                               tk_tiles, kv_ready, q_ready, do_ready, slot_free, turns,
                               out_desc, t_out_desc, lse_ptr, delta_ptr, mu_ptr, c_ptr,
                               factors_ptr, batch, kv_head, k_start, group_size, first_block,
                               n_blocks, n_heads, n_q, qk_scale, scale, GROUP: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                               CARRY: gl.constexpr, KEYS: gl.constexpr,
                               num_warps: gl.constexpr):
    """One group of 64 keys of the dK pass (KEYS: dK, dtK) or the dV pass (dV, dtV): per
    visit a turn for the score-sized products, the elementwise terms, a turn for the
    accumulating products; then the two gradients out."""
    GROUP_N: gl.constexpr = out_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = out_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = q_2d.shape[1]
    dtype: gl.constexpr = q_2d.dtype
    st_layout: gl.constexpr = mma_layout(BLOCK_M, num_warps)
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM, num_warps)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    query_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    k_smem, tk_smem = k_2d.index(GROUP), tk_2d.index(GROUP)
    v_smem, tv_smem = v_2d.index(GROUP), tv_2d.index(GROUP)
    first_key = k_start + GROUP * GROUP_N

    acc = gl.zeros([GROUP_N, HEAD_DIM], gl.float32, acc_layout)
    t_acc = gl.zeros([GROUP_N, HEAD_DIM], gl.float32, acc_layout)
    st_zero = gl.zeros([GROUP_N, BLOCK_M], gl.float32, st_layout)
    mbarrier.wait(kv_ready, 0)
    turn = 0
    for j in range(group_size * n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        head, start_m = _query_visit(j, kv_head, group_size, first_block, n_blocks, BLOCK_M)
        q_smem, tq_smem = q_2d.index(slot), tq_2d.index(slot)
        do_smem, dto_smem = do_2d.index(slot), dto_2d.index(slot)
        head_rows = (batch * n_heads + head).to(gl.int64) * n_q
        rows = start_m + gl.arange(0, BLOCK_M, row_layout)
        lse, mu = _lse_and_mu(lse_ptr + head_rows, mu_ptr + head_rows, factors_ptr, rows,
                              n_q, CARRY)
        mbarrier.wait(q_ready.index(slot), phase)
        if KEYS:  # dK's scores need dO and dtO too
            c = _scaled_rows(c_ptr + head_rows, rows, n_q,
                             _carried(factors_ptr, 11, CARRY, 1.0))
            mbarrier.wait(do_ready.index(slot), phase)
            turn = _take_turn(turns, turn, GROUP, True)
            st, tst = _tangent_scores(k_smem, tk_smem, q_smem, tq_smem, st_zero)
            dpt = warpgroup_mma(v_smem, do_smem.permute((1, 0)), st_zero, use_acc=False,
                                is_async=True)
            dpt = warpgroup_mma(tv_smem, dto_smem.permute((1, 0)), dpt, is_async=True)
            gt = warpgroup_mma(v_smem, dto_smem.permute((1, 0)), st_zero, use_acc=False,
                               is_async=True)
            _pass_turn(turns, GROUP, True)
            st, tst, dpt, gt = warpgroup_mma_wait(0, deps=(st, tst, dpt, gt))
        else:
            turn = _take_turn(turns, turn, GROUP, True)
            st, tst = _tangent_scores(k_smem, tk_smem, q_smem, tq_smem, st_zero)
            _pass_turn(turns, GROUP, True)
            st, tst = warpgroup_mma_wait(0, deps=(st, tst))
        st = _causal_transposed(st, first_key, start_m, CAUSAL)
        pt, tst = _probabilities(st, tst, _in_columns(lse, query_layout),
                                 _in_columns(mu, query_layout), factors_ptr, qk_scale, scale,
                                 CARRY)
        if KEYS:
            delta = _scaled_rows(delta_ptr + head_rows, rows, n_q,
                                 _carried(factors_ptr, 1, CARRY, 1.0))
            dst, dtst = _score_gradients(pt, tst, dpt, gt, _in_columns(c, query_layout),
                                         _in_columns(c * mu, query_layout),
                                         _in_columns(delta, query_layout), factors_ptr, CARRY)
            a_op = gl.convert_layout(dst.to(dtype), op_layout)
            b_op = gl.convert_layout(dtst.to(dtype), op_layout)
            turn = _take_turn(turns, turn, GROUP, True)
            acc, t_acc = _issue_gradient_products(acc, t_acc, a_op, b_op, q_smem, tq_smem,
                                                  factors_ptr, CARRY)
        else:
            a_op = gl.convert_layout(pt.to(dtype), op_layout)  # Pᵀ
            b_op = gl.convert_layout((pt * tst).to(dtype), op_layout)  # tPᵀ
            mbarrier.wait(do_ready.index(slot), phase)
            turn = _take_turn(turns, turn, GROUP, True)
            acc = warpgroup_mma(a_op, do_smem, acc, is_async=True)
            acc = warpgroup_mma(b_op, dto_smem, acc, is_async=True)
            t_acc = warpgroup_mma(a_op, dto_smem, t_acc, is_async=True)
        _pass_turn(turns, GROUP, True)
        acc, t_acc, a_op, b_op = warpgroup_mma_wait(0, deps=(acc, t_acc, a_op, b_op))
        if KEYS and CARRY:
            acc = acc * _carried(factors_ptr, 15, CARRY, 1.0)
        mbarrier.arrive(slot_free.index(slot), count=1)

    if KEYS:
        acc = acc * (scale * _carried(factors_ptr, 3, CARRY, 1.0))
        t_acc = t_acc * (scale * _carried(factors_ptr, 7, CARRY, 1.0))
    else:
        acc = acc * _carried(factors_ptr, 4, CARRY, 1.0)
        t_acc = t_acc * _carried(factors_ptr, 8, CARRY, 1.0)
    _store_group_gradients(out_desc, t_out_desc, k_tiles, tk_tiles, acc, t_acc, batch, kv_head,
                           first_key, GROUP)


@gluon.jit
def warp_specialized_tangent_pass_kernel(
        k_desc, tk_desc, v_desc, tv_desc, q_desc, tq_desc, do_desc, dto_desc, out_desc,
        t_out_desc, lse_ptr, delta_ptr, mu_ptr, c_ptr, factors_ptr, n_kv_heads, n_q,
        group_size, qk_scale, scale, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        CARRY: gl.constexpr, KEYS: gl.constexpr, num_warps: gl.constexpr):
    """Grid (cdiv(Nk, 128), B·Hkv): dK and dtK (KEYS) or dV and dtV of 128 keys of one
    key/value head per program (the backward through the tangent, chapter 6), 64 per
    compute group, summed over the query heads of its GQA group. The dV pass reads neither
    V, tV, Delta_2 nor c (their arguments stand in)."""
    k_start, batch, kv_head, first_block, n_blocks = _key_side_program(
        n_kv_heads, n_q, k_desc.block_type.shape[2], q_desc.block_type.shape[2], CAUSAL)
    k_tiles, tk_tiles = _blocks(k_desc, 2), _blocks(tk_desc, 2)
    if KEYS:
        v_tiles, tv_tiles = _blocks(v_desc, 2), _blocks(tv_desc, 2)
    else:
        v_tiles, tv_tiles = k_tiles, tk_tiles
    q_ring, tq_ring = _blocks(q_desc, STAGES), _blocks(tq_desc, STAGES)
    do_ring, dto_ring = _blocks(do_desc, STAGES), _blocks(dto_desc, STAGES)
    kv_ready, q_ready, do_ready, slot_free, turns = _ring_barriers(STAGES, 2)
    k_2d, tk_2d = _as_matrices(k_tiles, k_desc), _as_matrices(tk_tiles, tk_desc)
    v_2d, tv_2d = _as_matrices(v_tiles, v_desc), _as_matrices(tv_tiles, tv_desc)
    q_2d, tq_2d = _as_matrices(q_ring, q_desc), _as_matrices(tq_ring, tq_desc)
    do_2d, dto_2d = _as_matrices(do_ring, do_desc), _as_matrices(dto_ring, dto_desc)
    n_heads = n_kv_heads * group_size
    gl.warp_specialize([
        (_tangent_compute_partition, (
            k_2d, tk_2d, v_2d, tv_2d, q_2d, tq_2d, do_2d, dto_2d, k_tiles, tk_tiles, kv_ready,
            q_ready, do_ready, slot_free, turns, out_desc, t_out_desc, lse_ptr, delta_ptr,
            mu_ptr, c_ptr, factors_ptr, batch, kv_head, k_start, group_size, first_block,
            n_blocks, n_heads, n_q, qk_scale, scale, 0, STAGES, CAUSAL, CARRY, KEYS,
            num_warps)),
        (_tangent_compute_partition, (
            k_2d, tk_2d, v_2d, tv_2d, q_2d, tq_2d, do_2d, dto_2d, k_tiles, tk_tiles, kv_ready,
            q_ready, do_ready, slot_free, turns, out_desc, t_out_desc, lse_ptr, delta_ptr,
            mu_ptr, c_ptr, factors_ptr, batch, kv_head, k_start, group_size, first_block,
            n_blocks, n_heads, n_q, qk_scale, scale, 1, STAGES, CAUSAL, CARRY, KEYS,
            num_warps)),
        (_tangent_load_partition, (k_desc, tk_desc, v_desc, tv_desc, q_desc, tq_desc, do_desc,
                                   dto_desc, k_tiles, tk_tiles, v_tiles, tv_tiles, q_ring,
                                   tq_ring, do_ring, dto_ring, kv_ready, q_ready, do_ready,
                                   slot_free, batch, kv_head, k_start, group_size,
                                   first_block, n_blocks, STAGES, KEYS)),
    ], [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])


@gluon.jit
def _dq_tangent_load_partition(q_desc, tq_desc, do_desc, dto_desc, k_desc, tk_desc, v_desc,
                               tv_desc, q_tiles, tq_tiles, do_tiles, dto_tiles, k_ring,
                               tk_ring, v_ring, tv_ring, q_ready, k_ready, v_ready, slot_free,
                               batch, head, kv_head, q_start, n_blocks, STAGES: gl.constexpr):
    """One warp: both groups' Q, tQ, dO and dtO once, then each key tile's K and tK, V and
    tV into the ring."""
    _load_program_tiles(q_desc, tq_desc, do_desc, dto_desc, q_tiles, tq_tiles, do_tiles,
                        dto_tiles, q_ready, batch, head, q_start, 2)
    _stream_key_tiles(k_desc, tk_desc, v_desc, tv_desc, k_ring, tk_ring, v_ring, tv_ring,
                      k_ready, v_ready, slot_free, batch, kv_head, n_blocks, STAGES, True)


@gluon.jit
def _dq_tangent_compute_partition(q_2d, tq_2d, do_2d, dto_2d, q_tiles, tq_tiles, k_2d, tk_2d,
                                  v_2d, tv_2d, q_ready, k_ready, v_ready, slot_free, turns,
                                  dq_desc, dtq_desc, lse_ptr, delta_ptr, mu_ptr, c_ptr,
                                  factors_ptr, batch, head, n_heads, q_start, n_q, n_k,
                                  n_blocks, qk_scale, scale, GROUP: gl.constexpr,
                                  STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                  CARRY: gl.constexpr, num_warps: gl.constexpr):
    """One group of 64 queries: its row statistics once; per key tile a turn for S, tS,
    dP0 and G, then dS and dtS, a turn for dQ += dS K + dtS tK and dtQ += dtS K; then s·dQ
    and s·dtQ."""
    GROUP_M: gl.constexpr = dq_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = dq_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_2d.shape[1]
    dtype: gl.constexpr = q_2d.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N, num_warps)
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM, num_warps)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    q_smem, tq_smem = q_2d.index(GROUP), tq_2d.index(GROUP)
    do_smem, dto_smem = do_2d.index(GROUP), dto_2d.index(GROUP)
    first_row = q_start + GROUP * GROUP_M
    rows = first_row + gl.arange(0, GROUP_M, gl.SliceLayout(1, s_layout))
    head_rows = (batch * n_heads + head).to(gl.int64) * n_q
    lse, mu = _lse_and_mu(lse_ptr + head_rows, mu_ptr + head_rows, factors_ptr, rows, n_q,
                          CARRY)
    c = _scaled_rows(c_ptr + head_rows, rows, n_q, _carried(factors_ptr, 11, CARRY, 1.0))
    delta = _scaled_rows(delta_ptr + head_rows, rows, n_q, _carried(factors_ptr, 1, CARRY, 1.0))
    lse, mu, c, c_mu, delta = (gl.expand_dims(lse, 1), gl.expand_dims(mu, 1),
                               gl.expand_dims(c, 1), gl.expand_dims(c * mu, 1),
                               gl.expand_dims(delta, 1))

    acc = gl.zeros([GROUP_M, HEAD_DIM], gl.float32, acc_layout)
    t_acc = gl.zeros([GROUP_M, HEAD_DIM], gl.float32, acc_layout)
    s_zero = gl.zeros([GROUP_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_ready, 0)
    turn = 0
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        k_smem, tk_smem = k_2d.index(slot), tk_2d.index(slot)
        v_smem, tv_smem = v_2d.index(slot), tv_2d.index(slot)
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.wait(v_ready.index(slot), phase)
        turn = _take_turn(turns, turn, GROUP, True)
        s, ts = _tangent_scores(q_smem, tq_smem, k_smem, tk_smem, s_zero)
        dp = warpgroup_mma(do_smem, v_smem.permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
        dp = warpgroup_mma(dto_smem, tv_smem.permute((1, 0)), dp, is_async=True)
        g = warpgroup_mma(dto_smem, v_smem.permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        _pass_turn(turns, GROUP, True)
        s, ts, dp, g = warpgroup_mma_wait(0, deps=(s, ts, dp, g))
        s = _masked(s, j * BLOCK_N, first_row, n_k, CAUSAL)
        p, ts = _probabilities(s, ts, lse, mu, factors_ptr, qk_scale, scale, CARRY)
        ds, dts = _score_gradients(p, ts, dp, g, c, c_mu, delta, factors_ptr, CARRY)
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        dts_op = gl.convert_layout(dts.to(dtype), op_layout)
        turn = _take_turn(turns, turn, GROUP, True)
        acc, t_acc = _issue_gradient_products(acc, t_acc, ds_op, dts_op, k_smem, tk_smem,
                                              factors_ptr, CARRY)
        _pass_turn(turns, GROUP, True)
        acc, t_acc, ds_op, dts_op = warpgroup_mma_wait(0, deps=(acc, t_acc, ds_op, dts_op))
        if CARRY:
            acc = acc * _carried(factors_ptr, 15, CARRY, 1.0)
        mbarrier.arrive(slot_free.index(slot), count=1)

    # The group's Q and tQ tiles, read by no product any more, carry the gradients out.
    _store_group_gradients(dq_desc, dtq_desc, q_tiles, tq_tiles,
                           acc * (scale * _carried(factors_ptr, 2, CARRY, 1.0)),
                           t_acc * (scale * _carried(factors_ptr, 6, CARRY, 1.0)), batch, head,
                           first_row, GROUP)


@gluon.jit
def warp_specialized_dq_tangent_kernel(
        q_desc, tq_desc, do_desc, dto_desc, k_desc, tk_desc, v_desc, tv_desc, dq_desc,
        dtq_desc, lse_ptr, delta_ptr, mu_ptr, c_ptr, factors_ptr, n_heads, n_q, n_k,
        group_size, qk_scale, scale, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        CARRY: gl.constexpr, HEAD_GROUP: gl.constexpr, num_warps: gl.constexpr):
    """Grid (cdiv(Nq, 128), B·Hq): dQ and dtQ of 128 queries of one head per program (the
    backward through the tangent, chapter 6), 64 per compute group, over streamed key
    tiles; causal programs in chapter 11's order (`_program_tile`: groups of HEAD_GROUP
    heads, the longest tiles first), as the forward's, whose keys these are."""
    GROUP_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    q_start, _, batch, head, n_blocks = _program_tile(n_heads, n_k, 2 * GROUP_M, BLOCK_N,
                                                      CAUSAL, HEAD_GROUP)
    q_tiles, tq_tiles = _blocks(q_desc, 2), _blocks(tq_desc, 2)
    do_tiles, dto_tiles = _blocks(do_desc, 2), _blocks(dto_desc, 2)
    k_ring, tk_ring = _blocks(k_desc, STAGES), _blocks(tk_desc, STAGES)
    v_ring, tv_ring = _blocks(v_desc, STAGES), _blocks(tv_desc, STAGES)
    q_ready, k_ready, v_ready, slot_free, turns = _ring_barriers(STAGES, 2)
    q_2d, tq_2d = _as_matrices(q_tiles, q_desc), _as_matrices(tq_tiles, tq_desc)
    do_2d, dto_2d = _as_matrices(do_tiles, do_desc), _as_matrices(dto_tiles, dto_desc)
    k_2d, tk_2d = _as_matrices(k_ring, k_desc), _as_matrices(tk_ring, tk_desc)
    v_2d, tv_2d = _as_matrices(v_ring, v_desc), _as_matrices(tv_ring, tv_desc)
    gl.warp_specialize([
        (_dq_tangent_compute_partition, (
            q_2d, tq_2d, do_2d, dto_2d, q_tiles, tq_tiles, k_2d, tk_2d, v_2d, tv_2d, q_ready,
            k_ready, v_ready, slot_free, turns, dq_desc, dtq_desc, lse_ptr, delta_ptr, mu_ptr,
            c_ptr, factors_ptr, batch, head, n_heads, q_start, n_q, n_k, n_blocks, qk_scale,
            scale, 0, STAGES, CAUSAL, CARRY, num_warps)),
        (_dq_tangent_compute_partition, (
            q_2d, tq_2d, do_2d, dto_2d, q_tiles, tq_tiles, k_2d, tk_2d, v_2d, tv_2d, q_ready,
            k_ready, v_ready, slot_free, turns, dq_desc, dtq_desc, lse_ptr, delta_ptr, mu_ptr,
            c_ptr, factors_ptr, batch, head, n_heads, q_start, n_q, n_k, n_blocks, qk_scale,
            scale, 1, STAGES, CAUSAL, CARRY, num_warps)),
        (_dq_tangent_load_partition, (q_desc, tq_desc, do_desc, dto_desc, k_desc, tk_desc,
                                      v_desc, tv_desc, q_tiles, tq_tiles, do_tiles, dto_tiles,
                                      k_ring, tk_ring, v_ring, tv_ring, q_ready, k_ready,
                                      v_ready, slot_free, batch, head, head // group_size,
                                      q_start, n_blocks, STAGES)),
    ], [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])


def launch_warp_specialized_dq_tangent(q, k, v, tq, tk, tv, grad_out, grad_tangent_out, lse,
                                       delta, mu, c, factors, dq, dtq, is_causal: bool,
                                       scale: float, *,
                                       key_block: int | None = None,
                                       stages: int = TANGENT_PASS_STAGES) -> None:
    """Write dq and dtq (in the gradients' dtype) of the backward through the tangent;
    arguments as `launch_warp_specialized_dk_tangent`, `key_block` keys a visit (default
    `dq_tangent_key_block`)."""
    batch, n_heads, n_q, _ = q.shape
    key_block = key_block or dq_tangent_key_block(q.shape[-1])
    descriptors = ([_descriptor(t, GROUP_ROWS) for t in (q, tq, grad_out, grad_tangent_out)]
                   + [_descriptor(t, key_block) for t in (k, tk, v, tv)]
                   + [_descriptor(t, GROUP_ROWS) for t in (dq, dtq)])
    grid = (triton.cdiv(n_q, 2 * GROUP_ROWS), batch * n_heads)
    cached(warp_specialized_dq_tangent_kernel)[grid](
        *descriptors, lse, delta, mu, c, lse if factors is None else factors, n_heads, n_q,
        k.shape[2], n_heads // k.shape[1], scale * math.log2(math.e), scale, STAGES=stages,
        CAUSAL=is_causal, CARRY=factors is not None,
        HEAD_GROUP=head_group(is_causal, k, v, tk, tv, queries_per_head=n_heads // k.shape[1]),
        num_warps=4, maxnreg=LAUNCH_REGS)


def _tangent_pass_launch(keys: bool, key_side, query_side, outputs, statistics, factors,
                         n_heads: int, n_q: int, is_causal: bool, scale: float,
                         query_rows: int, stages: int) -> None:
    """Launch the dK pass (`keys`) or the dV pass: descriptors of 64 keys over `key_side`
    (K, tK, V, tV) and `outputs`, of `query_rows` queries over `query_side`, then the row
    statistics (LSE, Delta_2, mu, c), the factors (the LSE standing in without them), the
    heads and scales."""
    k = key_side[0]
    batch, n_kv_heads, n_k = k.shape[0], k.shape[1], k.shape[2]
    descriptors = ([_descriptor(t, GROUP_ROWS) for t in key_side]
                   + [_descriptor(t, query_rows) for t in query_side]
                   + [_descriptor(t, GROUP_ROWS) for t in outputs])
    grid = (triton.cdiv(n_k, 2 * GROUP_ROWS), batch * n_kv_heads)
    cached(warp_specialized_tangent_pass_kernel)[grid](
        *descriptors, *statistics, statistics[0] if factors is None else factors, n_kv_heads,
        n_q, n_heads // n_kv_heads, scale * math.log2(math.e), scale, STAGES=stages,
        CAUSAL=is_causal, CARRY=factors is not None, KEYS=keys, num_warps=4,
        maxnreg=LAUNCH_REGS)


def launch_warp_specialized_dk_tangent(q, k, v, tq, tk, tv, grad_out, grad_tangent_out, lse,
                                       delta, mu, c, factors, dk, dtk, is_causal: bool,
                                       scale: float, *,
                                       query_rows: int = DK_TANGENT_QUERY_ROWS,
                                       stages: int = TANGENT_PASS_STAGES) -> None:
    """Write dk and dtk (in the gradients' dtype) of the backward through the tangent from
    the forward's `lse`, `mu` and the row statistics' `delta` (Delta_2) and `c`, fp32
    (B, Hq, Nq); `factors` are chapter 5's carried factors of the second order
    (`second_order_operands`) when the operands are its carried copies, else None."""
    _tangent_pass_launch(True, (k, tk, v, tv),
                         (q, tq, grad_out, grad_tangent_out), (dk, dtk), (lse, delta, mu, c),
                         factors, q.shape[1], q.shape[2], is_causal, scale, query_rows, stages)


def launch_warp_specialized_dv_tangent(q, k, tq, tk, grad_out, grad_tangent_out, lse, mu,
                                       factors, dv, dtv, is_causal: bool, scale: float, *,
                                       query_rows: int = DV_TANGENT_QUERY_ROWS,
                                       stages: int = TANGENT_PASS_STAGES) -> None:
    """Write dv and dtv (in the gradients' dtype) of the backward through the tangent;
    arguments as `launch_warp_specialized_dk_tangent`."""
    _tangent_pass_launch(False, (k, tk, k, tk), (q, tq, grad_out, grad_tangent_out),
                         (dv, dtv), (lse, lse, mu, mu), factors,
                         q.shape[1], q.shape[2], is_causal, scale, query_rows, stages)


# %% [markdown]
# Chapter 5's launcher hands the backward through the tangent's three passes ($dQ$, then
# $dV$ and $dK$) to these kernels where the first-order Hopper kernels would take the call
# (unmasked, D = Dv in (64, 128), long enough rows, the carried copies in "accurate" bf16,
# tensors the copy engine can address in "fast") and the tangents and the tangent's
# cotangent match the primals. `SECOND_ORDER_PASSES` names the passes handed over.

# %% tags=["export"]
SECOND_ORDER_PASSES = frozenset({"dq", "dk", "dv"})


def warp_specialized_tangent_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    tangents: tuple[torch.Tensor, ...],
                                    grad_out: torch.Tensor, grad_tangent_out: torch.Tensor,
                                    exact: bool) -> bool:
    """Whether the backward through the tangent hands its passes (`SECOND_ORDER_PASSES`) to
    this chapter's kernels: the first-order dK/dV kernel would run
    (`warp_specialized_backward_kernels`) and the tangents and dtO are alike to the primals
    and dO (and addressable in "fast")."""
    if not (SECOND_ORDER_PASSES
            and warp_specialized_backward_kernels(q, k, v, grad_out, exact)[1]):
        return False
    alike = all(t.shape == x.shape and t.dtype == x.dtype for t, x in zip(
        (*tangents, grad_tangent_out), (q, k, v, grad_out), strict=True))
    return alike and (exact or all(_describable(t) for t in (*tangents, grad_tangent_out)))


def launched_tangent_pass(name: str, q, k, v, tq, tk, tv, grad_out, grad_tangent_out, lse,
                          delta, mu, c, factors, dq, dk, dv, dtq, dtk, dtv, is_causal: bool,
                          scale: float) -> bool:
    """Run pass `name` ("dq", "dk" or "dv") of the backward through the tangent in this
    chapter's form; False where it is not in `SECOND_ORDER_PASSES`, its gradients cannot
    be stored by the copy engine or this Triton cannot compile it: chapter 6's pass runs
    instead."""
    outputs = {"dq": (dq, dtq), "dk": (dk, dtk), "dv": (dv, dtv)}[name]
    if name not in SECOND_ORDER_PASSES or not all(_describable(t) for t in outputs):
        return False
    if name == "dv":
        return launched(launch_warp_specialized_dv_tangent, q, k, tq, tk, grad_out,
                        grad_tangent_out, lse, mu, factors, dv, dtv, is_causal, scale)
    launch = (launch_warp_specialized_dq_tangent if name == "dq"
              else launch_warp_specialized_dk_tangent)
    return launched(launch, q, k, v, tq, tk, tv, grad_out, grad_tangent_out, lse, delta, mu,
                    c, factors, *outputs, is_causal, scale)

# %% [markdown]
# ### Same numbers, second order
#
# Through the library's call as a user makes it (`torch.func.jvp` of `attention`, then
# `torch.autograd.grad` of both outputs), each of the six gradients against chapter 1's
# float64 reference, over PyTorch's math path's error in the same dtype: GQA, the $(B, N,
# H, D)$ layout, causal rows, lengths that are not multiples of the tiles (each form of the
# three kernels compiles on first use, so the chapter keeps to two cases;
# `tests/library/test_hopper_backward.py` runs more on the GPU).

# %%
from jvp_attention.accuracy import float64_truth, math_path  # noqa: E402

SECOND_ORDER_CASES = [  # (B, Hq, Hkv, N, d, causal, layout), each long enough for the passes
    (1, 16, 4, 4096, 128, True, "bnhd"), (2, 16, 16, 4100, 64, False, "bhnd"),
]
GRADIENTS = ("dq", "dk", "dv", "dtq", "dtk", "dtv")


def second_order_gradients(q, k, v, tangents, grad_out, grad_tangent_out, is_causal):
    """The six gradients of <dO, out> + <dtO, tangent_out> through the library's call."""
    primals = [x.detach().requires_grad_() for x in (q, k, v)]
    tangents = [t.detach().requires_grad_() for t in tangents]
    out, tangent_out = torch.func.jvp(
        lambda *x: jvp_attention.attention(*x, is_causal=is_causal, enable_gqa=True),
        tuple(primals), tuple(tangents))
    return torch.autograd.grad((out, tangent_out), (*primals, *tangents),
                               (grad_out, grad_tangent_out))


def batch_by_batch(reference, q, k, v, tangents, grad_out, grad_tangent_out, is_causal):
    """`reference`'s six gradients, one batch element at a time (the float64 score
    matrices of a whole batch would not fit)."""
    parts = []
    for b in range(q.shape[0]):
        one = [x[b:b + 1] for x in (q, k, v, *tangents, grad_out, grad_tangent_out)]
        result = reference(*one[:3], is_causal=is_causal, enable_gqa=True,
                           tangents=tuple(one[3:6]), grad_out=one[6],
                           grad_tangent_out=one[7])
        parts.append([result[name] for name in GRADIENTS])
    return [torch.cat(grads) for grads in zip(*parts, strict=True)]


def second_order_errors(q, k, v, tangents, grad_out, grad_tangent_out, is_causal, precision):
    """Each gradient's max error against float64 over the math path's."""
    inputs = (q, k, v, tangents, grad_out, grad_tangent_out, is_causal)
    with jvp_attention.precision(precision):
        ours = second_order_gradients(*inputs)
    exact = batch_by_batch(float64_truth, *inputs)
    floor = batch_by_batch(math_path, *inputs)
    return [(mine.double() - truth).abs().max().item()
            / (low.double() - truth).abs().max().item()
            for mine, low, truth in zip(ours, floor, exact, strict=True)]


if HOPPER:
    torch.manual_seed(0)
    for B, HQ, HKV, N, D, causal, layout in SECOND_ORDER_CASES:
        for dtype, precision in ((torch.bfloat16, "accurate"), (torch.bfloat16, "fast"),
                                 (torch.float16, "fast")):
            q, tq, grad_out, grad_tangent_out = (random_heads(B, HQ, N, D, layout, dtype)
                                                 for _ in range(4))
            k, v, tk, tv = (random_heads(B, HKV, N, D, layout, dtype) for _ in range(4))
            assert warp_specialized_tangent_passes(q, k, v, (tq, tk, tv), grad_out,
                                                   grad_tangent_out, precision == "accurate")
            ratios = second_order_errors(q, k, v, (tq, tk, tv), grad_out, grad_tangent_out,
                                         causal, precision)
            print(f"({B}, {HQ}/{HKV}, {N}, {D}) {layout} causal={causal!s:5} "
                  f"{str(dtype)[6:]:8} {precision:8}: "
                  + ", ".join(f"{name} {ratio:.2f}x"
                              for name, ratio in zip(GRADIENTS, ratios, strict=True))
                  + " the math path's error")
            # the test-suite's rule is 2x the math path's error; "fast" rounds more
            assert max(ratios) < (2.0 if precision == "accurate" else 4.0), ratios
else:
    print("no sm_90 GPU here: the passes are checked by the GPU tests and the executed "
          "chapter")

# %% [markdown]
# ### Does it pay, second order?
#
# `python benchmarks/second_order_passes.py` times the backward through both outputs as a
# user calls it, with chapter 6's three passes (`chapter6`), with one pass handed over at
# one tile (`dk:32`: the $dK$ pass on 32-query visits) and with the library's choice
# (`all`), each kernel's GPU time from the profiler; FLOPs credited as fifteen products,
# $30BHN^2d$ (half when causal). The chart shows each variant's rate.

# %% tags=["hide_input"]
# The H200's run where there is one, else the H100's.
PASSES_RESULTS = next((path for gpu in ("h200", "h100") if (path := Path(
    f"../benchmarks/results/second_order_passes_{gpu}.json")).exists()),
    Path("../benchmarks/results/second_order_passes_h200.json"))


def plot_second_order_passes(rows, title):
    """A table of each variant's time (ms) and a chart of its TFLOP/s, by case."""
    cases = list(dict.fromkeys((tuple(row["shape"]), row["causal"], row["precision"])
                               for row in rows))
    variants = list(dict.fromkeys(row["variant"] for row in rows))
    ms = {(tuple(row["shape"]), row["causal"], row["precision"], row["variant"]): row
          for row in rows}
    print(f"{'(B, H, N, d)':20} {'':6} {'':8} " + " ".join(f"{v:>9}" for v in variants)
          + "   (ms)")
    for shape, causal, precision in cases:
        cells = [ms.get((shape, causal, precision, v), {}).get("call_ms") for v in variants]
        print(f"{str(shape):20} {'causal' if causal else 'full':6} {precision:8} "
              + " ".join(f"{c:>9.2f}" if c else f"{'-':>9}" for c in cells))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        ax.bar([x + i * width for x in range(len(cases))],
               [ms.get((*case, variant), {}).get("tflops") or 0 for case in cases], width,
               label=variant)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))],
                  [f"{shape}\n{'causal' if causal else 'full'} {precision}"
                   for shape, causal, precision in cases], fontsize=7)
    ax.set_ylabel("TFLOP/s (30 BHN²d)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=5)
    plt.tight_layout()
    plt.show()


if PASSES_RESULTS.exists():
    record = json.loads(PASSES_RESULTS.read_text())
    print(f"command: {record['command']}")
    plot_second_order_passes(record["rows"], f"The backward through both outputs on the "
                             f"{record['gpu']}, bf16: chapter 6's passes and chapter 12's")
else:
    print(f"no saved run at {PASSES_RESULTS}")

# %% [markdown]
# The saved run above (`second_order_passes_h100.json`, an H100, 2026-12-05): with all
# three passes, 12.83 against chapter 6's 21.30 ms at (4, 16, 4096, 128) "accurate" (321
# against 194 TFLOP/s), causal 7.11 against 11.56 (290 against 178, 0.90x the unmasked
# rate), "fast" 11.26 against 19.59 (366 against 210); 25.74 against 41.71 ms at
# (2, 16, 8192, 128) (320 against 198), causal 13.30 (310, 0.97x); at $d = 64$ 7.82
# against 8.78 (264 against 235), causal 4.06 against 4.80 (254 against 215). Each
# variant's gradients stay within 0.34% of chapter 6's largest entry. At $d = 128$ the
# $dQ$ pass on 64-key visits does not fit (262,848 bytes of shared memory against the
# H100's 232,448), as the tile choice expected; at $d = 64$ it is the faster one (8.37
# against 9.11 ms on 32-key visits, the others chapter 6's).
#
# What the numbers said on an H100 before that (bf16, GPU time from the profiler, one run
# of the same method before the script):
#
# * **The three passes together: 1.6x chapter 6's.** At (4, 16, 4096, 128) "accurate"
#   13.22 against 21.22 ms, 312 against 194 TFLOP/s; the key-side passes 8.16 against
#   14.64 ms, the $dQ$ pass 4.43 against 5.95. Causal 7.02 against 11.53 ms (294 against
#   179: within 6% of the unmasked rate), "fast" 11.32 against 19.57 (364 against 211),
#   (2, 16, 8192, 128) 25.44 against 41.86 (324 against 197). At $d = 64$ the gain is
#   small, 8.20 against 8.77 ms at (4, 16, 4096, 64) (251 against 235), with 32-key $dQ$
#   visits; 64-key ones took the $dQ$ kernel from 2.45 to 1.86 ms, hence
#   `dq_tangent_key_block`.
# * **Each pass alone**, in place of chapter 6's at (4, 16, 4096, 128): $dK$ 5.48 ms (the
#   Triton key side then 4.09 for $dV$ alone), $dV$ 2.38 (10.50 left for $dK$), $dQ$ 4.27
#   against 5.95. Every pass pays on its own, most the $dK$ pass, whose nine products a
#   visit chapter 6's Triton kernel could only hold on 16- or 32-query tiles of `mma.sync`.
# * **Where it stays as it was.** Calls the first-order kernels do not take (masks, fewer
#   than 4096 keys, fp16 "accurate", tangents of another shape or dtype) run chapter 6's
#   kernels: (16, 16, 1024, 128) took 6.05 ms either way. In "accurate" the carried
#   copies (0.36 ms) and the range pass (0.18) are now 4% of the call at 4096 tokens.
# * **Errors** are chapter 6's: the same products in the same precision, summed in
#   another order; each gradient's ratio to the math path's error came out the same as
#   chapter 6's to two digits (bf16 "accurate" 1.00x to 1.04x). In "fast", fp16, both
#   pass the test-suite's 2x at a few shapes (dk 2.14x at (1, 4, 700 x 1300, 128) causal,
#   dv 2.52x at (4, 8, 4096, 64)): one more 16-bit rounding of $P$ and $dS$ before each
#   product, as in the first order; the tests hold this chapter's passes to chapter 6's
#   error there.
