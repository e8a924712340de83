#!/usr/bin/env python3
"""An experiment toward a warp-specialised backward (issue: the backward at 0.8x SDPA's best):
chapter 11's schedule for the key side of the first-order backward, dK and dV, in Gluon. Not
part of the library, and **not yet run on a GPU**: it compiles for sm_90 (`--resources`, on
any machine) and its GPU mode checks it against float64 before timing it, so its first GPU
run says whether it is right and whether it pays.

    python benchmarks/warp_specialized_backward.py --resources        # CPU: ptxas -v for sm_90
    python benchmarks/warp_specialized_backward.py --out results.json  # an sm_90 GPU

A program owns 128 keys of one head: two compute warpgroups of 64 keys each, taking turns
at the tensor cores (ping-pong), and a loader warp that copies the program's K and V tiles
once, then each query tile's Q and dO into a ring. Per query tile a group computes, with
the scores transposed so that its keys are the rows,

    Sᵀ = K Qᵀ,  dPᵀ = V dOᵀ            (one turn: two products from shared memory)
    Pᵀ = exp2(Sᵀ log2(e) s - LSE log2(e)),  dSᵀ = Pᵀ ∘ (dPᵀ - Δ)
    dV += Pᵀ dO,  dK += dSᵀ Q          (the next turn: register operands)

and at the end stores dK·s and dV through the copy engine. A second kernel computes dQ the
same way from the query side, as the library's backward does (chapter 5: its dQ kernel is
a launch of its own): a program owns 128 queries, the loader streams K and V, and per key
tile a group computes S = Q Kᵀ and dP = dO Vᵀ in one turn, then dQ += dS K in the next.
Fast precision (each 16-bit operand rounded once), no GQA, no mask beyond is_causal: enough
to say what the schedule is worth. Register budget at d = 128 with 64-query tiles: dK and
dV (64 each), Sᵀ and dPᵀ (32 each), two 16-bit operands (16 each): 224 of the 240.

The GPU mode checks dQ, dK and dV against float64 (each error over PyTorch math's in bf16,
through autograd), then times each kernel beside the library's backward in "fast"
precision (the whole call, and its dK/dV and dQ kernels alone from the profiler) and
SDPA's cuDNN backward. FLOPs: the backward's five products, 10·B·H·N²·d (half when
causal), of which the dK/dV kernel does four and the dQ kernel, recomputing S and dP,
three (6·B·H·N²·d).
"""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from warp_specialized import (  # noqa: E402
    checked_and_timed,
    compiled_report,
    run_record,
    schedule_arguments,
)

from jvp_attention.warp_specialized import (  # noqa: E402
    COMPUTE_REGS,
    GROUP_ROWS,
    LAUNCH_REGS,
    LOADER_REGS,
    _as_matrices,
    _blocks,
    _descriptor,
    _load_with_tangent,
    _masked,
    _pass_turn,
    _program_tile,
    _ring_barriers,
    _store_rows,
    _take_turn,
    mma_layout,
    tma_load,
)

SCHEMA = "jvp_attention.warp_specialized_backward/1"
KEY_ROWS = 64  # keys per compute group
TILES = {  # name: (d, query rows per tile, ring slots)
    "d128_m64_s2": (128, 64, 2),
    "d64_m64_s2": (64, 64, 2),
    "d64_m128_s2": (64, 128, 2),
}
DQ_TILES = {  # name: (d, keys per tile, ring slots)
    "dq_d128_n64_s3": (128, 64, 3),
    "dq_d128_n128_s2": (128, 128, 2),
    "dq_d64_n128_s2": (64, 128, 2),
}


@gluon.jit
def _bwd_load_partition(k_desc, v_desc, q_desc, do_desc, k_tiles, v_tiles, q_ring, do_ring,
                        kv_ready, q_ready, do_ready, slot_free, batch, head, k_start,
                        first_block, n_blocks, STAGES: gl.constexpr):
    """One warp: both groups' K and V tiles once, then each query tile's Q and dO into the
    ring, as soon as both groups have freed the slot."""
    GROUPS: gl.constexpr = k_tiles.shape[0]
    GROUP_N: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    mbarrier.expect(kv_ready, GROUPS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for g in gl.static_range(GROUPS):
        tma_load(k_desc, [batch, head, k_start + g * GROUP_N, 0], kv_ready, k_tiles.index(g))
        tma_load(v_desc, [batch, head, k_start + g * GROUP_N, 0], kv_ready, v_tiles.index(g))
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(slot_free.index(slot), ((j // STAGES) & 1) ^ 1)
        row = (first_block + j) * BLOCK_M
        _load_with_tangent(q_desc, q_desc, batch, head, row, q_ready.index(slot),
                           q_ring.index(slot), q_ring.index(slot), False)
        _load_with_tangent(do_desc, do_desc, batch, head, row, do_ready.index(slot),
                           do_ring.index(slot), do_ring.index(slot), False)


@gluon.jit
def _causal_transposed(st, first_key, start_m, CAUSAL: gl.constexpr):
    """Sᵀ with the keys after their query set to -inf (top-left causal: query i sees keys
    j <= i); only tiles that reach the diagonal pay for the compare."""
    if CAUSAL and start_m < first_key + st.shape[0]:
        keys = first_key + gl.arange(0, st.shape[0], gl.SliceLayout(1, st.type.layout))
        queries = start_m + gl.arange(0, st.shape[1], gl.SliceLayout(0, st.type.layout))
        st = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(queries, 0), st,
                      -float("inf"))
    return st


@gluon.jit
def _bwd_compute_partition(k_blocks, v_blocks, k_tiles, v_tiles, q_ring, do_ring, kv_ready,
                           q_ready, do_ready, slot_free, turns, dk_desc, dv_desc, lse_ptr,
                           delta_ptr, batch, head, row_base, k_start, first_block, n_blocks,
                           n_q, qk_scale, scale, GROUP: gl.constexpr, STAGES: gl.constexpr,
                           CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """One group of 64 keys: per query tile a turn for Sᵀ and dPᵀ, the probabilities and
    dSᵀ, a turn for dV and dK; then dK·s and dV."""
    GROUP_N: gl.constexpr = dk_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = dk_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = q_ring.shape[1]
    dtype: gl.constexpr = q_ring.dtype
    st_layout: gl.constexpr = mma_layout(BLOCK_M, num_warps)
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM, num_warps)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    query_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    k_smem = k_tiles.index(GROUP)
    v_smem = v_tiles.index(GROUP)
    first_key = k_start + GROUP * GROUP_N

    dk = gl.zeros([GROUP_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([GROUP_N, HEAD_DIM], gl.float32, acc_layout)
    st_zero = gl.zeros([GROUP_N, BLOCK_M], gl.float32, st_layout)
    mbarrier.wait(kv_ready, 0)
    turn = 0
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        start_m = (first_block + j) * BLOCK_M
        q_smem = q_ring.index(slot)
        do_smem = do_ring.index(slot)
        mbarrier.wait(q_ready.index(slot), phase)
        mbarrier.wait(do_ready.index(slot), phase)
        turn = _take_turn(turns, turn, GROUP, True)
        st = warpgroup_mma(k_smem, q_smem.permute((1, 0)), st_zero, use_acc=False,
                           is_async=True)
        dpt = warpgroup_mma(v_smem, do_smem.permute((1, 0)), st_zero, use_acc=False,
                            is_async=True)
        _pass_turn(turns, GROUP, True)
        st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
        queries = start_m + gl.arange(0, BLOCK_M, query_layout)
        # Queries past the end get LSE = +inf, so probability 0 (their Q and dO are zeros).
        lse = gl.load(lse_ptr + row_base + queries, mask=queries < n_q, other=float("inf"))
        st = _causal_transposed(st, first_key, start_m, CAUSAL)
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse * 1.4426950408889634, 0))
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        # Loaded only now, so that its registers and the LSE's are not live together.
        delta = gl.load(delta_ptr + row_base + queries, mask=queries < n_q, other=0.0)
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        dst_op = gl.convert_layout(dst.to(dtype), op_layout)
        turn = _take_turn(turns, turn, GROUP, True)
        dv = warpgroup_mma(pt_op, do_smem, dv, is_async=True)
        dk = warpgroup_mma(dst_op, q_smem, dk, is_async=True)
        _pass_turn(turns, GROUP, True)
        dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
        mbarrier.arrive(slot_free.index(slot), count=1)

    # Every product is done: the K and V tiles carry the gradients out.
    _store_rows(dk_desc, k_smem, k_blocks.index(GROUP), (dk * scale).to(dtype), batch, head,
                first_key)
    _store_rows(dv_desc, v_smem, v_blocks.index(GROUP), dv.to(dtype), batch, head, first_key)


@gluon.jit
def ws_dkdv_kernel(k_desc, v_desc, q_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr,
                   n_heads, n_q, n_k, qk_scale, scale, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """Grid (cdiv(Nk, 128), B·H): 128 keys of one head per program, 64 per compute group."""
    GROUP_N: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    k_start = gl.program_id(0) * 2 * GROUP_N
    batch = gl.program_id(1) // n_heads
    head = gl.program_id(1) % n_heads
    first_block = 0
    if CAUSAL:  # query i sees keys j <= i: the tiles from the program's first key on
        first_block = k_start // BLOCK_M
    n_blocks = gl.cdiv(n_q, BLOCK_M) - first_block
    k_tiles, v_tiles = _blocks(k_desc, 2), _blocks(v_desc, 2)
    q_ring, do_ring = _blocks(q_desc, STAGES), _blocks(do_desc, STAGES)
    kv_ready, q_ready, do_ready, slot_free, turns = _ring_barriers(STAGES, 2)
    k_2d, v_2d = _as_matrices(k_tiles, k_desc), _as_matrices(v_tiles, v_desc)
    q_2d, do_2d = _as_matrices(q_ring, q_desc), _as_matrices(do_ring, do_desc)
    row_base = gl.program_id(1).to(gl.int64) * n_q
    gl.warp_specialize([
        (_bwd_compute_partition, (k_tiles, v_tiles, k_2d, v_2d, q_2d, do_2d, kv_ready,
                                  q_ready, do_ready, slot_free, turns, dk_desc, dv_desc,
                                  lse_ptr, delta_ptr, batch, head, row_base, k_start,
                                  first_block, n_blocks, n_q, qk_scale, scale, 0, STAGES,
                                  CAUSAL, num_warps)),
        (_bwd_compute_partition, (k_tiles, v_tiles, k_2d, v_2d, q_2d, do_2d, kv_ready,
                                  q_ready, do_ready, slot_free, turns, dk_desc, dv_desc,
                                  lse_ptr, delta_ptr, batch, head, row_base, k_start,
                                  first_block, n_blocks, n_q, qk_scale, scale, 1, STAGES,
                                  CAUSAL, num_warps)),
        (_bwd_load_partition, (k_desc, v_desc, q_desc, do_desc, k_tiles, v_tiles, q_ring,
                               do_ring, kv_ready, q_ready, do_ready, slot_free, batch, head,
                               k_start, first_block, n_blocks, STAGES)),
    ], [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])


@gluon.jit
def _dq_load_partition(q_desc, do_desc, k_desc, v_desc, q_tiles, do_tiles, k_ring, v_ring,
                       q_ready, k_ready, v_ready, slot_free, batch, head, q_start, n_blocks,
                       STAGES: gl.constexpr):
    """One warp: both groups' Q and dO tiles once, then each key tile's K and V into the
    ring."""
    GROUPS: gl.constexpr = q_tiles.shape[0]
    GROUP_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    mbarrier.expect(q_ready, 2 * GROUPS * q_desc.block_type.nbytes)
    for g in gl.static_range(GROUPS):
        tma_load(q_desc, [batch, head, q_start + g * GROUP_M, 0], q_ready, q_tiles.index(g))
        tma_load(do_desc, [batch, head, q_start + g * GROUP_M, 0], q_ready, do_tiles.index(g))
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(slot_free.index(slot), ((j // STAGES) & 1) ^ 1)
        _load_with_tangent(k_desc, k_desc, batch, head, j * BLOCK_N, k_ready.index(slot),
                           k_ring.index(slot), k_ring.index(slot), False)
        _load_with_tangent(v_desc, v_desc, batch, head, j * BLOCK_N, v_ready.index(slot),
                           v_ring.index(slot), v_ring.index(slot), False)


@gluon.jit
def _dq_compute_partition(q_blocks, q_tiles, do_tiles, k_ring, v_ring, q_ready, k_ready,
                          v_ready, slot_free, turns, dq_desc, lse_ptr, delta_ptr, batch, head,
                          row_base, q_start, n_q, n_k, n_blocks, qk_scale, scale,
                          GROUP: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                          num_warps: gl.constexpr):
    """One group of 64 queries: per key tile a turn for S and dP, then dS, a turn for
    dQ += dS K; then dQ·s."""
    GROUP_M: gl.constexpr = dq_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = dq_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_ring.shape[1]
    dtype: gl.constexpr = q_tiles.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N, num_warps)
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM, num_warps)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_smem = q_tiles.index(GROUP)
    do_smem = do_tiles.index(GROUP)
    first_row = q_start + GROUP * GROUP_M
    rows = first_row + gl.arange(0, GROUP_M, row_layout)
    # Rows past the end have zero Q and dO, so dS = P (dP - 0) = 0 whatever their LSE.
    lse = gl.load(lse_ptr + row_base + rows, mask=rows < n_q, other=0.0) * 1.4426950408889634
    delta = gl.load(delta_ptr + row_base + rows, mask=rows < n_q, other=0.0)

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

    _store_rows(dq_desc, q_smem, q_blocks.index(GROUP), (dq * scale).to(dtype), batch, head,
                first_row)


@gluon.jit
def ws_dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr, n_heads, n_q,
                 n_k, qk_scale, scale, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 num_warps: gl.constexpr):
    """Grid (cdiv(Nq, 128), B·H): 128 queries of one head per program, 64 per group; causal
    programs in reverse order, as chapter 11's forward."""
    GROUP_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    q_start, batch, head, n_blocks = _program_tile(n_heads, n_k, 2 * GROUP_M, BLOCK_N, CAUSAL)
    q_tiles, do_tiles = _blocks(q_desc, 2), _blocks(do_desc, 2)
    k_ring, v_ring = _blocks(k_desc, STAGES), _blocks(v_desc, STAGES)
    q_ready, k_ready, v_ready, slot_free, turns = _ring_barriers(STAGES, 2)
    q_2d, do_2d = _as_matrices(q_tiles, q_desc), _as_matrices(do_tiles, do_desc)
    k_2d, v_2d = _as_matrices(k_ring, k_desc), _as_matrices(v_ring, v_desc)
    row_base = gl.program_id(1).to(gl.int64) * n_q
    gl.warp_specialize([
        (_dq_compute_partition, (q_tiles, q_2d, do_2d, k_2d, v_2d, q_ready, k_ready, v_ready,
                                 slot_free, turns, dq_desc, lse_ptr, delta_ptr, batch, head,
                                 row_base, q_start, n_q, n_k, n_blocks, qk_scale, scale, 0,
                                 STAGES, CAUSAL, num_warps)),
        (_dq_compute_partition, (q_tiles, q_2d, do_2d, k_2d, v_2d, q_ready, k_ready, v_ready,
                                 slot_free, turns, dq_desc, lse_ptr, delta_ptr, batch, head,
                                 row_base, q_start, n_q, n_k, n_blocks, qk_scale, scale, 1,
                                 STAGES, CAUSAL, num_warps)),
        (_dq_load_partition, (q_desc, do_desc, k_desc, v_desc, q_tiles, do_tiles, k_ring,
                              v_ring, q_ready, k_ready, v_ready, slot_free, batch, head,
                              q_start, n_blocks, STAGES)),
    ], [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])


def launch_dq(q, k, v, grad_out, lse, delta, dq, is_causal: bool, scale: float,
              key_block: int, stages: int) -> None:
    """dQ of (B, H, N, D) inputs (H the same for q and k), as `launch` takes them."""
    batch, n_heads, n_q, _ = q.shape
    descriptors = [_descriptor(t, rows) for t, rows in (
        (q, GROUP_ROWS), (k, key_block), (v, key_block), (grad_out, GROUP_ROWS),
        (dq, GROUP_ROWS))]
    grid = (triton.cdiv(n_q, 2 * GROUP_ROWS), batch * n_heads)
    ws_dq_kernel[grid](*descriptors, lse, delta, n_heads, n_q, k.shape[2],
                       scale * math.log2(math.e), scale, STAGES=stages, CAUSAL=is_causal,
                       num_warps=4, maxnreg=LAUNCH_REGS)


def launch(q, k, v, grad_out, lse, delta, dk, dv, is_causal: bool, scale: float,
           query_rows: int, stages: int) -> None:
    """dK and dV of (B, H, N, D) inputs (H the same for q and k), from the forward's lse
    (natural log) and delta = rowsum(dO ∘ O) (fp32)."""
    batch, n_heads, n_q, _ = q.shape
    descriptors = [_descriptor(t, rows) for t, rows in (
        (k, KEY_ROWS), (v, KEY_ROWS), (q, query_rows), (grad_out, query_rows),
        (dk, KEY_ROWS), (dv, KEY_ROWS))]
    grid = (triton.cdiv(k.shape[2], 2 * KEY_ROWS), batch * n_heads)
    ws_dkdv_kernel[grid](*descriptors, lse, delta, n_heads, n_q, k.shape[2],
                         scale * math.log2(math.e), scale, STAGES=stages, CAUSAL=is_causal,
                         num_warps=4, maxnreg=LAUNCH_REGS)


def compile_for_hopper(name: str, causal: bool = False) -> dict:
    """Tile `name` (of TILES: the dK/dV kernel; of DQ_TILES: the dQ kernel) compiled for
    sm_90 (`compiled_report`)."""
    x = torch.empty(1, 1, 1024, 128 if "d128" in name else 64, dtype=torch.bfloat16)
    if name in DQ_TILES:
        d, key_block, stages = DQ_TILES[name]
        kernel, rows = ws_dq_kernel, {"q_desc": GROUP_ROWS, "k_desc": key_block,
                                      "v_desc": key_block, "do_desc": GROUP_ROWS,
                                      "dq_desc": GROUP_ROWS}
        shape = {"d": d, "key_block": key_block, "stages": stages}
    else:
        d, query_rows, stages = TILES[name]
        kernel, rows = ws_dkdv_kernel, {"k_desc": KEY_ROWS, "v_desc": KEY_ROWS,
                                        "q_desc": query_rows, "do_desc": query_rows,
                                        "dk_desc": KEY_ROWS, "dv_desc": KEY_ROWS}
        shape = {"d": d, "query_rows": query_rows, "stages": stages}
    descriptors = {name: _descriptor(x, r) for name, r in rows.items()}
    scalars = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "n_heads": "i32", "n_q": "i32",
               "n_k": "i32", "qk_scale": "fp32", "scale": "fp32"}
    report = compiled_report(kernel, descriptors, scalars, {"STAGES": stages, "CAUSAL": causal},
                             4)
    return {"tile": name, **shape, "causal": causal, **report}


def problem(B, H, N, d, causal, device="cuda", dtype=torch.bfloat16, seed=0):
    """Inputs, the forward's out and lse (the library's, fast precision), a cotangent and
    delta = rowsum(dO ∘ O)."""
    import jvp_attention
    from jvp_attention.forward import flash_attention_forward

    generator = torch.Generator(device).manual_seed(seed)
    q, k, v, grad_out = (torch.randn(B, H, N, d, device=device, dtype=dtype,
                                     generator=generator) for _ in range(4))
    with jvp_attention.precision("fast"):
        forward = flash_attention_forward(q, k, v, None, causal)
    delta = (forward.out.float() * grad_out.float()).sum(-1)
    return q, k, v, grad_out, forward.out, forward.lse, delta


def run_tile(q, k, v, grad_out, lse, delta, causal: bool, query_rows: int, stages: int):
    """This experiment's dK and dV with one tile choice."""
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    launch(q, k, v, grad_out, lse, delta, dk, dv, causal, q.shape[-1] ** -0.5, query_rows,
           stages)
    return dk, dv


def run_dq(q, k, v, grad_out, lse, delta, causal: bool, key_block: int, stages: int):
    """This experiment's dQ with one tile choice, as a one-tuple."""
    dq = torch.empty_like(q)
    launch_dq(q, k, v, grad_out, lse, delta, dq, causal, q.shape[-1] ** -0.5, key_block,
              stages)
    return (dq,)


def errors(result, q, k, v, grad_out, causal: bool, names=("dk", "dv")) -> dict:
    """Max errors of `result` (the gradients `names`, of dq, dk, dv) against float64, each
    over PyTorch math's in the inputs' dtype (autograd through the math path)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def grads(a, b, c, cotangent):
        a, b, c = (x.detach().requires_grad_() for x in (a, b, c))
        with sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal)
        return dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (a, b, c), cotangent),
                        strict=True))

    exact = grads(q.double(), k.double(), v.double(), grad_out.double())
    floor = grads(q, k, v, grad_out)
    row = {}
    for name, mine in zip(names, result, strict=True):
        truth, low = exact[name], floor[name]
        error = (mine.double() - truth).abs().max().item()
        row[f"{name}_err_ratio"] = error / (low.double() - truth).abs().max().item()
    return row


def library_backward_ms(q, k, v, out, lse, grad_out, causal: bool) -> dict:
    """The library's backward in "fast" precision: the whole call's time, and its dK/dV
    and dQ kernels' own from the profiler."""
    import jvp_attention
    from jvp_attention.backward import flash_attention_backward

    def call():
        with jvp_attention.precision("fast"):
            return flash_attention_backward(q, k, v, out, lse, grad_out, None, causal)

    call()
    whole = triton.testing.do_bench(call, warmup=25, rep=100)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time / 5e3
    dkdv = sum(ms for name, ms in kernels.items() if "dkdv" in name)
    dq = sum(ms for name, ms in kernels.items() if "_dq_" in name)
    return {"backward_ms": whole, "dkdv_kernel_ms": dkdv, "dq_kernel_ms": dq,
            "kernels_ms": {name[:60]: round(ms, 4) for name, ms in kernels.items()}}


def measure(shapes, check_n: int) -> list[dict]:
    """Every tile of each shape's head dim, full and causal: checked, then timed beside the
    library's dK/dV kernel and cuDNN's whole backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for (B, H, N, d), causal in ((shape, c) for shape in shapes for c in (False, True)):
        q, k, v, grad_out, out, lse, delta = problem(B, H, N, d, causal)
        flops = 8 * B * H * N * N * d / (2 if causal else 1)  # dK/dV's four products
        base = {"shape": [B, H, N, d], "causal": causal}
        for name, (dd, query_rows, stages) in TILES.items():
            if dd == d:
                rows.append(checked_and_timed(
                    base | {"impl": f"ws_{name}"},
                    functools.partial(run_tile, q, k, v, grad_out, lse, delta, causal,
                                      query_rows, stages),
                    functools.partial(errors, q=q, k=k, v=v, grad_out=grad_out,
                                      causal=causal) if N <= check_n else None, flops))
        dq_flops = flops * 3 / 4  # S, dP and dS K: three products
        for name, (dd, key_block, stages) in DQ_TILES.items():
            if dd == d:
                rows.append(checked_and_timed(
                    base | {"impl": f"ws_{name}"},
                    functools.partial(run_dq, q, k, v, grad_out, lse, delta, causal,
                                      key_block, stages),
                    functools.partial(errors, q=q, k=k, v=v, grad_out=grad_out,
                                      causal=causal, names=("dq",)) if N <= check_n else None,
                    dq_flops))
        try:
            library = library_backward_ms(q, k, v, out, lse, grad_out, causal)
            library["dkdv_tflops"] = flops / library["dkdv_kernel_ms"] / 1e9
            library["dq_tflops"] = dq_flops / library["dq_kernel_ms"] / 1e9
        except Exception as error:  # noqa: BLE001 - record why, keep the other rows
            library = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        rows.append(base | {"impl": "ours_fast_backward"} | library)
        print(json.dumps(rows[-1]), flush=True)
        inputs = tuple(x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa_out = torch.nn.functional.scaled_dot_product_attention(*inputs,
                                                                        is_causal=causal)
        cudnn = triton.testing.do_bench(
            functools.partial(torch.autograd.grad, sdpa_out, inputs, grad_out,
                              retain_graph=True), warmup=25, rep=100)
        rows.append(base | {"impl": "sdpa_cudnn_backward", "backward_ms": cudnn,
                            "tflops": 10 * B * H * N * N * d / (2 if causal else 1) / cudnn / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    args = schedule_arguments(__doc__.split("\n")[0], ["4,16,4096,128", "1,16,16384,128",
                                                       "4,32,4096,64"]).parse_args()
    if args.resources:
        rows = [compile_for_hopper(name, causal) for name in [*TILES, *DQ_TILES]
                for causal in (False, True)]
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        rows = measure([tuple(int(x) for x in s.split(",")) for s in args.shapes], args.check_n)
    if args.out:
        args.out.write_text(json.dumps(run_record(SCHEMA, rows), indent=1) + "\n")

if __name__ == "__main__":
    main()
