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
# # Chapter 4: Hopper's copy engine (TMA), and what bounds the kernels
#
# Chapters 2 and 3 load every tile with pointer arithmetic: each thread computes the
# addresses of its share of a $B_N \times D$ tile, masks the rows past the sequence end, and
# issues its loads. On Ampere that is how it is done (Triton turns such loads into
# asynchronous copies, `cp.async`, and pipelines them). Hopper (the H100 and H200) adds a
# **bulk tensor copy engine**, the Tensor Memory Accelerator: one thread hands it a
# *descriptor* (base address, shape, strides of a matrix, and the box to copy) and a
# coordinate, and the hardware moves the whole tile into shared memory, signalling a
# barrier when it is done. Out-of-bounds elements of the box are written as zeros by the
# hardware. What this buys:
#
# * the address arithmetic and the boundary masks leave the registers (the threads compute
#   nothing per element), which matters in kernels as register-hungry as ours;
# * the copies are asynchronous by construction, so the software pipeliner overlaps the
#   next block's K and V with the current block's matrix products;
# * the zero fill replaces the masks at the sequence end, as long as the descriptor's shape
#   stops where the data stops.
#
# That last condition is the one to get right. A descriptor over the whole `(B, H, N, D)`
# tensor flattened to `(B·H·N, D)` would read the next head's first rows where this head's
# last tile runs past $N$: silently wrong numbers for every length that is not a multiple of
# the tile. Our kernels build one descriptor per (batch, head) inside each program, with
# shape $(N_{\text{head}}, D)$ and the tensor's own row stride, so rows past the end are the
# hardware's zeros. `tl.make_tensor_descriptor` does this on the device (Triton writes the
# 128-byte descriptor into a small global workspace, which is why the launcher installs an
# allocator); `tl.make_block_ptr`, the older way to say the same, is removed in Triton 3.9.

# %%
import inspect
import json
import os
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
FULL_SIZE = DEVICE == "cuda"
print(f"device: {DEVICE}, interpreter: {os.environ.get('TRITON_INTERPRET', '0') == '1'}")

# %% [markdown]
# ## One switch, no second kernel
#
# The descriptor path is not a copy of the kernels. Chapter 2's kernels ask a *tile source*
# for their tiles; `USE_TMA`, a compile-time constant, decides what a source is: the
# pointer to the head's first row, or a descriptor built from that pointer. Triton compiles
# each choice into its own specialisation, so the pointer kernel carries no trace of the
# descriptor one. The two helpers are all there is to it:

# %%
from jvp_attention import tiles

for helper in (tiles.tile_source, tiles.load_rows):
    print(inspect.getsource(helper.fn))

# %% [markdown]
# The kernels call them for Q, K, V and the tangents (chapter 5's backward does the same
# for dO, with the same helpers). Masks stay on pointers: a broadcast mask has stride 0,
# which a descriptor cannot express.
#
# ## When descriptors are used
#
# The copy engine has rules: the last dimension contiguous, the base address and every
# other stride a multiple of 16 bytes, a positive row stride. `tma_eligible` checks them on
# every tensor that the kernel reads through a descriptor, and the launch falls back to
# pointers when any fails, or off Hopper, or on CPU tensors. `JVP_ATTENTION_TMA=0` turns
# descriptors off; `=1` forces them (the interpreter emulates descriptors, which is how the
# CPU tests cover this path). The decision is part of the autotuning key (`USE_TMA`), so
# each path keeps its own best tile.
#
# One more rule is about length, not layout. Each program builds its descriptors in global
# memory before its first block, and a short loop has few blocks to repay that. Once the
# pointer loads carry their alignment (chapter 2's `row_alignment`), they run level with
# descriptors at d = 64 (within 4%) and ahead of them at d = 72, up to long rows. On the
# H200 (bf16, GPU time per call, pointers against descriptors) the forward with the
# tangent took 0.59 against 0.79 ms at (48, 12, 512, 72), 0.99 against 1.12 ms at (16, 16,
# 1024, 72) and 2.07 against 2.16 ms at (8, 16, 2048, 128); from 4096 keys the two were
# within 3%, descriptors ahead at d = 72 and 128. So the forward reads through pointers
# below 4096 keys (`FORWARD_TMA_MIN_KEYS`, chapter 2). The first-order backward, whose dQ
# loop runs over the keys and dK/dV loop over the queries, switches at 1024 of both
# (`BACKWARD_TMA_MIN_TOKENS`, chapter 5): below that pointers were up to 15% faster (the
# backward's kernels took 0.26 against 0.31 ms at (64, 12, 256, 64)), above it descriptors
# were (1.12 against 1.31 ms at (32, 12, 1024, 64)).
# `benchmarks/results/descriptors_h200.json` has every case. These lengths were measured
# without a mask; a causal program loops over about half the keys, so causal rows might
# have preferred pointers longer. They do not: causal, at 4096 and 8192 tokens (bf16, d 64
# and 128), descriptors were level or ahead for the forward with the tangent (2.18 against
# 2.19 ms at (4, 32, 4096, 64), 4.08 against 4.15 ms at (2, 16, 8192, 128)) and 8 to 24%
# faster for the backward (2.78 against 3.35 ms at (4, 32, 4096, 64), 4.97 against 6.16 ms
# at (2, 32, 8192, 64); `benchmarks/results/descriptors_causal_h200.json`).

# %%
from jvp_attention.launch import descriptor_compatible

x = torch.randn(2, 4, 64, 80, dtype=torch.float16)
layouts = {
    "(B, H, N, D) contiguous": x,
    "(B, N, H, D) storage, transposed view": x.transpose(1, 2).contiguous().transpose(1, 2),
    "D not contiguous": x.transpose(-1, -2),
    "rows 81 halves apart (162 bytes)": torch.randn(2, 4, 64, 81, dtype=torch.float16),
    "81 of 96 columns (rows 192 bytes apart)": torch.randn(2, 4, 64, 96,
                                                          dtype=torch.float16)[..., :81],
    "expanded (stride 0 rows)": torch.ones(1, 1, 1, 80).expand(2, 4, 64, 80),
}
for name, tensor in layouts.items():
    print(f"{name:40} descriptor-compatible: {descriptor_compatible(tensor)}")

# %% [markdown]
# ## Same numbers
#
# A descriptor changes how tiles reach shared memory, not what they hold, so the two paths
# must agree. In the interpreter they agree bit for bit; we check the forward with tangents
# and both backwards on a problem built to catch a wrong boundary: ragged lengths (45
# queries, 37 keys: every head's last tile runs past its end), GQA, $d_{qk} = 80 \ne d_v =
# 48$ and a key-padding mask. On the GPU the compiled kernels may order their arithmetic
# differently, so there we compare each path with float64 instead.

# %%
from jvp_attention.backward import flash_attention_backward
from jvp_attention.forward import flash_attention_forward
from jvp_attention.reference import FORWARDS_PER_CALL, reference_attention, sdpa_flops

torch.manual_seed(0)
N_Q, N_K = (4250, 4133) if FULL_SIZE else (45, 37)
dtype = torch.bfloat16 if FULL_SIZE else torch.float16
q = torch.randn(2, 4, N_Q, 80, device=DEVICE, dtype=dtype)
k = torch.randn(2, 2, N_K, 80, device=DEVICE, dtype=dtype)
v = torch.randn(2, 2, N_K, 48, device=DEVICE, dtype=dtype)
tangents = tuple(torch.randn_like(t) for t in (q, k, v))
grad_out = torch.randn(2, 4, N_Q, 48, device=DEVICE, dtype=dtype)
grad_tangent_out = torch.randn_like(grad_out)
keep = torch.rand(2, 1, 1, N_K, device=DEVICE) > 0.2


def run_everything(setting: str) -> dict[str, torch.Tensor]:
    """Forward with tangents, first- and second-order backward, with JVP_ATTENTION_TMA set."""
    os.environ["JVP_ATTENTION_TMA"] = setting
    try:
        fwd = flash_attention_forward(q, k, v, keep, False, None, tangents)
        plain = flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out, keep)
        second = flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out, keep, False,
                                          None, tangents, fwd.tangent_out, fwd.mu,
                                          grad_tangent_out)
    finally:
        os.environ.pop("JVP_ATTENTION_TMA")
    return {"out": fwd.out, "tangent_out": fwd.tangent_out,
            **dict(zip(("dq", "dk", "dv"), plain, strict=True)),
            **dict(zip(("dq2", "dk2", "dv2", "dtq", "dtk", "dtv"), second, strict=True))}


descriptor_path, pointer_path = run_everything("1"), run_everything("0")
if not FULL_SIZE:
    for name, value in descriptor_path.items():
        assert torch.equal(value, pointer_path[name]), name
    print("interpreter: every output of the descriptor path equals the pointer path's, bit for bit")
else:
    gqa = dict(enable_gqa=True, attn_mask=keep)
    ref = reference_attention(q.double(), k.double(), v.double(), **gqa)
    scale = ref.out.abs().max().item()
    for name, paths in (("descriptors", descriptor_path), ("pointers", pointer_path)):
        err = (paths["out"].double() - ref.out).abs().max().item() / scale
        print(f"{name:12} out: max error vs float64 {err:.1e} (relative to max |O|)")
    diffs = {name: (descriptor_path[name].float() - pointer_path[name].float()).abs().max().item()
             for name in descriptor_path}
    print("largest difference between the paths:",
          "  ".join(f"{name} {diff:.1e}" for name, diff in diffs.items()))

# %% [markdown]
# The tests (`tests/library/test_forward_tma.py`) repeat this on more shapes, and on the H200
# check both paths against float64 at $N = 4250$ with the same floor-ratio criterion as every
# other kernel test.
#
# ## What each tile costs: registers, spills, shared memory
#
# Which tiles to offer the autotuner, and whether descriptors pay, can be read off the
# compiler before any GPU time is spent. `tools/kernel_resources.py` compiles every
# configuration of every kernel for `sm_90` on a CPU machine (Triton ships `ptxas`) and
# reports registers per thread, spilled bytes and shared memory, and which copy instructions
# the PTX uses: `cp.async.bulk.tensor` is the copy engine, `cp.async` the Ampere-style
# asynchronous copy. A Hopper block may take 227 KiB of shared memory and a thread 255
# registers; past those, a tile cannot launch or spills to local memory. The table below is
# bf16, $d = 128$, no mask (`benchmarks/results/kernel_resources_sm90.json`).

# %%
RESOURCES = Path("../benchmarks/results/kernel_resources_sm90.json")
rows = json.loads(RESOURCES.read_text())
header = f"{'kernel':24} {'tile (M, N, warps, stages)':28} {'path':9} {'regs':>5} {'spills':>7} {'smem KiB':>9}"
print(header)
print("-" * len(header))
for row in sorted(rows, key=lambda r: (r["kernel"], tuple(r["tile"]), r["use_tma"])):
    path = "TMA" if row["use_tma"] else "pointers"
    flag = "" if row["fits"] else "  too much shared memory"
    print(f"{row['kernel']:24} {str(tuple(row['tile'])):28} {path:9} {row['regs']:5d} "
          f"{row['spills']:7d} {row['shared'] / 1024:9.0f}{flag}")

# %% [markdown]
# Three things stand out. First, descriptors lower the register count of the plain
# forward and of the first-order backward kernels (no per-element addresses), at the same
# shared memory. Second, the **second-order** backward kernels hold four fp32 accumulators
# and up to eight input tiles: they sit at or just under the 255-register ceiling, the
# dK/dV kernel spills on every tile but 16 × 32 and the dQ kernel on its 128 × 32 one.
# Their rows above are pointer-only: compiled with descriptors forced on they spilled
# hundreds of bytes per thread (468 and 856 bytes for the 32 × 32 tiles of the dK/dV and
# dQ kernels with a boolean mask), so the launcher keeps them on pointers (chapter 5). Third, the
# forward with the tangent fits a 128 × 32 tile on 8 warps with no spills, but not
# 128 × 64, and its 64 × 64 tile on 4 warps spills about 100 bytes: the tangent doubles
# the accumulators, which is what bounds its tile size.
#
# ## Does it pay? Timing both paths
#
# On the H200 (bf16, B = 4, H = 16, N = 4096, d = 128), each kernel autotuned on each
# path, timed with `triton.testing.do_bench` (median, L2 flushed between calls). FLOPs are
# counted as everywhere in the book (chapter 1's `sdpa_flops` and `FORWARDS_PER_CALL`):
# $4BHN^2d$ per forward (halved when causal), three times that for the forward with its JVP,
# 2.5 times for the backward.

# %%
def timings(causal: bool) -> dict[str, dict[str, float]]:
    """TFLOP/s of fwd, fwd+JVP and bwd with descriptors (auto) and with pointers."""
    import triton.testing

    b, h, n, d = 4, 16, 4096, 128
    x = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(7)]
    q_, k_, v_, tq, tk, tv, do = x
    flops = sdpa_flops(b, h, n, n, d, d, causal)
    credit = FORWARDS_PER_CALL
    calls = {
        "fwd": (credit["fwd"], lambda: flash_attention_forward(q_, k_, v_, is_causal=causal)),
        "fwd+JVP": (credit["fwd_jvp"], lambda: flash_attention_forward(
            q_, k_, v_, is_causal=causal, tangents=(tq, tk, tv))),
    }
    saved = flash_attention_forward(q_, k_, v_, is_causal=causal)
    calls["bwd"] = (credit["bwd"], lambda: flash_attention_backward(
        q_, k_, v_, saved.out, saved.lse, do, is_causal=causal))
    result = {}
    for setting, label in (("auto", "TMA"), ("0", "pointers")):
        os.environ["JVP_ATTENTION_TMA"] = setting
        try:
            result[label] = {name: multiple * flops / triton.testing.do_bench(
                fn, return_mode="median") / 1e9 for name, (multiple, fn) in calls.items()}
        finally:
            os.environ.pop("JVP_ATTENTION_TMA")
    return result


if FULL_SIZE:
    for causal in (False, True):
        measured = timings(causal)
        for label, row in measured.items():
            cells = "  ".join(f"{name} {value:6.1f}" for name, value in row.items())
            print(f"causal={causal!s:5} {label:9} TFLOP/s: {cells}")
else:
    print("timings need a GPU (the executed chapter on the documentation site shows the H200's)")

# %% [markdown]
# On the H200, at these 4096 tokens, the two paths are level for the forward with its JVP,
# and descriptors make the plain forward 2 to 9% faster and the backward 8 to 9% faster,
# causal or not (the outputs above; the executed chapter shows the H200's). Triton's
# asynchronous copies already hide most of the load latency at these tile sizes; what
# descriptors add is registers, which the tables above show and which the backward, with
# its five products per tile, turns into speed. The automatic choice therefore stays on descriptors
# for long rows wherever the rules allow, except for the second-order backward (lengths
# in the section above).
#
# ## What bounds the kernels
#
# The measurements of chapter 8 (bf16, d = 128) put our forward at 0.80 to 0.83 of SDPA's
# best backend (507 against 617 TFLOP/s at B4 H16 N4096; FlashAttention 3 or cuDNN,
# hand-written for Hopper), the forward with its JVP at 392 TFLOP/s at N = 4096 and 436 at
# N = 16384 (433 and 446 in "fast" precision), and the backward at 0.66 of SDPA's at
# N = 4096 and 0.75 at N = 16384. The evidence points at four limits, in order of weight:
#
# 1. **What accuracy costs.** For fp16 inputs the default "accurate" precision splits the
#    fp32 operands of 16-bit products into two 16-bit halves (chapter 3): the forward with
#    its JVP runs nine matrix products per tile where the FLOP count credits six, the
#    backward ten where it credits five (seven without the split; FlashAttention recomputes
#    the same way). With splits for bf16 too, an earlier run measured 334 TFLOP/s for the
#    forward with its JVP and 0.54 of SDPA for the backward, and "fast" precision was 1.29x
#    and 1.41x faster, as the product counts predict (10/7 = 1.43x). bf16 inputs now run
#    those products on exact fp16 copies (chapter 2) with no extra product; what is left is
#    the copies themselves, O(N) passes over the inputs: about 0.4 ms at B4 H16 N4096 (the
#    backward takes 3.9 ms against 3.45 ms in "fast" precision), shrinking relative to the
#    O(N^2) kernels as sequences grow (1.02x to 1.09x at N = 16384).
# 2. **Registers.** The tangent doubles the fp32 accumulators, and the second-order
#    backward quadruples them: the table above shows those kernels at the 255-register
#    ceiling, which limits their tiles to 32-64 rows and costs them tensor-core efficiency
#    (a Hopper warpgroup multiply wants 64 rows per warpgroup). Halving the second-order
#    dK/dV kernel's accumulators by splitting it into two launches, one for $dK$ and
#    $dt_K$ and one for $dV$ and $dt_V$, does not pay: each launch recomputes the scores and
#    their tangents (21 products per tile between them where one kernel runs 18), and in an
#    experiment on the H200 (bf16, autotuned, not kept) the pair took 17 to 26% longer than
#    the one kernel, 19.9 against 15.8 ms at B4 H16 N4096 d128 and 0.64 against 0.54 ms at
#    (64, 12, 256, 64), with the autotuner still choosing 16 × 32 tiles for $dK$.
# 3. **No warp specialisation.** SDPA's Hopper kernels dedicate warps to the copy engine
#    and overlap the softmax of one tile with the matrix products of the next (FlashAttention
#    3's ping-pong schedule). Triton 3.6 on Hopper pipelines the copies but issues products
#    and exponentials from the same warps. Its automatic warp specialisation
#    (`tl.range(..., warp_specialize=True)`) does not take this kernel yet: on the forward's
#    key loop, compiled for sm_90 with descriptors, the 128 × 64 tiles compile to the same
#    registers and shared memory as without it, with no warp-group split in the PTX (no
#    `setmaxnreg`, the same barriers and products), and the 64 × 64 tile on 4 warps stops in
#    Triton's `NVGPUWarpSpecialization` pass. Triton 3.9.0 does the same. The way there is
#    Gluon, Triton's explicit layer, with the copies, barriers and warp groups written out:
#    chapter 11 builds the primal forward that way (a loader warp, two warpgroups in
#    ping-pong) and measures 616 against 492 TFLOP/s for this chapter's kernel at
#    (4, 16, 4096, 128), level with cuDNN, then the forward with its JVP (572 against 414
#    TFLOP/s in "accurate" mode); the library takes both for long unmasked rows. The
#    backward kernels do not have it yet.
# 4. **The exponential unit** is not the limit at $d = 128$: one `exp2` per score against
#    $2d$ multiply-adds per score for the two forward products.
#
# The cold start is part of the cost a user sees: on a fresh H200 process, the first call
# of each kernel compiles its candidate tiles and times them: 7 s for the forward, 8 s for
# the forward with the JVP, 10 s for the backward and 11 s for the second-order backward at
# B4 H16 N4096 d128 (`benchmarks/results/h200_2026-11-30.json`, `first_call_ms`, with the
# benchmark's quicker timer for the candidates); later shapes in the same power-of-two length
# bucket reuse the choice, and Triton's on-disk cache removes the compile part in later
# processes. `JVP_ATTENTION_AUTOTUNE=0` skips the timing and takes the first tile that fits.
