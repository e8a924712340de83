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
# # Chapter 2: the flash forward in Triton
#
# Chapter 1 wrote attention twice in PyTorch: exactly, and *tiled*, one block of keys at a
# time with a running maximum. The tiled version never holds more than a slab of scores, and
# that is the whole idea of flash attention: a score matrix of $N_q \times N_k$ entries is
# never written to memory. Here the tiled loop becomes a Triton kernel.
#
# One program of the kernel owns one tile of $B_M$ query rows of one (batch, head). It loads
# its queries once, then walks over the keys in blocks of $B_N$, folding each block into a
# running state that lives in registers:
#
# | state | shape | meaning |
# |---|---|---|
# | `m_i` | $B_M$ | running row maximum of the scores (log2 units) |
# | `l_i` | $B_M$ | running $\ell = \sum_j \tilde P_{ij}$ |
# | `acc_o` | $B_M \times D_v$ | running $A = \sum_j \tilde P_{ij} V_j$ |
# | `r_i`, `acc_t` | $B_M$, $B_M \times D_v$ | the tangent's $r$ and $G + H$ (switched on by `HAS_TANGENT`) |
#
# and at the end writes $O = A/\ell$ and $\mathrm{LSE} = m + \log \ell$. The kernel carries the
# tangent accumulators of chapter 1 as well, behind a compile-time switch: with
# `HAS_TANGENT=False` Triton removes every tangent line and the kernel is a plain flash
# forward; with `HAS_TANGENT=True` the same loop produces $t_O$ and $\mu$. One loop, two
# specialisations, no second copy. This chapter builds and checks the primal path; chapter 3
# checks the tangent path and studies its accuracy.
#
# Everything that SDPA accepts is handled in the kernel itself: any $N_q$, $N_k$ (boundary
# masks, not asserts), causal masking with PyTorch's top-left alignment, boolean or additive
# masks broadcast with stride-0 dimensions (never materialised), GQA by index arithmetic
# (no repeated K/V), head dimensions that are not powers of two, $d_{qk} \ne d_v$, and
# arbitrary strides (a last dimension that is not contiguous is copied).

# %%
import functools
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch

# On a machine without a GPU the kernels run in Triton's interpreter; it must be switched on
# before triton is imported.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
FULL_SIZE = DEVICE == "cuda"
print(f"device: {DEVICE}, interpreter: {os.environ.get('TRITON_INTERPRET', '0') == '1'}")

import triton  # noqa: E402  (after the interpreter switch)
import triton.language as tl  # noqa: E402
from torch._subclasses.functional_tensor import FunctionalTensor  # noqa: E402
from torch.library import wrap_triton  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from jvp_attention.reference import AttentionOutputs  # noqa: E402  (chapter 1)

# %% [markdown]
# ## Loading tiles with pointer arithmetic
#
# A tile is addressed by its row and column indices and the tensor's strides, except that
# columns are read at unit stride: the launchers copy an operand whose last dimension is not
# contiguous (`unit_last_stride`, below), which the usual layouts never need, since a linear
# layer's output seen through `view` and `transpose` keeps a unit last stride. That saves a
# stride parameter per tensor and the multiply by it in every column address, and the
# kernels give up nothing they used: Triton specialises an integer argument equal to 1 into
# a constant, so for such inputs this is the code the GPU ran already. (Masks keep all
# their strides: one broadcast over the keys has a last stride of 0.) Rows past the
# sequence end and columns past the head dimension are masked and read as zero. Zeros are
# harmless everywhere: a zero query row produces scores that are never stored, a zero key row
# is masked to $-\infty$ below, and zero padding columns add nothing to a dot product. This is
# what lets the kernel take any length and any head dimension (the tile width is the next
# power of two). We use plain pointers rather than `tl.make_block_ptr`, which Triton 3.9
# removes.
#
# Padding is free for the loads but not for the products: a head dim of 72 (DiT-XL's 1152
# wide, 16 heads) padded to 128 multiplies 56 columns of zeros, 44% of every $QK^T$ and
# $PV$ product, and holds 128-column accumulators. The forward therefore cuts such a head
# dim into two tiles: the largest power of two that fits, then a narrower one for the rest
# (72 = 64 + 16, 80 columns multiplied; `column_tiles` in the launcher picks the cut). The
# second tile is the same matrix seen from its 64th column on, with 8 columns (`tail_source`):
# the loads, masks and tensor descriptors above serve it unchanged, the scores add a second
# product, and $O$, $t_O$ get a second, 16-column accumulator. Compiled for Hopper, the bf16
# forward with the tangent at $d = 72$ then needs 193 registers per thread and 80 KiB of
# shared memory on a 128 × 32 tile, against 255 registers, 60 bytes of spills and 128 KiB
# padded to 128 (`tools/kernel_resources.py --head-dim 72`). The 128 × 64 tile that $d = 64$
# may use fits too (212 registers, no spills), so the autotuner's candidates count such a
# head dim by the columns it multiplies, 80, not by its padded 128 (`prune_wide_tiles`).
#
# With the tangent, half of such a tail tile is still padding: at $d = 72$ each 16-column
# tail holds 8 columns. Two half-empty products can become one full one. The tangent
# scores' tails, $t_Q K^T + Q\,t_K^T$, are one product of $[t_Q \mid Q]$ with
# $[K \mid t_K]$, each a 16-column tile that holds two tensors' tails side by side
# (`load_paired_tail_rows`). The output's tails $\tilde P V$ and $\tilde P\,t_V$ are one
# product of $\tilde P$ with $[V \mid t_V]$; its left half is $O$'s tail and its right half
# goes to $t_O$'s at the end (`split_halves`). The tangent's running centring on $\mu$
# subtracts $\Delta\mu$ times $O$'s tail from the centred sum's tail, and both sit in the
# left halves of their accumulators, so it stays an elementwise update. Per key block the
# tails take four products instead of six, eight instead of twelve where accurate precision
# splits each product in two.
#
# Pairing pays only where products are dear. Timed on the H200 tile by tile (bf16,
# `tools/tile_sweep.py`, saved in `benchmarks/results/paired_tails_h200.json`: the same
# three tiles before and after, at $(32, 16, 256)$,
# $(48, 12, 512)$ and $(16, 16, 1024)$ for $(B, H, N)$), the best tile of accurate
# precision's split products got 2-6% faster at $d = 72$ and $d = 40$ (0.154 to 0.149 ms at
# 256 tokens, 0.966 to 0.910 at 1024, $d = 72$), while "fast" precision, one product per
# pair, got 1-11% slower: the paired tiles hold more registers, and the products they save
# are cheap. So `pair_tails` pairs only split products read through pointers (descriptors
# read one tensor per tile).
#
# Fewer columns are not yet the same speed per FLOP everywhere. Timed on the H200 tile by
# tile (bf16, forward with the tangent, tiles read through pointers, the best tile of each;
# `tools/tile_sweep.py`, saved in `benchmarks/results/tile_sweep_h200.json`), with the
# alignment described next: at 256 tokens $d = 64$ runs at 226 TFLOP/s, $d = 72$ at 192,
# $d = 80$ at 221 and $d = 96$ (64 + 32) at 226, so there the cut costs little; at 1024
# tokens $d = 64$'s kernel reaches 401 (334 for the whole call, which at that length also
# runs the bf16 carry's range pass and copies) against 243, 283 and 284, each call a single
# kernel. Counted in the compiled code
# (`tools/kernel_resources.py`, chapter 8): each product of a key block becomes two
# tensor-core operations, and Triton waits for each one's group of warpgroup instructions
# before its result is used, so at 1024 tokens the 64 × 64 tile commits 12 groups per key
# block instead of 6 and waits 9 times instead of 5, for a quarter more arithmetic. Per
# head the d = 72 kernel takes 1.46x d = 64's time there, where d = 128 (as many groups as
# d = 64, twice the arithmetic) takes 1.95x: the extra groups cost about 17% on top of the
# arithmetic. Tiles outside the autotuner's list that compile without spills do no
# better.
#
# One more cost at $d = 72$ is not the cut's. Triton specialises an integer argument by its
# divisibility by 16 only, so a row stride of 72 elements (144 bytes, 16-byte aligned) looks
# unaligned to it, and so does a column bound of 72: every tile read through pointers moved
# one element per load, through registers, without the asynchronous copies of the
# pipeline, and $d = 80$, whose stride and bound are multiples of 16, did not pay that. The
# launch therefore finds the largest power of two, up to 16 bytes of elements, that divides
# every head dim and every batch, head and row stride (`row_alignment`, ALIGN), and the
# kernels write those integers as $\lfloor n / \mathrm{ALIGN} \rfloor \cdot \mathrm{ALIGN}$
# (`aligned`): the same numbers, in a form from which the compiler sees the divisibility.
# Compiled for sm_90 at $d = 72$ in bf16, every pipelined tile of every kernel then copies
# asynchronously, and the spills fall: the forward with the tangent on 64 × 64 from 260 to
# 8 bytes, the second-order dQ kernel on 128 × 32 from 1924 to 20, its dK/dV kernel on
# 16 × 32 from 124 to none (`tools/kernel_resources.py --head-dim 72`). The head stride
# matters as much as the row stride: a model that projects q, k and v together and views
# the result as (B, N, H, D) hands the kernel heads 72 elements apart, and with that stride
# hidden every forward+JVP tile fell back to single-element loads and spilled 112 to 276
# bytes (`--layout bnhd`).
#
# Timed on the H200 (bf16, GPU time of one `torch.func.jvp(attention)` call, both versions
# assembled by the same ptxas), the alignment took the forward with the tangent from 0.235
# to 0.154 ms at DiT-XL/2's 256-pixel shape (32, 16, 256, 72), 1.5x, and from 1.247 to
# 1.116 ms at (16, 16, 1024, 72); in the (B, N, H, D) layout from 0.253 to 0.160 and from
# 1.269 to 1.140 ms. Before it, the best tile at $d = 72$ ran at 129 TFLOP/s at 256 tokens
# and 161 at 1024 through pointers; $d = 64$ is unchanged.

# %% tags=["export:tiles"]
"""The Triton device helpers that the forward (chapter 2) and backward (chapter 5) kernels
share: tile loads and stores, masks and the causal band, rounded products, the online-softmax
step and the carry's shifts, with the constants they use.

`notebooks/02_forward.py` derives them.
"""

import math

import triton
import triton.language as tl

# constexpr, so that jit functions may read them (host code reads `.value`)
LOG2E = tl.constexpr(math.log2(math.e))  # natural units to log2 units: exp2 for exp
LN2 = tl.constexpr(math.log(2.0))  # log2 units back to natural ones (the LSE)
# The lowest log2-unit score a bias gives (`log2_bias`): -2**31, where fp32 scores are 256
# apart, so that a finite bias below it (the dtype's lowest number, as Hugging Face builds
# its masks) stays finite instead of overflowing to -inf, and fp64 holds log2 of a row's
# sum beside it (the LSE of an additive-mask call is fp64).
LOWEST_SCORE = tl.constexpr(-2.0**31)
BIAS_FLOOR = tl.constexpr(-(2.0**31) / math.log2(math.e))  # the natural-unit bias giving it
# MASK_KIND: what the mask operand holds. ADDITIVE_WITH_TANGENT: each query row's biases
# followed by their tangents, Nk elements further on (`launch.mask_operand`).
NO_MASK = tl.constexpr(0)
BOOL_MASK = tl.constexpr(1)
ADDITIVE_MASK = tl.constexpr(2)
ADDITIVE_WITH_TANGENT = tl.constexpr(3)


@triton.jit
def head_base(ptr, batch, head, stride_b, stride_h, ALIGN: tl.constexpr = 1):
    """The start of one (batch, head) matrix of a (B, H, N, D) tensor (`batch` is int64, so
    offsets past 2**31 elements are safe). Strides that are multiples of ALIGN are written
    so that the compiler sees it (`aligned`): a head stride of 72 (the (B, N, H, D) layout
    of a fused projection at d = 72) would otherwise hide the rows' alignment too."""
    return ptr + batch * aligned(stride_b, ALIGN) + head * aligned(stride_h, ALIGN)


@triton.jit
def in_fp32(x):
    """A float argument in fp32. Triton's launch passes a Python float as fp32, but Inductor,
    launching a user's kernel from a compiled graph, passes it as fp64, which would carry
    fp64 into everything computed from it, down to the accumulators of the products."""
    return tl.cast(x, tl.float32)


@triton.jit
def aligned(n, ALIGN: tl.constexpr):
    """`n`, a row stride or a width that the launch found to be a multiple of ALIGN, written
    so that the compiler sees it is one (it cannot tell 72 from 73). Then each row of a tile
    starts on a 16-byte boundary and its column mask is constant over runs of ALIGN, and
    loads and stores move 16 bytes at a time, asynchronously when pipelined, instead of one
    element each (`row_alignment` picks ALIGN)."""
    if ALIGN > 1:
        n = (n // ALIGN) * ALIGN
    return n


@triton.jit
def aligned_operands(stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn, stride_tvn,
                     head_dim, value_dim, ALIGN: tl.constexpr):
    """`aligned` row strides of q, k, v and their tangents, and head dims."""
    return (aligned(stride_qm, ALIGN), aligned(stride_kn, ALIGN), aligned(stride_vn, ALIGN),
            aligned(stride_tqm, ALIGN), aligned(stride_tkn, ALIGN),
            aligned(stride_tvn, ALIGN), aligned(head_dim, ALIGN), aligned(value_dim, ALIGN))


@triton.jit
def load_tile(ptr, rows, cols, stride_row, stride_col, n_rows, n_cols):
    """Load the [rows x cols] tile at `ptr`; entries outside (n_rows, n_cols) read as zero."""
    ptrs = ptr + rows[:, None] * stride_row + cols[None, :] * stride_col
    return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def tile_source(ptr, n_rows, n_cols, stride_row, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr, USE_TMA: tl.constexpr):
    """Where a (n_rows x n_cols) matrix's tiles come from: its pointer, or (USE_TMA, chapter
    4) a tensor descriptor whose shape stops at this head's own rows, so that the copy engine
    reads rows past the end as zeros rather than the next head's rows."""
    if USE_TMA:
        return tl.make_tensor_descriptor(ptr, shape=[n_rows, n_cols], strides=[stride_row, 1],
                                         block_shape=[BLOCK_R, BLOCK_C])
    else:
        return ptr


@triton.jit
def load_rows(src, start, stride_row, n_rows, n_cols, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr, USE_TMA: tl.constexpr):
    """The [BLOCK_R x BLOCK_C] tile of rows start.. of a `tile_source` (columns at unit
    stride); zeros outside."""
    if USE_TMA:
        return src.load([start, 0])
    else:
        return load_tile(src, start + tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_C),
                          stride_row, 1, n_rows, n_cols)


@triton.jit
def load_head_rows(ptr, start, stride_row, n_rows, n_cols, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr, USE_TMA: tl.constexpr):
    """One tile of rows start.. of a matrix read once (no source kept for later tiles)."""
    src = tile_source(ptr, n_rows, n_cols, stride_row, BLOCK_R, BLOCK_C, USE_TMA)
    return load_rows(src, start, stride_row, n_rows, n_cols, BLOCK_R, BLOCK_C, USE_TMA)


@triton.jit
def tail_source(ptr, n_rows, n_cols, stride_row, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                TAIL: tl.constexpr, USE_TMA: tl.constexpr):
    """The columns past the first BLOCK_C of a matrix as a `tile_source` of width TAIL, for a
    head dim cut into two tiles (72 = 64 + 16 columns, not 128); `ptr` itself with no tail."""
    if TAIL > 0:
        src = tile_source(ptr + BLOCK_C, n_rows, n_cols - BLOCK_C, stride_row, BLOCK_R, TAIL,
                          USE_TMA)
    else:
        src = ptr
    return src


@triton.jit
def load_tail_rows(src, start, stride_row, n_rows, n_cols, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr, TAIL: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows start.. of a `tail_source` (columns BLOCK_C up to n_cols); a 1 x 1 placeholder,
    never read, with no tail."""
    if TAIL > 0:
        x = load_rows(src, start, stride_row, n_rows, n_cols - BLOCK_C, BLOCK_R, TAIL, USE_TMA)
    else:
        x = tl.zeros([1, 1], tl.float32)
    return x


@triton.jit
def load_head_tail_rows(ptr, start, stride_row, n_rows, n_cols, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr, TAIL: tl.constexpr, USE_TMA: tl.constexpr):
    """`load_head_rows` for the tail columns: a tile read once."""
    src = tail_source(ptr, n_rows, n_cols, stride_row, BLOCK_R, BLOCK_C, TAIL, USE_TMA)
    return load_tail_rows(src, start, stride_row, n_rows, n_cols, BLOCK_R, BLOCK_C, TAIL,
                          USE_TMA)


@triton.jit
def tail_accumulator(BLOCK_R: tl.constexpr, TAIL: tl.constexpr):
    """fp32 zeros for the tail columns' results; a 1 x 1 placeholder with no tail."""
    if TAIL > 0:
        acc = tl.zeros([BLOCK_R, TAIL], dtype=tl.float32)
    else:
        acc = tl.zeros([1, 1], dtype=tl.float32)
    return acc


@triton.jit
def load_paired_tail_rows(a_src, b_src, start, stride_a, stride_b, n_rows, width,
                          BLOCK_R: tl.constexpr, TAIL: tl.constexpr):
    """Rows start.. of two pointer `tail_source`s whose tails are at most TAIL // 2 wide,
    side by side in one [BLOCK_R x TAIL] tile: a's tail columns, then b's, zeros past
    `width` in each half. One product over it does the work of two over half-empty tiles."""
    half: tl.constexpr = TAIL // 2
    rows = start + tl.arange(0, BLOCK_R)
    c = tl.arange(0, TAIL)
    first = c < half
    cols = tl.where(first, c, c - half)
    a_ptrs = a_src + rows[:, None] * stride_a + cols[None, :]
    b_ptrs = b_src + rows[:, None] * stride_b + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < width)
    return tl.load(tl.where(first[None, :], a_ptrs, b_ptrs), mask=mask, other=0.0)


@triton.jit
def split_halves(x, BLOCK_R: tl.constexpr, TAIL: tl.constexpr):
    """The left and the right TAIL // 2 columns of a [BLOCK_R x TAIL] tile."""
    return tl.split(tl.permute(tl.reshape(x, [BLOCK_R, 2, TAIL // 2]), [0, 2, 1]))


@triton.jit
def store_rows(ptr, x, flat_rows, rows, dims, n_rows, n_dims):
    """Store a tile into a contiguous (rows, n_dims) tensor; `flat_rows` index the whole tensor."""
    mask = (rows[:, None] < n_rows) & (dims[None, :] < n_dims)
    tl.store(ptr + flat_rows[:, None] * n_dims + dims[None, :], x.to(ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def store_rounded(ptr, residual_ptr, x, flat_rows, rows, dims, n_rows, n_dims,
                   STORE_RESIDUAL: tl.constexpr):
    """Store fp32 `x` rounded to the output dtype and, with STORE_RESIDUAL, the rounding
    residual x - round(x) (in the same dtype) for the backward's row statistics."""
    store_rows(ptr, x, flat_rows, rows, dims, n_rows, n_dims)
    if STORE_RESIDUAL:
        rounded = x.to(ptr.dtype.element_ty).to(tl.float32)
        store_rows(residual_ptr, x - rounded, flat_rows, rows, dims, n_rows, n_dims)


# %% [markdown]
# ## Scores, masks and the causal band
#
# The scores live in log2 units: $S_2 = \log_2(e)\,(s\,QK^\top + B)$, so that the softmax
# uses `exp2`, which is a single hardware instruction, with $\log_2 e$ folded into the scale
# once per launch rather than multiplied into every exponent. A boolean mask (True = attend)
# turns scores into $-\infty$; an additive mask is added (times $\log_2 e$). Both are read
# through their own strides, so a `(B, 1, 1, N_k)` key-padding mask is expanded with stride 0
# and never written out at `(B, H, N_q, N_k)`.
#
# Column masks for the sequence end and the causal band cost instructions, and most key
# blocks need neither. `key_block_ranges` splits a query tile's keys into a prefix of whole
# blocks that every row sees entirely, and a short tail that needs masks. With top-left
# causal alignment (query $i$ sees keys $j \le i$, as `torch.ones(Nq, Nk).tril()`), a query
# tile starting at row $m_0$ needs keys below $m_0 + B_M$, and a block of keys is whole for
# every row of the tile when it ends at or before $m_0 + 1$.

# %% tags=["export:tiles"]
@triton.jit
def masked_scores(s, rows, cols, mask_ptr, stride_mask_m, stride_mask_n, n_q, n_k,
                   IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                   CHECK_BOUNDS: tl.constexpr):
    """Apply the user's mask, and (when CHECK_BOUNDS) the key boundary and causal band, to
    log2-unit scores; masked entries become -inf."""
    if MASK_KIND == BOOL_MASK:
        keep = load_tile(mask_ptr, rows, cols, stride_mask_m, stride_mask_n, n_q, n_k)
        s = tl.where(keep != 0, s, float("-inf"))
    if MASK_KIND >= ADDITIVE_MASK:  # or ADDITIVE_WITH_TANGENT: the bias is read the same
        bias = load_tile(mask_ptr, rows, cols, stride_mask_m, stride_mask_n, n_q, n_k)
        s = s + log2_bias(bias.to(tl.float32))
    if CHECK_BOUNDS:
        visible = cols[None, :] < n_k
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def log2_bias(bias):
    """A natural-unit bias in log2 units, no lower than LOWEST_SCORE unless it is -inf (a
    masked key) or NaN (which propagates, as in SDPA)."""
    lowest = tl.where(bias == float("-inf"), bias, LOWEST_SCORE)
    return tl.where(bias < BIAS_FLOOR, lowest, bias * LOG2E)


@triton.jit
def add_mask_tangent(ts, rows, cols, mask_ptr, stride_mask_m, stride_mask_n, n_q, n_k,
                      MASK_KIND: tl.constexpr):
    """tS + tB for natural-unit tangent scores: with ADDITIVE_WITH_TANGENT (3) the tangent
    of each bias sits n_k elements after it; any other mask has no tangent."""
    if MASK_KIND == ADDITIVE_WITH_TANGENT:
        t_bias = load_tile(mask_ptr + n_k, rows, cols, stride_mask_m, stride_mask_n, n_q, n_k)
        ts += t_bias.to(tl.float32)
    return ts


@triton.jit
def key_block_ranges(start_m, n_k, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Split the keys a query tile needs: [0, full_end) needs no column masks, [full_end, end) does."""
    if IS_CAUSAL:
        end = tl.minimum(n_k, start_m + BLOCK_M)
        full_end = (tl.minimum(n_k, start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        end = n_k
        full_end = (n_k // BLOCK_N) * BLOCK_N
    return full_end, end


@triton.jit
def causal_program(HEAD_GROUP: tl.constexpr):
    """This program's query tile and batch x head in a grid (query tiles, batch x heads)
    under a causal mask, where a tile sees more keys the later it sits. The GPU starts
    programs in launch order (program_id(0) fastest), so the order decides what runs in
    the last wave. Heads go in groups of HEAD_GROUP; a group's programs take its tiles
    longest first, its heads side by side: the last wave holds short tiles, while the
    programs running together read the keys of a few heads, which L2 serves to all."""
    tiles = tl.num_programs(0)
    launched = tl.program_id(1) * tiles + tl.program_id(0)
    first = launched // (HEAD_GROUP * tiles) * HEAD_GROUP
    heads = tl.minimum(tl.num_programs(1) - first, HEAD_GROUP)
    rank = launched % (HEAD_GROUP * tiles)
    return tiles - 1 - rank // heads, first + rank % heads


@triton.jit
def query_program(IS_CAUSAL: tl.constexpr, HEAD_GROUP: tl.constexpr):
    """This program's query tile and batch x head: the grid's own order, or under a causal
    mask `causal_program`'s."""
    block, bh = tl.program_id(0), tl.program_id(1)
    if IS_CAUSAL:
        block, bh = causal_program(HEAD_GROUP)
    return block, bh


@triton.jit
def batch_and_head(bh, n_heads, stride_mask_b, stride_mask_h, MASK_KIND: tl.constexpr):
    """The (batch, head) of flat program index `bh` (`batch` int64): heads fastest, or,
    for a mask that every batch element shares but each head has its own (a learnable
    (1, H, Nq, Nk) bias), batch fastest. Programs that run together then read one head's
    mask, which L2 serves to the whole batch; heads fastest, each batch element would read
    the mask from memory again (B times its size, more than L2 holds at 1024 tokens)."""
    batch, head = bh // n_heads, bh % n_heads
    if MASK_KIND != NO_MASK:
        n_batch = tl.num_programs(1) // n_heads
        batch_fastest = (stride_mask_b == 0) & (stride_mask_h != 0)
        batch = tl.where(batch_fastest, bh % n_batch, batch)
        head = tl.where(batch_fastest, bh // n_batch, head)
    return batch.to(tl.int64), head


@triton.jit
def query_block_start(BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """The first query row of this program's tile, for kernels that take their batch x head
    from program_id(1): under a causal mask the longest tiles of each head first (groups of
    one head)."""
    return query_program(IS_CAUSAL, 1)[0] * BLOCK_M


# %% [markdown]
# ## One block of keys
#
# Folding a block into the state is chapter 1's online softmax, line for line:
#
# $$m' = \max(m, \max_j S_{2,ij}),\quad \alpha = 2^{m - m'},\quad \tilde P = 2^{S_2 - m'},\quad
# \ell \leftarrow \alpha \ell + \textstyle\sum_j \tilde P_{ij},\quad
# A \leftarrow \alpha A + \tilde P V.$$
#
# A row can have every key masked so far (a user mask can hide a whole block, or a whole
# row). Its maximum is then $-\infty$ and $m - m'$ would be $-\infty - (-\infty) = $ NaN; we
# subtract 0 instead, which leaves $\tilde P = 0$ and $\alpha = 0$, so the row's state stays
# empty. Without a user mask every row sees key 0 in the first block, and the guard is
# compiled out.
#
# **Huge biases.** Models mask with finite numbers too: Hugging Face fills its masks with the
# dtype's lowest number, other code with -1e9. SDPA's fp32 math path adds such a bias to the
# scores, where it rounds them away: a row that every key masks that way averages the values
# (every score equally low), with gradients to match. Two things stood between the kernels
# and that answer. Folded into log2 units, $-3.4 \cdot 10^{38}$ times $\log_2 e$ overflows to
# $-\infty$, so such a row saw no key and gave zeros; `log2_bias` saturates the fold at
# `LOWEST_SCORE` $= -2^{31}$ instead (where fp32 scores lie 256 apart, so the scores are
# rounded away as in SDPA), keeping $-\infty$ and NaN as they are. And a row whose maximum
# is that low has an LSE, $m + \log_2 \ell$, that fp32 cannot hold: at $|m| = 2^{31}$ its
# neighbours are 256 apart and $\log_2 \ell$ vanishes (already at $|m| = 2^{24}$ the
# rounding moves the backward's $P = 2^{S - \mathrm{LSE}}$ by up to 40%; at a bias of
# $-10^9$ the gradients were off by as much as their own size). So a call with an additive
# mask stores its LSE in fp64 (`lse_dtype`), the sum made in fp64 from the fp32 $m$ and
# $\log_2 \ell$, and chapter 5's backward reads it as an fp32 pair, $\mathrm{hi} +
# \mathrm{lo}$. Calls without an additive mask, whose scores are the products' own, keep
# fp32 and their bits. Through Triton's interpreter, at $(1, 2, 20, 16)$ in fp32 with rows
# masked entirely by $-3.4 \cdot 10^{38}$, $-10^{30}$ and $-10^{9}$ and a learnable bias, the
# output, its tangent and every gradient (the bias's and the backward through the tangent's
# too) now lie within $2 \cdot 10^{-6}$ of SDPA's fp32 math path
# (`test_rows_masked_entirely_by_a_huge_bias_average_as_sdpa`); before, the output was off
# by 0.53 and dQ by 5.9.
#
# $\tilde P$ is rounded to the input dtype before the $\tilde P V$ product, so the tensor
# cores run at 16-bit speed; the product accumulates in fp32. For fp32 inputs the dots use
# IEEE fp32 (`input_precision="ieee"`) rather than TF32, to match PyTorch's fp32 math.
#
# The tangent branch accumulates chapter 1's $r$ and $G + H$ in one tensor `acc_t`:
#
# $$t_S = s\,(t_Q K^\top + Q\,t_K^\top),\quad r \leftarrow \alpha r + \textstyle\sum_j
# (\tilde P \circ t_S)_{ij},\quad \texttt{acc\_t} \leftarrow \alpha\,\texttt{acc\_t} +
# (\tilde P \circ t_S) V + \tilde P\, t_V.$$
#
# Four more matrix products per block: six in all, three times the forward's two.
#
# **A bias that moves.** A learnable relative-position bias or ALiBi slopes enter as the
# additive mask $B$, and then $B$ has a tangent $t_B$ too. The scores are
# $S = s\,QK^\top + B$, linear in $B$, so differentiating along $(t_Q, t_K, t_B)$ gives
#
# $$t_S = s\,(t_Q K^\top + Q\,t_K^\top) + t_B,$$
#
# and nothing else changes: $\tilde P$, $\ell$ and $m$ depend on $B$ but not on $t_B$, and
# $t_S$ enters the accumulators only through $\tilde P \circ t_S$ and $\mu$. The kernel adds
# the tile of $t_B$ to `ts` in natural units (`add_mask_tangent`); where $B = -\infty$,
# $\tilde P = 0$ and $t_B$ is never seen. $t_B$ reaches the kernel through the mask operand
# itself (`MASK_KIND = ADDITIVE_WITH_TANGENT`): the launcher stores each query row's biases
# followed by their tangents in one tensor (`mask_pairs`), so both are read at unit stride
# along the keys and the tangent is $N_k$ elements after its bias, with no second set of
# strides. The pairs are stored once along every dimension that both $B$ and $t_B$ broadcast
# over (a per-head $(1, H, N_q, N_k)$ bias stays that, even when it arrives expanded to the
# batch, as it does from `attention`), twice the bias's memory, never $(B, H, N_q, N_k)$.
# The first layout put each tangent in the element right after its bias, at the broadcast
# shape of the tensors as the launcher received them: a bias expanded to the batch was
# stored B times, and both were read at stride 2. On an H100 (bf16, $(16, 16, 1024, 72)$, a
# $(1, 16, 1024, 1024)$ learnable bias, `benchmarks/carry_cost.py --bias`) the copy took
# 1.88 ms and the forward+JVP kernel 3.65 ms, against 0.78 ms without a bias. With
# `mask_pairs` the copy takes 0.042 ms and the kernel 1.11 ms: the call's GPU time went from
# 5.63 to 1.25 ms in "accurate" and from 5.17 to 1.10 ms in "fast"; at (32, 12, 1024, 64)
# from 7.59 to 1.30 ms, at (16, 16, 1024, 128) from 6.01 to 1.65 ms
# (`benchmarks/results/carry_cost_bias_h100.json`, two runs on H100 machines of one kind).
#
# Such a bias is the same for every batch element, so the kernel's programs take the batch
# fastest when the mask has a batch stride of 0 and a head stride that is not
# (`batch_and_head`): the programs that run together then read one head's bias, and L2
# serves it to the whole batch. In the grid's usual order, heads fastest, each batch element
# reads every head's bias again, 16 times 64 MB at (16, 16, 1024, 72), more than L2 holds.
# It helped less than that traffic suggests (H100, one session, the call's attention kernel
# in "accurate" before and after, runs "mask pairs, again" and "batch fastest" of
# `carry_cost_bias_h100.json`): 1.078 to 0.981 ms at (32, 12, 1024, 64),
# 1.473 to 1.426 at (16, 16, 1024, 128), and no change at (16, 16, 1024, 72) (1.110 and
# 1.118). Most of what a bias costs the kernel (1.12 against 0.79 ms without one at
# (16, 16, 1024, 72)) is thus not its memory traffic.

# %% tags=["export:tiles"]
@triton.jit
def dot_rounded(a, b, acc, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """acc + a @ b for an fp32 tile `a` (probabilities, or products with them) and an input
    tile `b`. The tensor cores need `a` in b's 16-bit dtype; with SPLIT, `a` is rounded as
    hi + lo, two 16-bit tiles whose sum carries about twice the mantissa, at one more product."""
    hi = a.to(b.dtype)
    acc = tl.dot(hi, b, acc=acc, input_precision=DOT_PRECISION)
    if SPLIT:
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        acc = tl.dot(lo, b, acc=acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def online_softmax_step(s, m_i, CAN_BE_EMPTY: tl.constexpr):
    """One online-softmax step in log2 units: the new running max, the rescale factor alpha
    for the old state, and the block's unnormalised probabilities p~."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if CAN_BE_EMPTY:
        # Everything masked so far: subtract 0 rather than -inf, so p~ = 0 and alpha = 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    return m_new, alpha, p


# %% [markdown]
# The helpers so far are shared with the backward of chapter 5, so they are exported to a
# module of their own, `jvp_attention.tiles` (the launch policy further down goes to
# `jvp_attention.launch`). The forward kernel's module starts here. Its first cell imports
# those helpers; in this notebook the cells above have defined them already, so the cell is
# shown but not run, and the checks at the end exercise this notebook's own cells.

# %% tags=["export", "skip-execution"]
"""Chapter 2: the flash-attention forward (and, switched on by a constexpr, its tangent) in Triton.

The kernel follows the tiled online-softmax reference of chapter 1 block for block, built
from the device helpers of `jvp_attention.tiles` and launched under the policy of
`jvp_attention.launch`; the notebook `notebooks/02_forward.py` derives it and checks it
against that reference.
"""

import torch
import triton
import triton.language as tl

from jvp_attention.launch import (
    CachedLauncher,
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
    head_group,
    kernel_meta,
    launch_column_tiles,
    launchable,
    length_bucket,
    mask_operand,
    on_device,
    pair_tails,
    prepare_descriptors,
    remember,
    replay_table,
    row_alignment,
    row_strides,
    tma_eligible,
    traceable_launches,
    unit_last_stride,
)
from jvp_attention.reference import AttentionOutputs
from jvp_attention.tiles import (
    ADDITIVE_MASK,
    ADDITIVE_WITH_TANGENT,
    LN2,
    LOG2E,
    MAX_SHIFT,
    TANGENT_TOP,
    add_mask_tangent,
    aligned_operands,
    batch_and_head,
    dot_rounded,
    head_base,
    in_fp32,
    key_block_ranges,
    load_head_rows,
    load_head_tail_rows,
    load_paired_tail_rows,
    load_rows,
    load_tail_rows,
    masked_scores,
    online_softmax_step,
    power_of_two,
    query_program,
    shift_exponent,
    split_halves,
    store_rounded,
    tail_accumulator,
    tail_source,
    tangent_units,
    tile_source,
    vector_entry,
    with_entry,
)
from jvp_attention.warp_specialized import takes_warp_specialized, warp_specialized_forward


# %% tags=["export"]
@triton.jit
def _forward_key_block(
    acc_o, acc_o2, acc_t, acc_t2, l_i, mu_i, m_i, t_units, q, q2, tq, tq2, rows, start_n,
    k_src, k2_src, stride_kn, v_src, v2_src, stride_vn, tk_src, tk2_src, stride_tkn,
    tv_src, tv2_src, stride_tvn, mask_ptr, stride_mask_m, stride_mask_n, v_shift, t_shift,
    n_q, n_k, head_dim, value_dim, qk_scale, scale,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_TANGENT: tl.constexpr,
    CHECK_BOUNDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr, DV_TAIL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, USE_TMA: tl.constexpr,
    PAIR_D: tl.constexpr, PAIR_DV: tl.constexpr, CARRY: tl.constexpr,
):
    """Fold the key block starting at `start_n` into the softmax state (and the tangent state).
    A name ending in 2 is the second tile of a head dim cut in two (D_TAIL, DV_TAIL > 0);
    with PAIR_D (PAIR_DV) its tangent products are paired (`pair_tails`). With CARRY, v and
    tv are fp16 copies, times 2**v_shift and 2**t_shift (`value_operands`),
    and acc_t is kept in units 2**t_units per row ("Exact fp16 operands" below)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(k_src, start_n, stride_kn, n_k, head_dim, BLOCK_N, BLOCK_D, USE_TMA)
    v = load_rows(v_src, start_n, stride_vn, n_k, value_dim, BLOCK_N, BLOCK_DV, USE_TMA)
    k2 = load_tail_rows(k2_src, start_n, stride_kn, n_k, head_dim, BLOCK_N, BLOCK_D, D_TAIL,
                        USE_TMA)
    v2 = load_tail_rows(v2_src, start_n, stride_vn, n_k, value_dim, BLOCK_N, BLOCK_DV,
                        DV_TAIL, USE_TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if D_TAIL > 0:
        s = tl.dot(q2, tl.trans(k2), acc=s, input_precision=DOT_PRECISION)
    s = masked_scores(s * qk_scale, rows, cols, mask_ptr, stride_mask_m, stride_mask_n, n_q,
                       n_k, IS_CAUSAL, MASK_KIND, CHECK_BOUNDS)
    m_new, alpha, p = online_softmax_step(s, m_i, MASK_KIND != 0)
    l_new = l_i * alpha + tl.sum(p, 1)
    acc_o = acc_o * alpha[:, None]
    if DV_TAIL > 0:
        acc_o2 = acc_o2 * alpha[:, None]
    if HAS_TANGENT:
        tk = load_rows(tk_src, start_n, stride_tkn, n_k, head_dim, BLOCK_N, BLOCK_D, USE_TMA)
        tv = load_rows(tv_src, start_n, stride_tvn, n_k, value_dim, BLOCK_N, BLOCK_DV,
                        USE_TMA)
        # Natural units: masked entries have p~ = 0, so their tS never matters.
        ts = tl.dot(tq, tl.trans(k), input_precision=DOT_PRECISION)
        ts = tl.dot(q, tl.trans(tk), acc=ts, input_precision=DOT_PRECISION)
        if D_TAIL > 0 and PAIR_D:  # tq2 is [tQ's tail | Q's tail]: one product
            k_pair = load_paired_tail_rows(k2_src, tk2_src, start_n, stride_kn, stride_tkn,
                                           n_k, head_dim - BLOCK_D, BLOCK_N, D_TAIL)
            ts = tl.dot(tq2, tl.trans(k_pair), acc=ts, input_precision=DOT_PRECISION)
        elif D_TAIL > 0:
            tk2 = load_tail_rows(tk2_src, start_n, stride_tkn, n_k, head_dim, BLOCK_N, BLOCK_D,
                                 D_TAIL, USE_TMA)
            ts = tl.dot(tq2, tl.trans(k2), acc=ts, input_precision=DOT_PRECISION)
            ts = tl.dot(q2, tl.trans(tk2), acc=ts, input_precision=DOT_PRECISION)
        # The running mu including this block; acc_t is kept centred on it.
        l_safe = tl.where(l_new == 0.0, 1.0, l_new)
        # The carry keeps tS unscaled (scale and the units fold into one multiply-add)
        # unless a mask's tB joins it, in natural units (its bound then counts tB too)
        ts_scale = scale
        if MASK_KIND == ADDITIVE_WITH_TANGENT or not CARRY:
            ts = add_mask_tangent(ts * scale, rows, cols, mask_ptr, stride_mask_m,
                                  stride_mask_n, n_q, n_k, MASK_KIND)
            ts_scale = in_fp32(1.0)
        if CARRY:  # acc_t moves to units that keep this block's rounded operands in range;
            tl.static_assert(not PAIR_DV)
            mu_new = (mu_i * l_i * alpha + ts_scale * tl.sum(p * ts, 1)) / l_safe
            units = tangent_units(ts, tl.abs(ts_scale), mu_new, t_units, v_shift, t_shift)
            to_v_units = power_of_two(units - v_shift)
            alpha_t = alpha * power_of_two(units - t_units)
            mu_step = (mu_new - mu_i) * to_v_units
            ts_centred = (ts * (ts_scale * to_v_units)[:, None]
                          - (mu_new * to_v_units)[:, None])
            p_tangent = p * power_of_two(units - t_shift)[:, None]
            t_units = units
        else:
            mu_new = (mu_i * l_i * alpha + tl.sum(p * ts, 1)) / l_safe
            alpha_t, mu_step, ts_centred, p_tangent = (alpha, mu_new - mu_i,
                                                       ts - mu_new[:, None], p)
        acc_t = acc_t * alpha_t[:, None] - mu_step[:, None] * acc_o
        p_centred = p * ts_centred
        acc_t = dot_rounded(p_centred, v, acc_t, DOT_PRECISION, SPLIT)
        acc_t = dot_rounded(p_tangent, tv, acc_t, DOT_PRECISION, SPLIT)
        if DV_TAIL > 0:
            # Paired, the left halves hold the tails of P~ V and of the centred sum, column
            # for column, so the centring below is unchanged (the right half of acc_t2 is
            # never stored).
            acc_t2 = acc_t2 * alpha_t[:, None] - mu_step[:, None] * acc_o2
            acc_t2 = dot_rounded(p_centred, v2, acc_t2, DOT_PRECISION, SPLIT)
            if PAIR_DV:  # P~ tV's tail joins P~ V's product, as acc_o2's right half
                v2 = load_paired_tail_rows(v2_src, tv2_src, start_n, stride_vn, stride_tvn,
                                           n_k, value_dim - BLOCK_DV, BLOCK_N, DV_TAIL)
            else:
                tv2 = load_tail_rows(tv2_src, start_n, stride_tvn, n_k, value_dim, BLOCK_N,
                                     BLOCK_DV, DV_TAIL, USE_TMA)
                acc_t2 = dot_rounded(p_tangent, tv2, acc_t2, DOT_PRECISION, SPLIT)
        mu_i = mu_new
    acc_o = dot_rounded(p, v, acc_o, DOT_PRECISION, SPLIT)
    if DV_TAIL > 0:
        acc_o2 = dot_rounded(p, v2, acc_o2, DOT_PRECISION, SPLIT)
    return acc_o, acc_o2, acc_t, acc_t2, l_new, mu_i, m_new, t_units


# %% [markdown]
# ## Exact fp16 operands for bf16 inputs
#
# Chapter 3 measures what the single rounding of $\tilde P$ and $\tilde P \circ (t_S - \mu)$
# to 16 bits costs: in bf16 the tangent lands up to 1.4x PyTorch's error, and the split
# $a_{hi} + a_{lo}$ of `dot_rounded` brings it back to 1.0x for one more product each: nine
# products where six are credited. bf16 inputs have a cheaper way out. A bf16 number has 8
# significant bits and float16 has 11, so any bf16 value times a power of two is *exactly* a
# float16 value, provided the product lands inside float16's range. Carry $V$ and $t_V$ as
# rescaled float16 copies $\hat V = 2^{e_v} V$ and $\hat t_V = 2^{e_t} t_V$, and the three
# probability products run on fp16 tensor cores: their fp32 operands are rounded once, to
# float16, with an error $2^{-11}$, eight times below bf16's and well below the output's own
# rounding. The scores keep their bf16 products ($Q$, $K$, $t_Q$, $t_K$ are never rounded).
#
# **Why not TF32.** Hopper's tensor cores also multiply fp32 operands as TF32: ten stored
# mantissa bits and fp32's exponent range. $\tilde P$ rounded to TF32 keeps float16's 11
# significant bits with no range to choose, and a bf16 or fp16 tile widens to fp32 exactly:
# the carry's accuracy without copies, for fp16 inputs too. We tried it in place of the
# split (one TF32 product for each probability product, $\tilde P$ rounded to nearest on its
# bits, the 16-bit tile widened). Its errors were the split's to three digits, and it was
# slower than the split: on an H200 at DiT-B/2's $(64, 12, 256)$, bf16, the forward with
# its JVP took 0.237 ms at $d = 64$ against the split's 0.173 ("fast": 0.154) and 0.340
# against 0.228 at $d = 72$ ("fast": 0.182); a MeanFlow call (the forward with its JVP, then
# the primal backward) 0.519 against 0.417 ms and 0.767 against 0.594 ("fast": 0.342 and
# 0.447) (`benchmarks/results/tf32_products_h200.json`, `tools/tile_sweep.py --auto-only
# --check`). A TF32 product runs at half the 16-bit rate (NVIDIA's H100 datasheet: 495
# against 989 dense TFLOP/s), as many tensor-core cycles as the split's two products; and
# the tensor cores read that operand from shared memory, so each block's widened tile is
# written there again, twice the bytes of the 16-bit one, which the split does not need
# (our reading of the difference; the kernels were timed, not profiled).
#
# The powers of two come back out exactly in fp32, once per row at the end. What has to be
# chosen is the range, so that nothing overflows and nothing that matters underflows:
#
# * $\hat V$ keeps $V$'s own scale ($e_v = 0$) while its largest entry lies in
#   $[2^{-6}, 2^{14})$ (`copy_exponent`), and is otherwise shifted so that its largest
#   entry lies in $[1/2, 1)$. Unshifted, a bf16 value at or above $2^{-17}$ is exact in
#   float16 (its 8 significant bits fit even float16's subnormals down to there), and a
#   smaller one errs by at most $2^{-25}$, below $2^{-19}$ of the largest entry and far
#   below the output's own rounding; past $2^{14}$ the copy would come near float16's
#   largest value. $\tilde P \le 1$ is safe as it is: entries below float16's normal range
#   ($2^{-14}$ of the row's largest) add less than $2^{-25}$ each.
# * $\hat t_V$ is chosen the same way ($e_t$). The tangent's two products,
#   $\tilde P \circ (t_S - \mu)$ times $\hat V$ and $\tilde P$ times $\hat t_V$, share one
#   accumulator, so they must land in the same units. Row $i$ keeps its tangent accumulator
#   in units $2^{c_i}$ and multiplies its operands by powers of two before rounding them:
#   the centred scores by $2^{c_i - e_v}$, $\tilde P$ by $2^{c_i - e_t}$. $c_i$ must keep
#   both below float16's largest value: with
#   $|t_{S,ij} - \mu_i| \le M_i = \max_j |t_{S,ij}| + |\mu_i|$ over the key block and
#   $\tilde P \le 1$, the largest $c_i$ with
#   $M_i\,2^{c_i - e_v} < 2^{14}$ and $c_i - e_t \le 14$ (`tangent_units`) keeps them at
#   least four times below it, whatever the data. Whichever limit binds, the other operand's
#   entries are small next to the binding one's, so what it loses to underflow does not show.
#
# The kernel chooses $c_i$ as it goes, as the online softmax chooses its maximum: at each
# key block, from that block's largest $|t_S|$ in the row (one more row reduction), never
# above the previous blocks' $c_i$, so that the sums already made never grow. Moving the
# accumulator to the new units is a multiply by $2^{c_i' - c_i}$, exact in fp32, folded
# into the softmax's rescaling by $\alpha$; the factor on the centred scores folds into the
# multiply-add that centres them ($t_S\,s\,2^{c - e_v} - \mu\,2^{c - e_v}$, from the
# unscaled product), and only $\tilde P$'s factor for the $t_V$ product is a multiply of its
# own. At the end, $t_O = \texttt{acc\_t}\,2^{-c_i}/\ell$ and $\mu$ is in natural units
# throughout. A learnable mask's tangent $t_B$ joins the scores' tangent before the bound,
# $M_i$ then bounding $|s\,t_S + t_B - \mu_i|$ (one multiply more per entry, only in such
# calls), so a call with one carries as any other: a bias tangent a thousand times the
# scores' stays in range (`test_carried_mask_tangent_gpu`). With a learnable bias the
# carry is about level with the split, as without one (H100, bf16, GPU time per
# forward+JVP call, carried against split,
# `benchmarks/results/carry_cost_bias_h100.json`): 1.25 against 1.36 ms at (16, 16, 1024,
# 72), 1.30 against 1.36 at (32, 12, 1024, 64), 1.65 against 1.64 at (16, 16, 1024, 128);
# causal, 0.77 against 0.77, 0.79 against 0.78 and 1.05 against 0.96.
# An earlier version chose one power of two $w$ for the whole call from a bound on $t_S$,
# $s\,d\,(\max|t_Q|\max|K| + \max|Q|\max|t_K|)$, and scaled $t_V$'s copy by $w\,2^{e_v}$
# so that the kernel needed no per-row factor; the bound made the range pass read $Q$,
# $K$, $t_Q$ and $t_K$ as well as the two tensors it copies (measurements below).
#
# Everything is computed on the GPU, so the launch never waits for the host, in two
# launches whatever the number of tensors (`carried_operands`). The first, the range pass,
# streams every input once: 256 programs per tensor (`RANGE_PROGRAMS`) each keep the largest
# magnitude of their share of its rows. In the second, every program reduces those partial maxima (a few hundred
# floats, from L2), turns them into exponents (frexp, read off the fp32 bits) and powers of
# two with a small @triton.jit function passed to it as a constexpr (`value_shifts` here,
# `backward_shifts` in chapter 5), and writes one tile of one copy, a multiply straight to
# float16; its first program also stores what the attention kernel needs to undo the
# shifts, here the two exponents, a small device tensor it reads once. This chapter's two
# copies are made first (`copy_first`): the range pass writes $V$ and $t_V$ to float16
# unshifted as it reads them, and the second launch rewrites a copy only where its shift is
# not 1, so a tensor whose largest entry lies in $[2^{-6}, 2^{14})$ is read once and written
# once, not read twice. Measured on one H100 machine, before and after in one session
# (bf16, `carry_cost.py`, runs "flat passes, again" and "copies made first" in
# `benchmarks/results/carry_cost_h100.json`), the two passes went from 0.078 to 0.058 ms at
# (16, 16, 1024, 72), 0.103 to 0.078 at (32, 12, 1024, 64) and 0.137 to 0.105 at
# (16, 16, 1024, 128): the range pass now takes 0.049 to 0.091 ms and the copy launch, which
# rewrites nothing for such data, 0.009 to 0.015. That launch then had a program per tile,
# each reducing the partial maxima only to find nothing to do; after copies made first it
# has as many programs as the range pass, each taking every 256th tile, and takes 0.002 ms
# (the carry 0.051, 0.068 and 0.093 ms at those shapes, run "copy launch of 256 programs"
# against "copies made first, again" on one H100 machine). The range pass itself streams at
# 2.6 to 2.8 TB/s, reads and writes together, whatever its programs (128 to 1024) and warps
# (4 or 8); PyTorch's own `x.to(torch.float16)` of the same tensors ran at 1.35 TB/s there
# (`benchmarks/carry_passes.py`, `benchmarks/results/carry_passes_h100.json`).
# What is left of the carry is one read and one write of $V$ and $t_V$. The tensors travel
# to both kernels as tuples, so the host does the same few steps for any of them. The copies are O(N) memory.
# Exponents are clamped to $\pm 36$: a tensor whose largest entry lies below $2^{-37}$ (about
# $10^{-11}$) keeps fewer bits for its smallest entries, and one above $2^{52}$ would
# overflow float16. fp16 inputs have no wider 16-bit type and keep the split; chapter 5
# carries the backward the same way.
#
# Both passes take their tensors in tiles of 8192 elements. A tensor whose rows are
# strided (heads split off a projection without a copy, say) is read row by row, its
# columns padded to a power of two; a contiguous one, the usual case, as a flat array
# (`carried_operands`, `_pass_block`), which wastes no lanes on padding (72 columns otherwise
# read as 128) and does no row arithmetic. A copy keeps its rows only where the epilogue
# reads them (`row_copies`; bit $c$ of the copy kernel's `FLAT` says copy $c$ is flat):
# chapter 5's backward copies $Q$, $K$ and $V$ flat and dO, whose rows make $\Delta$, by
# rows. Measured on one H100 machine (bf16, `carry_cost.py`, both
# runs in `benchmarks/results/carry_cost_h100.json`), the forward's two passes took 0.078
# ms flat against 0.090 by rows at (16, 16, 1024, 72); at head dims that are powers of two
# nothing changed (0.103 against 0.105 ms at (32, 12, 1024, 64), 0.137 at
# (16, 16, 1024, 128)). A sweep of the flat passes' programs, warps and tile sizes on the
# same machine (256 or 1024 programs per tensor, 4 or 8 warps, tiles of 2048 to 8192
# elements, one or four tiles per copy program) found none more than 3% faster: the two
# passes stream at about 1.3 and 1.5 TB/s at these sizes (tens of MB), whatever the launch.
#
# The first version did the same arithmetic with PyTorch operations (`torch._foreach_norm`,
# a stack, a one-program shifts kernel, one multiply per copy): about a dozen launches per
# call, against the two above. The range pass and the copies still cost two O(N) passes,
# which the saved products pay back only on long rows. Measured on the H200 with that first
# version (bf16, GPU time per call in ms of the forward+JVP, one run, B·H = 196608 / N rows
# of N tokens, so the same number of query rows at every N):
#
# | d, N | 256 | 512 | 1024 | 2048 | 4096 | 16384 |
# |---|---|---|---|---|---|---|
# | 64: carry / split / fast | 0.33 / 0.18 / 0.15 | 0.41 / 0.29 / 0.24 | 0.58 / 0.52 / 0.40 | 0.94 / 0.98 / 0.73 | 1.57 / 1.93 / 1.38 | 5.19 / 7.48 / 4.98 |
# | 128: carry / split / fast | 0.63 / 0.36 / 0.31 | 0.80 / 0.57 / 0.48 | 1.15 / 1.01 / 0.83 | 1.83 / 1.87 / 1.51 | 3.20 / 3.60 / 2.88 | |
#
# With that first version "accurate" carried from 2048 keys per row. The two-launch carry
# moved the crossover: on the H200 (bf16, 16384 tokens in B sequences of N, 16 heads of 128
# or 32 of 64, `bench.py` with and without `--carry-min-keys 0`, chapter 8) carrying at 1024 keys brings the forward+JVP from
# 1.34x (d = 64) and 1.24x (d = 128) the time of "fast" down to 1.21x and 1.17x, and the
# primal backward (chapter 5) from 1.67x and 1.37x down to 1.19x and 1.22x. So "accurate"
# carries from 1024 keys per row and splits below (`CARRY_MIN_KEYS`), forward and backward
# alike. Head dims cut into two column tiles (72 = 64 + 16, `column_tiles` in
# "Tiles, autotuning and the launch" below) first carried from 2048 keys, the earlier
# threshold: at DiT-XL/2's (16, 16, 1024, 72) the carried forward+JVP took 1.62 ms
# against the split's 1.25 ms, and the MeanFlow step 3.75 against 2.71 ms. Measured again with the
# two-launch carry and paired tails (H200, bf16, (16, 16, 1024, 72), `triton.testing.do_bench`
# of the call, one process), the carry took 0.900 ms for the forward+JVP against the
# split's 0.942 ("fast": 0.756), and 2.361 against 2.353 ms for the MeanFlow call (forward
# with the tangent, then the backward; "fast": 2.002): level, so the threshold stayed.
# Since the launches tell the kernels that rows of 72 elements are 16-byte aligned
# (`row_alignment`, "Tiles, autotuning and the launch" below), the carried kernels at
# $d = 72$ load as fast as the others, and head dims cut in two now carry from 1024 keys
# too: at (16, 16, 1024, 72), GPU time per call from the profiler
# (`benchmarks/training_shapes.py --shape dit-xl2-512 --impl ours`, H200, bf16, both
# thresholds in one session), the forward+JVP took 0.900 ms carried against 0.913 split,
# and the MeanFlow call 2.130 against 2.321 ms (8% less). The carry costs the host more
# (2.07 against 1.49 ms per MeanFlow call: four more launches) and memory (peak 331
# against 187 MB: the fp16 copies). So an eager MeanFlow call, which the host then nearly
# binds, gains little in wall time (2.157 against 2.356 ms in that session, 2.418 in a
# later run of `training_shapes.py` whose host took 2.31 ms), while under CUDA graphs
# (`ours_cudagraphs`, `benchmarks/results/training_shapes_h200.json`) the call took 2.156
# ms against 2.409 before and the forward+JVP 0.894 against 0.944. A compiled graph
# carries too: the copy kernel's launch cannot enter a graph (it takes jit functions as
# arguments), so the graph calls the copies as an opaque operator and traces the attention
# kernels that read them (`graph_carry`, below). Below 1024 keys the two O(N) passes of the carry cost more than the split's extra
# products saves (0.33 against 0.18 ms at 256 keys with the first version; not measured
# again), and accurate mode costs the split: 15 to 30% more GPU time than "fast" for the
# forward+JVP, where the call is bound by host work anyway.
#
# What the carry costs at 1024 keys, where it starts, is the two passes and nothing else.
# Profiled on the H200 (bf16, `torch.profiler`, GPU time per call, mean of ten warm calls),
# the forward+JVP at (16, 32, 1024, 64) took 1.237 ms carried against 1.017 ms fast: the
# attention kernel 1.034 ms, the range pass 0.138 ms, the copies 0.066 ms. At
# (16, 16, 1024, 128) it was 1.096 + 0.137 + 0.066 against 1.100 ms, and at
# (8, 32, 2048, 64) 1.958 + 0.138 + 0.066 against 1.947 ms. A MeanFlow call at
# (16, 32, 1024, 64), the forward+JVP and then chapter 5's carried backward, ran the same
# three attention kernels within 1% of fast's times (2.254 against 2.250 ms) plus 0.474 ms
# of range passes and copies: 1.21x in all. The copies stream at about 4.1 TB/s, near the
# H200's memory bandwidth; the range pass, which reads six tensors, streamed at about
# 2.9 TB/s with 64 programs of 8 warps per tensor. With 256 programs of 4 (`RANGE_PROGRAMS`,
# `RANGE_WARPS` below) it takes 0.104 ms instead of 0.137 at (16, 32, 1024, 64), about
# 3.9 TB/s: the carried forward+JVP then took 1.200 ms against fast's 1.010 (1.19x), and the
# whole MeanFlow call 2.981 ms of GPU time against 3.054 before (one run, all kernels).
# Counting bytes shows where a 10% target lies at this length: the forward's two passes
# move 671 MB (six tensors read, two read again and written as fp16), which take 0.14 ms
# even at the H200's nominal 4.8 TB/s, 14% of the fast kernel's time. Faster passes alone
# cannot get there. Converting to float16 inside the attention kernel after each load,
# instead of the copies (their 268 MB gone, the range pass's reads left), was tried and
# does not get there either: on the H200 (bf16, GPU time of the whole call under CUDA
# graphs, one session) the forward+JVP took 0.986 ms at (32, 12, 1024, 64) against 0.983
# carried and 0.815 fast, and 1.257 against 1.128 carried at (8, 16, 2048, 64). Each key
# block's $V$ and $t_V$ tiles then go from shared memory to registers and back before the
# tensor cores read them, which costs what the copies did. (At 256 keys it took 0.160 ms
# against the split's 0.179 and fast's 0.137 at (64, 12, 256, 64), before the range pass
# that its shifts would still need.)
#
# Choosing the tangent's units per row in the kernel (above) took the range pass from six
# tensors to two. Measured on H100 machines (bf16, `torch.func.jvp` of the call, GPU time
# per call from the profiler, mean of ten warm calls; accurate and "fast" in the same
# process; `benchmarks/carry_cost.py`, `benchmarks/results/carry_cost_h100.json`), the
# carry's two passes went from 0.153 to 0.089 ms at (16, 16, 1024, 72), from 0.178 to 0.105
# at (32, 12, 1024, 64), from 0.224 to 0.138 at (16, 16, 1024, 128) and from 0.117 to 0.071
# at (8, 16, 2048, 64). The attention kernel pays for its per-row factors: 0 to 6% over
# "fast"'s kernel without a causal mask, 1 to 5% with one at d = 72 and 128, 10 and 12% at
# (32, 12, 1024, 64) and (8, 16, 2048, 64). In all, accurate over "fast" went from 1.17 to
# 1.15 at (16, 16, 1024, 72), 1.23 to 1.20 at (32, 12, 1024, 64), 1.16 to 1.14 at
# (16, 16, 1024, 128) and stayed at 1.10 at (8, 16, 2048, 64); causal, from 1.34 to 1.23,
# 1.36 to 1.33 and 1.36 to 1.24 at the three 1024-key shapes, and from 1.19 to 1.25 at
# (8, 16, 2048, 64), where the kernel's 12% outweighs the passes' savings. (The runs were
# on two machines of the same kind; the unchanged (4, 16, 4096, 64) calls, chapter 11's
# kernel, moved by two points between them.) Two designs that cut the passes further lost in the
# kernel what they saved outside it (same measurement, one H100 machine each): copies
# shifted per block of 64 keys, made in one pass (0.066 ms at (32, 12, 1024, 64)), made the
# kernel load each block's exponents inside its key loop, which cost it 3 to 14% over
# "fast"'s (loading the next block's a block ahead was slower still); copies
# shifted per head by one program per head, the kernel unchanged, took 0.127 ms there, no
# faster than the two passes over all heads. Chapter 11's warp-specialized kernel keeps the
# earlier single power of two $w$ (`jvp_operands`, below).

# %% tags=["export:tiles"]
# |exponent| of any carrying shift: sums of three exponents stay inside fp32's range.
MAX_SHIFT = tl.constexpr(36)


@triton.jit
def shift_exponent(bound, top):
    """The largest integer e with bound * 2**e < 2**top (bound >= 0, fp32), clamped to
    +-MAX_SHIFT (zero gives MAX_SHIFT): frexp, read off bound's exponent bits."""
    exponent = ((bound.to(tl.int32, bitcast=True) >> 23) & 255) - 126
    return tl.minimum(tl.maximum(top - exponent, -MAX_SHIFT), MAX_SHIFT)


@triton.jit
def power_of_two(exponent):
    """2**exponent in fp32, built from its bits (exact for -126 <= exponent <= 127)."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def carry_factor(factors_ptr, index, CARRY: tl.constexpr, identity):
    """Entry `index` of a launch's carry factors (`jvp_operands`); `identity` without CARRY."""
    if CARRY:
        factor = tl.load(factors_ptr + index)
    else:
        factor = identity
    return factor


@triton.jit
def vector_entry(vector, index):
    """Entry `index` of a small 1-D tensor (Triton indexes tensors only through masks)."""
    return tl.sum(tl.where(tl.arange(0, vector.shape[0]) == index, vector, 0.0), 0)


@triton.jit
def with_entry(vector, index, value):
    """`vector` with entry `index` set to `value`."""
    return tl.where(tl.arange(0, vector.shape[0]) == index, value, vector)


@triton.jit
def _row_block(strides, shapes, index: tl.constexpr, batch, block, BLOCK_R: tl.constexpr,
               BLOCK_W: tl.constexpr, ALIGN: tl.constexpr):
    """Offsets, flat row numbers and mask of row block `block` of tensor `index`, a
    (B, H, N, W) view with unit last stride whose rows are taken in (b, h, n) order; its
    strides and W are multiples of ALIGN (`aligned`)."""
    heads, n = shapes[3 * index], shapes[3 * index + 1]
    width = aligned(shapes[3 * index + 2], ALIGN)
    rows = tl.arange(0, BLOCK_R).to(tl.int64) + block * BLOCK_R  # (b, h, n) < 2**31 rows
    cols = tl.arange(0, BLOCK_W)
    offsets = ((rows // (heads * n)) * aligned(strides[3 * index], ALIGN)
               + ((rows // n) % heads) * aligned(strides[3 * index + 1], ALIGN)
               + (rows % n) * aligned(strides[3 * index + 2], ALIGN))
    mask = (rows < batch * heads * n)[:, None] & (cols < width)[None, :]
    return offsets[:, None] + cols[None, :], rows, cols, mask


@triton.jit
def _pass_blocks(shapes, index: tl.constexpr, batch, BLOCK_R: tl.constexpr,
                 BLOCK_W: tl.constexpr, FLAT: tl.constexpr):
    """How many blocks of tensor `index` a pass takes (`_pass_block`)."""
    rows = batch * shapes[3 * index] * shapes[3 * index + 1]
    if FLAT:
        blocks = tl.cdiv(rows * shapes[3 * index + 2], BLOCK_R * BLOCK_W)
    else:
        blocks = tl.cdiv(rows, BLOCK_R)
    return blocks


@triton.jit
def _pass_block(strides, shapes, index: tl.constexpr, batch, block, BLOCK_R: tl.constexpr,
                BLOCK_W: tl.constexpr, ALIGN: tl.constexpr, FLAT: tl.constexpr):
    """Offsets into tensor `index` and into its contiguous copy, flat row numbers, columns
    and mask of block `block`: BLOCK_R rows (`_row_block`) or, with FLAT, BLOCK_R * BLOCK_W
    consecutive elements of a contiguous tensor (no padded columns, no divisions; its rows
    and columns then mean nothing)."""
    if FLAT:
        numel = batch * shapes[3 * index] * shapes[3 * index + 1] * shapes[3 * index + 2]
        rows = tl.arange(0, BLOCK_R).to(tl.int64) + block * BLOCK_R
        cols = tl.arange(0, BLOCK_W)
        offsets = rows[:, None] * BLOCK_W + cols[None, :]
        copy_offsets, mask = offsets, offsets < numel
    else:
        offsets, rows, cols, mask = _row_block(strides, shapes, index, batch, block, BLOCK_R,
                                               BLOCK_W, ALIGN)
        copy_offsets = rows[:, None] * aligned(shapes[3 * index + 2], ALIGN) + cols[None, :]
    return offsets, copy_offsets, rows, cols, mask


@triton.jit
def range_partials_kernel(tensors, strides, shapes, batch, partials_ptr,
                       N_TENSORS: tl.constexpr, N_COPIES: tl.constexpr,
                       PROGRAMS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                       ALIGN: tl.constexpr, FLAT: tl.constexpr, COPY_FIRST: tl.constexpr):
    """partials[t, p] = max |x| over blocks p, p + PROGRAMS, ... of tensor t: a
    (PROGRAMS, N_TENSORS) grid reads every tensor once. With COPY_FIRST it also writes the
    first N_COPIES tensors in float16 as they are (unshifted) to their copies, which follow
    the N_TENSORS inputs in `tensors` (one tuple: a replay fills in one)."""
    program, which = tl.program_id(0), tl.program_id(1)
    for t in tl.static_range(N_TENSORS):
        if which == t:
            n_blocks = _pass_blocks(shapes, t, batch, BLOCK_R, BLOCK_W, FLAT)
            largest = tl.zeros([BLOCK_R, BLOCK_W], tl.float32)
            for block in range(program, n_blocks, PROGRAMS):
                offsets, copy_offsets, _, _, mask = _pass_block(
                    strides, shapes, t, batch, block, BLOCK_R, BLOCK_W, ALIGN, FLAT)
                x = tl.load(tensors[t] + offsets, mask=mask, other=0.0)
                largest = tl.maximum(largest, tl.abs(x.to(tl.float32)))
                if COPY_FIRST and t < N_COPIES:
                    tl.store(tensors[N_TENSORS + t] + copy_offsets, x.to(tl.float16),
                             mask=mask)
            tl.store(partials_ptr + t * PROGRAMS + program, tl.max(tl.max(largest, 1), 0))


@triton.jit
def no_epilogue(copy_index: tl.constexpr, x, rows, cols, args):
    """The copies alone: nothing more is made of the rows the copy kernel holds."""
    return


@triton.jit
def _copy_block(x_ptr, copy_ptr, shift, strides, shapes, index: tl.constexpr, batch, block,
                epilogue_args, EPILOGUE: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_W: tl.constexpr, ALIGN: tl.constexpr, FLAT: tl.constexpr):
    """Block `block` of tensor `index` times `shift`, written to its float16 copy, then
    EPILOGUE on the rows (`carried_copies_kernel`)."""
    offsets, copy_offsets, rows, cols, mask = _pass_block(strides, shapes, index, batch, block,
                                                          BLOCK_R, BLOCK_W, ALIGN, FLAT)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # bf16 (8 bits) times a power of two is exact in fp16 (11) inside its range
    tl.store(copy_ptr + copy_offsets, (x * shift).to(tl.float16), mask=mask)
    EPILOGUE(index, x, rows, cols, epilogue_args)


@triton.jit
def carried_copies_kernel(tensors, copies, strides, shapes, batch, partials_ptr, factors_ptr,
                           bound, epilogue_args, SHIFTS: tl.constexpr, EPILOGUE: tl.constexpr,
                           N_TENSORS: tl.constexpr, N_COPIES: tl.constexpr,
                           N_FACTORS: tl.constexpr, PROGRAMS: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                           ALIGN: tl.constexpr, FLAT: tl.constexpr,
                           COPY_FIRST: tl.constexpr):
    """Block program_id(0) of copy program_id(1) (`_pass_block`; bit c of FLAT: copy c as
    a flat array, which EPILOGUE must not read rows of; COPY_FIRST only with
    `no_epilogue`): tensor c times its power of two (with COPY_FIRST, only where that is
    not 1: the range pass wrote the copy unshifted), written to float16 (contiguous). Every
    program with a block to copy reduces the partial maxima itself (a few hundred floats,
    from L2) and asks SHIFTS(maxima, bound) for a vector of 16 or 32 values: the copies'
    shifts, then the factors, which the first program stores. EPILOGUE(c, rows of tensor c
    in fp32, their flat row numbers, columns, epilogue_args) then may use the rows in
    registers for more (the backward's row statistics, chapter 5). With COPY_FIRST the
    grid is smaller than the blocks and each program takes every num_programs(0)-th block:
    most such launches rewrite nothing, and each program reads the partial maxima once."""
    first, which = tl.program_id(0), tl.program_id(1)
    live = (first == 0) & (which == 0)  # the program that stores the factors
    for c in tl.static_range(N_COPIES):  # a flat copy has fewer blocks than one by rows
        live |= (which == c) & (first < _pass_blocks(shapes, c, batch, BLOCK_R, BLOCK_W,
                                                     (FLAT >> c) & 1))
    if live:
        tensor = tl.arange(0, 8)  # at most 8 tensors
        partial = tl.load(partials_ptr + tensor[:, None] * PROGRAMS
                          + tl.arange(0, PROGRAMS)[None, :],
                          mask=(tensor < N_TENSORS)[:, None], other=0.0)
        values = SHIFTS(tl.max(partial, 1), bound)
        if (first == 0) & (which == 0):
            entry = tl.arange(0, values.shape[0])
            tl.store(factors_ptr + entry - N_COPIES, values,
                     mask=(entry >= N_COPIES) & (entry < N_COPIES + N_FACTORS))
        for c in tl.static_range(N_COPIES):
            shift = vector_entry(values, c)
            if COPY_FIRST:  # only where the shift is not 1, many blocks per program
                if (which == c) & (shift != 1.0):
                    for block in range(first, _pass_blocks(shapes, c, batch, BLOCK_R, BLOCK_W,
                                                           (FLAT >> c) & 1),
                                       tl.num_programs(0)):
                        _copy_block(tensors[c], copies[c], shift, strides, shapes, c, batch,
                                    block, epilogue_args, EPILOGUE, BLOCK_R, BLOCK_W, ALIGN,
                                    (FLAT >> c) & 1)
            elif which == c:  # one block per program
                _copy_block(tensors[c], copies[c], shift, strides, shapes, c, batch, first,
                            epilogue_args, EPILOGUE, BLOCK_R, BLOCK_W, ALIGN, (FLAT >> c) & 1)


# The tangent operands' largest entries stay below 2**TANGENT_TOP, four times below
# float16's largest value (`tangent_units`).
TANGENT_TOP = tl.constexpr(14)


@triton.jit
def tangent_units(ts, ts_scale, mu, units, v_shift, t_shift):
    """The exponent c of the units 2**c the tangent accumulator is kept in after this key
    block, per row: at most `units` (the previous blocks'), so that earlier sums never grow,
    and small enough that both rounded operands of the block stay below 2**TANGENT_TOP:
    P~ (tS - mu) 2**(c - v_shift) with |tS - mu| <= max |tS| + |mu| (tS = `ts` times
    `ts_scale` > 0), and P~ 2**(c - t_shift) with P~ <= 1."""
    bound = ts_scale * tl.max(tl.abs(ts), 1) + tl.abs(mu)
    block_units = tl.minimum(shift_exponent(bound, TANGENT_TOP) + v_shift,
                             TANGENT_TOP + t_shift)
    return tl.minimum(units, block_units)


# %% [markdown]
# The host side of the carry is launch policy, shared with the backward: it opens the
# module `jvp_attention.launch` (its imports, shown but not run, as above).

# %% tags=["export:launch", "skip-execution"]
"""The launch policy that the forward (chapter 2) and backward (chapter 5) launchers share:
the precision mode, the autotuning keys and tiles, tensor-descriptor eligibility, the device
guard, the mask operand, the shape checks and the host side of the bf16 carry.

`notebooks/02_forward.py` derives it.
"""

import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch
import triton
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import wrap_triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.driver import driver

from jvp_attention.tiles import (
    ADDITIVE_MASK,
    ADDITIVE_WITH_TANGENT,
    BOOL_MASK,
    NO_MASK,
    carried_copies_kernel,
    no_epilogue,
    range_partials_kernel,
)


# %% tags=["export:launch"]
def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1. `triton.next_power_of_2` and `triton.cdiv`
    are constexpr functions: called from the host, each passes through a wrapper that costs
    a few microseconds, and a call of the library makes about a dozen such calls."""
    return 1 << (n - 1).bit_length()


def length_bucket(n: int) -> int:
    """The autotuners' key for a sequence length: its power-of-two bucket. A length that a
    compiled graph traces as symbolic (a `torch.SymInt`) gets 1 instead: a traced launch's
    autotuner keys on nothing (`TracedLaunch`), and `SymInt.bit_length` would fix the
    length, so that the graph served that length only and every new one compiled another."""
    return next_power_of_2(n) if type(n) is int else 1


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers."""
    return -(-a // b)


# The range pass's programs per tensor and warps per program. More, smaller programs keep
# more loads in flight: on the H200, reading six (16, 32, 1024, 64) bf16 tensors took
# 143.8 us with 64 programs of 8 warps and 109.4 us with 256 of 4. Every copy program
# reduces all their partial maxima (6 KiB from L2 at 256 per tensor).
RANGE_PROGRAMS = 256
RANGE_WARPS = 4


def scratch_tensor(shape, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor that a call's kernels work in (the carry's copies and
    factors). While the call is being recorded (`RECORDER`, "Replaying a call" below) it
    is noted, so that a replay of the call allocates one like it."""
    x = torch.empty(shape, device=device, dtype=dtype)
    if RECORDER.scratch is not None:
        RECORDER.scratch.append(x)
    return x


def carried_operands(copied: tuple[torch.Tensor, ...], others: tuple[torch.Tensor, ...],
                     shifts: triton.JITFunction, bound: float, n_factors: int,
                     epilogue: triton.JITFunction = no_epilogue, epilogue_args: tuple = (0,),
                     copy_first: bool = False, row_copies: tuple[int, ...] | None = None,
                     ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Exact fp16 copies of `copied`, each scaled by a power of two, and the factors that
    undo the shifts, in two launches that never wait for the host.

    Args:
        copied: The (B, H, N, W) tensors to copy, unit last stride (bf16, or fp16 in tests).
        others: Tensors whose largest magnitudes the shifts also depend on.
        shifts: A @triton.jit function of (the largest |x| of `copied` then `others`,
            `bound`) returning 16 or 32 fp32 values: the copies' shifts, then the factors.
        bound: A number `shifts` needs (a scale, or a power of two's exponent), or a tuple
            of numbers.
        n_factors: How many factors follow the shifts.
        epilogue: A @triton.jit function of (copy index, a block of that tensor's rows in
            fp32, their flat (b, h, n) row numbers, the columns, `epilogue_args`) that the
            copy kernel calls after writing each block (`no_epilogue`: nothing).
        epilogue_args: A tuple of tensors and numbers that `epilogue` reads.
        copy_first: The range pass writes the copies unshifted as it reads them, and the
            second launch rewrites only those whose shift is not 1 (`shifts` then keeps a
            tensor's own scale wherever that copy is as exact: `copy_exponent`); only with
            `no_epilogue`.
        row_copies: The copies whose rows `epilogue` reads (None: every copy, unless there
            is no epilogue); the others, where contiguous, are copied as flat arrays.

    Returns:
        The contiguous fp16 copies, and the factors (fp32, on the inputs' device).
    """
    tensors = (*copied, *others)
    device = tensors[0].device
    strides = tuple(s for x in tensors for s in x.stride()[:3])
    shapes = tuple(n for x in tensors for n in x.shape[1:])
    width = next_power_of_2(max(x.shape[-1] for x in tensors))
    programs = 4 if interpreting() else RANGE_PROGRAMS
    meta = {"N_TENSORS": len(tensors), "PROGRAMS": programs,
            "BLOCK_R": max(1, 8192 // width), "BLOCK_W": width,
            "ALIGN": row_alignment(tensors, tuple(x.shape[-1] for x in tensors))}
    partials = scratch_tensor(len(tensors) * programs, device, torch.float32)
    copies = tuple(scratch_tensor(x.shape, device, torch.float16) for x in copied)
    factors = scratch_tensor(n_factors, device, torch.float32)
    batch = tensors[0].shape[0]
    # Contiguous tensors are read as flat arrays (`_pass_block`: no padded columns, no row
    # arithmetic); a copy keeps its rows where the epilogue reads them (bit c of
    # `flat_copies`: copy c flat). (Loops, not generators: this runs on every call.)
    if row_copies is None:
        row_copies = () if epilogue is no_epilogue else tuple(range(len(copied)))
    flat, flat_copies, blocks = True, 0, 0
    for i, x in enumerate(tensors):
        flat = flat and x.is_contiguous()
        if i < len(copied) and x.is_contiguous() and i not in row_copies:
            flat_copies |= 1 << i
            blocks = max(blocks, cdiv(x.numel(), meta["BLOCK_R"] * width))
        elif i < len(copied):
            blocks = max(blocks, cdiv(x.shape[:3].numel(), meta["BLOCK_R"]))
    cached(range_partials_kernel)[(programs, len(tensors))](
        (*tensors, *copies) if copy_first else tensors, strides, shapes, batch, partials,
        num_warps=RANGE_WARPS, N_COPIES=len(copied), FLAT=flat, COPY_FIRST=copy_first,
        **meta)
    if copy_first:  # as many programs as the range pass's, each taking many blocks
        blocks = min(blocks, programs)
    cached(carried_copies_kernel)[(blocks, len(copied))](
        tensors, copies, strides, shapes, batch, partials, factors, bound, epilogue_args,
        SHIFTS=shifts, EPILOGUE=epilogue, N_COPIES=len(copied), N_FACTORS=n_factors,
        num_warps=8, FLAT=flat_copies, COPY_FIRST=copy_first, **meta)
    return copies, factors


# Keys per row from which carrying beats the split (the H200 measurements above).
CARRY_MIN_KEYS = 1024


def carry_min_keys(head_dim: int) -> int:
    """Keys per row from which bf16 "accurate" carries at this head dim: CARRY_MIN_KEYS at
    every head dim, those cut into two column tiles (72 = 64 + 16) included since their
    loads are aligned (see above)."""
    return CARRY_MIN_KEYS


def carries(q: torch.Tensor, n_keys: int) -> bool:
    """Whether "accurate" mode carries the rounded products as exact fp16 copies rather
    than splitting them: bf16 inputs with at least `carry_min_keys` keys per row. Shorter
    rows split, which is as accurate and cheaper there; fp16 always splits (it has no wider
    16-bit type) and fp32 has nothing to round. A compiled graph carries as an eager call
    does, its copies made by an opaque operator (`graph_carry`)."""
    return q.dtype == torch.bfloat16 and n_keys >= carry_min_keys(q.shape[-1])


def carried_fakes(copied: tuple[torch.Tensor, ...], n_factors: int) -> tuple[torch.Tensor, ...]:
    """What `carried_operands` returns for `copied`, as empty tensors, flat: the fp16
    copies, then the fp32 factors (a carry operator's fake implementation)."""
    return (*(torch.empty(x.shape, device=x.device, dtype=torch.float16) for x in copied),
            torch.empty(n_factors, device=copied[0].device, dtype=torch.float32))


def graph_carry(name: str, schema: str, carry: Callable[..., tuple[torch.Tensor, ...]],
                fake: Callable[..., tuple[torch.Tensor, ...]],
                ) -> Callable[..., tuple[torch.Tensor, ...]]:
    """How a launcher calls `carry` (a function of tensors and numbers built on
    `carried_operands`): directly on real tensors; on the functional tensors of a compiled
    graph being traced, through the opaque operator `jvp_attention::name` (its `schema`,
    `fake` its fake implementation). The copy kernel takes jit functions as arguments, which
    Inductor cannot paste into a graph's code; the attention kernels that read the copies
    are traced as usual."""
    def on_inputs_device(*args):
        with on_device(args[0]):
            return carry(*args)

    operator = torch.library.custom_op(f"jvp_attention::{name}", on_inputs_device,
                                       mutates_args=(), schema=schema,
                                       tags=(torch.Tag.needs_fixed_stride_order,))
    operator.register_fake(fake)

    def call(*args):
        return (operator if isinstance(args[0], FunctionalTensor) else carry)(*args)
    return call


# %% tags=["export"]
@triton.jit
def jvp_shifts(maxima, t_scale):
    """From max |v|, |tv|, |q|, |k|, |tq|, |tk|: the shifts 2**e_v of v and 2**(e_w + e_v) of
    tv, then the forward+JVP kernel's factors w = 2**e_w, 2**-e_v, 2**-(e_w + e_v), 2**-e_w."""
    # |tS| <= s d (max|tQ| max|K| + max|Q| max|tK|), and |mu| too
    t_bound = in_fp32(t_scale) * (vector_entry(maxima, 4) * vector_entry(maxima, 3)
                         + vector_entry(maxima, 2) * vector_entry(maxima, 5))
    e_v = shift_exponent(vector_entry(maxima, 0), 0)
    e_w = tl.minimum(shift_exponent(2 * t_bound, 14),
                     shift_exponent(vector_entry(maxima, 1), 14 - e_v))
    values = tl.zeros([16], tl.float32)
    values = with_entry(values, 0, power_of_two(e_v))
    values = with_entry(values, 1, power_of_two(e_w + e_v))
    values = with_entry(values, 2, power_of_two(e_w))
    values = with_entry(values, 3, power_of_two(-e_v))
    values = with_entry(values, 4, power_of_two(-e_w - e_v))
    return with_entry(values, 5, power_of_two(-e_w))


def jvp_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tq: torch.Tensor,
                 tk: torch.Tensor, tv: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """Exact fp16 copies of v and tv for the forward+JVP kernel on bf16 inputs, and the
    factors that undo their shifts (fp32, on the device): the tangent scores' w, then the
    factors of O, tO and mu."""
    (v_hat, tv_hat), factors = carried_operands((v, tv), (q, k, tq, tk), jvp_shifts,
                                                abs(scale) * q.shape[-1], 4)
    return v_hat, tv_hat, factors


# The largest entries for which a copy made unshifted keeps its tensor's own scale ("Exact
# fp16 operands" above): [COPY_LOW, COPY_HIGH).
COPY_LOW = tl.constexpr(2.0**-6)
COPY_HIGH = tl.constexpr(2.0**14)


@triton.jit
def copy_exponent(largest):
    """The exponent e of a copy made unshifted first (`carried_operands`' copy_first): 0,
    the tensor's own scale, while its largest entry lies in [COPY_LOW, COPY_HIGH), else the
    one that brings that entry into [1/2, 1) (`shift_exponent`)."""
    own_scale = (largest >= COPY_LOW) & (largest < COPY_HIGH)
    return tl.where(own_scale, 0, shift_exponent(largest, 0))


@triton.jit
def value_shifts(maxima, unused):
    """From max |v|, |tv|: the shifts 2**e_v and 2**e_t of their copies (`copy_exponent`),
    then the exponents e_v, e_t themselves (exact in fp32)."""
    e_v = copy_exponent(vector_entry(maxima, 0))
    e_t = copy_exponent(vector_entry(maxima, 1))
    values = tl.zeros([16], tl.float32)
    values = with_entry(values, 0, power_of_two(e_v))
    values = with_entry(values, 1, power_of_two(e_t))
    values = with_entry(values, 2, e_v.to(tl.float32))
    return with_entry(values, 3, e_t.to(tl.float32))


def value_operands(v: torch.Tensor, tv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Exact fp16 copies of v and tv for this chapter's forward+JVP kernel on bf16 inputs,
    each shifted by its own power of two, and the two exponents (fp32, on the device)."""
    (v_hat, tv_hat), exponents = carried_operands((v, tv), (), value_shifts, 0.0, 2,
                                                  copy_first=True)
    return v_hat, tv_hat, exponents


carried_value_operands = graph_carry(
    "value_operands", "(Tensor v, Tensor tv) -> (Tensor, Tensor, Tensor)", value_operands,
    lambda v, tv: carried_fakes((v, tv), 2))


# %% [markdown]
# ## The kernel
#
# The grid is (query tiles, batch × query heads). Under a causal mask the tiles differ in
# work (the last sees every key, the first one block), and the GPU starts programs in launch
# order, so the order decides what runs in the last wave. Each head's tiles last first, one
# head after another, ends on a few heads whose long tiles start late; every head's longest
# tile first makes the programs that run together read different heads' keys, which L2 cannot
# share (chapter 11 timed it slower). `query_program` takes the heads in groups
# (`causal_program`): a group's tiles longest first, its heads side by side, as many heads
# (up to 16) as keep their keys and values within 16 MiB (`head_group`). On the H100 (bf16,
# GPU time) that took the causal forward with its JVP from 0.306 to 0.278 ms at
# (4, 16, 2048, 64) and the forward from 0.199 to 0.187 ms at (4, 16, 2048, 128); chapter
# 11's kernels gain 4%. A program finds its key/value head by
# integer division, which is all GQA needs: `group_size` query heads share one key head, and
# nothing is repeated in memory. Pointers are offset in 64-bit arithmetic so that tensors
# above $2^{31}$ elements are safe. The epilogue normalises, and a row that saw no key at all
# ($\ell = 0$) writes $O = 0$, $t_O = 0$, $\mu = 0$ and $\mathrm{LSE} = -\infty$: our
# convention, the same as SDPA's since PyTorch 2.5 (a textbook softmax would give NaN).

# %% tags=["export"]
@triton.jit
def _attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, tq_ptr, tk_ptr, tv_ptr, mask_ptr, o_ptr, to_ptr, lse_ptr, mu_ptr,
    o_residual_ptr, to_residual_ptr, factors_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_tqb, stride_tqh, stride_tqm,
    stride_tkb, stride_tkh, stride_tkn, stride_tvb, stride_tvh, stride_tvn,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    n_heads, n_q, n_k, head_dim, value_dim, group_size, qk_scale, scale,
    n_q_bucket, n_k_bucket,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_TANGENT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr, USE_TMA: tl.constexpr, CARRY: tl.constexpr,
    D_TAIL: tl.constexpr, DV_TAIL: tl.constexpr, ALIGN: tl.constexpr,
    PAIR_D: tl.constexpr = False, PAIR_DV: tl.constexpr = False,
    HEAD_GROUP: tl.constexpr = 1,
):
    """O and LSE (and tO, mu when HAS_TANGENT) of one tile of query rows of one (batch, head).
    With CARRY, v and tv are `value_operands`' fp16 copies and `factors_ptr` their two
    exponents.
    With D_TAIL (DV_TAIL), the head dim of q and k (of v) is cut into tiles of BLOCK_D and
    D_TAIL columns (`column_tiles`), and with PAIR_D (PAIR_DV) the tangent's products over
    the tails are paired (`pair_tails`). Row strides and head dims are multiples of ALIGN."""
    (stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn, stride_tvn, head_dim,
     value_dim) = aligned_operands(stride_qm, stride_kn, stride_vn, stride_tqm, stride_tkn,
                                   stride_tvn, head_dim, value_dim, ALIGN)
    qk_scale, scale = in_fp32(qk_scale), in_fp32(scale)
    block, bh = query_program(IS_CAUSAL, HEAD_GROUP)
    start_m = block * BLOCK_M
    batch, head = batch_and_head(bh, n_heads, stride_mask_b, stride_mask_h, MASK_KIND)
    kv_head = head // group_size
    rows = start_m + tl.arange(0, BLOCK_M)
    q_base = head_base(q_ptr, batch, head, stride_qb, stride_qh, ALIGN)
    q = load_head_rows(q_base, start_m, stride_qm, n_q, head_dim, BLOCK_M, BLOCK_D, USE_TMA)
    q2 = load_head_tail_rows(q_base, start_m, stride_qm, n_q, head_dim, BLOCK_M, BLOCK_D,
                             D_TAIL, USE_TMA)
    k_base = head_base(k_ptr, batch, kv_head, stride_kb, stride_kh, ALIGN)
    k_src = tile_source(k_base, n_k, head_dim, stride_kn, BLOCK_N, BLOCK_D, USE_TMA)
    k2_src = tail_source(k_base, n_k, head_dim, stride_kn, BLOCK_N, BLOCK_D, D_TAIL, USE_TMA)
    v_base = head_base(v_ptr, batch, kv_head, stride_vb, stride_vh, ALIGN)
    v_src = tile_source(v_base, n_k, value_dim, stride_vn, BLOCK_N, BLOCK_DV, USE_TMA)
    v2_src = tail_source(v_base, n_k, value_dim, stride_vn, BLOCK_N, BLOCK_DV, DV_TAIL,
                         USE_TMA)
    mask_ptr = head_base(mask_ptr, batch, head, stride_mask_b, stride_mask_h)
    if HAS_TANGENT:
        tq_base = head_base(tq_ptr, batch, head, stride_tqb, stride_tqh, ALIGN)
        tq = load_head_rows(tq_base, start_m, stride_tqm, n_q, head_dim, BLOCK_M, BLOCK_D,
                            USE_TMA)
        if PAIR_D:
            tq2 = load_paired_tail_rows(tq_base + BLOCK_D, q_base + BLOCK_D, start_m,
                                        stride_tqm, stride_qm, n_q, head_dim - BLOCK_D,
                                        BLOCK_M, D_TAIL)
        else:
            tq2 = load_head_tail_rows(tq_base, start_m, stride_tqm, n_q, head_dim, BLOCK_M,
                                      BLOCK_D, D_TAIL, USE_TMA)
        tk_base = head_base(tk_ptr, batch, kv_head, stride_tkb, stride_tkh, ALIGN)
        tk_src = tile_source(tk_base, n_k, head_dim, stride_tkn, BLOCK_N, BLOCK_D, USE_TMA)
        tk2_src = tail_source(tk_base, n_k, head_dim, stride_tkn, BLOCK_N, BLOCK_D, D_TAIL,
                              USE_TMA)
        tv_base = head_base(tv_ptr, batch, kv_head, stride_tvb, stride_tvh, ALIGN)
        tv_src = tile_source(tv_base, n_k, value_dim, stride_tvn, BLOCK_N, BLOCK_DV, USE_TMA)
        tv2_src = tail_source(tv_base, n_k, value_dim, stride_tvn, BLOCK_N, BLOCK_DV, DV_TAIL,
                              USE_TMA)
        acc_t = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        acc_t2 = tail_accumulator(BLOCK_M, DV_TAIL)
    else:
        tq, tq2, tk_src, tk2_src, tv_src, tv2_src = q, q2, k_src, k2_src, v_src, v2_src
        acc_t = tl.zeros([1, 1], dtype=tl.float32)
        acc_t2 = tl.zeros([1, 1], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc_o2 = tail_accumulator(BLOCK_M, DV_TAIL)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    mu_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # The carry: the copies' exponents, and for acc_t the largest units `tangent_units` gives
    v_shift, t_shift = 0, 0
    if CARRY:
        v_shift = tl.load(factors_ptr).to(tl.int32)
        t_shift = tl.load(factors_ptr + 1).to(tl.int32)
    t_units = tl.full([BLOCK_M], TANGENT_TOP + MAX_SHIFT, dtype=tl.int32)

    full_end, end = key_block_ranges(start_m, n_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        acc_o, acc_o2, acc_t, acc_t2, l_i, mu_i, m_i, t_units = _forward_key_block(
            acc_o, acc_o2, acc_t, acc_t2, l_i, mu_i, m_i, t_units, q, q2, tq, tq2, rows,
            start_n, k_src, k2_src, stride_kn, v_src, v2_src, stride_vn, tk_src, tk2_src,
            stride_tkn, tv_src, tv2_src, stride_tvn, mask_ptr, stride_mask_m, stride_mask_n,
            v_shift, t_shift, n_q, n_k, head_dim, value_dim, qk_scale, scale, IS_CAUSAL,
            MASK_KIND, HAS_TANGENT, False, BLOCK_N, BLOCK_D, D_TAIL, BLOCK_DV, DV_TAIL,
            DOT_PRECISION, SPLIT, USE_TMA, PAIR_D, PAIR_DV, CARRY)
    for start_n in range(full_end, end, BLOCK_N):
        acc_o, acc_o2, acc_t, acc_t2, l_i, mu_i, m_i, t_units = _forward_key_block(
            acc_o, acc_o2, acc_t, acc_t2, l_i, mu_i, m_i, t_units, q, q2, tq, tq2, rows,
            start_n, k_src, k2_src, stride_kn, v_src, v2_src, stride_vn, tk_src, tk2_src,
            stride_tkn, tv_src, tv2_src, stride_tvn, mask_ptr, stride_mask_m, stride_mask_n,
            v_shift, t_shift, n_q, n_k, head_dim, value_dim, qk_scale, scale, IS_CAUSAL,
            MASK_KIND, HAS_TANGENT, True, BLOCK_N, BLOCK_D, D_TAIL, BLOCK_DV, DV_TAIL,
            DOT_PRECISION, SPLIT, USE_TMA, PAIR_D, PAIR_DV, CARRY)

    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    o_factor = inv_l
    if CARRY:
        o_factor *= power_of_two(-v_shift)
    flat_rows = (batch * n_heads + head) * n_q + rows
    dims_v = tl.arange(0, BLOCK_DV)
    store_rounded(o_ptr, o_residual_ptr, acc_o * o_factor[:, None], flat_rows, rows, dims_v,
                   n_q, value_dim, STORE_RESIDUAL)
    o2, t2_paired, dims_v2 = acc_o2, acc_o2, dims_v
    if PAIR_DV:  # acc_o2 = [O's tail | the tail of P~ tV, which goes to tO's]
        o2, t2_paired = split_halves(acc_o2, BLOCK_M, DV_TAIL)
        dims_v2 = BLOCK_DV + tl.arange(0, DV_TAIL // 2)
    elif DV_TAIL > 0:
        dims_v2 = BLOCK_DV + tl.arange(0, DV_TAIL)
    if DV_TAIL > 0:
        store_rounded(o_ptr, o_residual_ptr, o2 * o_factor[:, None], flat_rows, rows,
                      dims_v2, n_q, value_dim, STORE_RESIDUAL)
    log2_l = tl.log2(tl.where(empty, 1.0, l_i))
    if MASK_KIND >= ADDITIVE_MASK:  # m_i may be near LOWEST_SCORE: add log2(l) in fp64
        lse = tl.where(empty, float("-inf"), (m_i.to(tl.float64) + log2_l.to(tl.float64)) * LN2)
    else:
        lse = tl.where(empty, float("-inf"), (m_i + log2_l) * LN2)
    tl.store(lse_ptr + flat_rows, lse, mask=rows < n_q)
    if HAS_TANGENT:
        # acc_t is centred on the final mu: tO = acc_t / l, no cancellation left to do.
        t_factor = inv_l
        if CARRY:
            t_factor *= power_of_two(-t_units)
        store_rounded(to_ptr, to_residual_ptr, acc_t * t_factor[:, None], flat_rows, rows,
                       dims_v, n_q, value_dim, STORE_RESIDUAL)
        if PAIR_DV:
            t2 = split_halves(acc_t2, BLOCK_M, DV_TAIL)[0] + t2_paired
        else:
            t2 = acc_t2
        if DV_TAIL > 0:
            store_rounded(to_ptr, to_residual_ptr, t2 * t_factor[:, None], flat_rows, rows,
                          dims_v2, n_q, value_dim, STORE_RESIDUAL)
        tl.store(mu_ptr + flat_rows, mu_i, mask=rows < n_q)


# %% [markdown]
# ## Tiles, autotuning and the launch
#
# The best tile depends on the head dimension, the dtype, causality, the mask kind, whether
# the tangent is on (it doubles the registers the accumulators need) and, coarsely, the
# lengths. Those are the autotuning keys; the lengths enter as their next power of two, so
# ragged batches of similar lengths share one tuning. Triton adds the dtypes of tensor
# arguments to the key itself. Under the interpreter there is one small configuration
# (several would need a GPU to time them), chosen so that CPU tests cross block boundaries.
#
# Triton's autotuner is used with four changes (`KeyedAutotuner`). Timing the candidates
# takes seconds at a new key, so the chosen tiles are written to Triton's cache directory
# (its `cache_results`), and a new process at a known shape reads them back instead of
# timing again (`benchmarks/first_call.py` measures the difference, chapter 8). Each
# candidate is timed for 20 ms after 5 ms of warm-up (`time_candidate`) where Triton's
# default spends 100 and 25: a hundred calls of a 0.2 ms kernel rank tiles as well, and
# timing the backward's tiles at a new DiT shape took 0.39 to 0.48 s on the H200 instead of
# 1.4 to 2.4 (chapter 8). Compiling them takes longer still: in a fresh process with an
# empty cache the first MeanFlow call at (64, 12, 256, 64) took 21.5 s, 18.5 of them
# compiling candidates one after another. Triton compiles each candidate in its own MLIR
# context and leaves Python's lock for most of the work (only its front end, which walks
# the kernel's Python, holds it: about a quarter of a compile), so `compile_candidates`
# compiles a new key's candidates together on threads, through Triton's
# `AsyncCompileMode`, before they are timed one by one: the same cold call then took
# 12.4 and 12.8 s in two runs on the H200's 16 cores (chapter 8). And on every
# launch, Triton's autotuner builds dictionaries of all of the kernel's ~60 arguments to
# find the key. That is tens of microseconds per launch, at shapes where the kernel itself
# runs for 0.2 ms. Once a key is tuned, `KeyedAutotuner` reads the key's arguments by
# position and looks the tile up directly.
#
# The launch after that has the same problem one layer down. Triton's `JITFunction.run`
# binds and specialises every argument again on each launch (is this pointer 16-byte
# aligned, is this integer divisible by 16), formats its options into a cache key, looks
# the compiled kernel up, and builds metadata for launch hooks that are usually absent. On
# the H200's host that is about 60 µs of Python per launch of our ~60-argument kernels,
# before its C launcher (chapter 8, "Inside the host time"), and a MeanFlow call launches
# three or four kernels. A training loop launches the same kernels with the same shapes, strides
# and dtypes step after step, so `CachedLauncher` remembers the compiled kernel of each
# distinct launch and calls its C launcher directly, as `JITFunction.run` does last. What
# makes two launches "the same" must be at least as strict as Triton's specialisation, or
# a kernel compiled for aligned pointers would run on unaligned ones: tensors match by
# dtype and alignment, the host tensor descriptors of chapter 11's kernels by dtype, block
# and layout, everything else by type and value. Launches that a profiler hooks,
# and the interpreter's, go through Triton as before.
#
# Stacked, the two layers did some work twice: the autotuner built its key, merged the
# tile's dictionary into the keywords, and the launcher then matched every argument again
# (tile included) and built a dictionary of all the arguments for the grid function. Now
# the launcher's match of the call's own arguments is the autotuner's key as well: a launch
# seen before finds its tile and its compiled kernel in one lookup, and a grid function is
# handed the keywords (the meta-parameters, the only thing this library's grids read; one
# that asks for another argument still gets them all). Timed on this machine's CPU with a
# stand-in C launcher, a launch of the backward's 75-argument dQ kernel went from 29 to
# 19 µs of Python. On the H200 (bf16, host time per step with the GPU kept busy, the two
# launch paths alternated in one process, best of twelve groups of 30 steps), the MeanFlow
# step went from 1.21 to 1.01 ms at (64, 12, 256, 64) and from 1.51 to 1.44 ms at
# (16, 16, 1024, 72); at (32, 12, 1024, 64) the two were within the run's noise
# (1.64 and 1.68 ms), and the forward+JVP alone moved by 0.01-0.02 ms either way. What is
# left of a launch is mostly the match itself (a dtype and an address per tensor, about
# 8 µs here) and Triton's C launcher, which reads every argument again.
#
# Which tiles are worth timing was decided before any GPU time was spent: `tools/kernel_resources.py`
# compiles each candidate for Hopper (sm_90) on a CPU machine and reads ptxas's report, the
# `-Xptxas -v` of the CUDA world. For bf16, $d = 128$ with the tangent, a 128 × 32 tile on 8
# warps keeps both fp32 accumulators in 221 registers per thread with no spills and takes
# 128 KiB of shared memory; 64 × 64 on 4 warps hits the 255-register ceiling and spills, and
# with three pipeline stages and a mask tile it asks for more shared memory (237 KiB) than a
# Hopper block may take (227 KiB). With autotuning off (`JVP_ATTENTION_AUTOTUNE=0`) the
# first tile that survives the pruning below is the one used, so the list starts with tiles
# that compile within those limits for every mask kind.
#
# One more choice is made for the compiler, not the kernel. Triton 3.6 assembles Hopper code
# with the ptxas it bundles, release 12.8, and that release miscompiles this forward with
# the tangent at head dims 40 and 72 (a partly used second column tile): on the H200, once
# a process ran a second tile after another, as autotuning does, the kernel faulted on an
# out-of-range shared-memory address in a tensor-core product, and with one pipeline stage
# it returned wrong tangents without faulting. Assembled by ptxas 12.9, which the same
# Triton bundles for Blackwell, or by CUDA 13.0's, every tile passed the accuracy check.
# So the launch compiles this library's kernels, and only them, with the newer ptxas when
# Triton's own is 12.8 (`sound_ptxas`, `sound_compiler`); a `TRITON_PTXAS_PATH` the user
# sets is left alone. The switch costs no speed: on the H200 at 4096 tokens, bf16, the
# forward with the tangent, the backward and the second-order backward ran within 1.6% of
# their 12.8-assembled times at $d = 64$ (B = 4, H = 32) and $d = 128$ (B = 4, H = 16;
# `benchmarks/bench.py`), and the registers, spills and shared memory of every $d = 128$
# configuration are the same.
#
# A compiled graph (chapter 7) cannot make that switch: Inductor compiles the kernels it
# launches in its own worker processes, with Triton's ptxas. So there a cut head dim is
# padded to one column tile (`launch_column_tiles`): 72 columns in a 128-column tile,
# which ptxas 12.8 compiles correctly, at 60% more columns than the 64 + 16 cut. Where the
# call is short that is the better trade, since the graph saves the host time of an opaque
# operator; where the GPU time dominates it is not. On the H200 (bf16, compiled,
# `benchmarks/training_shapes.py --padded-max-scores`), at (32, 16, 256, 72), $2^{25}$
# scores, the forward with the tangent took 0.20 ms padded against 0.48 ms opaque, and the
# MeanFlow call (with the backward) 0.77 against 2.01 ms, for more GPU time (0.19 against
# 0.15 ms, 0.45 against 0.41 ms). At (16, 16, 1024, 72), $2^{28}$ scores, the
# opaque call is already bound by its GPU time (0.92 of its 0.97 ms for the forward with
# the tangent), so padding could only add to it. So the graph pads calls of up to
# `PADDED_MAX_SCORES` = $2^{27}$ scores (`pads_in_graph`), the boundary set between the
# two measured sizes, and keeps the opaque operator for larger ones, whose kernels this
# library compiles itself.
#
# The launcher takes `(B, H, N, D)` tensors with any strides (a last dimension that is not
# contiguous is copied) and launches on the inputs' own device. The public API of chapter 7 validates arguments and handles other ranks;
# here we only check what would make the kernel read out of bounds.

# %% tags=["export:launch"]
def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tile_configs(gpu_tiles: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """Autotuning configurations from (BLOCK_M, BLOCK_N, num_warps, num_stages) tuples;
    under the interpreter, a single small one."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in gpu_tiles]


def prune_wide_tiles(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop tiles whose accumulators cannot fit in registers for wide heads, fp32 inputs or
    the tangent; with JVP_ATTENTION_AUTOTUNE=0 keep only the first tile that fits. A head
    dim cut into two column tiles counts as their sum (72 = 64 + 16 as 80 columns)."""
    width = max(kwargs.get("BLOCK_D", named_args["head_dim"]) + kwargs.get("D_TAIL", 0),
                kwargs.get("BLOCK_DV", named_args["value_dim"]) + kwargs.get("DV_TAIL", 0))
    budget = 128 * 128 if width <= 80 else 128 * 64
    if width > 128:
        budget //= 4
    if kwargs.get("HAS_TANGENT", False):
        budget //= 2
    if named_args["q_ptr"].dtype == torch.float32:
        budget //= 4  # fp32 tiles take twice the registers and shared memory, IEEE dots more
    kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= budget]
    kept = kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
    return kept if os.environ.get("JVP_ATTENTION_AUTOTUNE", "1") != "0" else kept[:1]


AUTOTUNE_KEYS = ["n_q_bucket", "n_k_bucket", "head_dim", "value_dim",
                 "IS_CAUSAL", "MASK_KIND", "HAS_TANGENT", "SPLIT", "USE_TMA"]

# Milliseconds of warm-up and of timed calls per candidate tile. With Triton's default, 25
# and 100, timing the backward's tiles at a new DiT shape took 1.4 to 2.4 s on the H200;
# 20 ms still times a 0.2 ms kernel a hundred times (L2 flushed between calls), and a 10 ms
# one twice after five calls for the estimate.
TUNING_WARMUP_MS = 5
TUNING_REP_MS = 20

# Threads that compile a new key's candidate tiles together. Triton's compiler leaves
# Python's lock in its MLIR and LLVM passes and runs ptxas as a process of its own, so
# compiles overlap but for their Python front end (about a quarter of each): on a
# two-core CPU the 20 candidates of the forward with the tangent and the backward's dQ and
# dK/dV kernels (bf16, d = 64) compiled for Hopper in 8.0 to 9.0 s on two threads against
# 14.2 to 14.7 s one after another. JVP_ATTENTION_COMPILE_WORKERS=1 compiles them in turn.
COMPILE_WORKERS = int(os.environ.get("JVP_ATTENTION_COMPILE_WORKERS",
                                     min(8, os.cpu_count() or 1)))


def time_candidate(kernel_call, quantiles=None):
    """The autotuner's timing of one candidate tile: `triton.testing.do_bench` with
    TUNING_WARMUP_MS and TUNING_REP_MS."""
    return triton.testing.do_bench(kernel_call, warmup=TUNING_WARMUP_MS, rep=TUNING_REP_MS,
                                   quantiles=quantiles)


# Distinct launches (shapes, strides, dtypes, alignments) remembered per kernel; past this
# the memory starts afresh, so that ragged lengths cannot grow it without bound.
CACHED_LAUNCHES = 256


# The ptxas releases that Triton bundles for Hopper and that miscompile these kernels: with
# 12.8 (Triton 3.6) the forward with the tangent at head dims 40 and 72 faults (an
# out-of-range shared-memory address in a tensor-core product) or, with one pipeline stage,
# returns wrong tangents. ptxas 12.9, which the same Triton bundles for Blackwell, and 13.0
# compile the same kernels correctly.
MISCOMPILING_PTXAS = frozenset({"12.8"})


@functools.cache
def sound_ptxas(arch: int) -> str | None:
    """The ptxas to compile this library's kernels with for the GPU architecture `arch`
    (90 for the H100/H200) when the one Triton would use is among MISCOMPILING_PTXAS:
    Triton's Blackwell ptxas, when it is newer. None keeps Triton's choice, as does
    setting TRITON_PTXAS_PATH. (Triton 3.9 assembles Hopper code with its newer ptxas
    itself.)"""
    if arch // 10 != 9 or os.environ.get("TRITON_PTXAS_PATH"):
        return None
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        own, newer = get_ptxas(arch), triton.knobs.nvidia.ptxas_blackwell
    except (ImportError, AttributeError, RuntimeError, OSError):  # no such Triton API,
        return None  # or no ptxas, or one that cannot be run
    if own.version not in MISCOMPILING_PTXAS:
        return None
    return newer.path if version_tuple(newer.version) > version_tuple(own.version) else None


def version_tuple(version: str) -> tuple[int, ...]:
    """"12.9" as (12, 9)."""
    return tuple(int(part) for part in version.split("."))


@contextmanager
def sound_compiler(arch: int | None = None) -> Iterator[None]:
    """Within: Triton compiles for `arch` (by default the current GPU's) with `sound_ptxas`
    where it applies. Used around this library's compilations only: Triton's settings are
    restored on leaving."""
    path = sound_ptxas(driver.active.get_current_target().arch if arch is None else arch)
    if path is None:
        yield
        return
    with triton.knobs.nvidia.scope():
        triton.knobs.nvidia.ptxas = path
        forget_ptxas_version()
        try:
            yield
        finally:
            forget_ptxas_version()


def forget_ptxas_version() -> None:
    """Make Triton ask ptxas its version again: the version enters the key of Triton's
    cache of compiled kernels, which must tell the two ptxas' kernels apart."""
    from triton.backends.nvidia import compiler

    getattr(getattr(compiler, "get_ptxas_version", None), "cache_clear", lambda: None)()


class CachedLauncher:
    """Launches a `@triton.jit` kernel, skipping Triton's per-launch Python once it has seen
    a launch with the same arguments.

    Triton's `JITFunction.run` binds and specialises every argument on each launch (the
    alignment of each pointer, the size and divisibility of each integer), formats the
    options into its cache key, looks the compiled kernel up and builds launch metadata for
    its hooks. Here a launch that matches an earlier one calls that launch's compiled kernel
    directly, the way `JITFunction.run` calls it. The match is stricter than Triton's
    specialisation, so the compiled kernel is the one Triton would pick: each tensor by
    dtype and 16-byte alignment, every other argument (keywords too) by type and value, and
    the device and Triton's settings that change the code (`code_options`). Everything
    else goes through Triton: the first launch of each match, a warm-up, the interpreter,
    and launches while a launch hook (a profiler's) or a pre-run hook is installed; on the
    GPU those compile with `sound_compiler`. A callable grid is called with the launch's
    keyword arguments (the meta-parameters, all that this library's grids read), and with
    every argument by name only if it asks for another.
    """

    def __init__(self, kernel: triton.runtime.JITFunction):
        self.kernel = kernel
        # Under the interpreter (decided when triton was imported) kernels are not
        # JITFunctions and launch through Triton.
        self.direct = isinstance(kernel, triton.runtime.JITFunction)
        self.names = kernel.arg_names
        self.defaults = {p.name: p.default for p in getattr(kernel, "params", ())}
        self.launches: dict[tuple, tuple] = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def match(self, args: tuple, kwargs: dict) -> tuple | None:
        """The key of this launch among the remembered ones, or None for a launch that must
        go through Triton (the interpreter, hooks, an argument that cannot be hashed)."""
        if not self.direct or launch_hooks() or self.kernel.pre_run_hooks:
            return None
        key = (driver.active.get_current_device(), *code_options(), len(args), *kwargs,
               *launch_match(tuple(kwargs.values())), *launch_match(args))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def through_triton(self, args: tuple, kwargs: dict, grid, warmup: bool = False):
        """Triton's own launch (compiling, on the GPU, with `sound_compiler`)."""
        if not self.direct:
            return self.kernel.run(*args, grid=grid, warmup=warmup, **kwargs)
        with sound_compiler():
            return self.kernel.run(*args, grid=grid, warmup=warmup, **kwargs)

    def remember(self, key: tuple | None, compiled, n_args: int) -> None:
        """Keep Triton's `compiled` kernel for launches matching `key` (unless it compiles
        asynchronously), as what `launch` takes."""
        if key is not None and not hasattr(compiled, "result"):
            remember(self.launches, key, (compiled, self.names[n_args:]))

    def run(self, *args, grid, warmup: bool = False, **kwargs):
        """Launch as `kernel[grid](*args, **kwargs)` would; returns the compiled kernel."""
        if not self.direct:  # the interpreter runs the kernel: nothing to save here
            if RECORDER.launches is not None and not warmup:
                RECORDER.launches.append(InterpretedLaunch(self.kernel, grid, args, kwargs))
            return self.kernel.run(*args, grid=grid, warmup=warmup, **kwargs)
        key = None if warmup else self.match(args, kwargs)
        known = None if key is None else self.launches.get(key)
        if known is None:
            note_untraced_launch()
            compiled = self.through_triton(args, kwargs, grid, warmup)
            if not warmup:
                self.remember(key, compiled, len(args))
            return compiled
        return self.launch(known, args, kwargs, grid, key[0])

    def launch(self, known: tuple, args: tuple, kwargs: dict, grid, device: int):
        """Call a remembered compiled kernel's C launcher on `device` (the current one), as
        `JITFunction.run` does."""
        compiled, rest = known
        values = (*args, *[kwargs[n] if n in kwargs else self.defaults[n] for n in rest])
        if callable(grid):
            try:
                grid = grid(kwargs)
            except KeyError:
                grid = grid(dict(zip(self.names, values, strict=True)))
        grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        compiled.run(*grid, driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *values)
        if RECORDER.launches is not None:  # a call being planned (`ReplayedLaunch`)
            RECORDER.launches.append(DirectLaunch(compiled, grid, values, device))
        return compiled


def note_untraced_launch() -> None:
    """While a call is being recorded (`RECORDER`), mark a launch that does not go through
    `CachedLauncher.launch` (None): such a call cannot be replayed."""
    if RECORDER.launches is not None:
        RECORDER.launches.append(None)


def remember(launches: dict, key: tuple, value: tuple) -> None:
    """launches[key] = value, in a memory of at most CACHED_LAUNCHES entries."""
    if len(launches) >= CACHED_LAUNCHES:
        launches.clear()
    launches[key] = value


@functools.cache
def cached(kernel) -> CachedLauncher:
    """The one `CachedLauncher` of `kernel`: launch with `cached(kernel)[grid](...)`."""
    return CachedLauncher(kernel)


# Argument types matched by value. Checked first: `isinstance(x, torch.Tensor)` is slow
# enough to matter at 60 arguments per launch.
PLAIN_TYPES = frozenset({int, float, bool, str, type(None)})


def launch_match(values: tuple) -> tuple:
    """What of each argument a cached launch must match, flat (it is hashed on every
    launch): the arguments' types, then a tensor's dtype and 16-byte alignment (a pointer's
    specialisation), a host tensor descriptor's `descriptor_match` and any other argument's
    value, tuples taken apart."""
    return (*map(type, values),
            *[v if v.__class__ in PLAIN_TYPES
              else launch_match(v) if v.__class__ is tuple
              else (v.dtype, v.data_ptr() % 16 == 0) if isinstance(v, torch.Tensor)
              else descriptor_match(v) if hasattr(v, "block_shape")
              else v for v in values])


def descriptor_match(descriptor) -> tuple:
    """What of a host tensor descriptor (the copy engine's view of a tensor, which chapter
    11's kernels take) Triton compiles for: its tensor's dtype, the block, the shared-memory
    layout, the padding and (Triton 3.9) the rounding to tf32. Its address, shape and
    strides are read at each launch, and no tensor is kept."""
    return (descriptor.base.dtype, tuple(descriptor.block_shape),
            getattr(descriptor, "layout", None), getattr(descriptor, "padding", None),
            getattr(descriptor, "round_f32_to_tf32", None))


def code_options() -> tuple:
    """Triton's settings that change the compiled code without being a kernel argument:
    debug, instrumentation and (from Triton 3.9) the floating-point sanitizer's casts. A
    launch under other settings than a cached one's goes through Triton, which compiles
    for them."""
    compilation = triton.knobs.compilation
    return (triton.knobs.runtime.debug, compilation.instrumentation_mode,
            getattr(compilation, "fpsan_homomorphic_casts", None))


def launch_hooks() -> bool:
    """Whether Triton has launch hooks installed (a profiler's, say): launches then take
    Triton's own path, which calls them."""
    runtime = triton.knobs.runtime
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


class KeyedAutotuner(Autotuner):
    """Triton's autotuner with three changes for a kernel launched many times per step.

    - Tuned tiles persist across processes: Triton's `cache_results`, stored in Triton's
      cache directory (`TRITON_CACHE_DIR`, by default `~/.triton/cache`) under a hash of
      the kernel's source, the GPU, Triton's version, the tuning key and the candidates.
    - Each candidate is timed for TUNING_REP_MS (`time_candidate`), not Triton's 100 ms.
    - A launch at a key already tuned finds its tile from the key arguments' positions.
      Triton's own `run` builds and filters dicts of all of the kernel's ~60 arguments on
      every launch, a sizeable share of a short call's host time. The launch itself goes
      through a `CachedLauncher`.
    - At a key that has to be timed, the candidates are compiled at once, on
      COMPILE_WORKERS threads (`compile_candidates`), before Triton times them in turn.
    """

    def __init__(self, kernel, configs: list[triton.Config], key: list[str]):
        super().__init__(kernel, kernel.arg_names, configs, key, reset_to_zero=None,
                         restore_value=None, cache_results=True, do_bench=time_candidate,
                         prune_configs_by={"early_config_prune": prune_wide_tiles})
        self.tuned: dict[tuple, triton.Config] = {}
        # Launches seen at a tuned key: that key, its tile and the launcher's compiled kernel.
        self.launches: dict[tuple, tuple] = {}
        self.key_positions = [kernel.arg_names.index(name) for name in key]
        self.launcher = cached(kernel)
        self.tuning_call: tuple | None = None  # (args, keywords) of the launch being tuned

    def launch_key(self, args: tuple, kwargs: dict) -> tuple:
        """The key values (by position, or by name when passed as keywords) and the dtypes
        of the tensor arguments: what Triton's key holds."""
        values = [args[i] if i < len(args) else kwargs.get(self.arg_names[i])
                  for i in self.key_positions]
        return (*values, *[a.dtype for a in args
                           if a.__class__ not in PLAIN_TYPES and isinstance(a, torch.Tensor)])

    def run(self, *args, grid, warmup: bool = False, **kwargs):
        launcher = self.launcher
        match = launcher.match(args, kwargs) if launcher.direct and not warmup else None
        known = None if match is None else self.launches.get(match)
        # A launch seen before, whose tile is still the tuned one (a tile sweep or a test
        # may have reset `tuned`): its tile and compiled kernel.
        if known is not None and self.tuned.get(known[0]) is known[1]:
            _, config, tile, launched = known
            self.best_config = config
            compiled = launcher.launch(launched, args, {**kwargs, **tile}, grid, match[0])
            if RECORDER.launches:  # valid while this key keeps this tile
                RECORDER.launches[-1] = RECORDER.launches[-1]._replace(
                    tuned=(self, known[0], config))
            return compiled
        key = self.launch_key(args, kwargs)
        config = self.tuned.get(key)
        if config is None or warmup:  # first launch at this key: tune (or read the disk cache)
            note_untraced_launch()
            self.tuning_call = (args, {**kwargs, "grid": grid})
            try:
                with sound_compiler() if launcher.direct else nullcontext():
                    result = super().run(*args, grid=grid, warmup=warmup, **kwargs)
            finally:
                self.tuning_call = None
            self.tuned.setdefault(key, self.best_config)
            return result
        self.best_config = config
        tile = config.all_kwargs()
        if launcher.direct:  # its tile would not be checked against `tuned` on a replay
            note_untraced_launch()
        compiled = launcher.run(*args, grid=grid, **kwargs, **tile)
        if match is not None:  # from the next launch on, one lookup
            launched = launcher.launches.get(launcher.match(args, {**kwargs, **tile}) or ())
            if launched is not None:
                remember(self.launches, match, (key, config, tile, launched))
        return compiled

    def check_disk_cache(self, tuning_key, configs, bench_fn) -> bool:
        """Triton's reading of the tuned tile from its cache directory; on a miss, the
        candidates are compiled together before `bench_fn` times them."""
        def compile_then_time():
            self.compile_candidates(configs)
            bench_fn()
        return super().check_disk_cache(tuning_key, configs, compile_then_time)

    def compile_candidates(self, configs: list[triton.Config]) -> None:
        """Compile every candidate tile of the launch being tuned, COMPILE_WORKERS at a time,
        into the kernel's cache, where Triton's timing of each then finds it. A candidate
        that fails to compile is left for the timing, which handles it as before; should
        the asynchronous compile itself fail, a warning says so and candidates compile in
        turn from then on."""
        global COMPILE_WORKERS
        workers = min(COMPILE_WORKERS, len(configs))
        compile_mode = getattr(triton, "AsyncCompileMode", None)
        if self.tuning_call is None or workers < 2 or compile_mode is None or interpreting():
            return
        args, kwargs = self.tuning_call
        try:
            with (ThreadPoolExecutor(workers) as pool,
                  compile_mode(pool, ignore_errors=True)):
                for config in configs:
                    self.fn.run(*args, **{**kwargs, "warmup": True, **config.all_kwargs()})
        except Exception as error:  # a Triton whose asynchronous compile works otherwise
            COMPILE_WORKERS = 1
            warnings.warn(f"jvp_attention: compiling candidate tiles together failed ({error!r}); "
                          "they compile one after another from now on", RuntimeWarning,
                          stacklevel=2)


def launchable(kernel, like: torch.Tensor):
    """How a launch site runs `kernel` (a `KeyedAutotuner` or a `@triton.jit` function), as
    `launchable(kernel, q)[grid](...)`. On real tensors: our own launch path (the autotuner,
    or `cached`). On the functional tensors of a compiled graph being traced, inside a
    `torch.library.triton_op` (chapter 7): through `wrap_triton`, so that the graph holds the
    launch and Inductor runs it, with none of this Python per call."""
    if not isinstance(like, FunctionalTensor):
        return kernel if isinstance(kernel, KeyedAutotuner) else cached(kernel)
    return TracedLaunch(kernel)


class TracedLaunch:
    """`kernel[grid](...)` recorded for Inductor. An autotuned kernel becomes a plain
    `triton.autotune` over the tiles that `prune_wide_tiles` keeps for this launch, which
    Inductor times itself when it compiles the graph."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kernel = self.kernel
            if isinstance(kernel, KeyedAutotuner):
                named = {**dict(zip(kernel.arg_names, args, strict=False)), **kwargs}
                kernel = plain_autotuner(kernel.fn, tuple(prune_wide_tiles(kernel.configs, named,
                                                                           **named)))
            return wrap_triton(kernel)[grid](*args, **kwargs)
        return launch


@functools.cache
def plain_autotuner(kernel, configs: tuple[triton.Config, ...]) -> Autotuner:
    """One `triton.autotune` object per kernel and tile list, so that traces share it."""
    return triton.autotune(configs=list(configs), key=[])(kernel)


def traceable_launches(q: torch.Tensor, n_k: int, *, long_rows: bool, cut: bool) -> bool:
    """Whether a launcher's kernels may enter a compiled graph (`launchable`): not with rows
    long enough for tensor descriptors (choosing them reads the data's alignment, which a
    traced tensor has not got), nor under the interpreter. A carry enters it through its
    opaque operator (`graph_carry`). Head dims cut into two column tiles where this library
    compiles with its own ptxas (`sound_ptxas`: Inductor's compile workers would not) enter
    it padded to one tile, when the call is small enough for that to pay (`pads_in_graph`)."""
    if long_rows or interpreting() or os.environ.get("JVP_ATTENTION_TMA") == "1":
        return False
    return not (cut and needs_sound_ptxas(q)) or pads_in_graph(q, n_k)


# A compiled graph keeps an operator it cannot trace as an opaque call, which runs this
# library's Python on every step: about 1 ms per call at DiT-B/2's 1024 tokens, where a
# compiled MeanFlow step spent 58.7 of its 63.6 ms in the host's forward and backward
# (chapter 9). Unless CUDA graphs replay the graph (`mode="reduce-overhead"`), which takes
# that host work out, a graph therefore takes the kernels it can trace over the faster ones
# it cannot: in the backward, pointers instead of tensor descriptors below 4096 tokens
# (chapter 5), and in the forward and backward alike at any length in calls of at most
# GRAPH_POINTER_MAX_SCORES scores (`graph_takes_pointers`). The carry it keeps: its copies
# come from an opaque operator of their own (`graph_carry`), two launches' host time
# rather than a whole call's.
def host_bound_graph(q: torch.Tensor) -> bool:
    """Whether `q` is a tensor of a compiled graph being traced that will run its launches
    from Python on every call: not one that Inductor will replay through CUDA graphs (its
    `triton.cudagraphs` option, set while it compiles)."""
    if not isinstance(q, FunctionalTensor):
        return False
    config = sys.modules.get("torch._inductor.config")
    return config is None or not config.triton.cudagraphs


def needs_sound_ptxas(q: torch.Tensor) -> bool:
    """Whether kernels for `q`'s device must be compiled with `sound_ptxas` when their head
    dims are cut in two (Hopper with Triton 3.6's ptxas)."""
    return q.is_cuda and sound_ptxas(90) is not None


# The most scores (B * Hq * Nq * Nk) of a call whose cut head dims a compiled graph pads to
# one column tile (`launch_column_tiles`). H200, bf16, d = 72, compiled, padded against the
# opaque operators (benchmarks/results/training_shapes_d72_*_h200.json): at
# (32, 16, 256, 72), 2**25 scores, the forward with the tangent took 0.20 against 0.48 ms
# per call and the MeanFlow call 0.77 against 2.01 ms (the host time saved outweighs the
# GPU time added); at (16, 16, 1024, 72), 2**28 scores, the opaque forward with the tangent
# is bound by its GPU time (0.92 of 0.97 ms), to which padding would only add.
PADDED_MAX_SCORES = 2**27


def pads_in_graph(q: torch.Tensor, n_k: int) -> bool:
    """Whether a compiled graph's call with queries `q` and `n_k` keys is small enough to
    take padded column tiles (PADDED_MAX_SCORES)."""
    batch, heads, n_q, _ = q.shape
    return batch * heads * n_q * n_k <= PADDED_MAX_SCORES


# The most scores of a call that a compiled graph running its launches from Python traces
# through pointers at any length, where an eager call would read rows long enough through
# tensor descriptors (which keeps the graph's call opaque: about 1 ms of host time). H200,
# bf16, DiT-B/2 at 4096 tokens (batch 2, 12 heads: 2**28.6 scores), compiled in the default
# mode: the opaque calls left the step bound by the host, 28.6 ms of host time in its
# forward against the math path's 22.0 (chapter 9); at 4096 keys pointers cost the forward
# with the tangent under 3% of GPU time (see FORWARD_TMA_MIN_KEYS). Larger calls are bound
# by their GPU time, which hides the opaque call's host work; they keep the descriptors and
# chapters 11-12's kernels, which also need them.
GRAPH_POINTER_MAX_SCORES = 2**29


def graph_takes_pointers(q: torch.Tensor, n_k: int) -> bool:
    """Whether a call with queries `q` and `n_k` keys reads through pointers whatever its
    length: one of a compiled graph that runs its launches from Python (`host_bound_graph`)
    with at most GRAPH_POINTER_MAX_SCORES scores (B * Hq * Nq * Nk)."""
    if not host_bound_graph(q):
        return False
    batch, heads, n_q, _ = q.shape
    return batch * heads * n_q * n_k <= GRAPH_POINTER_MAX_SCORES


def launch_column_tiles(q: torch.Tensor, n_k: int, head_dim: int, value_dim: int) -> dict:
    """`column_tiles` for this launch: in a compiled graph on a GPU whose kernels need
    `sound_ptxas` (Inductor compiles with Triton's own ptxas), one padded tile per head dim
    (`traceable_launches` lets such a call in only when `pads_in_graph`)."""
    if isinstance(q, FunctionalTensor) and needs_sound_ptxas(q):
        whole = (max(16, next_power_of_2(width)) for width in (head_dim, value_dim))
        return dict(zip(("BLOCK_D", "BLOCK_DV"), whole, strict=True)) | {"D_TAIL": 0,
                                                                        "DV_TAIL": 0}
    return column_tiles(head_dim, value_dim)


def autotuned(kernel, gpu_tiles: list[tuple[int, int, int, int]]) -> KeyedAutotuner:
    """`kernel` autotuned over `gpu_tiles` (in order of preference: with autotuning off the
    first tile that survives `prune_wide_tiles` runs), keyed by AUTOTUNE_KEYS."""
    return KeyedAutotuner(kernel, tile_configs(gpu_tiles), AUTOTUNE_KEYS)


def check_mask_tangent(attn_mask: torch.Tensor | None, mask_tangent: torch.Tensor | None,
                       shape: tuple[int, int, int, int]) -> None:
    """Raise ValueError unless `mask_tangent` is None, or a float tensor broadcastable to
    `shape` = (B, Hq, Nq, Nk) that goes with an additive (float) `attn_mask`."""
    if mask_tangent is None:
        return
    if attn_mask is None or not attn_mask.is_floating_point():
        kind = "no attn_mask" if attn_mask is None else f"an attn_mask of dtype {attn_mask.dtype}"
        raise ValueError(f"mask_tangent is the tangent of an additive (float) attn_mask; got "
                         f"{kind}")
    if not mask_tangent.is_floating_point():
        raise ValueError(f"mask_tangent must be floating point, got {mask_tangent.dtype}")
    try:
        fits = torch.broadcast_shapes(mask_tangent.shape, shape) == torch.Size(shape)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"mask_tangent of shape {tuple(mask_tangent.shape)} does not "
                         f"broadcast to the scores' shape {tuple(shape)}")


def mask_pairs(attn_mask: torch.Tensor, mask_tangent: torch.Tensor,
               shape: tuple[int, int, int, int]) -> torch.Tensor:
    """A bias and its tangent in one tensor, viewed as (B, H, Nq, 2, Nk): each query row's
    Nk biases, then their Nk tangents, in the two's common dtype. Stored once along each of
    B, H and Nq that both broadcast over (a per-head bias shared by the batch is stored once,
    not B times, however expanded it arrives), so that both rows load at unit stride."""
    bias, tangent = attn_mask.expand(shape), mask_tangent.expand(shape)
    stored = tuple(slice(None) if bias.stride(i) or tangent.stride(i) else slice(0, 1)
                   for i in range(3))
    dtype = torch.promote_types(attn_mask.dtype, mask_tangent.dtype)
    pairs = torch.stack((bias[stored].to(dtype), tangent[stored].to(dtype)), dim=-2)
    return pairs.expand(*shape[:3], 2, shape[3])


def mask_operand(attn_mask: torch.Tensor | None, shape: tuple[int, int, int, int],
                 mask_tangent: torch.Tensor | None = None):
    """The mask as the kernel reads it, broadcast to `shape` = (B, H, Nq, Nk) as a stride-0
    view (no copy): a bool mask as it is (Triton reads a bool pointer as bytes), an additive
    one in its own dtype. With `mask_tangent` (see `check_mask_tangent`), `mask_pairs`: each
    query row's biases, then their tangents, so that each tangent is Nk elements after its
    bias. The kernel is handed the whole tensor it reads, never a view of part of it, so a
    compiled graph that stores the operand anew stores all of it (chapter 7).

    Returns:
        (tensor or None, its strides over (B, H, Nq, Nk), MASK_KIND).
    """
    if attn_mask is None:
        return None, (0, 0, 0, 0), NO_MASK.value
    if mask_tangent is not None:
        pairs = mask_pairs(attn_mask, mask_tangent, shape)
        return pairs, (*pairs.stride()[:3], 1), ADDITIVE_WITH_TANGENT.value
    if attn_mask.shape != shape:  # (the mask itself where it has the shape: a replay finds it)
        attn_mask = attn_mask.expand(shape)
    kind = BOOL_MASK if attn_mask.dtype == torch.bool else ADDITIVE_MASK
    return attn_mask, attn_mask.stride(), kind.value


PRECISIONS = ("accurate", "fast")
# One process-wide mode, in a dict so that torch.compile guards on its value (a compiled call
# recompiles, rather than running stale, when the mode changes).
_mode = {"precision": os.environ.get("JVP_ATTENTION_PRECISION", "accurate")}


def _checked(mode: str) -> str:
    if mode not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {mode!r}")
    return mode


def set_precision(mode: str) -> None:
    """Choose how 16-bit products are rounded (chapter 3 measures both); `precision` does
    the same for a block of code.

    Args:
        mode: "accurate" (default): the fp32 operands of the tangent's and the backward's
            16-bit products keep their errors at the level of PyTorch's fp32-accumulating
            math path: their hi + lo split (about a third more matrix products), or for bf16
            inputs with long rows exact fp16 copies of the other operand (chapter 2).
            "fast": one 16-bit rounding per product, as FlashAttention does. The primal
            forward always rounds once: its error is at the floor already.
            The environment variable JVP_ATTENTION_PRECISION sets the initial mode.

    Raises:
        ValueError: For a mode other than "accurate" or "fast".
    """
    _mode["precision"] = _checked(mode)


def get_precision() -> str:
    """The precision mode in effect: "accurate" or "fast" (see `set_precision`)."""
    return _checked(_mode["precision"])


@contextmanager
def precision(mode: str) -> Iterator[str]:
    """Run a block of code in precision `mode` ("accurate" or "fast"), then restore the
    mode that was in effect before. The mode is process-wide, like `set_precision`.

    A forward captures the mode it runs in, and its backward uses that mode, whenever and
    wherever the backward runs.

    Example:
        >>> with jvp_attention.precision("fast"):
        ...     out, t_out = torch.func.jvp(jvp_attention.attention, (q, k, v), (tq, tk, tv))
    """
    previous = get_precision()
    set_precision(mode)
    try:
        yield mode
    finally:
        _mode["precision"] = previous


def accurate(mode: str | None = None) -> bool:
    """True when `mode` ("accurate" or "fast"), or when it is None the mode in effect
    (`get_precision`), is "accurate". The launchers take the mode per call, so that a
    backward runs in the mode of its forward."""
    return (get_precision() if mode is None else _checked(mode)) == "accurate"


# The causal launch order's groups (`causal_program`): at most this many heads, whose keys
# and values take at most this many bytes. H100, bf16, forward with its JVP, GPU time by
# heads per group 1 / 4 / 8 / 16: 1.349 / 1.283 / 1.292 / 1.302 ms at (4, 16, 4096, 128)
# causal (4 MiB of keys and values a head), 1.609 / 1.441 / 1.410 / 1.411 at
# (2, 16, 8192, 64) (4 MiB), but 4.834 / 5.227 / 5.115 / 5.204 at (1, 16, 16384, 128)
# (16 MiB): a group whose keys outgrow L2 (50 MB) reads them from memory again.
CAUSAL_HEAD_GROUP = 16
CAUSAL_GROUP_BYTES = 16 * 2**20


def head_group(is_causal: bool, *keys: torch.Tensor, queries_per_head: int = 1) -> int:
    """Heads per group of the programs' launch order (`query_program`): 1, the grid's own
    order, without a causal mask; with one, the most heads (a power of two up to
    CAUSAL_HEAD_GROUP) whose `keys` (the (B, H, N, D) keys and values a program streams,
    shared by `queries_per_head` query heads) take at most CAUSAL_GROUP_BYTES."""
    if not is_causal:
        return 1
    per_head = sum(x.shape[-2] * x.shape[-1] * x.element_size() for x in keys)
    group = CAUSAL_HEAD_GROUP
    while group > 1 and group * per_head > CAUSAL_GROUP_BYTES * queries_per_head:
        group //= 2
    return group


def kernel_meta(q: torch.Tensor, head_dim: int, value_dim: int, split: bool = False) -> dict:
    """Compile-time tile widths and product precision shared by every kernel of the library.

    `split` asks for hi + lo rounding of the fp32 operands of 16-bit products (see
    `dot_rounded`); it is meaningless, and off, for fp32 inputs."""
    return {
        "BLOCK_D": max(16, next_power_of_2(head_dim)),
        "BLOCK_DV": max(16, next_power_of_2(value_dim)),
        # Match PyTorch's fp32 matmuls (no TF32); 16-bit inputs ignore this.
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "SPLIT": split and q.dtype != torch.float32,
    }


def row_alignment(tensors: tuple[torch.Tensor, ...], widths: tuple[int, ...]) -> int:
    """ALIGN for a launch (`aligned` in the kernels): the largest power of two, up to 16
    bytes of the tensors' elements, that divides every width and every batch, head and row
    stride of the (B, H, N, D) tensors.

    Triton specialises an integer argument on divisibility by 16 only, so a head dim of 72
    (or 40, or a row or head stride of 72) would otherwise make every pointer-loaded tile
    move one element per load, and lose the asynchronous copies of the pipeline."""
    bits = 0
    for x in tensors:  # plain loops: this runs on every launch
        stride = x.stride()
        bits |= stride[-4] | stride[-3] | stride[-2]
    for width in widths:
        bits |= width
    return min(16 // tensors[0].element_size(), bits & -bits) if bits else 1


def column_tiles(head_dim: int, value_dim: int) -> dict:
    """The forward's tiles across the head dims: BLOCK_D columns of q and k, then D_TAIL more
    (0: none), and the same for v. A width that a power of two would pad by more than the
    second tile's extra product costs is cut in two: 72 = 64 + 16 (80 columns multiplied,
    not 128), 96 = 64 + 32, 48 = 32 + 16."""
    (block_d, d_tail), (block_dv, dv_tail) = (_two_tiles(n) for n in (head_dim, value_dim))
    return {"BLOCK_D": block_d, "D_TAIL": d_tail, "BLOCK_DV": block_dv, "DV_TAIL": dv_tail}


def cut_in_two(head_dim: int, value_dim: int) -> bool:
    """Whether `column_tiles` cuts either head dim into two column tiles."""
    tiles = column_tiles(head_dim, value_dim)
    return tiles["D_TAIL"] > 0 or tiles["DV_TAIL"] > 0


def pair_tails(tiles: dict, head_dim: int, value_dim: int, paired: bool) -> dict:
    """PAIR_D and PAIR_DV where `paired` (the forward with the tangent, its products split,
    its tiles read through pointers): a tail tile (`column_tiles`) that its columns fill at
    most half of (72 = 64 + 8 in a 16-column tile) holds two tensors' tails side by side, so
    that the tangent's products over the tails take one product where they took two."""
    def half_full(width: int, block: int, tail: int) -> bool:
        return paired and tail > 0 and width - block <= tail // 2

    return {"PAIR_D": half_full(head_dim, tiles["BLOCK_D"], tiles["D_TAIL"]),
            "PAIR_DV": half_full(value_dim, tiles["BLOCK_DV"], tiles["DV_TAIL"])}


def _two_tiles(width: int) -> tuple[int, int]:
    whole = max(16, next_power_of_2(width))
    first = 1 << (width.bit_length() - 1)  # the largest power of two <= width
    if first < 16 or first == width:
        return whole, 0
    tail = max(16, next_power_of_2(width - first))
    return (first, tail) if first + tail < whole else (whole, 0)


def tma_eligible(*tensors: torch.Tensor, long_enough: bool = True) -> bool:
    """True when the tiles of these (B, H, N, D) CUDA tensors can come through tensor
    descriptors (chapter 4): a Hopper or newer GPU, contiguous rows, 16-byte aligned base
    and strides, and rows `long_enough` to repay building the descriptors in each program.
    JVP_ATTENTION_TMA=0 turns descriptors off; =1 forces them, unchecked (the interpreter
    emulates descriptors: that is how CPU tests cover this path)."""
    setting = os.environ.get("JVP_ATTENTION_TMA", "auto")
    if setting in ("0", "1"):
        return setting == "1"
    if not long_enough or interpreting() or not all(t.is_cuda for t in tensors):
        return False
    if cuda_major(tensors[0].device.index) < 9:
        return False
    return all(descriptor_compatible(t) for t in tensors)


@functools.cache
def cuda_major(index: int | None) -> int:
    """The compute capability's major version of CUDA device `index` (None: the current
    one), asked once per device."""
    return torch.cuda.get_device_capability(index)[0]


def descriptor_compatible(t: torch.Tensor) -> bool:
    """A tensor descriptor can address `t`'s rows: contiguous rows, a positive row stride,
    16-byte aligned base and strides (the copy engine's rules)."""
    return (t.stride(-1) == 1 and t.stride(-2) > 0 and t.data_ptr() % 16 == 0
            and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1]))


def _descriptor_workspace(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory in which kernels build their tensor descriptors."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def prepare_descriptors(use_tma: bool) -> None:
    """Kernels that build tensor descriptors need Triton's allocator. Triton keeps it per
    thread context (the autograd engine runs backward in its own threads), so it is set
    before each launch that needs it, unless the user has set one."""
    if not use_tma or interpreting():
        return
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        if not isinstance(_allocator.get(), NullAllocator):
            return
    except (ImportError, AttributeError):  # a Triton that keeps it elsewhere
        pass
    triton.set_allocator(_descriptor_workspace)


def on_device(t: torch.Tensor):
    """A context that makes `t`'s CUDA device current (kernels launch there, not on cuda:0)."""
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


def check_kernel_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q, k, v are (B, H, N, D) with matching batch and GQA heads."""
    ok = q.dim() == k.dim() == v.dim() == 4
    ok = ok and q.shape[0] == k.shape[0] == v.shape[0] and k.shape[:3] == v.shape[:3]
    ok = ok and q.shape[3] == k.shape[3] and q.shape[1] % k.shape[1] == 0
    if not ok:
        raise ValueError(f"expected q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) with "
                         f"Hq a multiple of Hkv; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """`x` with unit stride along its last dimension, as the kernels read columns: `x`
    itself when it has that (or when the dimension has at most one entry, whose stride is
    never used), else a copy. Dimensions broadcast with stride 0 (an expanded cotangent)
    stay broadcast: only one slice along them is copied."""
    if x.stride(-1) == 1 or x.shape[-1] <= 1:
        return x
    one_slice = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in x.stride()[:-1])
    return x[one_slice].contiguous().expand(x.shape)


def row_strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """The batch, head and row strides of each (B, H, N, D) tensor, in order: the kernels'
    stride arguments (their columns are at unit stride, see `unit_last_stride`)."""
    return tuple([stride for t in tensors for stride in t.stride()[:-1]])


# %% [markdown]
# ### Replaying a call
#
# Even with both layers above, a short call's host time is mostly decisions that a
# training loop takes again with the same answer at every step: the shape checks, whether
# to read through descriptors, carry fp16 copies or hand over to chapter 11's kernel, the
# column tiles, the head group, the row alignment, the autotuner's tile, the dictionary of
# ~30 compile-time arguments; then the launch matches every argument once more. Each is a
# few microseconds of Python; together they were 165 µs of a 445 µs forward+JVP call on the
# H200's host at DiT-B/2's (64, 12, 256, 64) (`benchmarks/host_breakdown.py`), against
# 20 µs for Triton's C launcher.
#
# Every one of those decisions depends only on what the inputs *are* (shapes, strides,
# dtypes, devices, 16-byte alignment), on the call's options and on a few settings, never
# on their values or addresses. So the launcher keys a call by exactly those facts (and by
# which inputs are one and the same tensor, since chapter 5's replay finds its tensors by
# identity: `attention(x, x, x)` and a call with three tensors are keyed apart), and the
# first call at a key whose launches all went directly (`CachedLauncher.launch`, the path
# of a launch seen before) leaves a `CallReplay`: for each launch (a carried call's range
# pass and copies, then the attention kernel) a `ReplayedLaunch` with the compiled kernel,
# its grid and every argument that is not a tensor, and the place of each tensor argument
# in the call's pool: its inputs and outputs, then the scratch tensors the call worked in
# (the carry's copies and factors, allocated through `scratch_tensor`, which notes them
# while a call is recorded). A later call at the same key allocates its outputs and new
# scratch tensors like the recorded ones and calls each C launcher with its own tensors'
# addresses in their places (`addresses`: handed a tensor, Triton's C launcher would call
# its `data_ptr` and ask the driver whether each address is the GPU's, which the key has
# settled); nothing else. Under the Triton release it knows (`native_launch`) it calls the
# launcher's C function itself, with the workspace in which a kernel builds its tensor
# descriptors allocated among the call's scratch tensors: Triton's launcher object would
# look its allocator up, call it and hand the driver that address to check, per launch.
# A mask is one more input (the launcher hands the kernel the
# mask itself when it has the scores' shape, as `attention` passes it, a stride-0 view
# where it broadcasts); a mask with a tangent is not replayed, since PyTorch pairs the two
# in a new tensor. A tensor the launcher made from an input (the copy of a
# column-strided one) is in no pool, so such a call is not replayed. A
# replay is refused, and the call takes the whole path, while a launch hook (a
# profiler's) is installed or once the autotuner holds another tile for the key (a tile
# sweep), and the key holds the settings that the decisions read (the descriptor and
# warp-specialisation switches, the carry threshold, Triton's code options). Under the
# interpreter, where there is no C launcher, the recorded launch is the interpreter's,
# and a replay runs it with the new tensors: the same decisions are skipped, which is how
# the CPU tests exercise it.
#
# On the H200's host (bf16, (64, 12, 256, 64), `benchmarks/host_breakdown.py` five times,
# `benchmarks/results/host_breakdown_replay_h200.json`) `torch.func.jvp(attention)` then
# took 315 µs a call (median; 286 to 522), the forward launcher about 70 µs of it and
# Triton's C launcher 16 to 18; `torch.func.jvp` of a clone, PyTorch's own cost of the
# call, took 127 µs. The backward replays its launches the same way (chapter 5).

# %% tags=["export:launch"]
class LaunchRecorder(threading.local):
    """The direct launches made on this thread while a call is being recorded (None when
    none is): `CachedLauncher.launch` appends each, as a `DirectLaunch`; and the scratch
    tensors the call allocated (`scratch_tensor`)."""

    launches: list | None = None
    scratch: list | None = None


RECORDER = LaunchRecorder()


class DirectLaunch(NamedTuple):
    """A launch made by calling a compiled kernel's C launcher (`CachedLauncher.launch`):
    every argument in signature order, the grid, the device; `tuned` is (autotuner, key,
    tile) when an autotuner chose the tile, which it must still hold for a replay."""

    compiled: object
    grid: tuple[int, int, int]
    values: tuple
    device: int
    tuned: tuple | None = None


class InterpretedLaunch(NamedTuple):
    """A launch run by Triton's interpreter while a call was being recorded: the kernel, the
    grid, the positional arguments and the keywords (the tile's included)."""

    kernel: object
    grid: object
    values: tuple
    kwargs: dict
    tuned: None = None


class ReplayedLaunch(NamedTuple):
    """A recorded launch to repeat for later calls that differ from it only in their tensors
    (see `CallReplay`): the compiled kernel's C launcher (or the interpreter) called with
    the new tensors in front of the other recorded arguments; `descriptors`: with Triton's
    allocator for tensor descriptors set first; `placed`: the other arguments hold tensors
    too (in tuples: the carry's), as `PoolPlace`s to fill from the call's pool; `native`:
    (C launch function, cooperative grid, PDL, the place of the descriptors' workspace in
    the pool or None), to call the launcher's C function itself (`native_launch`)."""

    descriptors: bool
    recorded: DirectLaunch | InterpretedLaunch
    placed: bool = False
    native: tuple | None = None

    def usable(self) -> bool:
        """Whether a replay does what the full path would: no launch hook to call, and the
        autotuner still on the recorded tile."""
        recorded = self.recorded
        if isinstance(recorded, InterpretedLaunch):
            return True
        if launch_hooks():
            return False
        if recorded.tuned is None:
            return True
        autotuner, key, tile = recorded.tuned
        return autotuner.tuned.get(key) is tile

    def __call__(self, tensors: tuple, pool: tuple = ()) -> None:
        """Launch with `tensors` in place of the recorded ones (and, where `placed`, the
        other arguments' tensors taken from `pool`)."""
        recorded = self.recorded
        rest = recorded.values[len(tensors):]
        if isinstance(recorded, InterpretedLaunch):
            if self.placed:
                rest = filled(rest, pool)
            recorded.kernel.run(*tensors, *rest, grid=recorded.grid, warmup=False,
                                **recorded.kwargs)
            return
        if self.placed:
            rest = filled(rest, addresses(pool))
        if recorded.tuned is not None:
            recorded.tuned[0].best_config = recorded.tuned[2]
        compiled = recorded.compiled
        stream = driver.active.get_current_stream(recorded.device)
        if self.native is None:
            prepare_descriptors(self.descriptors)
            compiled.run(*recorded.grid, stream, compiled.function, compiled.packed_metadata,
                         None, None, None, *addresses(tensors), *rest)
            return
        c_launch, cooperative, pdl, workspace = self.native
        c_launch(*recorded.grid, stream, compiled.function, cooperative, pdl,
                 None if workspace is None else pool[workspace].data_ptr(), None,
                 compiled.packed_metadata, None, None, None, *addresses(tensors), *rest)


def addresses(tensors: tuple) -> list:
    """The tensors' device addresses, None kept: what Triton's C launcher takes for a
    pointer argument. Handed a tensor, the launcher calls its `data_ptr` and then asks the
    driver whether the address is the GPU's (`cuPointerGetAttribute`, per pointer and per
    launch); handed an int, it takes it as it is. A replay's key holds every tensor's
    device, so the question is settled before the replay."""
    return [None if t is None else t.data_ptr() for t in tensors]


# The Triton releases whose CUDA launcher `native_launch` knows: the C function's arguments
# (grid, stream, function, cooperative grid, PDL, global and profile scratch, metadata, hooks,
# the kernel's) and the scratch's size (blocks x CTAs x bytes per CTA).
NATIVE_LAUNCH_TRITON = ("3.6.",)


def native_launch(direct) -> tuple[Callable, bool, bool, int] | None:
    """What a replay needs to call a direct launch's C function itself: the function, the
    cooperative-grid and PDL flags, and the bytes of global memory the kernel builds its
    tensor descriptors in (0: none), for the replay to allocate with its scratch tensors.
    Triton's launcher object would, per launch, look its allocator up, call it and ask the
    driver about that memory's address too. None under a Triton this does not know, or a
    launcher that also wants profiling scratch (Proton's): the replay calls the launcher
    object, as Triton does."""
    launcher = getattr(getattr(direct, "compiled", None), "run", None)
    if (type(launcher).__name__ != "CudaLauncher"
            or not triton.__version__.startswith(NATIVE_LAUNCH_TRITON)):
        return None
    try:
        if launcher.profile_scratch_size or launcher.global_scratch_align > 256:
            return None  # (the caching allocator's blocks are 512-byte aligned)
        blocks = direct.grid[0] * direct.grid[1] * direct.grid[2]
        workspace = blocks * launcher.num_ctas * launcher.global_scratch_size
        return launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl, workspace
    except AttributeError:  # a launcher of another shape
        return None


class PoolPlace(NamedTuple):
    """Where a recorded launch's tensor argument is in its call's pool (`placed`)."""

    index: int


def placed(values: tuple, places: dict[int, int]) -> tuple | None:
    """`values` with each tensor (in tuples too) replaced by its `PoolPlace` (`places`: id
    -> place), or None when a tensor is not in the pool or a value is neither a tensor nor
    a constant (a tensor descriptor holds an address)."""
    out = []
    for x in values:
        if isinstance(x, torch.Tensor):
            if id(x) not in places:
                return None
            x = PoolPlace(places[id(x)])
        elif x.__class__ is tuple:
            x = placed(x, places)
            if x is None:
                return None
        elif not (x.__class__ in PLAIN_TYPES or callable(x)):  # (jit functions are constants)
            return None
        out.append(x)
    return tuple(out)


def filled(values: tuple, pool: tuple) -> tuple:
    """`placed`'s values with the tensors of `pool` in their places."""
    return tuple([pool[x.index] if x.__class__ is PoolPlace
                  else filled(x, pool) if x.__class__ is tuple else x for x in values])


def launch_slots(launches: list, pool: tuple) -> list[tuple[DirectLaunch, tuple, bool]] | None:
    """For each recorded launch, where in `pool` each of its leading tensor arguments is
    (by identity; None for a None argument), and whether its other arguments hold tensors
    too (then recorded as `placed`); or None when the launches cannot be replayed from
    `pool`: one went through Triton's own path or took a tile the autotuner had not
    settled yet, a tensor argument is not in `pool` (a copy made during the call), or an
    argument is neither a tensor nor a constant."""
    if None in launches:
        return None
    places: dict[int, int] = {}  # id -> first place in pool (plain loops: run per call)
    for place, tensor in enumerate(pool):
        places.setdefault(id(tensor), place)
    found = []
    for recorded in launches:
        values = recorded.values
        lead = 0
        while lead < len(values) and (values[lead] is None
                                      or isinstance(values[lead], torch.Tensor)):
            lead += 1
        rest = tuple(values[lead:])
        keywords = tuple(getattr(recorded, "kwargs", {}).values())
        plain = {x.__class__ for x in (*rest, *keywords)} <= PLAIN_TYPES
        if not plain:
            rest = placed(rest, places)
            if rest is None or placed(keywords, {}) is None:
                return None
        slots = tuple([None if x is None else places.get(id(x), -1) for x in values[:lead]])
        if -1 in slots:
            return None
        # Kept without the call's tensors: a replay must not hold them alive (their
        # memory, and the gradients autograd could otherwise take over uncopied).
        found.append((recorded._replace(values=(None,) * lead + rest), slots, not plain))
    return found


def scratch_needed(direct) -> bool:
    """Whether a compiled kernel asks Triton's allocator for global memory (its tensor
    descriptors): the allocator must then be set on the thread that launches it."""
    compiled = getattr(direct, "compiled", None)  # (none under the interpreter)
    return getattr(getattr(compiled, "metadata", None), "global_scratch_size", 0) > 0


class CallReplay(NamedTuple):
    """The launches of a call, to repeat for a later call at the same key: each a
    `ReplayedLaunch` with the places of its leading tensor arguments in the call's pool
    (its inputs and outputs, then tensors like the `scratch` (shape, dtype, device) that
    the recorded call allocated, new for each replay)."""

    launches: tuple
    scratch: tuple = ()

    def usable(self) -> bool:
        """Whether every launch may be replayed (`ReplayedLaunch.usable`)."""
        for replay, _ in self.launches:  # (a loop: a generator would step once per launch)
            if not replay.usable():
                return False
        return True

    def __call__(self, pool: tuple) -> None:
        """Launch each kernel with its tensors taken from `pool` and new scratch tensors."""
        if self.scratch:
            pool = (*pool, *[torch.empty(shape, device=device, dtype=dtype)
                             for shape, dtype, device in self.scratch])
        pool = (*pool, None)  # where a None argument's slot points
        for replay, slots in self.launches:
            replay(tuple(map(pool.__getitem__, slots)), pool)


class Recording:
    """`with Recording(pool, on) as recording:` records the direct launches made inside
    (when `on`) and the scratch tensors they work in; after it, `recording.replay` is the
    `CallReplay` that repeats them with a later call's `pool` (the call's inputs and
    outputs), or None: not recorded, or not replayable (`launch_slots`)."""

    def __init__(self, pool: tuple, on: bool):
        self.pool, self.on, self.replay = pool, on, None

    def __enter__(self) -> "Recording":
        if self.on:
            self.outer = RECORDER.launches, RECORDER.scratch
            RECORDER.launches, RECORDER.scratch = [], []
        return self

    def __exit__(self, kind, error, trace) -> None:
        if not self.on:
            return
        launches, scratch = RECORDER.launches, RECORDER.scratch
        RECORDER.launches, RECORDER.scratch = self.outer
        note_untraced_launch()  # a call recorded inside another: launches the outer one missed
        found = None if kind is not None else launch_slots(launches, (*self.pool, *scratch))
        if found:
            self.replay = call_replay(found, len(self.pool),
                                      [(x.shape, x.dtype, x.device) for x in scratch])


def call_replay(found: list, n_pool: int, scratch: list) -> CallReplay:
    """The `CallReplay` of `launch_slots`' launches for a pool of `n_pool` tensors and the
    `scratch` (shape, dtype, device) the call allocated; a workspace for each launch whose
    C function is called directly and needs one (`native_launch`) joins the scratch."""
    replays = []
    for direct, slots, placed in found:
        native = native_launch(direct)
        if native is not None:
            c_launch, cooperative, pdl, workspace = native
            if workspace:
                scratch.append(((workspace,), torch.int8, torch.device("cuda", direct.device)))
            native = (c_launch, cooperative, pdl, n_pool + len(scratch) - 1 if workspace else None)
        replays.append((ReplayedLaunch(scratch_needed(direct), direct, placed, native), slots))
    absent = n_pool + len(scratch)  # the None at the end of a replay's pool
    return CallReplay(tuple((replay, tuple([absent if i is None else i for i in slots]))
                            for replay, slots in replays), tuple(scratch))


# Every launcher's table of replays (key -> ReplayedLaunch), for `forget_replays`.
REPLAY_TABLES: list[dict] = []


def replay_table() -> dict:
    """A new, registered table of replays for a launcher."""
    REPLAY_TABLES.append({})
    return REPLAY_TABLES[-1]


def forget_replays() -> None:
    """Drop every recorded replay. The keys hold what the launchers read of the inputs and
    of the settings; code that changes a launcher's decisions by other means (a test that
    patches one of its functions) calls this, so that the next call decides afresh."""
    for table in REPLAY_TABLES:
        table.clear()


def call_facts(*tensors: torch.Tensor) -> tuple | None:
    """What the launchers' decisions read of these tensors (type, shape, strides, dtype,
    device, 16-byte alignment) with the current CUDA device, the settings that change the
    launch and which tensors are the same object (`same_objects`); None unless they are
    plain tensors (a traced or fake tensor has no address, and is never replayed)."""
    first = tensors[0]
    if type(first) is not torch.Tensor:
        return None
    device = driver.active.get_current_device() if first.is_cuda else None
    settings = (os.environ.get("JVP_ATTENTION_TMA"), os.environ.get("JVP_ATTENTION_WARP_SPECIALIZED"),
                CARRY_MIN_KEYS, *code_options())
    ids = list(map(id, tensors))  # (builtins only: no Python call on the common path)
    return (device, settings, None if len(set(ids)) == len(ids) else same_objects(ids),
            *[(type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
              for t in tensors])


def same_objects(ids: list[int]) -> tuple[int, ...]:
    """Each object's first place among `ids` (of tensors, some of them one object). A
    replay that finds its tensors by identity (`launch_slots`) recorded where each argument
    was first seen: recorded from `attention(x, x, x)`, it would hand a later call's q to
    the kernels as k and v too, so such calls get keys of their own."""
    return tuple([ids.index(i) for i in ids])


# %% [markdown]
# The launcher below runs this chapter's kernel for every call but one kind: on an sm_90 GPU
# (H100, H200), a call without a mask, in fp16 or bf16, with $D = D_v \in \{64,
# 128\}$ and at least 4096 keys, goes to chapter 11's forward instead, written in Gluon with
# warp specialisation, which there is level with cuDNN (1.25x this kernel at (4, 16, 4096,
# 128), bf16); with tangents, its forward with the JVP does (in "accurate" mode for bf16
# only, on this chapter's carried fp16 copies). It returns the same outputs, so nothing
# downstream can tell. (The module's
# import of it is in the skipped cell at the top; this notebook imports it here.)

# %%
from jvp_attention.warp_specialized import (  # noqa: E402  (chapter 11)
    takes_warp_specialized,
    warp_specialized_forward,
)

# %% tags=["export"]
_attention_forward = autotuned(_attention_forward_kernel, [
    (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2),
    (64, 32, 4, 2), (32, 32, 4, 2)])
# The tangent doubles the accumulators, so it has its own list: tiles whose registers and
# shared memory fit with the tangent on (tools/kernel_resources.py).
_attention_forward_jvp = autotuned(_attention_forward_kernel, [
    (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (64, 32, 4, 2),
    (32, 32, 4, 2)])
# Each program builds its tensor descriptors before its first key block; unless the rows are
# long, that costs more than the descriptors save over aligned pointer loads. H200, bf16,
# forward+JVP GPU time per call, pointers against descriptors: 0.59 against 0.79 ms at
# (48, 12, 512, 72), 0.99 against 1.12 at (16, 16, 1024, 72), 1.58 against 1.66 at
# (8, 16, 2048, 72), 2.07 against 2.16 at (8, 16, 2048, 128); from 4096 keys the two are
# within 3%, descriptors ahead at d = 72 and 128 (2.93 against 2.86 at (4, 16, 4096, 72)).
FORWARD_TMA_MIN_KEYS = 4096


def traceable_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the forward's launches may enter a compiled graph (`traceable_launches`)."""
    n_k = k.shape[-2]
    return traceable_launches(q, n_k, long_rows=long_forward_rows(q, n_k),
                              cut=cut_in_two(q.shape[-1], v.shape[-1]))


def long_forward_rows(q: torch.Tensor, n_k: int) -> bool:
    """Whether the forward reads rows of `n_k` keys through tensor descriptors (given tensors
    that allow them): from FORWARD_TMA_MIN_KEYS, unless `graph_takes_pointers`."""
    return n_k >= FORWARD_TMA_MIN_KEYS and not graph_takes_pointers(q, n_k)


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    tangents: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    residuals: bool = False,
    *,
    mask_tangent: torch.Tensor | None = None,
    precision: str | None = None,
) -> AttentionOutputs | tuple[AttentionOutputs, tuple[torch.Tensor, torch.Tensor | None]]:
    """Run the fused forward kernel on (B, H, N, D) tensors.

    Args:
        q: Queries, (B, Hq, Nq, Dqk), fp16/bf16/fp32, any strides (as k, v and the
            tangents); a last dimension that is not contiguous is copied.
        k: Keys, (B, Hkv, Nk, Dqk) with Hq a multiple of Hkv (GQA).
        v: Values, (B, Hkv, Nk, Dv).
        attn_mask: None, bool (True = attend) or additive, broadcastable to (B, Hq, Nq, Nk).
        is_causal: Top-left causal mask (query i sees keys j <= i), combinable with attn_mask.
        scale: Softmax scale; defaults to 1/sqrt(Dqk).
        tangents: Optional (tq, tk, tv) shaped like (q, k, v): also compute tO and mu.
        residuals: Also return the rounding residuals of out (and tangent_out), the parts
            of their fp32 values that the output dtype dropped, for an accurate backward.
        mask_tangent: The tangent of an additive (float) attn_mask, any float dtype,
            broadcastable to (B, Hq, Nq, Nk); needs `tangents`. It adds to tS.
        precision: "accurate" or "fast" for this call; None uses the global mode
            (`set_precision`).

    Returns:
        AttentionOutputs(out, lse, tangent_out, mu); lse and mu are (B, Hq, Nq), fp32
        (lse fp64 with an additive attn_mask, `lse_dtype`);
        tangent_out and mu are None without tangents. With `residuals`, a pair
        (outputs, (out_residual, tangent_out_residual)).

    Raises:
        ValueError: For mismatched shapes, a bad `precision`, or a `mask_tangent` without
            `tangents` or without an additive attn_mask.
    """
    exact = accurate(precision)
    has_tangent = tangents is not None
    key = None
    if mask_tangent is None:  # a call that can be replayed (PyTorch pairs a mask's tangent with it)
        facts = call_facts(q, k, v, *(tangents if has_tangent else ()),
                           *(() if attn_mask is None else (attn_mask,)))
        key = (None if facts is None
               else (is_causal, scale, residuals, exact, attn_mask is None, *facts))
        replay = FORWARD_REPLAYS.get(key) if key is not None else None
        if replay is not None and replay.usable():
            buffers = forward_buffers(q, v.shape[3], has_tangent, residuals, attn_mask)
            replay((q, k, v, *(tangents or NO_TANGENTS), attn_mask, *buffers))
            return forward_results(buffers, has_tangent, residuals)
    check_kernel_shapes(q, k, v)
    batch, n_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    check_mask_tangent(attn_mask, mask_tangent, (batch, n_heads, n_q, n_k))
    if mask_tangent is not None and tangents is None:
        raise ValueError("mask_tangent is part of the tangent: pass tangents=(tq, tk, tv) too")
    scale = head_dim**-0.5 if scale is None else scale
    # Chapter 11's kernels read descriptors too: not in a graph that takes pointers (asked
    # last: short calls, most of a training step's, stop at the first two questions).
    if (attn_mask is None and takes_warp_specialized(q, k, v, tangents, exact, is_causal)
            and not graph_takes_pointers(q, n_k)):
        ran = warp_specialized_forward(q, k, v, is_causal, scale, residuals,  # chapter 11
                                       tangents, jvp_operands if exact else None)
        if ran is not None:
            return ran
    buffers = forward_buffers(q, value_dim, has_tangent, residuals, attn_mask)
    pool = (q, k, v, *(tangents or NO_TANGENTS), attn_mask, *buffers)  # a replay's tensors
    q, k, v = (unit_last_stride(x) for x in (q, k, v))
    tq, tk, tv = (unit_last_stride(x) for x in tangents) if has_tangent else (q, k, v)
    mask, mask_strides, mask_kind = mask_operand(attn_mask, (batch, n_heads, n_q, n_k),
                                                 mask_tangent)

    # bf16 tangents in "accurate" mode: exact fp16 copies of v and tv instead of the split
    # (a mask's tangent too: the kernel bounds tS + tB block by block).
    carry = has_tangent and exact and carries(q, n_k) and min(q.numel(), k.numel()) > 0
    launcher = launchable(_attention_forward_jvp if has_tangent else _attention_forward, q)
    # The launches, recorded for a replay: the carry's too (a replay allocates copies of its
    # own). A copy of a column-strided input is not in the pool, so not replayed; a traced
    # launch (or a tool's stand-in) launches nothing to repeat.
    recording = Recording(pool, key is not None
                          and isinstance(launcher, (KeyedAutotuner, CachedLauncher)))

    def grid(meta):
        return cdiv(n_q, meta["BLOCK_M"]), batch * n_heads

    with on_device(q), recording:
        factors = lse_factors(buffers)  # not read without CARRY
        if carry:
            v, tv, factors = carried_value_operands(v, tv)
        use_tma = tma_eligible(q, k, v, tq, tk, tv, long_enough=long_forward_rows(q, n_k))
        tiles = launch_column_tiles(q, n_k, head_dim, value_dim)
        constants = kernel_meta(q, head_dim, value_dim, split=has_tangent and exact and not carry)
        prepare_descriptors(use_tma)
        launcher[grid](
            *forward_tensors(q, k, v, (tq, tk, tv) if has_tangent else None,
                             q if mask is None else mask, factors, buffers),
            *row_strides(q, k, v, tq, tk, tv), *mask_strides,
            n_heads, n_q, n_k, head_dim, value_dim, n_heads // n_kv_heads,
            scale * LOG2E.value, scale, length_bucket(n_q), length_bucket(n_k),
            IS_CAUSAL=is_causal, MASK_KIND=mask_kind, HAS_TANGENT=has_tangent,
            STORE_RESIDUAL=residuals, USE_TMA=use_tma, CARRY=carry,
            HEAD_GROUP=head_group(is_causal, k, v, *((tk, tv) if has_tangent else ()),
                                  queries_per_head=n_heads // n_kv_heads),
            ALIGN=row_alignment((q, k, v, tq, tk, tv), (head_dim, value_dim)),
            **{**constants, **tiles},  # the column tiles' widths replace the padded ones
            **pair_tails(tiles, head_dim, value_dim, constants["SPLIT"] and not use_tma))
    if recording.replay is not None:
        remember(FORWARD_REPLAYS, key, recording.replay)
    return forward_results(buffers, has_tangent, residuals)


# Replays of earlier calls (`Recording`), by everything their launch decisions read.
FORWARD_REPLAYS: dict[tuple, CallReplay] = replay_table()
NO_TANGENTS = (None, None, None)  # a call without tangents, in a replay's pool


def forward_buffers(q: torch.Tensor, value_dim: int, has_tangent: bool, residuals: bool,
                    attn_mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The forward's outputs, uninitialised, in the kernel's order: out, tangent_out, lse,
    mu and the residuals of out and tangent_out. Those the call does not compute alias out
    and lse, which the kernel then never writes through them."""
    batch, n_heads, n_q, _ = q.shape
    out = torch.empty((batch, n_heads, n_q, value_dim), device=q.device, dtype=q.dtype)
    wide = attn_mask is not None and attn_mask.dtype != torch.bool  # `lse_dtype`, inline
    lse = torch.empty((batch, n_heads, n_q), device=q.device,
                      dtype=torch.float64 if wide else torch.float32)
    t_out = torch.empty_like(out) if has_tangent else out
    mu = torch.empty_like(lse, dtype=torch.float32) if has_tangent else lse
    out_res = torch.empty_like(out) if residuals else out
    t_out_res = torch.empty_like(out) if residuals and has_tangent else out_res
    return out, t_out, lse, mu, out_res, t_out_res


def lse_dtype(attn_mask: torch.Tensor | None) -> torch.dtype:
    """The LSE's dtype: fp64 for an additive mask, whose bias can put a row's scores near
    LOWEST_SCORE, where fp32 could not hold log2 of the row's sum beside them; else fp32."""
    additive = attn_mask is not None and attn_mask.dtype != torch.bool
    return torch.float64 if additive else torch.float32


def lse_factors(buffers: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The carry-factors operand of a call without a carry (never read): lse."""
    return buffers[2]


def forward_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    tangents: tuple | None, mask: torch.Tensor, factors: torch.Tensor,
                    buffers: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The kernel's tensor arguments in order; without tangents q, k, v stand in for them."""
    return (q, k, v, *(tangents or (q, k, v)), mask, *buffers, factors)


def forward_results(buffers: tuple[torch.Tensor, ...], has_tangent: bool, residuals: bool):
    """What `flash_attention_forward` returns, from `forward_buffers`."""
    out, t_out, lse, mu, out_res, t_out_res = buffers
    outputs = AttentionOutputs(out, lse, t_out if has_tangent else None,
                               mu if has_tangent else None)
    if residuals:
        return outputs, (out_res, t_out_res if has_tangent else None)
    return outputs


# %% [markdown]
# ## Checking it against chapter 1
#
# The reference of chapter 1 in float64 is the ground truth. We run the kernel in float32
# (where it should agree to about $10^{-6}$) and in float16 over the features one at a time:
# lengths that are not multiples of the tiles, $N_q \ne N_k$, causal, GQA, a broadcast
# key-padding mask, an additive mask, $d_{qk} \ne d_v$ with a head dimension that is not a
# power of two, and inputs in the `(B, N, H, D)` memory layout that most models produce
# (a transposed view: no copy is made). bf16 is checked on the GPU only: Triton's interpreter
# multiplies raw bf16 bits (its bf16 dot products are wrong).

# %%
from jvp_attention.reference import reference_attention

torch.manual_seed(0)
N = 1000 if FULL_SIZE else 40


def random_case(batch, hq, hkv, n_q, n_k, d, dv, dtype, layout_bnhd=False):
    """Random q, k, v; optionally stored as (B, N, H, D) and viewed as (B, H, N, D)."""
    def make(h, n, width):
        if layout_bnhd:
            return torch.randn(batch, n, h, width, device=DEVICE, dtype=dtype).transpose(1, 2)
        return torch.randn(batch, h, n, width, device=DEVICE, dtype=dtype)
    return make(hq, n_q, d), make(hkv, n_k, d), make(hkv, n_k, dv)


def forward_error(q, k, v, **options):
    """Max |O - O_ref| and |LSE - LSE_ref| against the float64 reference."""
    ours = flash_attention_forward(q, k, v, **options)
    gqa = q.shape[1] != k.shape[1]
    ref = reference_attention(q.double(), k.double(), v.double(), enable_gqa=gqa, **options)
    finite = ref.lse.isfinite()
    return ((ours.out.double() - ref.out).abs().max().item(),
            (ours.lse.double() - ref.lse)[finite].abs().max().item())


cases = {
    "plain": dict(shape=(2, 4, 4, N, N + 7, 64, 64)),
    "Nq != Nk, causal": dict(shape=(2, 4, 4, N + 13, N // 2 + 3, 64, 64), is_causal=True),
    "GQA 8:2": dict(shape=(1, 8, 2, N, N, 64, 64)),
    "d_qk=80, d_v=48": dict(shape=(1, 2, 2, N, N, 80, 48)),
    "(B, N, H, D) layout": dict(shape=(2, 4, 4, N, N, 64, 64), layout_bnhd=True),
}
for dtype in (torch.float32, torch.float16):
    for name, case in cases.items():
        q, k, v = random_case(*case["shape"], dtype, case.get("layout_bnhd", False))
        err_o, err_lse = forward_error(q, k, v, is_causal=case.get("is_causal", False))
        print(f"{str(dtype):14} {name:22} max|dO| {err_o:.1e}  max|dLSE| {err_lse:.1e}")

# %% [markdown]
# Masks: a boolean key-padding mask of shape `(B, 1, 1, N_k)` (broadcast, never expanded in
# memory), an additive `(N_q, N_k)` bias, and a mask that hides every key from some rows,
# which must give zeros rather than NaN.

# %%
q, k, v = random_case(2, 4, 4, N, N, 64, 64, torch.float32)
padding = torch.rand(2, 1, 1, N, device=DEVICE) > 0.2
bias = torch.randn(N, N, device=DEVICE)
hide_rows = torch.ones(2, 4, N, N, dtype=torch.bool, device=DEVICE)
hide_rows[:, :, :5] = False
for name, mask in [("key padding", padding), ("additive", bias), ("rows hidden", hide_rows)]:
    print(f"{name:12} errors {forward_error(q, k, v, attn_mask=mask)}")
out = flash_attention_forward(q, k, v, attn_mask=hide_rows).out
assert out[:, :, :5].eq(0).all() and out.isfinite().all()
print("hidden rows: O = 0, no NaN")

# %% [markdown]
# The switch really removes the tangent work, and nothing else: in fp32, with the same tile,
# the primal results of the `HAS_TANGENT=True` specialisation equal those of the primal-only
# one bit for bit, because the primal lines are the same code. The interpreter runs one tile
# for both, so there we check bit equality. On the GPU the two specialisations autotune
# separately (the tangent's accumulators favour narrower key blocks, chapter 4), and a
# different tile sums the same terms in a different order: there they agree to fp32
# rounding. (In 16 bits the JVP kernel also rounds its products more carefully by default,
# chapter 3's "accurate" mode, so there the two agree to 16-bit rounding.)

# %%
tangents = tuple(torch.randn_like(x) for x in (q, k, v))
with_tangent = flash_attention_forward(q, k, v, is_causal=True, tangents=tangents)
primal_only = flash_attention_forward(q, k, v, is_causal=True)
same = torch.equal if not FULL_SIZE else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)
assert same(with_tangent.out, primal_only.out)
assert same(with_tangent.lse, primal_only.lse)
print("primal outputs agree with and without the tangent "
      f"({'bit for bit' if not FULL_SIZE else 'to fp32 rounding'})")

# %% [markdown]
# A learnable bias with a tangent: $t_S$ gains $t_B$. The truth is `torch.func.jvp` in
# float64 of attention written out with the bias as one more input; the bias is one per head
# and shared over the batch, $(1, H, N_q, N_k)$, causal, with a row that sees no key. Without
# $t_B$ the tangent is visibly wrong, so the check can fail.

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


q, k, v = random_case(2, 4, 4, N, N, 64, 64, torch.float32)
tangents = tuple(torch.randn_like(x) for x in (q, k, v))
bias = torch.randn(1, 4, N, N, device=DEVICE)
bias[:, :, 3] = -math.inf  # query row 3 sees no key
bias_tangent = torch.randn_like(bias)
_, truth = torch.func.jvp(lambda *x: biased_attention(*x, True),
                          tuple(x.double() for x in (q, k, v, bias)),
                          tuple(x.double() for x in (*tangents, bias_tangent)))
ours = flash_attention_forward(q, k, v, bias, True, tangents=tangents, mask_tangent=bias_tangent)
without = flash_attention_forward(q, k, v, bias, True, tangents=tangents)
error = (ours.tangent_out.double() - truth).abs().max().item()
print(f"tO with t_B: max error {error:.1e}; ignoring t_B: "
      f"{(without.tangent_out.double() - truth).abs().max().item():.1e}")
assert error < 1e-4 and ours.tangent_out[:, :, 3].eq(0).all()
