#!/usr/bin/env python3
"""Does warp specialisation pay for our forward on Hopper? A Gluon experiment, timed beside
the library's forward and SDPA's backends. Saved as JSON.

    python benchmarks/warp_specialized.py --out benchmarks/results/warp_specialized_h200.json
    python benchmarks/warp_specialized.py --resources   # CPU: compile for sm_90, ptxas -v

Chapter 4 found that Triton 3.6 does not split the forward's warps into a copy warp and
compute warpgroups (`tl.range(..., warp_specialize=True)` leaves the kernel as it was), so
the softmax of a tile cannot hide under the matrix products of another. Gluon, Triton's
explicit layer, writes that schedule out by hand. This file holds one such forward, primal
only (no tangent), non-causal, bf16 or fp16, head dim 64 or 128, N a multiple of the tiles:
the smallest kernel that says whether the schedule is worth carrying the tangent into.

The schedule (FlashAttention-3's, Shah et al. 2024, section 3):

- a **loader** partition (one warp, 24 registers) issues the copy engine's (TMA) loads: the
  query tile once, then the key and value tiles into a ring of `STAGES` shared-memory slots,
  each slot guarded by three barriers (keys ready, values ready, slot free);
- the **compute** partition (two warpgroups, 64 query rows each, the registers the loader
  gave up) runs the online softmax on the warpgroup tensor cores (`wgmma`), and pipelines
  within a warpgroup: it issues the scores of key tile j+1 and the product of tile j's
  probabilities with its values back to back, waits only for the scores, and computes their
  softmax while the value product is still running (`PIPELINE=1`; `PIPELINE=0` waits for
  each product in turn, the baseline that separates the two effects).

Checked against float64 attention before timing (the error relative to PyTorch's math path
in the same dtype); timed with `triton.testing.do_bench` beside `jvp_attention`'s forward
(no grad) and SDPA's flash and cuDNN backends, credited 4·B·H·N²·d FLOPs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
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

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "jvp_attention.warp_specialized/1"
LOG2E = 1.4426950408889634
BLOCK_M = 128  # query rows per program: two warpgroups of 64 (a wgmma is 16 rows per warp)
LOADER_REGS = gl.constexpr(24)
COMPUTE_REGS = gl.constexpr(240)  # what the loader gives up, for the second compute group
# Registers a thread may hold at launch: 65,536 per SM over the 12 warps (8 compute, one
# loader rounded up to a warpgroup); the loader then gives up all but LOADER_REGS and the
# compute warpgroups take them (setmaxnreg).
LAUNCH_REGS = 168


@gluon.constexpr_function
def mma_layout(rows: int, cols: int, num_warps: int):
    """The wgmma accumulator layout for a rows x cols fp32 tile over `num_warps` warps."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, cols, 16])


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_tiles, k_ring, v_ring, q_ready, k_ready, v_ready,
                    slot_free, q_row, kv_row, n_blocks, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr):
    """One warp: the query tiles, then each key and value tile into the next free ring slot."""
    GROUPS: gl.constexpr = q_tiles.shape[0]
    GROUP_M: gl.constexpr = q_tiles.shape[1]
    mbarrier.expect(q_ready, GROUPS * q_desc.block_type.nbytes)
    for g in gl.static_range(GROUPS):
        tma.async_copy_global_to_shared(q_desc, [q_row + g * GROUP_M, 0], q_ready,
                                        q_tiles.index(g))
    for j in range(n_blocks):
        slot = j % STAGES
        # A fresh barrier counts as having finished the phase before its first, so the
        # first pass over the ring does not wait.
        mbarrier.wait(slot_free.index(slot), ((j // STAGES) & 1) ^ 1)
        row = kv_row + j * BLOCK_N
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, 0], k_ready.index(slot), k_ring.index(slot))
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, 0], v_ready.index(slot), v_ring.index(slot))


@gluon.jit
def _causal(s, start_n, first_row, CAUSAL: gl.constexpr):
    """Scores of keys after their query set to -inf, in the key tiles that reach the
    diagonal (a compare per score there; the tiles below it pass through)."""
    if CAUSAL:
        if start_n + s.shape[1] > first_row:
            rows = first_row + gl.arange(0, s.shape[0], gl.SliceLayout(1, s.type.layout))
            cols = start_n + gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
            s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), s, -float("inf"))
    return s


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, p_layout: gl.constexpr, dtype: gl.constexpr):
    """Fold one score tile into the row maxima and sums; return the probabilities as the
    next product's register operand and the factor that rescales the accumulator."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_i


@gluon.jit
def _take_turn(turns, turn, GROUP: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the other warpgroup has issued its products (group 0 goes
    first), so that one group's products run while the other computes its softmax."""
    if PINGPONG:
        mbarrier.wait(turns.index(GROUP), (turn & 1) ^ (1 - GROUP))
    return turn + 1


@gluon.jit
def _pass_turn(turns, GROUP: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - GROUP), count=1)


@gluon.jit
def _compute_partition(q_tiles, k_ring, v_ring, q_ready, k_ready, v_ready, slot_free, turns,
                       o_desc, lse_ptr, q_row, q_start, n_blocks, qk_scale, GROUP: gl.constexpr,
                       BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                       PIPELINE: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr,
                       num_warps: gl.constexpr):
    """One group of compute warps (its GROUP_M query rows of the program's tile): the
    online softmax over every key tile, then the output's store through shared memory.

    Each pass issues the scores of key tile j and the value product of tile j-1 back to
    back; with PIPELINE it waits for the scores only (issued first, so done first) and
    computes their softmax while the value product runs, else it waits for both."""
    GROUP_M: gl.constexpr = q_tiles.shape[1]
    dtype: gl.constexpr = q_tiles.dtype
    s_layout: gl.constexpr = mma_layout(GROUP_M, BLOCK_N, num_warps)
    o_layout: gl.constexpr = mma_layout(GROUP_M, HEAD_DIM, num_warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_smem = q_tiles.index(GROUP)

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
    first_row = q_start + GROUP * GROUP_M  # this group's first query, within the head
    s = _causal(s, 0, first_row, CAUSAL)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, p_layout, dtype)
    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        turn = _take_turn(turns, turn, GROUP, PINGPONG)
        s = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        p_read = p  # the value product reads these registers until it is done
        acc = warpgroup_mma(p_read, v_ring.index(prev), acc, is_async=True)
        _pass_turn(turns, GROUP, PINGPONG)
        s = warpgroup_mma_wait(1 if PIPELINE else 0, deps=(s,))
        s = _causal(s, j * BLOCK_N, first_row, CAUSAL)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, p_layout, dtype)
        acc, p_read = warpgroup_mma_wait(0, deps=(acc, p_read))
        mbarrier.arrive(slot_free.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row_layout), 1)
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    turn = _take_turn(turns, turn, GROUP, PINGPONG)
    acc = warpgroup_mma(p, v_ring.index(last), acc, is_async=True)
    _pass_turn(turns, GROUP, PINGPONG)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(slot_free.index(last), count=1)

    # The query tile is no longer read (every product is done): stage the output there.
    out = acc / gl.expand_dims(gl.convert_layout(l_i, o_row_layout), 1)
    q_smem.store(out.to(dtype))
    fence_async_shared()
    row = q_row + GROUP * GROUP_M
    tma.async_copy_shared_to_global(o_desc, [row, 0], q_smem)
    rows = row + gl.arange(0, GROUP_M, row_layout)
    gl.store(lse_ptr + rows, (m_i + gl.log2(l_i)) / 1.4426950408889634)  # natural-log LSE
    tma.store_wait(0)


@gluon.jit
def ws_forward_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, n_q, n_k, qk_scale,
                      STAGES: gl.constexpr, PIPELINE: gl.constexpr, PINGPONG: gl.constexpr,
                      CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """Grid (N / BLOCK_M, B·H): one tile of BLOCK_M query rows of one head per program,
    q, k, v, o as (B·H·N, d) row-major views (a head's rows contiguous). Without PINGPONG
    one group of 8 compute warps takes all BLOCK_M rows; with it two groups of 4 warps take
    64 rows each and alternate their products."""
    GROUP_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    GROUPS: gl.constexpr = 2 if PINGPONG else 1
    head = gl.program_id(1)
    tile = gl.program_id(0)
    if CAUSAL:  # the longest rows first, so that the short ones fill the tail
        tile = gl.num_programs(0) - 1 - tile
    q_start = tile * (GROUPS * GROUP_M)
    q_row = head * n_q + q_start
    kv_row = head * n_k
    if CAUSAL:  # keys up to the tile's last query (square attention: n_q == n_k)
        n_blocks = gl.cdiv(q_start + GROUPS * GROUP_M, BLOCK_N)
    else:
        n_blocks = n_k // BLOCK_N

    q_tiles = gl.allocate_shared_memory(q_desc.dtype, [GROUPS] + q_desc.block_type.shape,
                                        q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape,
                                       k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape,
                                       v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    slot_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(slot_free.index(i), count=GROUPS)  # every group frees the slot
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)

    # Argument tuples are written out: adding tuples would turn their constexprs to tensors.
    if PINGPONG:
        gl.warp_specialize([
            (_compute_partition, (q_tiles, k_ring, v_ring, q_ready, k_ready, v_ready, slot_free,
                                  turns, o_desc, lse_ptr, q_row, q_start, n_blocks, qk_scale, 0,
                                  BLOCK_N, HEAD_DIM, STAGES, PIPELINE, PINGPONG, CAUSAL,
                                  num_warps)),
            (_compute_partition, (q_tiles, k_ring, v_ring, q_ready, k_ready, v_ready, slot_free,
                                  turns, o_desc, lse_ptr, q_row, q_start, n_blocks, qk_scale, 1,
                                  BLOCK_N, HEAD_DIM, STAGES, PIPELINE, PINGPONG, CAUSAL,
                                  num_warps)),
            (_load_partition, (q_desc, k_desc, v_desc, q_tiles, k_ring, v_ring, q_ready, k_ready,
                               v_ready, slot_free, q_row, kv_row, n_blocks, BLOCK_N, STAGES)),
        ], [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_compute_partition, (q_tiles, k_ring, v_ring, q_ready, k_ready, v_ready, slot_free,
                                  turns, o_desc, lse_ptr, q_row, q_start, n_blocks, qk_scale, 0,
                                  BLOCK_N, HEAD_DIM, STAGES, PIPELINE, PINGPONG, CAUSAL,
                                  num_warps)),
            (_load_partition, (q_desc, k_desc, v_desc, q_tiles, k_ring, v_ring, q_ready, k_ready,
                               v_ready, slot_free, q_row, kv_row, n_blocks, BLOCK_N, STAGES)),
        ], [1], [LOADER_REGS])


def descriptors(q, k, v, out, block_n: int, group_m: int):
    """TMA descriptors over (B·H·N, d) views: query and output tiles of group_m rows, key
    and value tiles of block_n rows, in the swizzled layout wgmma reads."""
    d = q.shape[-1]
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def describe(x, rows):
        flat = x.reshape(-1, d)
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], dtype)
        return TensorDescriptor.from_tensor(flat, [rows, d], layout)

    return describe(q, group_m), describe(k, block_n), describe(v, block_n), describe(out, group_m)


def launch_options(pingpong: bool) -> tuple[int, int]:
    """(rows per compute group, warps of the kernel's own partition) of a variant."""
    return (64, 4) if pingpong else (128, 8)


def ws_forward(q, k, v, scale: float | None = None, *, is_causal: bool = False,
               block_n: int = 128, stages: int = 2, pipeline: bool = True,
               pingpong: bool = True):
    """Attention output and natural-log LSE of contiguous (B, H, N, d) q, k, v (no mask but
    the causal one, for square attention)."""
    B, H, N, d = q.shape
    n_k = k.shape[2]
    if (N % BLOCK_M or n_k % block_n or d not in (64, 128) or (is_causal and n_k != N)
            or q.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"the experiment takes N % {BLOCK_M} == 0, N_k % {block_n} == 0, "
                         f"d in (64, 128), bf16/fp16, N_k == N if causal; got {tuple(q.shape)}, {q.dtype}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    group_m, num_warps = launch_options(pingpong)
    q_desc, k_desc, v_desc, o_desc = descriptors(q, k, v, out, block_n, group_m)
    grid = (N // BLOCK_M, B * H)
    ws_forward_kernel[grid](q_desc, k_desc, v_desc, o_desc, lse, N, n_k, scale * LOG2E,
                            STAGES=stages, PIPELINE=int(pipeline), PINGPONG=int(pingpong),
                            CAUSAL=int(is_causal), num_warps=num_warps, maxnreg=LAUNCH_REGS)
    return out, lse


VARIANTS = {  # name: (block_n, stages, pipeline, pingpong)
    "ws_serial": (128, 2, False, False),
    "ws_pipelined": (128, 2, True, False),
    "ws_pingpong_serial": (128, 2, False, True),
    "ws_pingpong": (128, 2, True, True),
    "ws_pingpong_s3": (128, 3, True, True),
    "ws_pingpong_n64": (64, 3, True, True),
}


def resources(dtype: str = "bf16", d: int = 128) -> list[dict]:
    """Compile each variant for sm_90 on this machine (no GPU needed): registers, spills,
    shared memory, and the register budgets the partitions ask for (setmaxnreg)."""
    import re

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(ROOT / "tools"))
    from kernel_resources import ptxas_report  # noqa: E402

    target = GPUTarget("cuda", 90, 128)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    rows = []
    for name, causal in [(name, 0) for name in VARIANTS] + [("ws_pingpong", 1)]:
        block_n, stages, pipeline, pingpong = VARIANTS[name]
        x = torch.empty(1, 1, 1024, d, dtype=torch_dtype)
        group_m, num_warps = launch_options(pingpong)
        descs = descriptors(x, x, x, x, block_n, group_m)
        signature = {name_: native_specialize_impl(BaseBackend, desc, False, True, True)[0]
                     for name_, desc in zip(("q_desc", "k_desc", "v_desc", "o_desc"), descs,
                                            strict=True)}
        signature |= {"lse_ptr": "*fp32", "n_q": "i32", "n_k": "i32", "qk_scale": "fp32",
                      "STAGES": "constexpr", "PIPELINE": "constexpr", "PINGPONG": "constexpr",
                      "CAUSAL": "constexpr", "num_warps": "constexpr"}
        constexprs = {"STAGES": stages, "PIPELINE": int(pipeline), "PINGPONG": int(pingpong),
                      "CAUSAL": causal, "num_warps": num_warps}
        source = GluonASTSource(ws_forward_kernel, signature, constexprs)
        start = time.perf_counter()
        compiled = triton.compile(source, target=target,
                                  options={"num_warps": num_warps, "maxnreg": LAUNCH_REGS})
        ptx = compiled.asm["ptx"]
        rows.append({"variant": name, "block_n": block_n, "stages": stages,
                     "pipeline": pipeline, "pingpong": pingpong, "causal": bool(causal), "dtype": dtype, "d": d, **ptxas_report(ptx),
                     "shared": compiled.metadata.shared,
                     "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned"
                                                         r"\.u32\s+(\d+)", ptx))),
                     "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                     "compile_s": round(time.perf_counter() - start, 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def reference_error(out, q, k, v, causal: bool) -> tuple[float, float]:
    """Max error of `out` and of PyTorch's math path in the same dtype, both against float64."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    exact = sdpa(q.double(), k.double(), v.double(), is_causal=causal)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        math_out = sdpa(q, k, v, is_causal=causal)
    return ((out.double() - exact).abs().max().item(),
            (math_out.double() - exact).abs().max().item())


def timed_calls(q, k, v, causal: bool) -> dict:
    """name -> zero-argument forward call, ours and SDPA's fused backends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import jvp_attention

    def sdpa(backend):
        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=causal)
        return call

    calls = {name: (lambda b=b, s=s, p=p, g=g: ws_forward(q, k, v, is_causal=causal, block_n=b,
                                                          stages=s, pipeline=p, pingpong=g))
             for name, (b, s, p, g) in VARIANTS.items()}
    calls["ours"] = lambda: jvp_attention.attention(q, k, v, is_causal=causal)
    calls["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    calls["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    return calls


def measure(shapes, dtype, check_n: int, causal_modes) -> list[dict]:
    """Check and time every call at every shape; FLOPs credited as dense (causal: half)."""
    rows = []
    for (B, H, N, d), causal in ((shape, c) for shape in shapes for c in causal_modes):
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        flops = 4 * B * H * N * N * d / (2 if causal else 1)
        with torch.no_grad():
            for name, call in timed_calls(q, k, v, causal).items():
                row = {"shape": [B, H, N, d], "causal": causal, "impl": name}
                try:
                    call()
                    torch.cuda.synchronize()
                    if N <= check_n:
                        out = call()
                        out = out[0] if isinstance(out, tuple) else out
                        ours_err, math_err = reference_error(out, q, k, v, causal)
                        row |= {"max_err": ours_err, "math_max_err": math_err,
                                "err_ratio": ours_err / math_err}
                    ms = triton.testing.do_bench(call, warmup=25, rep=100)
                    row |= {"ms": ms, "tflops": flops / ms / 1e9}
                except Exception as error:  # a backend that does not run here: say why
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resources", action="store_true",
                        help="compile each variant for sm_90 and report (no GPU needed)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--shapes", nargs="+", default=["4,16,4096,128", "1,16,16384,128",
                                                        "4,16,4096,64", "32,12,1024,64"],
                        help="B,H,N,d")
    parser.add_argument("--check-n", type=int, default=4096,
                        help="check against float64 up to this N (the reference is O(N^2))")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args()
    if args.resources:
        rows = resources(args.dtype, 128) + resources(args.dtype, 64)
    else:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
        causal_modes = {"0": (False,), "1": (True,), "both": (False, True)}[args.causal]
        rows = measure(shapes, dtype, args.check_n, causal_modes)
    if args.out:
        record = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "command": " ".join(["python", *sys.argv]),
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  "versions": {"torch": torch.__version__, "triton": triton.__version__},
                  "dtype": args.dtype, "rows": rows}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
