#!/usr/bin/env python3
"""An experiment toward issue #18's forward with its JVP: chapter 11's warp-specialised
schedule carrying the tangent. Not part of the library, and **not yet run on a GPU**: it
compiles for sm_90 (`--resources`, on any machine) and its GPU mode checks it against
float64 before timing it, so its first GPU run says whether it is right and whether it pays.

    python benchmarks/warp_specialized_jvp.py --resources        # CPU: ptxas -v for sm_90
    python benchmarks/warp_specialized_jvp.py --out results.json  # an sm_90 GPU

The kernel is chapter 11's (a loader warp, two warpgroups of 64 query rows taking turns at
the tensor cores) with chapter 3's tangent: per key tile, the scores S = Q Kᵀ and their
tangent tS = tQ Kᵀ + Q tKᵀ in one turn, the online softmax with the running mu, then
O += P̃ V and tO += (P̃ ∘ (tS - mu)) V + P̃ tV in the next turn (tO kept centred on mu, as
in chapter 2's kernel). All products are in the inputs' 16-bit dtype (the library's "fast"
precision; "accurate" needs chapter 2's exact fp16 copies or split products on top). The
loader fills two ring slots, each holding K, tK, V and tV.

The register budget decides the tiles (compiled with Triton 3.6 for sm_90, ptxas -v): a
compute thread holds S and tS (64 x N fp32 each), O and tO (64 x d) and the two 16-bit
operands. At d = 128, 64-key tiles fit the 240 registers with no spill; 128-key tiles spill
about 3 KB. At d = 64, 128-key tiles fit. The GPU mode times each candidate beside
`torch.func.jvp(jvp_attention.attention)` in both precisions, credited 3x the forward's
FLOPs as chapter 8 does.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from jvp_attention.warp_specialized import (  # noqa: E402
    COMPUTE_REGS,
    GROUP_ROWS,
    LAUNCH_REGS,
    LOADER_REGS,
    _as_matrices,
    _descriptor,
    _masked,
    _pass_turn,
    _store_rows,
    _take_turn,
    mma_layout,
    tma_load,
)

sys.path.insert(0, str(ROOT / "benchmarks"))
from warp_specialized import checked_and_timed  # noqa: E402

SCHEMA = "jvp_attention.warp_specialized_jvp/1"
CANDIDATES = {  # name: (d, key tile, ring slots)
    "d128_n64_s2": (128, 64, 2),
    "d128_n128_s1": (128, 128, 1),
    "d64_n128_s2": (64, 128, 2),
    "d64_n64_s3": (64, 64, 3),
}


@gluon.jit
def _jvp_loader(q_desc, k_desc, v_desc, tq_desc, tk_desc, tv_desc, q_tiles, tq_tiles, k_ring,
                v_ring, tk_ring, tv_ring, q_ready, k_ready, v_ready, slot_free, batch, head,
                kv_head, q_start, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Chapter 11's loader with the tangents: tQ beside Q, tK beside K (one barrier: the
    scores need both), tV beside V."""
    GROUPS: gl.constexpr = q_tiles.shape[0]
    GROUP_M: gl.constexpr = q_desc.block_type.shape[2]
    mbarrier.expect(q_ready, 2 * GROUPS * q_desc.block_type.nbytes)
    for g in gl.static_range(GROUPS):
        tma_load(q_desc, [batch, head, q_start + g * GROUP_M, 0], q_ready, q_tiles.index(g))
        tma_load(tq_desc, [batch, head, q_start + g * GROUP_M, 0], q_ready, tq_tiles.index(g))
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(slot_free.index(slot), ((j // STAGES) & 1) ^ 1)
        start_n = j * BLOCK_N
        mbarrier.expect(k_ready.index(slot), 2 * k_desc.block_type.nbytes)
        tma_load(k_desc, [batch, kv_head, start_n, 0], k_ready.index(slot), k_ring.index(slot))
        tma_load(tk_desc, [batch, kv_head, start_n, 0], k_ready.index(slot), tk_ring.index(slot))
        mbarrier.expect(v_ready.index(slot), 2 * v_desc.block_type.nbytes)
        tma_load(v_desc, [batch, kv_head, start_n, 0], v_ready.index(slot), v_ring.index(slot))
        tma_load(tv_desc, [batch, kv_head, start_n, 0], v_ready.index(slot), tv_ring.index(slot))


@gluon.jit
def _jvp_compute(q_blocks, tq_blocks, q_tiles, tq_tiles, k_ring, v_ring, tk_ring, tv_ring,
                 q_ready, k_ready, v_ready, slot_free, turns, o_desc, t_desc, lse_ptr, mu_ptr,
                 batch, head, lse_row, q_start, n_q, n_k, n_blocks, qk_scale, scale,
                 GROUP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """One compute group: two turns a key tile (the three score products, then the three
    value products), the softmax and mu between them; then out, tangent_out, lse, mu."""
    GROUP_M: gl.constexpr = o_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = o_desc.block_type.shape[3]
    dtype: gl.constexpr = q_tiles.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N, num_warps)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, num_warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_smem = q_tiles.index(GROUP)
    tq_smem = tq_tiles.index(GROUP)
    first_row = q_start + GROUP * GROUP_M

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
        s = _masked(s, j * BLOCK_N, first_row, n_k, CAUSAL)
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, axis=1)
        ts = ts * scale
        mu_new = (mu_i * l_i * alpha + gl.sum(p * ts, axis=1)) / l_new
        p_c = p * (ts - gl.expand_dims(mu_new, 1))
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        acc_o = acc_o * alpha_o
        shift = gl.expand_dims(gl.convert_layout(mu_new - mu_i, o_rows), 1)
        acc_t = acc_t * alpha_o - shift * acc_o  # tO stays centred on the running mu
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        pc_op = gl.convert_layout(p_c.to(dtype), p_layout)
        mbarrier.wait(v_ready.index(slot), phase)
        turn = _take_turn(turns, turn, GROUP, True)
        acc_o = warpgroup_mma(p_op, v_ring.index(slot), acc_o, is_async=True)
        acc_t = warpgroup_mma(pc_op, v_ring.index(slot), acc_t, is_async=True)
        acc_t = warpgroup_mma(p_op, tv_ring.index(slot), acc_t, is_async=True)
        _pass_turn(turns, GROUP, True)
        acc_o, acc_t, p_op, pc_op = warpgroup_mma_wait(0, deps=(acc_o, acc_t, p_op, pc_op))
        mbarrier.arrive(slot_free.index(slot), count=1)
        m_i, l_i, mu_i = m_new, l_new, mu_new

    inv_l = gl.expand_dims(gl.convert_layout(1.0 / l_i, o_rows), 1)
    _store_rows(o_desc, q_smem, q_blocks.index(GROUP), (acc_o * inv_l).to(dtype), batch, head,
                first_row)
    _store_rows(t_desc, tq_smem, tq_blocks.index(GROUP), (acc_t * inv_l).to(dtype), batch, head,
                first_row)
    rows = first_row + gl.arange(0, GROUP_M, row_layout)
    gl.store(lse_ptr + lse_row + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=rows < n_q)
    gl.store(mu_ptr + lse_row + rows, mu_i, mask=rows < n_q)


@gluon.jit
def _blocks(desc, count: gl.constexpr):
    """Shared memory for `count` blocks of `desc`."""
    return gl.allocate_shared_memory(desc.dtype, [count] + desc.block_type.shape, desc.layout)


@gluon.jit
def ws_jvp_kernel(q_desc, k_desc, v_desc, tq_desc, tk_desc, tv_desc, o_desc, t_desc, lse_ptr,
                  mu_ptr, n_heads, n_q, n_k, group_size, qk_scale, scale,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """Grid (cdiv(Nq, 128), B·Hq), as chapter 11's kernel, with the tangents' descriptors."""
    GROUP_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK_M: gl.constexpr = 2 * GROUP_M
    tile = gl.program_id(0)
    if CAUSAL:
        tile = gl.num_programs(0) - 1 - tile
    q_start = tile * BLOCK_M
    batch = gl.program_id(1) // n_heads
    head = gl.program_id(1) % n_heads
    if CAUSAL:
        n_blocks = gl.cdiv(gl.minimum(q_start + BLOCK_M, n_k), BLOCK_N)
    else:
        n_blocks = gl.cdiv(n_k, BLOCK_N)
    q_tiles, tq_tiles = _blocks(q_desc, 2), _blocks(tq_desc, 2)
    k_ring, tk_ring = _blocks(k_desc, STAGES), _blocks(tk_desc, STAGES)
    v_ring, tv_ring = _blocks(v_desc, STAGES), _blocks(tv_desc, STAGES)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    slot_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(slot_free.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    q_2d = _as_matrices(q_tiles, q_desc)
    tq_2d = _as_matrices(tq_tiles, q_desc)
    k_2d = _as_matrices(k_ring, k_desc)
    tk_2d = _as_matrices(tk_ring, k_desc)
    v_2d = _as_matrices(v_ring, v_desc)
    tv_2d = _as_matrices(tv_ring, v_desc)
    lse_row = gl.program_id(1).to(gl.int64) * n_q
    kv_head = head // group_size
    gl.warp_specialize([
        (_jvp_compute, (q_tiles, tq_tiles, q_2d, tq_2d, k_2d, v_2d, tk_2d, tv_2d, q_ready, k_ready,
                        v_ready, slot_free, turns, o_desc, t_desc, lse_ptr, mu_ptr, batch, head,
                        lse_row, q_start, n_q, n_k, n_blocks, qk_scale, scale, 0, BLOCK_N, STAGES,
                        CAUSAL, num_warps)),
        (_jvp_compute, (q_tiles, tq_tiles, q_2d, tq_2d, k_2d, v_2d, tk_2d, tv_2d, q_ready, k_ready,
                        v_ready, slot_free, turns, o_desc, t_desc, lse_ptr, mu_ptr, batch, head,
                        lse_row, q_start, n_q, n_k, n_blocks, qk_scale, scale, 1, BLOCK_N, STAGES,
                        CAUSAL, num_warps)),
        (_jvp_loader, (q_desc, k_desc, v_desc, tq_desc, tk_desc, tv_desc, q_tiles, tq_tiles, k_ring,
                       v_ring, tk_ring, tv_ring, q_ready, k_ready, v_ready, slot_free, batch, head,
                       kv_head, q_start, n_blocks, BLOCK_N, STAGES)),
    ], [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])


def launch(q, k, v, tq, tk, tv, is_causal: bool, scale: float, key_block: int, stages: int):
    """out, tangent_out, lse, mu of (B, H, N, D) inputs, as chapter 2's forward returns."""
    batch, n_heads, n_q, _ = q.shape
    out, t_out = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    mu = torch.empty_like(lse)
    rows = (GROUP_ROWS, key_block, key_block, GROUP_ROWS, key_block, key_block, GROUP_ROWS,
            GROUP_ROWS)
    descriptors = [_descriptor(t, r) for t, r in zip((q, k, v, tq, tk, tv, out, t_out), rows,
                                                     strict=True)]
    grid = (triton.cdiv(n_q, 2 * GROUP_ROWS), batch * n_heads)
    ws_jvp_kernel[grid](*descriptors, lse, mu, n_heads, n_q, k.shape[2],
                        n_heads // k.shape[1], scale * math.log2(math.e), scale,
                        STAGES=stages, CAUSAL=is_causal, num_warps=4, maxnreg=LAUNCH_REGS)
    return out, t_out, lse, mu


def compile_for_hopper(name: str, causal: bool = False) -> dict:
    """Compile candidate `name` for sm_90 on this machine: registers, spills, shared memory,
    the partitions' register budgets."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    from kernel_resources import ptxas_report  # noqa: E402

    d, key_block, stages = CANDIDATES[name]
    x = torch.empty(1, 1, 1024, d, dtype=torch.bfloat16)
    names = ("q_desc", "k_desc", "v_desc", "tq_desc", "tk_desc", "tv_desc", "o_desc", "t_desc")
    rows = (GROUP_ROWS, key_block, key_block, GROUP_ROWS, key_block, key_block, GROUP_ROWS,
            GROUP_ROWS)
    signature = {arg: native_specialize_impl(BaseBackend, _descriptor(x, r), False, True,
                                             True)[0] for arg, r in zip(names, rows, strict=True)}
    signature |= {"lse_ptr": "*fp32", "mu_ptr": "*fp32", "n_heads": "i32", "n_q": "i32",
                  "n_k": "i32", "group_size": "i32", "qk_scale": "fp32", "scale": "fp32"}
    constexprs = {"STAGES": stages, "CAUSAL": causal, "num_warps": 4}
    signature |= {constant: "constexpr" for constant in constexprs}
    start = time.perf_counter()
    compiled = triton.compile(GluonASTSource(ws_jvp_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 128),
                              options={"num_warps": 4, "maxnreg": LAUNCH_REGS})
    ptx = compiled.asm["ptx"]
    budgets = re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)
    return {"candidate": name, "d": d, "key_block": key_block, "stages": stages,
            "causal": causal, **ptxas_report(ptx), "shared": compiled.metadata.shared,
            "setmaxnreg": sorted(set(budgets)),
            "compile_s": round(time.perf_counter() - start, 2)}


def errors(q, k, v, tangents, ours, causal: bool) -> dict:
    """Max errors of out and tangent_out against float64, each over PyTorch math's in the
    inputs' dtype (torch.func.jvp of the math path)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from jvp_attention.reference import reference_attention

    exact = reference_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                enable_gqa=True, tangents=tuple(t.double() for t in tangents))
    with sdpa_kernel(SDPBackend.MATH):
        floor = torch.func.jvp(
            lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                a, b, c, is_causal=causal, enable_gqa=True), (q, k, v), tangents)
    row = {}
    for name, mine, low, truth in (("out", ours[0], floor[0], exact.out),
                                   ("tangent_out", ours[1], floor[1], exact.tangent_out)):
        error = (mine.double() - truth).abs().max().item()
        row[f"{name}_err_ratio"] = error / (low.double() - truth).abs().max().item()
    return row


def timed_calls(q, k, v, tangents, causal: bool) -> dict:
    """name -> zero-argument call: the candidates of q's head dim, and the library's
    forward with its JVP as users call it, in both precisions."""
    import jvp_attention

    d = q.shape[-1]
    calls = {name: (lambda kb=kb, st=st: launch(q, k, v, *tangents, causal, d**-0.5, kb, st))
             for name, (dd, kb, st) in CANDIDATES.items() if dd == d}

    def library(precision: str):
        with jvp_attention.precision(precision):
            return torch.func.jvp(
                lambda a, b, c: jvp_attention.attention(a, b, c, is_causal=causal),
                (q, k, v), tangents)

    for precision in ("accurate", "fast"):
        calls[f"ours_{precision}"] = lambda precision=precision: library(precision)
    return calls


def measure(shapes, check_n: int) -> list[dict]:
    """Every call at every shape, full and causal: checked, then timed."""
    from jvp_attention.reference import FORWARDS_PER_CALL, sdpa_flops

    rows = []
    for (B, H, N, d), causal in ((shape, c) for shape in shapes for c in (False, True)):
        q, k, v, tq, tk, tv = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16)
                               for _ in range(6))
        flops = sdpa_flops(B, H, N, N, d, d, causal) * FORWARDS_PER_CALL["fwd_jvp"]
        check = functools.partial(errors, q, k, v, (tq, tk, tv), causal=causal)
        for name, call in timed_calls(q, k, v, (tq, tk, tv), causal).items():
            rows.append(checked_and_timed({"shape": [B, H, N, d], "causal": causal,
                                           "impl": name}, call,
                                          check if N <= check_n else None, flops))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resources", action="store_true",
                        help="compile each candidate for sm_90 and report (no GPU needed)")
    parser.add_argument("--shapes", nargs="+", default=["4,16,4096,128", "1,16,16384,128",
                                                        "4,16,4096,64"], help="B,H,N,d")
    parser.add_argument("--check-n", type=int, default=4096,
                        help="check against float64 up to this N (the reference is O(N^2))")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args()
    if args.resources:
        rows = []
        for name in CANDIDATES:
            rows.append(compile_for_hopper(name))
            print(json.dumps(rows[-1]), flush=True)
    else:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        rows = measure(shapes, args.check_n)
    if args.out:
        record = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "command": " ".join(["python", *sys.argv]),
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  "versions": {"torch": torch.__version__, "triton": triton.__version__},
                  "rows": rows}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
