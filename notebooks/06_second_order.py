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
# # Chapter 6: backward through the tangent
#
# Some losses use the JVP output itself and need its gradient: Terminal Velocity Matching,
# Jacobian or Lipschitz regularisers, consistency losses without a stop-gradient,
# Hessian-vector products. After `o, t_o = torch.func.jvp(f, ...)`, a loss on $t_O$ must
# backpropagate to $Q, K, V$ *and* to the tangents $t_Q, t_K, t_V$. PyTorch's math path
# can do it by differentiating its own forward-AD graph, at $O(N^2)$ memory. Here it is a
# flash-style pass at $O(N)$ memory, and it is the `HAS_TANGENT` specialisation of chapter
# 5's two kernels: the same tiles, the same loops, more products per tile.
#
# ## The formulas
#
# Given cotangents $dO$ and $dt_O$, per tile (chapter 1 derived and checked these in
# float64; $G$ here is the *backward* quantity $dt_O V^\top$, not the forward accumulator):
#
# $$G = dt_O\,V^\top,\qquad c_i = \mathrm{rowsum}(dt_O \circ O),\qquad
# t_P = P \circ (t_S - \mu),$$
#
# $$dt_V = P^\top dt_O,\qquad dV = P^\top dO + t_P^\top dt_O,$$
#
# $$dP = dO\,V^\top + dt_O\,t_V^\top + G \circ (t_S - \mu) - c \circ t_S,\qquad
# dt_S = P \circ (G - c),$$
#
# $$dS = P \circ (dP - \Delta_2),\qquad \Delta_2 = \mathrm{rowsum}(dO \circ O) +
# \mathrm{rowsum}(dt_O \circ t_O) - \mu \circ c,$$
#
# $$dQ = s\,(dS\,K + dt_S\,t_K),\quad dK = s\,(dS^\top Q + dt_S^\top t_Q),\quad
# dt_Q = s\,dt_S\,K,\quad dt_K = s\,dt_S^\top Q.$$
#
# Every row statistic comes from what the forward stored: LSE and $\mu$ from the JVP
# kernel, $c$ and $\Delta_2$ from $O$, $t_O$, $\mu$ and the cotangents, by chapter 5's row
# statistics kernel. So one pass over the tiles suffices, and nothing of size
# $N_q \times N_k$ is stored. Per tile the kernels compute $S$, $t_S$ (two products), $dO V^\top$,
# $dt_O t_V^\top$, $G$ and the six gradient products: twelve matrix products against the
# plain backward's five.
#
# The key side's program holds four fp32 accumulators ($dK$, $dV$, $dt_K$, $dt_V$, each
# BLOCK_N × d), and at d = 128 every tile of it compiled for sm_90 spills 20–724 bytes of
# registers per thread (`tools/kernel_resources.py`). Two launches, $dV$ and $dt_V$ first,
# then $dK$ and $dt_K$, hold two accumulators each and spill nothing, but each recomputes
# $S$ and $t_S$: fifteen products on the key side instead of twelve. Timed on the H200 in
# one process against the single kernel (bf16, GPU time of the whole call, forward with the
# tangent plus the backward through both outputs), the split was slower at every shape
# tried: 1.01 against 1.14 ms at (64, 12, 256, 64), 6.51 against 7.43 ms at
# (32, 12, 1024, 64), 10.7 against 12.4 ms at (16, 16, 1024, 72), 15.8 against 18.4 ms at
# (4, 16, 4096, 64) and 28.2 against 33.0 ms at (4, 16, 4096, 128), with bitwise equal
# gradients. The spills cost less than the recomputation, so the key side stayed one kernel
# then; the two passes below reversed that at 4096 tokens and more, once each pass had a
# tile list of its own.
#
# Smaller tiles are the other way to fit the four accumulators. At d = 128 three tiles
# outside the list compile without spills: 16 × 32 on 4 warps (1 or 2 stages) and 32 × 16
# on 4 warps. Timed on the H200 inside the backward through both outputs at
# (4, 16, 4096, 128), bf16 (`tools/tile_sweep.py --kernel backward_dkdv_tangent`,
# `benchmarks/results/tile_sweep_h200.json`), the key side's kernel took 15.9 ms with
# 16 × 32 on 2 stages against 17.6 ms with the list's best (32 × 32 on 4 warps), and
# 17.5 ms on 1 stage, while 32 × 16 took 27.4 ms: so narrow query blocks pay, narrow key
# blocks do not. The 2-stage tile joined the list (chapter 5). At d = 64 the list's
# 32 × 32 stays the fastest (9.7 ms against 10.6 ms). The whole backward through both
# outputs at d = 128 then ran at 182 TFLOP/s at 4096 and 16384 tokens (175 and 182
# causal), against 169 and 154 (164 and 172 causal) in the earlier headline run
# (`benchmarks/results/second_order_h200.json`; separate runs, so the comparison is
# between runs). The dQ side's list keeps its best, 128 × 32 on 8 warps (6.6 ms).
#
# With two accumulators a pass, the key side can take the tiles the first-order kernel
# takes (64 × 64 on 4 warps, 128 × 32 on 8, ...), each pass tuned on its own over one list
# (chapter 5, `SPLIT_KEY_SIDE`). Timed in one session on the H200 at (4, 16, 4096, 128),
# bf16, the whole backward through both outputs took 21.39 ms in two passes against 22.49
# in one in "accurate" precision (193 against 183 TFLOP/s) and 16.21 against 18.62 ms in
# "fast" (254 against 221); at (4, 32, 4096, 64) 23.75 and 16.76 ms (174 and 246 TFLOP/s),
# against 26.68 and 22.22 ms for the one pass in the earlier run. So the key side now runs
# in two passes. At the short DiT shapes the two passes gain less but still gain: the
# second-order step (`benchmarks/training_shapes.py --mode second_order --key-side-passes
# 1|2`, GPU time of the call, "accurate", one session) took 0.98 against 1.00 ms at
# (64, 12, 256, 64), 1.01 against 1.03 at (32, 16, 256, 72), 5.87 against 6.46 at
# (32, 12, 1024, 64), 6.64 against 6.88 at (16, 16, 1024, 72) and 6.84 against 7.11 at
# (16, 16, 1024, 128) (`benchmarks/results/training_shapes_key_side_*_h200.json`).
#
# Even in two passes the key side at $d = 128$ seldom multiplies on Hopper's own
# instructions. Hopper's warpgroup products (`wgmma`) take 64 rows per warpgroup; a product
# with fewer, such as a key side's $dV \mathrel{+}= \tilde P^\top dO$ over a key block of
# 16 or 32 keys, falls back to Ampere's `mma.sync`. Counted in the code compiled for sm_90
# (`tools/kernel_resources.py --kernels tangent --head-dim 64 128 --tokens 4096`,
# `benchmarks/results/kernel_resources_second_order_sm90.json`, Triton 3.6): of the $dK$
# pass's tiles at $d = 128$, the only one that multiplies on `wgmma` alone (64 × 64 on 4
# warps) spills 684 bytes a thread, the others that use it spill 24 to 332 bytes or do not
# fit in shared memory, and the two spill-free tiles (32 × 32 and 16 × 32 on 4 warps) use
# `mma.sync` throughout; the $dV$ pass and the $dQ$ kernel each have spill-free tiles that
# use `wgmma` (128 × 16 and 64 × 32 on 8 warps; 128 × 16 on 8 warps), the $dV$ pass's
# for part of their products only, `mma.sync` for the rest. At $d = 64$ every pass has
# spill-free `wgmma` tiles. That is one bound on the backward through both outputs, about
# 230 TFLOP/s at $d = 128$ in "accurate" precision, under a third of the H200's measured
# bf16 peak. Outside the lists, 32 × 64 on 8 warps compiles the $dK$ pass without spills
# (3 `wgmma` groups beside its `mma.sync`), and 16 × 128 on 8 warps and 16 × 64 on 4 the
# $dV$ pass; none has been timed yet.
#
# The accumulators' layout is the other way in. Chapter 5's dK/dV kernel can hold them
# transposed, head dim × keys (`TRANSPOSED`), so that a key gradient's product takes the
# head dim as its rows: 128 or 64 rows whatever the key block, which `wgmma` can take. The
# second-order passes used to keep the stored layout, chosen while the key side was one
# kernel (the transposed one-pass form was slower at every tile tried). Compiled for sm_90
# with both passes transposed (`tools/kernel_resources.py --kernels _tangent --head-dim 64
# 128 --tokens 4096 --key-layout transposed`, and `stored`:
# `benchmarks/results/kernel_resources_second_order_layouts_sm90.json`, the lists' tiles
# and seven more): at $d = 128$ the $dK$ pass has three tiles that multiply on `wgmma`
# alone without spilling (64 × 16 on 8 or 4 warps, 128 × 16 on 8 warps and 1 stage; 215–234
# registers), where stored it has none, and the $dV$ pass eight (64 × 32 on 4 and 8 warps
# among them), where stored it has none (a key block of 16 or 32 keys multiplies its
# gradients on `mma.sync`); at $d = 64$ five of the stored list's eight tiles for $dV$ and
# four for $dK$, against one and none stored. Tiles with fewer than 64 query rows a
# warpgroup still multiply the scores on `mma.sync`. So each pass now tunes its layout with
# its tile: its candidates are the stored list and four transposed tiles that compile onto
# `wgmma` alone (chapter 5's `laid_out`), and the autotuner times both at each new shape.
# `tools/tile_sweep.py --kernel backward_dk_tangent --tiles "16,32,4,2;64,16,8,2,1"` times
# a stored and a transposed tile side by side (a fifth field 1: transposed).
#
# Timed on the H200 inside the backward through both outputs at (4, 16, 4096, 128), bf16
# "accurate" (the last two runs of `benchmarks/results/tile_sweep_h200.json`), the layouts
# split by pass. The $dV$ pass on the transposed 64 × 32 tile, 4 warps, took 14.04 ms
# against 16.54 ms on the stored list's best (64 × 32 on 8 warps), and the autotuner picks
# it. The $dK$ pass keeps the stored 16 × 32 tile on 4 warps (14.69 ms): its transposed
# tiles, on `wgmma` alone, took 18.68 ms (128 × 16, 8 warps), 19.21 ms (64 × 16, 4 warps)
# and 29.78 ms (64 × 16, 8 warps): multiplying on `wgmma` alone does not make that pass
# faster at these tiles (why was not profiled further). The whole backward through both
# outputs ran at 230 TFLOP/s in the same session (17.96 ms, `benchmarks/results/tvm_step_h200.json`), against 18.10 ms in
# the second-order run before the layouts were tuned.
#
# The $dQ$ kernel's list was tuned at $d = 128$ and missed $d = 64$'s best. Timed on an H100
# at (4, 16, 4096, 64), bf16 "accurate" (`tools/tile_sweep.py --kernel backward_dq_tangent`,
# `benchmarks/results/tile_sweep_second_order_h100.json`), 64 × 64 on 4 warps took 2.32 ms
# against 3.29 ms for the list's choice, and joined the list (at $d = 128$ it took 10.1 ms
# against 128 × 32's 5.9, so the autotuner keeps that one there). The GPU time of the whole
# call (forward with the tangent, then the backward through both outputs) fell from 11.25
# to 10.45 ms at $d = 64$ ("fast": 9.83 to 9.24) and stayed 20.7 ms at $d = 128$; the
# backward through both outputs then ran at 239 TFLOP/s at $d = 64$ and 234 at $d = 128$
# on that H100 (273 and 258 "fast"; 4096 tokens, $B \cdot H \cdot d$ the same at both head
# dims; `benchmarks/results/second_order_h100.json` keeps that run's command). In the same calls the key side's
# two passes took 11.5 ms at $d = 128$, the $dQ$ kernel 5.9, the forward with the tangent
# 2.4 and accurate precision's range pass and copies 0.8: the key side is where the rest of
# the time is.
#
# ## A tile that raced, and dQ summed on the key side
#
# Timing the $dK$ pass's tiles for the next step turned up a wrong answer. At $d = 128$ the
# tile the autotuner chose on the H100 above, 32 × 64 on 4 warps, returns a $dt_K$ that is
# not the same from one call to the next: in 8 calls on the same inputs ((2, 8, 1024, 128),
# bf16) one or more differ, once with 3.5x PyTorch's error where the others have 0.15x.
# No other gradient moves, and no other tile does: each tile of both key-side passes and of
# the $dQ$ kernel, forced in turn, gave bitwise the same six gradients in 8 calls at
# $d = 128$ and $64$ (16 × 128 on 8 warps, tried outside the lists, raced too). The
# kernel's source is the same at every tile, so the compiled form of that tile is at
# fault, not the formulas, and its code (Triton 3.6, sm_90) shows how: its threads store
# operands to shared memory (`st.shared`, `stmatrix`) that `wgmma` then reads, with no
# `fence.proxy.async` anywhere (as have 16 × 128 and 32 × 64 on 8 warps, outside the
# lists). Hopper's tensor cores read shared memory through the async proxy, which sees the
# threads' stores only after that fence; every other tile of every list, at $d = 64$ and
# $128$, is free of the pattern (`tools/kernel_resources.py` marks it, `unfenced_wgmma`), and
# so is every configuration of every kernel's list at head dims 16 to 256, in bf16 and fp16,
# causal or with a mask (680 compiled,
# `benchmarks/results/kernel_resources_unfenced_scan_sm90.json`). The tile left the key
# side's list (chapter 5, `_KEY_SIDE_TILES`, for the $dV$ pass too, whose code has the same
# pattern though its gradients did not vary in 8 calls); a CPU test compiles every tile of
# every kernel's list for sm_90 (at $d$ = 128, 72 and 64) and refuses the pattern, and GPU
# tests run every tile of every list (the second order's, the forward's and the first-order
# backward's) several times for bitwise equal results. The price, on the same H100, bf16,
# (4, 16, 4096, 128): the autotuner takes 16 × 32 on 4 warps, the key side's two passes
# take 14.7 ms instead of 11.5, the whole call 24.0 ms instead of 20.8 ("fast": 22.4 against 18.7); at $d = 64$ nothing changes (10.5 ms,
# 64 × 32 on 4 warps). Timed again without it (`benchmarks/bench.py`, the backward alone),
# the backward through both outputs at $d = 128$ runs at 197 TFLOP/s (20.95 ms; 212
# "fast") against 234 with the racing tile, while $d = 64$ keeps 239. Eight more $dK$
# tiles free of the pattern, stored and transposed, were timed on the same H100 (and found
# reproducible, 0.24x PyTorch math's error each): the best, 32 × 64 on 8 warps with one
# stage, transposed, took 16.6 ms for both passes against 14.7 with 16 × 32 on 4 warps
# (`benchmarks/results/tile_sweep_second_order_h100.json`), so the tile's 3 ms are not won
# back by another tile.
#
# The other step was to stop computing $dS$ twice. The $dK$ pass computes $dS$ and $dt_S$
# for every tile, and the $dQ$ kernel computes them again: $S$ and $t_S$ (three products),
# $dO\,V^\top$, $dt_O\,t_V^\top$ and $G$ (three more), all to feed its own three, $dS\,K$,
# $dt_S\,t_K$ and $dt_S\,K$. In products of a tile's size the two key-side passes and the
# $dQ$ kernel run 6 + 9 + 9 = 24; with the $dQ$ kernel's three products done in the $dK$
# pass and added to fp32 sums of $dQ$ and $dt_Q$, 6 + 12 = 18. But every key block's
# program then adds to every query row it sees: atomic adds, $2 \cdot \text{BLOCK\_M}
# \cdot d$ fp32 values per tile (Triton compiles them for sm_90 as 16-byte vector adds,
# `atom.global.gpu.relaxed.add.v4.f32`), about 17 GB of them per call at (4, 16, 4096, 128) with
# 64-key blocks. Built and timed on the H100 (bf16, the whole call, each form with its own
# tuned tiles, before the racing tile left the list), the sums lost everywhere: 22.5
# against 20.8 ms at $d = 128$ ("fast": 21.3 against 18.7) and 11.2 against 10.5 at
# $d = 64$ (9.4 against 9.1), besides giving up reproducible gradients. So the $dQ$
# kernel stays: the adds cost more than the five products they save. (Chapter 12's
# first-order kernel makes the trade pay by handing its adds to the copy engine, which the
# Triton kernels here cannot reach.)
#
# When nothing uses $t_O$ (the MeanFlow and sCM losses put a stop-gradient on the tangent
# target), autograd hands the Function a `None` cotangent for $t_O$ and the plain backward
# runs: the second-order kernels cost nothing unless used.

# %%
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
FULL_SIZE = DEVICE == "cuda"

# %% [markdown]
# ## Checking the kernels against chapter 1
#
# `reference_backward_tangent` applies the formulas above in float64. The kernels run in
# float32 here, over causal and non-causal attention, lengths that are not multiples of any
# tile, GQA (the group's sum happens inside the dK/dV program for all four key-side
# gradients) and a key-padding mask.

# %%
from jvp_attention.backward import flash_attention_backward
from jvp_attention.forward import flash_attention_forward
from jvp_attention.launch import set_precision
from jvp_attention.reference import reference_attention, reference_backward_tangent
from jvp_attention.accuracy import accuracy_table, float64_truth, format_table, math_path

torch.manual_seed(0)
N = 1000 if FULL_SIZE else 40
NAMES = ("dq", "dk", "dv", "dtq", "dtk", "dtv")


def random_inputs(batch, hq, hkv, n_q, n_k, d, dtype):
    shapes = [(batch, hq, n_q, d), (batch, hkv, n_k, d), (batch, hkv, n_k, d)]
    q, k, v = (torch.randn(s, device=DEVICE, dtype=dtype) for s in shapes)
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    grad_out, grad_tangent_out = (torch.randn(batch, hq, n_q, d, device=DEVICE, dtype=dtype)
                                  for _ in range(2))
    return q, k, v, tangents, grad_out, grad_tangent_out


def second_order_grads(q, k, v, tangents, grad_out, grad_tangent_out, **options):
    """The six gradients from our kernels, with the forward's rounding residuals of O and
    tO (chapter 5), as the autograd layer passes them."""
    fwd, (out_res, t_out_res) = flash_attention_forward(q, k, v, tangents=tangents,
                                                        residuals=True, **options)
    return flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out, tangents=tangents,
                                    tangent_out=fwd.tangent_out, mu=fwd.mu,
                                    grad_tangent_out=grad_tangent_out, out_residual=out_res,
                                    tangent_out_residual=t_out_res, **options)


padding = torch.rand(1, 1, 1, N, device=DEVICE) > 0.3
for name, shape, options in [
    ("non-causal", (1, 2, 2, N, N + 9), {}),
    ("causal", (1, 2, 2, N, N), {"is_causal": True}),
    ("GQA 4:2, Nq != Nk", (1, 4, 2, N + 5, N // 2), {}),
    ("key padding", (1, 2, 2, N, N), {"attn_mask": padding}),
]:
    q, k, v, tangents, grad_out, grad_tangent_out = random_inputs(*shape, 64, torch.float32)
    ours = second_order_grads(q, k, v, tangents, grad_out, grad_tangent_out, **options)
    wide = [x.double() for x in (q, k, v)]
    wide_tangents = tuple(t.double() for t in tangents)
    gqa = shape[1] != shape[2]
    ref = reference_attention(*wide, tangents=wide_tangents, enable_gqa=gqa, **options)
    truth = reference_backward_tangent(*wide, wide_tangents, ref.out, ref.lse, ref.tangent_out,
                                       ref.mu, grad_out.double(), grad_tangent_out.double(),
                                       enable_gqa=gqa, **options)
    errors = "  ".join(f"{n} {(a.double() - b).abs().max().item():.1e}"
                       for n, a, b in zip(NAMES, ours, truth, strict=True))
    print(f"{name:18} {errors}")

# %% [markdown]
# ## A learnable bias and its tangent
#
# With an additive mask $B$ that is a parameter, chapter 2's tangent scores are
# $t_S = s\,(t_Q K^\top + Q\,t_K^\top) + t_B$, so the backward through the tangent recomputes
# $t_S$ with $t_B$ too (`_backward_tile` adds it: pass `mask_tangent` to the backward). $B$
# and $t_B$ enter the scores exactly as $S$ and $t_S$ do, with coefficient one, so their
# gradients are the score gradients of the formulas above:
#
# $$\frac{\partial L}{\partial B} = dS = P \circ (dP - \Delta_2),\qquad
# \frac{\partial L}{\partial t_B} = dt_S = P \circ (G - c).$$
#
# With `mask_grad=True` the dQ kernel stores both tiles, as in chapter 5. The tests check them
# against float64 reverse-over-forward (autograd through `torch.func.jvp`) of attention
# written out with the bias as an input: `tests/library/test_backward_second_order.py` for the
# kernels (biases per head, shared by all, full; causal; GQA; rows that see no key) and
# `tests/library/test_autograd_parity.py` through the public API.

# %% [markdown]
# ## Accuracy against PyTorch's math path
#
# The floor is the math path differentiated through its own JVP in the same dtype. In the
# default "accurate" precision mode the kernels split every fp32 operand of a 16-bit product
# into two 16-bit parts (chapter 3); bf16 inputs with at least 1024 keys per row take exact
# fp16 copies instead (chapter 5, "Through the tangent"; the next section), and the rows
# below have 1000; "fast" rounds once. Both use the rounding residuals of
# $O$ and $t_O$ here: $c$ and $\Delta_2$ cancel like chapter 5's $\Delta$. Ratios (our error /
# floor):

# %%
DTYPES = [torch.bfloat16, torch.float16] if FULL_SIZE else [torch.float16]
rows = {}
for dtype in DTYPES:
    for causal in (False, True):
        q, k, v, tangents, grad_out, grad_tangent_out = random_inputs(2, 4, 4, N, N, 64, dtype)
        options = {"is_causal": causal, "tangents": tangents, "grad_out": grad_out,
                   "grad_tangent_out": grad_tangent_out}
        floor = math_path(q, k, v, **options)
        truth = float64_truth(q, k, v, **options)
        for mode in ("fast", "accurate"):
            set_precision(mode)
            ours = dict(zip(NAMES, second_order_grads(q, k, v, tangents, grad_out,
                                                      grad_tangent_out, is_causal=causal),
                            strict=True))
            rows[f"{str(dtype)[6:]:9} causal={causal!s:5} {mode}"] = accuracy_table(
                ours, floor, truth)
set_precision("accurate")
print(format_table(rows))

# %% [markdown]
# ## bf16 through exact fp16 copies
#
# The split costs the most here: per key tile the two key-side passes and the dQ kernel do
# 21 product-sized units of work in "accurate" precision against 15 in "fast", and on the
# H200 the split ran at 159 to 195 TFLOP/s where "fast" reaches 217 to 254. Chapter 5's cure
# for bf16, exact fp16 copies scaled by powers of two, carries over with care ("Through the
# tangent" there derives the units). The first version gave the whole tangent side one
# shift, the one that dK's and dQ's sums ask for, $l = e_{dS} - e_{dtS}$, which is free of
# work per tile. It failed the floor: with large tangent scores the only bound the range pass
# gives on $|t_S|$, $s\,d\,(\max|t_Q|\max|K| + \max|Q|\max|t_K|)$, lies tens of times above
# the scores that occur, the bound on $|dP|$ pulls $e_{dS}$ and with it $dO$'s copy into
# float16's subnormals, and in the interpreter (bf16 inputs, whose copies are exact there;
# $d = 64$, 384 causal tokens, queries and keys times 4, tangents times 30) $dV$ came out at
# 3.94x the floor where unit-scaled inputs gave 1.00x. Ranges of their own for $dS$, $dt_S$
# and the tangent copies cost two multiplies of a tile and two of an accumulator per tile,
# and keep every gradient at the floor over inputs scaled by up to $10^{\pm 6}$ in turn
# (`tests/library/test_backward_second_order.py`). Measured on the H200 against the split
# (bf16, `benchmarks/results/second_order_h200.json`, the whole backward through both
# outputs, TFLOP/s):
#
# | shape | split | carried | "fast" |
# |---|---|---|---|
# | B4 H16 N4096 d128 | 193 | 228 | 254 |
# | B4 H16 N4096 d128 causal | 180 | 206 | 231 |
# | B1 H16 N16384 d128 | 193 | 229 | 250 |
# | B1 H16 N16384 d128 causal | 195 | 233 | 248 |
# | B4 H32 N4096 d64 | 174 | 214 | 246 |
# | B4 H32 N4096 d64 causal | 159 | 193 | 217 |
# | B1 H32 N16384 d64 | 172 | 227 | 249 |
# | B1 H32 N16384 d64 causal | 169 | 213 | 233 |
#
# "Accurate" now takes 1.07x to 1.15x the time of "fast", against 1.29x to 1.45x; the eight
# fp16 copies raise the peak memory of the call from 386 to 898 MB at B4 H16 N4096 d128.
# The timing at the end of this chapter, a whole second-order step at B2 H16 N4096 d128 with
# the carry, took 13.0 ms on the H200 (13.5 ms before it).

# %% [markdown]
# ## A Hessian-vector product through an attention model
#
# Reverse-over-forward: the directional derivative of a loss along $v$ is a JVP, and its
# gradient is $H v$. Through our kernels the JVP is the fused forward pass and the gradient of
# the tangent is this chapter's backward. We check it against the same computation on
# PyTorch's math path, in float32, on a two-layer self-attention model.

# %%
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvp_attention

width, heads = 64, 4
params = {name: torch.randn(width, width, device=DEVICE) / width**0.5
          for name in ("wq1", "wk1", "wv1", "wq2", "wk2", "wv2")}
x = torch.randn(2, N // 2, width, device=DEVICE)


def model_loss(p):
    h = x
    for layer in ("1", "2"):
        q, k, v = (h @ p[f"w{name}{layer}"] for name in "qkv")
        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
    return h.square().mean()


def hessian_vector_product(p, direction):
    """H v = d/dp <grad L(p), v>: the gradient of the JVP of the loss along `direction`."""
    def directional_derivative(p_):
        return torch.func.jvp(model_loss, (p_,), (direction,))[1]
    return torch.func.grad(directional_derivative)(p)


direction = {name: torch.randn_like(w) for name, w in params.items()}
with jvp_attention.sdpa(strict=True):
    hvp_ours = hessian_vector_product(params, direction)
with sdpa_kernel(SDPBackend.MATH):
    hvp_math = hessian_vector_product(params, direction)
for name in params:
    rel = ((hvp_ours[name] - hvp_math[name]).abs().max() / hvp_math[name].abs().max()).item()
    print(f"Hv[{name}]: relative difference to the math path {rel:.1e}")
    assert rel < 1e-4

# %% [markdown]
# ## Time and memory at scale (GPU)
#
# B2 H16 N4096 d128 bf16: our second-order backward against PyTorch's math path, which has to
# keep the $N \times N$ probabilities and their tangents of every head for its backward.

# %%
def second_order_cost(fn, *inputs):
    """Milliseconds and peak memory (GB) of forward+JVP and the backward through both outputs."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out, tangent = fn(*inputs)
    (out.float().square().mean() + tangent.float().square().mean()).backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), (torch.cuda.max_memory_allocated() - base) / 1e9


if FULL_SIZE:
    shape = (2, 16, 4096, 128)
    leaves = [torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
              for _ in range(6)]

    def ours(q, k, v, tq, tk, tv):
        return jvp_attention.attention_jvp(q, k, v, (tq, tk, tv))

    def math(q, k, v, tq, tk, tv):
        with sdpa_kernel(SDPBackend.MATH):
            return torch.func.jvp(F.scaled_dot_product_attention, (q, k, v), (tq, tk, tv))

    for name, fn in [("jvp_attention", ours), ("PyTorch math", math)]:
        second_order_cost(fn, *leaves)  # warm-up (autotuning, allocator)
        for x in leaves:
            x.grad = None
        ms, gb = second_order_cost(fn, *leaves)
        print(f"{name:14} forward+JVP+second-order backward: {ms:8.1f} ms, peak {gb:6.2f} GB")
else:
    print("skipped on CPU: the timing needs a GPU")
