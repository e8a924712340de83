"""MeanFlow on a small DiT: an end-to-end training run that needs the JVP through attention.

MeanFlow (Geng et al. 2025, "Mean Flows for One-step Generative Modeling") trains a network
u(z, r, t) to predict the *average* velocity of the flow between times r and t, from the
MeanFlow identity u = v - (t - r) du/dt, where du/dt is the total derivative along the flow: a
Jacobian-vector product through the whole network, attention included. PyTorch's fused SDPA
backends refuse forward-mode AD, so this script routes the model's
`F.scaled_dot_product_attention` calls to jvp_attention's fused kernels with
`with jvp_attention.sdpa():`, with no change to the model.

Everything is here: the model (a DiT with adaLN-Zero blocks conditioned on t and t - r), the
data (coloured Gaussian blobs drawn on the fly, no download), the loss, one-step sampling, the
training loop, a step-time benchmark against PyTorch's math path and jvp-flash-attention, and
a data-parallel check. `notebooks/09_training.py` tells the story with it.

    python examples/meanflow_dit.py --steps 400                      # train on one device
    python examples/meanflow_dit.py --bench                          # the step-time table
    python examples/meanflow_dit.py --bench --preset dit-b2 --compile eager default
    torchrun --nproc_per_node=2 examples/meanflow_dit.py --ddp       # 2 ranks == 1 rank?
    torchrun --nproc_per_node=2 examples/meanflow_dit.py --fsdp      # the same with FSDP2

Each writes a JSON file (see --out). examples/README.md has the commands and the
measured results.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

try:
    import jvp_attention
except ImportError:  # run from a checkout that is not installed: the package sits beside us
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import jvp_attention

RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------------------------------
# The model: a DiT whose conditioning is (t, t - r)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DiTConfig:
    """Shape of the DiT. Tokens = (image_size / patch_size)²: 32/2 -> 256, 64/2 -> 1024,
    128/2 -> 4096."""

    image_size: int = 32
    channels: int = 3
    patch_size: int = 2
    width: int = 256
    depth: int = 6
    heads: int = 4
    mlp_ratio: int = 4

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def sincos_positions(width: int, grid: int) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embeddings, (grid², width), as in DiT."""
    if width % 4:
        raise ValueError(f"width {width} must be a multiple of 4 for 2-D sine-cosine positions")
    freqs = 1.0 / 10000 ** (torch.arange(width // 4, dtype=torch.float64) / (width // 4))
    ys, xs = torch.meshgrid(torch.arange(grid, dtype=torch.float64),
                            torch.arange(grid, dtype=torch.float64), indexing="ij")
    angles_y = ys.reshape(-1, 1) * freqs
    angles_x = xs.reshape(-1, 1) * freqs
    return torch.cat([angles_y.sin(), angles_y.cos(), angles_x.sin(), angles_x.cos()], 1).float()


# Times enter as they are, in [0, 1]. Scaled by 1000, as diffusion models scale their step
# numbers, the features' derivatives in t reach 1000: du/dt, hence the MeanFlow target, grew
# large and the loss climbed in our small runs.
TIME_SCALE = 1.0


def time_features(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of times in [0, 1] (times TIME_SCALE), as in DiT."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period)
                      * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = TIME_SCALE * t.float()[:, None] * freqs
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class TimeEmbedding(nn.Module):
    def __init__(self, width: int, features: int = 256):
        super().__init__()
        self.features = features
        self.mlp = nn.Sequential(nn.Linear(features, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(time_features(t, self.features))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class DiTBlock(nn.Module):
    """Pre-norm transformer block with adaLN-Zero: the conditioning sets each norm's shift and
    scale and a gate on each residual branch, all zero at initialisation."""

    def __init__(self, width: int, heads: int, mlp_ratio: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be a multiple of heads {heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(approximate="tanh"),
                                 nn.Linear(mlp_ratio * width, width))
        self.modulation = nn.Linear(width, 6 * width)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, n, width = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        # Looked up at call time, so `with jvp_attention.sdpa():` reroutes it.
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, width))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(c))[:, None].chunk(6, -1)
        x = x + gate1 * self.attention(modulate(self.norm1(x), shift1, scale1))
        return x + gate2 * self.mlp(modulate(self.norm2(x), shift2, scale2))


class DiT(nn.Module):
    """u_theta(z, r, t): images (B, C, H, W) and times r <= t, (B,), to an average velocity
    shaped like z. Random initialisation; the output layer starts at zero (adaLN-Zero)."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        if config.image_size % config.patch_size:
            raise ValueError(f"image_size {config.image_size} must be a multiple of "
                             f"patch_size {config.patch_size}")
        self.config = config
        width, patch = config.width, config.patch_size
        self.patchify = nn.Conv2d(config.channels, width, patch, stride=patch)
        grid = config.image_size // patch
        self.register_buffer("positions", sincos_positions(width, grid)[None], persistent=False)
        self.time = TimeEmbedding(width)
        self.interval = TimeEmbedding(width)
        self.blocks = nn.ModuleList(DiTBlock(width, config.heads, config.mlp_ratio)
                                    for _ in range(config.depth))
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Linear(width, 2 * width)
        self.head = nn.Linear(width, patch * patch * config.channels)
        for layer in (self.final_modulation, self.head):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, z: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = self.patchify(z).flatten(2).transpose(1, 2) + self.positions
        c = self.time(t) + self.interval(t - r)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_modulation(F.silu(c))[:, None].chunk(2, -1)
        x = self.head(modulate(self.final_norm(x), shift, scale))
        return self.unpatchify(x)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        p, channels = self.config.patch_size, self.config.channels
        grid = self.config.image_size // p
        x = x.view(x.shape[0], grid, grid, p, p, channels)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(x.shape[0], channels, grid * p, grid * p)


# Named model sizes for `--preset`. DiT-B/2 (Peebles & Xie 2023): width 768, 12 blocks of 12
# heads, patch 2; about 130 M parameters here (two time embeddings, for t and t - r).
PRESETS = {"dit-b2": DiTConfig(patch_size=2, width=768, depth=12, heads=12)}


def parameter_count(config: DiTConfig) -> int:
    """Parameters of `DiT(config)`, counted on the meta device (no memory is allocated)."""
    with torch.device("meta"):
        net = DiT(config)
    return sum(p.numel() for p in net.parameters())


# ---------------------------------------------------------------------------------------------
# The data: coloured Gaussian blobs, generated on the fly
# ---------------------------------------------------------------------------------------------

PALETTE = torch.tensor([[0.95, 0.25, 0.20], [0.20, 0.75, 0.30], [0.25, 0.45, 0.95],
                        [0.95, 0.80, 0.20], [0.75, 0.30, 0.85], [0.20, 0.80, 0.85]])


def blob_images(n: int, size: int, generator: torch.Generator, max_blobs: int = 3) -> torch.Tensor:
    """n images (n, 3, size, size) in [-1, 1]: one to `max_blobs` soft discs of palette colours
    at random places and sizes on black, painted one over the other."""
    coords = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    ys, xs = coords[:, None], coords[None, :]
    count = torch.randint(1, max_blobs + 1, (n,), generator=generator)
    image = torch.zeros(n, 3, size, size)
    for k in range(max_blobs):
        cy, cx = (0.2 + 0.6 * torch.rand(2, n, 1, 1, generator=generator)).unbind(0)
        sigma = 0.08 + 0.08 * torch.rand(n, 1, 1, generator=generator)
        colour = PALETTE[torch.randint(len(PALETTE), (n,), generator=generator)]
        alpha = torch.exp(-((ys - cy) ** 2 + (xs - cx) ** 2) / (2 * sigma**2))
        alpha = (alpha * (k < count).float()[:, None, None])[:, None]
        image = image * (1 - alpha) + alpha * colour[:, :, None, None]
    return image * 2 - 1


def sample_times(n: int, generator: torch.Generator, ratio: float = 0.25, mean: float = -0.4,
                 std: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, r) with r <= t: two logit-normal draws, sorted; for a fraction 1 - `ratio` of the
    batch r = t (plain flow matching). The defaults are the paper's ImageNet ones."""
    a, b = torch.sigmoid(mean + std * torch.randn(2, n, generator=generator)).unbind(0)
    t, r = torch.maximum(a, b), torch.minimum(a, b)
    same = torch.rand(n, generator=generator) >= ratio
    return t, torch.where(same, t, r)


def global_batch(step: int, batch_size: int, image_size: int, seed: int = 0,
                 ratio: float = 0.25) -> tuple[torch.Tensor, ...]:
    """The whole batch of one global step, (x, noise, t, r), a function of (seed, step) only:
    every rank draws it and takes its own slice, so any number of ranks sees the same data."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = blob_images(batch_size, image_size, generator)
    noise = torch.randn(x.shape, generator=generator)
    t, r = sample_times(batch_size, generator, ratio)
    return x, noise, t, r


# ---------------------------------------------------------------------------------------------
# The loss and one-step sampling
# ---------------------------------------------------------------------------------------------

def meanflow_loss(net: nn.Module, x: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
                  r: torch.Tensor, adaptive_p: float = 1.0,
                  adaptive_c: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """The MeanFlow loss of one batch. Returns (loss to minimise, per-sample squared error).

    z_t = (1 - t) x + t e and v = e - x. One `torch.func.jvp` gives u_theta(z_t, r, t) and
    its total derivative along (dz/dt, dr/dt, dt/dt) = (v, 0, 1); the target
    v - (t - r) du/dt is held fixed (stop-gradient). Each sample's mean squared error is
    weighted by 1 / (err + c)^p, also held fixed (the paper's adaptive weighting; p = 0 is
    the plain squared error).
    """
    t_, r_ = t.view(-1, 1, 1, 1), r.view(-1, 1, 1, 1)
    z = (1 - t_) * x + t_ * noise
    v = noise - x
    u, dudt = torch.func.jvp(net, (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
    target = (v - (t_ - r_) * dudt).detach()
    error = (u.float() - target.float()).square().flatten(1).mean(1)
    weight = (error.detach() + adaptive_c) ** -adaptive_p
    return (weight * error).mean(), error.detach()


class MeanFlow(nn.Module):
    """The DiT with its loss as `forward`, so that DistributedDataParallel wraps the whole
    training forward: the JVP runs inside DDP's forward, and DDP sees only a loss."""

    def __init__(self, config: DiTConfig, adaptive_p: float = 1.0):
        super().__init__()
        self.net = DiT(config)
        self.adaptive_p = adaptive_p

    def forward(self, x, noise, t, r):
        gather_sharded_weights(self.net)
        return meanflow_loss(self.net, x, noise, t, r, self.adaptive_p)


def gather_sharded_weights(net: nn.Module) -> None:
    """FSDP2 gathers a block's weights in the block's pre-forward hook. Inside
    `torch.func.jvp` that hook would allocate the gathered buffers as functorch's wrapped
    tensors, which have no storage ("Cannot access storage of TensorWrapper" on GPUs), so
    gather them here, before the transform; the hooks then find them gathered, and reshard
    and backward work as usual. Does nothing for a model that FSDP2 did not shard."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.unshard()


@torch.no_grad()
def one_step_samples(net: nn.Module, noise: torch.Tensor) -> torch.Tensor:
    """x = e - u(e, r=0, t=1): one network evaluation per image, clamped to [-1, 1]."""
    ones = torch.ones(noise.shape[0], device=noise.device)
    return (noise - net(noise, torch.zeros_like(ones), ones).float()).clamp(-1, 1)


# ---------------------------------------------------------------------------------------------
# Which attention runs the model's SDPA calls
# ---------------------------------------------------------------------------------------------

ATTENTIONS = ("jvp_attention", "jvp_attention_fast", "math", "jvp_flash_attention")


def jvp_flash_attention_available() -> str | None:
    """None if jvp-flash-attention imports, else why not."""
    try:
        from jvp_flash_attention.jvp_attention import JVPAttn  # noqa: F401
    except Exception as error:  # ImportError, or a Triton/CUDA error at its import
        return f"{type(error).__name__}: {error}"
    return None


@contextlib.contextmanager
def _jvp_flash_attention_sdpa():
    """Route F.scaled_dot_product_attention to jvp-flash-attention's `JVPAttn.fwd_dual`, the
    entry point its README gives for models called under torch.func.jvp."""
    from jvp_flash_attention.jvp_attention import JVPAttn

    previous = F.scaled_dot_product_attention

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        if dropout_p or enable_gqa:
            raise NotImplementedError("jvp-flash-attention route: no dropout or GQA here")
        return JVPAttn.fwd_dual(query, key, value, attn_mask=attn_mask, causal=is_causal,
                                sm_scale=scale)

    F.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous


def math_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
    """softmax(s QK^T + mask) V in plain PyTorch ops: what SDPA's math backend computes (it
    scales q and k by sqrt(s) each; we scale q by s), materialising the N x N scores.

    The benchmark's "math" row uses this rather than `sdpa_kernel(SDPBackend.MATH)`: on CUDA
    (torch 2.11, H200), the MATH backend under bf16 autocast raises in the backward of a
    torch.func.jvp ("expected input and grad types to match, or input to be at::Half and grad
    to be at::Float"), while the same ops written out run, with the same O(N^2) memory."""
    if dropout_p or enable_gqa:
        raise NotImplementedError("math_attention: no dropout or GQA in this example")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query * scale) @ key.transpose(-2, -1)
    n_q, n_k = scores.shape[-2:]
    if is_causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    return torch.softmax(scores, dim=-1).to(value.dtype) @ value


@contextlib.contextmanager
def _math_sdpa():
    """Route F.scaled_dot_product_attention to `math_attention`."""
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = math_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous


@contextlib.contextmanager
def _fast_precision():
    """jvp_attention's "fast" precision (one 16-bit rounding per product, as FlashAttention
    does) inside the block; the default "accurate" mode splits operands into hi + lo."""
    with jvp_attention.precision("fast"), jvp_attention.sdpa(strict=True):
        yield


def attention_context(attention: str):
    """A context in which the model's SDPA calls run on `attention`, one of ATTENTIONS:
    "jvp_attention" (our kernels, default precision), "jvp_attention_fast" (our kernels in
    "fast" precision), "math" (PyTorch's math path, written out: see `math_attention`),
    "jvp_flash_attention"."""
    if attention == "jvp_attention":
        return jvp_attention.sdpa(strict=True)
    if attention == "jvp_attention_fast":
        return _fast_precision()
    if attention == "math":
        return _math_sdpa()
    if attention == "jvp_flash_attention":
        return _jvp_flash_attention_sdpa()
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")


ATTENTION_RANGE = "attention"


@contextlib.contextmanager
def labelled_attention():
    """Run every call of the current `F.scaled_dot_product_attention` (enter this inside
    `attention_context`) in a `torch.profiler.record_function(ATTENTION_RANGE)` range, so a
    profile can tell the attention's forward and JVP apart from the rest of the step
    (`attention_profile` also finds its backward from these ranges)."""
    inner = F.scaled_dot_product_attention

    def labelled(*args, **kwargs):
        with torch.profiler.record_function(ATTENTION_RANGE):
            return inner(*args, **kwargs)

    F.scaled_dot_product_attention = labelled
    try:
        yield
    finally:
        F.scaled_dot_product_attention = inner


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainConfig:
    steps: int = 400
    batch_size: int = 128  # global: split over the ranks
    lr: float = 1e-3
    warmup: int = 50
    seed: int = 0
    ratio: float = 0.25  # fraction of the batch with r != t
    adaptive_p: float = 1.0
    dtype: str = "bfloat16"  # autocast dtype on CUDA; "float32" for none
    attention: str = "jvp_attention"


def autocast(device: torch.device, dtype: str):
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def make_optimizer(model: nn.Module, config: TrainConfig):
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, config.warmup)))
    return optimizer, schedule


def training_step(model: nn.Module, optimizer, batch, config: TrainConfig,
                  device: torch.device, *, label_attention: bool = False,
                  stamps: list[float] | None = None) -> torch.Tensor:
    """One optimisation step on `batch` (this rank's part). Returns the per-sample errors.
    `label_attention` puts each SDPA call in a profiler range (see `labelled_attention`).
    `stamps`, if given, receives `time.perf_counter()` at the start and as the forward, the
    backward and the optimizer return to Python (the host's side; the GPU may lag)."""
    mark = stamps.append if stamps is not None else (lambda _: None)
    mark(time.perf_counter())
    x, noise, t, r = (b.to(device, non_blocking=True) for b in batch)
    labels = labelled_attention() if label_attention else contextlib.nullcontext()
    with attention_context(config.attention), labels, autocast(device, config.dtype):
        loss, error = model(x, noise, t, r)
    mark(time.perf_counter())
    loss.backward()
    mark(time.perf_counter())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark(time.perf_counter())
    return error


def rank_slice(batch, rank: int, world: int):
    n = batch[0].shape[0]
    if n % world:
        raise ValueError(f"global batch {n} does not split over {world} ranks")
    per_rank = n // world
    return tuple(b[rank * per_rank:(rank + 1) * per_rank] for b in batch)


def train(model: nn.Module, dit: DiTConfig, config: TrainConfig, device: torch.device, *,
          rank: int = 0, world: int = 1, every: int = 0,
          callback: Callable[[int, list[float]], None] | None = None) -> dict:
    """Train `model` (a MeanFlow, or a DDP around one) for `config.steps` global steps.

    Returns {"loss": the mean squared error of each global step, averaged over the whole
    global batch (over all ranks), "seconds": wall time}. `callback(step, losses)` runs every
    `every` steps and after the last.
    """
    optimizer, schedule = make_optimizer(model, config)
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    for step in range(config.steps):
        batch = rank_slice(global_batch(step, config.batch_size, dit.image_size, config.seed,
                                        config.ratio), rank, world)
        error = training_step(model, optimizer, batch, config, device)
        schedule.step()
        loss = error.mean()
        if world > 1:
            loss = loss.clone()
            dist.all_reduce(loss)
            loss = loss / world
        losses.append(loss)
        if callback is not None and ((every and (step + 1) % every == 0)
                                     or step + 1 == config.steps):
            callback(step + 1, [x.item() for x in losses])
    history = [x.item() for x in losses]
    return {"loss": history, "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------------------------------
# The step-time benchmark: the same training step on three attentions
# ---------------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# torch.compile modes the benchmark takes ("eager" = not compiled). Compiled, the whole
# training forward (the DiT under torch.func.jvp, and the loss) is one compiled region;
# the backward runs AOTAutograd's compiled backward, and Adam stays eager.
COMPILE_MODES = ("eager", "default", "reduce-overhead", "max-autotune")

# Operators through which a compiled graph calls our kernels (eager calls skip them).
OUR_OPERATORS = "jvp_attention::"
# Our kernels by name, forward or backward: where a compiled graph launches them itself
# (chapter 7's traced twins), no operator of ours is in the profile, only the kernels, which
# Inductor names after the Triton function with a number appended.
OUR_KERNELS = {"_attention_forward_kernel": "forward",
               "_attention_backward_dq_kernel": "backward",
               "_attention_backward_dkdv_kernel": "backward",
               "_row_statistics_kernel": "backward"}
BACKWARD_NODE = "autograd::engine::evaluate_function: "


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def attention_profile(events, on_cuda: bool) -> dict:
    """The attention's share of one profiled training step, from `torch.profiler` events.

    Time is CUDA kernel time on CUDA (a counted event's is that of the kernels launched by it
    and the operators inside it; the step's total is that of all kernels) and, as a stand-in
    so that the code runs on CPU, CPU time elsewhere (the step's total is the sum of every
    event's self time).

    What counts as attention:

    - forward and JVP: the `ATTENTION_RANGE` ranges put round each SDPA call by
      `labelled_attention` (eager only: torch.compile drops record_function ranges);
    - backward: the autograd nodes created inside those ranges. A node's backward runs as
      "autograd::engine::evaluate_function: <node>", whose `sequence_nr` (and `fwd_thread`)
      is the number the node got when the forward created it. A forward op's event carries
      the thread's next sequence number whether or not the op creates a node, so an op that
      creates none shares the number of the next node, which may be created after the range
      (seen: `is_same_size` inside `_make_dual`, then the `transpose` after attention). Hence
      the nodes of a range are those numbered from the first number seen inside it up to,
      not including, the first number seen after it on the same thread. Checked on CPU under
      torch.func.jvp: our kernels' `_FusedTangentBackward` and the math path's
      Bmm/Softmax/... backward nodes are found this way, and no node from outside;
    - our kernels' custom operators (`jvp_attention::forward_jvp`, `jvp_attention::backward`,
      ...), which a compiled graph calls where it keeps them opaque;
    - on CUDA, our kernels by name (`OUR_KERNELS`) wherever else they run: a compiled graph
      that launches them itself has no operator of ours around them.

    Events nested in another counted event are not counted again.

    Returns {"attention_ms", "attention_fwd_ms", "attention_bwd_ms", "attention_share",
    "attention_basis", "attention_backward_nodes": {node name: count}}, or with
    "attention_note" (why) instead of the share when forward or backward cannot be attributed.
    """
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    ranges = [e for e in cpu if e.name == ATTENTION_RANGE
              and not any(a.name == ATTENTION_RANGE for a in _ancestors(e))]
    # The outermost range each event sits in, if any.
    owner = {}
    for event in cpu:
        for a in (event, *_ancestors(event)):
            if a.name == ATTENTION_RANGE:
                owner[id(event)] = a
    by_thread: dict[int, list] = {}
    for event in sorted(cpu, key=lambda e: e.time_range.start):
        by_thread.setdefault(event.thread, []).append(event)
    spans: dict[int, list[tuple[int, float]]] = {}  # forward thread -> [first, end) numbers
    for r in ranges:
        inside = [e.sequence_nr for e in cpu if e.sequence_nr >= 0 and owner.get(id(e)) is r]
        if not inside:
            continue
        around = {id(a) for a in _ancestors(r)}
        after = (e.sequence_nr for e in by_thread[r.thread]
                 if e.time_range.start >= r.time_range.start and e.sequence_nr >= 0
                 and owner.get(id(e)) is not r and id(e) not in around)
        spans.setdefault(r.thread, []).append((min(inside), next(after, math.inf)))

    def linked(event) -> bool:
        return (event.name.startswith(BACKWARD_NODE) and event.sequence_nr >= 0
                and any(lo <= event.sequence_nr < hi
                        for lo, hi in spans.get(event.fwd_thread, ())))

    counted = ranges + [e for e in cpu if linked(e) or e.name.startswith(OUR_OPERATORS)]
    ids = {id(e) for e in counted}
    roots = [e for e in counted if not any(id(a) in ids for a in _ancestors(e))]
    # Our kernels outside every counted event (microseconds, forward and backward).
    loose = {"forward": 0.0, "backward": 0.0}
    if on_cuda:
        for event in cpu:
            if id(event) in ids or any(id(a) in ids for a in _ancestors(event)):
                continue
            for k in event.kernels:
                part = next((part for name, part in OUR_KERNELS.items()
                             if k.name.startswith(name)), None)
                if part is not None:
                    loose[part] += k.duration
    if not roots and not any(loose.values()):
        return {"attention_note": "not attributed: no attention ranges, jvp_attention "
                "operators or kernels in the profile (torch.compile drops record_function "
                "ranges and fuses the math path's attention into its own kernels)"}
    spent = {id(e): 0.0 for e in roots}  # microseconds per counted root
    if on_cuda:
        # Each operator lists the kernels it launched (`FunctionEvent.kernels`, which the
        # profiler fills from the correlation ids in every torch this runs on), as PyTorch's
        # own tables count them. A record_function range lists its device-side copy there
        # ("gpu_user_annotation") under its own name: that is no kernel.
        total = 0.0
        for event in cpu:
            launched = sum(k.duration for k in event.kernels if k.name != event.name)
            total += launched
            for a in (event, *_ancestors(event)):
                if launched and id(a) in spent:
                    spent[id(a)] += launched
                    break
    else:
        total = sum(e.self_cpu_time_total for e in cpu)
        spent = {id(e): e.cpu_time_total for e in roots}

    def backward(event) -> bool:
        return (event.name.startswith(BACKWARD_NODE)
                or (event.name.startswith(OUR_OPERATORS) and "backward" in event.name))

    bwd = sum(spent[id(e)] for e in roots if backward(e)) + loose["backward"]
    fwd = sum(spent[id(e)] for e in roots if not backward(e)) + loose["forward"]
    nodes: dict[str, int] = {}  # which backward nodes were counted, for the record
    for event in roots:
        if event.name.startswith(BACKWARD_NODE):
            name = event.name[len(BACKWARD_NODE):]
            nodes[name] = nodes.get(name, 0) + 1
    found = {"attention_fwd_ms": fwd / 1e3, "attention_bwd_ms": bwd / 1e3,
             "attention_backward_nodes": nodes}
    if fwd <= 0 or bwd <= 0 or total <= 0:
        missing = " and ".join(part for part, t in (("forward", fwd), ("backward", bwd))
                               if t <= 0)
        return {**found, "attention_note": f"not attributed: no {missing} time found "
                "(under CUDA graphs the replayed kernels belong to no operator)"}
    return {**found, "attention_ms": (fwd + bwd) / 1e3, "attention_share": (fwd + bwd) / total,
            "attention_basis": "cuda kernel time" if on_cuda else "cpu time"}


def profile_step(step: Callable[[], object], device: torch.device):
    """Run `step` once under torch.profiler (CPU, and CUDA on a GPU); returns its events."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        with torch.profiler.record_function("meanflow step"):  # Python time counts on CPU
            step()
        synchronize(device)
    return profiler.events()


def benchmark_step(dit: DiTConfig, batch_size: int, attention: str, device: torch.device,
                   dtype: str = "bfloat16", warmup: int = 2, repeats: int = 5,
                   compile_mode: str = "eager", profile: bool = True) -> dict:
    """Median time and peak memory of one training step (forward + JVP, backward, Adam),
    eager or with the training forward under `torch.compile(mode=compile_mode)`; then, if
    `profile`, one more step under torch.profiler for the attention's share of it
    (`attention_profile`).

    Failures (out of memory, an attention that refuses the shapes, a compilation error) are
    recorded, not raised.
    """
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {compile_mode!r}")
    result = {"attention": attention, "compile": compile_mode, "tokens": dit.tokens,
              "batch": batch_size, "image_size": dit.image_size, "dtype": dtype}
    config = TrainConfig(batch_size=batch_size, dtype=dtype, attention=attention, warmup=1)
    compiled = compile_mode != "eager"
    if compiled:
        # Compilation, then (reduce-overhead) CUDA-graph warm-up and recording, take the
        # first calls; dynamo's caches start empty so that no earlier row's graphs count
        # against its recompile limit.
        warmup = max(warmup, 3)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    model = optimizer = run = None
    try:
        torch.manual_seed(0)
        model = MeanFlow(dit).to(device)
        optimizer, _ = make_optimizer(model, config)
        run = torch.compile(model, mode=compile_mode) if compiled else model
        batch = tuple(b.to(device) for b in global_batch(0, batch_size, dit.image_size))
        # CUDA graphs allocate their private memory pool while recording, in the warm-up;
        # replays allocate nothing, so a peak taken after the warm-up would miss the pool.
        peak_from_warmup = compile_mode == "reduce-overhead" and device.type == "cuda"
        if peak_from_warmup:
            torch.cuda.reset_peak_memory_stats(device)
            result["peak_memory_basis"] = "warm-up included (the CUDA graphs' memory pool)"
        for i in range(warmup):
            start = time.perf_counter()
            training_step(run, optimizer, batch, config, device)
            synchronize(device)
            if i == 0:
                result["first_step_s"] = time.perf_counter() - start
        if device.type == "cuda" and not peak_from_warmup:
            torch.cuda.reset_peak_memory_stats(device)
        times, phases = [], []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            stamps: list[float] = []
            training_step(run, optimizer, batch, config, device, stamps=stamps)
            synchronize(device)
            times.append(time.perf_counter() - start)
            phases.append([b - a for a, b in zip(stamps, stamps[1:], strict=False)])
        result["step_ms"] = 1e3 * statistics.median(times)
        # Host time per phase: when the three add up to about the step, the step waits on
        # Python, not on the GPU (HOST_PHASES says what each is).
        for i, name in enumerate(HOST_PHASES):
            result[name] = 1e3 * statistics.median(phase[i] for phase in phases)
        if device.type == "cuda":
            result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        if compiled:  # one graph and no breaks: the whole forward + JVP + loss was compiled
            counters = torch._dynamo.utils.counters
            result["graphs"] = counters["stats"]["unique_graphs"]
            result["graph_breaks"] = sum(counters["graph_break"].values())
        if profile:
            # Eager: the SDPA calls get profiler ranges for this step only. Compiled: not
            # (dynamo drops the ranges, and a new SDPA function would mean a recompilation).
            one_step = functools.partial(training_step, run, optimizer, batch, config, device,
                                         label_attention=not compiled)
            try:
                result.update(attention_profile(profile_step(one_step, device),
                                                device.type == "cuda"))
            except Exception as error:  # the timing stands; say why there is no share
                result["attention_note"] = (f"profiling failed: {type(error).__name__}: "
                                            f"{error}".splitlines()[0][:300])
    except Exception as error:  # recorded in the table: OOM, or a backend that refuses
        result["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    finally:
        del model, optimizer, run
        if compiled:
            torch._dynamo.reset()  # frees the compiled graphs (and CUDA graphs' memory pools)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


# A row's host time per phase of the timed steps (medians, ms): until the training forward
# (the DiT under torch.func.jvp, and the loss) returns, then `loss.backward()`, then Adam's
# step and zero_grad; measured on the host without waiting for the GPU.
HOST_PHASES = ("host_forward_ms", "host_backward_ms", "host_optimizer_ms")

BENCH_IMAGE_SIZES = (32, 64, 128)  # with patch 2: 256, 1024, 4096 tokens


def benchmark(dit: DiTConfig, batch_size: int | dict[int, int], device: torch.device,
              dtype: str = "bfloat16", image_sizes=BENCH_IMAGE_SIZES, warmup: int = 2,
              repeats: int = 5, attentions=ATTENTIONS, compile_modes=("eager",),
              profile: bool = True,
              on_row: Callable[[list[dict]], None] | None = None,
              compiled_attentions=None, previous: list[dict] = (),
              zero_tangents=("pytorch",)) -> list[dict]:
    """`benchmark_step` for every image size, compile mode and attention, and each of
    `zero_tangents` ("pytorch": PyTorch's kernels for forward AD's zero tangents; "lean":
    `jvp_attention.lean_zero_tangents`, chapter 13), one after the other for each row so
    that a drift in the machine's speed falls on both; jvp-flash-attention is skipped with
    a note when it does not import.

    `batch_size` is one batch for every size, or a batch per image size (so that the math
    path's O(N^2) memory fits at the largest). `on_row(rows)` runs after each row, e.g. to
    save what is measured so far. `compiled_attentions` (default: all of `attentions`) are
    the attentions that also run in the compiled modes: compiling a large model takes
    minutes per row. Rows of `previous` (a run that was cut short) that were measured or
    failed at the same tokens, batch, compile mode and attention are kept, not run again;
    so are its rows outside this run's plan (other sizes, say), in their place in the table."""
    done = {_row_key(row): row for row in previous if "step_ms" in row or "error" in row}
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        rows.sort(key=_row_order)
        print(format_row(row), flush=True)
        if on_row is not None:
            on_row(rows)

    for size in image_sizes:
        config = replace(dit, image_size=size)
        batch = batch_size[size] if isinstance(batch_size, dict) else batch_size
        for compile_mode in compile_modes:
            for attention in attentions:
                if compile_mode != "eager" and attention not in (compiled_attentions
                                                                 or attentions):
                    continue
                missing = (jvp_flash_attention_available()
                           if attention == "jvp_flash_attention" else None)
                for zeros in zero_tangents:
                    head = {"attention": attention, "compile": compile_mode,
                            "tokens": config.tokens, "batch": batch, "zero_tangents": zeros}
                    if _row_key(head) in done:
                        add({**done[_row_key(head)], "zero_tangents": zeros, "resumed": True})
                    elif missing is not None:
                        add({**head, "image_size": size, "dtype": dtype,
                             "skipped": f"not importable ({missing})"})
                    else:
                        with zero_tangents_setting(zeros):
                            row = benchmark_step(config, batch, attention, device, dtype,
                                                 warmup, repeats, compile_mode, profile)
                        add({**row, "zero_tangents": zeros})
    planned = {_row_key(row) for row in rows}
    for key, row in done.items():
        if key not in planned:
            add({**row, "resumed": True})
    return rows


# Forward AD's zero tangents: PyTorch's kernels, or jvp_attention.lean_zero_tangents'
# (chapter 13). A row without the key (runs before 2026-12-05) used PyTorch's.
ZERO_TANGENTS = ("pytorch", "lean")


def _zero_tangents(row: dict) -> str:
    return row.get("zero_tangents", "pytorch")


@contextlib.contextmanager
def zero_tangents_setting(zeros: str):
    """Forward AD's zero tangents as `zeros` says ("lean": `jvp_attention.lean_zero_tangents`
    on), with the setting in torch.compile's cache keys. The lean kernels change the graph a
    step traces below what those caches key on: torch 2.11's AOTAutograd cache served the
    lean rows the graphs compiled with PyTorch's zero tangents (they compiled in seconds
    after their PyTorch rows' minutes, with as many GEMMs)."""
    tag = f"{torch.compiler.config.cache_key_tag}|zero_tangents={zeros}"
    with jvp_attention.lean_zero_tangents(zeros == "lean"), \
            torch.compiler.config.patch(cache_key_tag=tag):
        yield


def _row_key(row: dict) -> tuple:
    return (row["tokens"], row["batch"], row.get("compile", "eager"), row["attention"],
            _zero_tangents(row))


def _row_order(row: dict) -> tuple:
    """Tokens, then compile mode, then attention, then zero tangents, each in the order the
    benchmark runs them."""
    compile_mode, attention = row.get("compile", "eager"), row["attention"]
    return (row["tokens"], row["batch"],
            COMPILE_MODES.index(compile_mode) if compile_mode in COMPILE_MODES else 99,
            ATTENTIONS.index(attention) if attention in ATTENTIONS else 99,
            ZERO_TANGENTS.index(_zero_tangents(row)))


def format_row(row: dict) -> str:
    head = (f"{row['tokens']:>6} tokens  batch {row['batch']:>3}  "
            f"{row.get('compile', 'eager'):<15} {row['attention']:<20} "
            f"{_zero_tangents(row):<7}")
    if "step_ms" not in row:
        return f"{head} {row.get('error') or row.get('skipped')}"
    memory = row.get("peak_memory_gb")
    memory = f"{memory:7.2f} GB" if memory is not None else "      n/a"
    if "attention_share" in row:
        share = (f"attention {row['attention_ms']:8.1f} ms = {100 * row['attention_share']:4.1f}%"
                 f" ({row['attention_basis']})")
    else:
        share = row.get("attention_note", "")
    return f"{head} {row['step_ms']:9.1f} ms {memory}  {share}"


def summary_table(rows: list[dict]) -> str:
    """Markdown table: step time, peak memory and the attention's share of the step per token
    count and compile mode, and the speed-up over the math path in the same mode."""
    by_key = {(r["tokens"], r.get("compile", "eager"), r["attention"], _zero_tangents(r)): r
              for r in rows}
    modes = [m for m in COMPILE_MODES if any(r.get("compile", "eager") == m for r in rows)]
    lines = ["| tokens | compile | attention | zero tangents | step (ms) | peak memory (GB) "
             "| math / this | attention (ms) | attention share |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for tokens in sorted({r["tokens"] for r in rows}):
        for mode in modes:
            for attention, zeros in itertools.product(ATTENTIONS, ZERO_TANGENTS):
                row = by_key.get((tokens, mode, attention, zeros))
                if row is None:
                    continue
                math_row = by_key.get((tokens, mode, "math", zeros), {})
                head = f"| {tokens} | {mode} | {attention} | {zeros} |"
                if "step_ms" not in row:
                    lines.append(f"{head} {row.get('error') or row.get('skipped')} | | | | |")
                    continue
                memory = row.get("peak_memory_gb")
                speedup = (f"{math_row['step_ms'] / row['step_ms']:.2f}x"
                           if "step_ms" in math_row else "")
                share = (f"{row['attention_ms']:.1f} | {100 * row['attention_share']:.0f}%"
                         if "attention_share" in row else " | n/a")
                lines.append(f"{head} {row['step_ms']:.1f} | "
                             f"{'' if memory is None else f'{memory:.2f}'} | {speedup} | "
                             f"{share} |")
    return "\n".join(lines)


def environment() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "jvp_attention": jvp_attention.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0")
    with contextlib.suppress(ImportError, AttributeError):
        info["jvp_attention_precision"] = jvp_attention.get_precision()
    lean = jvp_attention.zero_tangents.lean_zero_tangents_enabled()
    info["zero_tangents"] = "lean" if lean else "pytorch"  # forward AD's (chapter 13)
    # Where the autograd engine runs the backward on CUDA (--backward-thread).
    info["backward_thread"] = "device" if torch._C._is_multithreading_enabled() else "calling"
    return info


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Data parallel: 2 ranks give the loss trajectory of 1 rank with the same global batch
# ---------------------------------------------------------------------------------------------

# PyTorch 2.11's FSDP2 frees a block's gathered weights after the block's forward and, with
# the forward inside `torch.func.jvp`, does not gather them again before the block's backward
# ("setStorage: ... out of bounds for storage of size 0", pytorch/pytorch#182641, seen on
# 2.11; 2.13 gathers them). Before 2.13 the blocks keep them gathered from the forward to the
# backward: ZeRO-2's memory rather than ZeRO-3's, the same gradients.
FSDP_REGATHERS_UNDER_JVP = (2, 13)


def shard_fsdp2(model: MeanFlow) -> nn.Module:
    """FSDP2: each DiT block, then the rest of the model, as one `fully_shard` unit; blocks
    reshard after their forward where this PyTorch gathers them again for a backward taken
    through `torch.func.jvp` (FSDP_REGATHERS_UNDER_JVP)."""
    from torch.distributed.fsdp import fully_shard

    reshard = torch.__version__ >= FSDP_REGATHERS_UNDER_JVP
    if not reshard and int(os.environ.get("RANK", 0)) == 0:
        print(f"torch {torch.__version__}: FSDP2 blocks stay gathered from forward to backward "
              "(reshard_after_forward=False; pytorch/pytorch#182641)", flush=True)
    for block in model.net.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    return fully_shard(model)


# NVLink multicast (NCCL's NVLS algorithms, torch's symmetric memory) fails to initialise on
# some multi-GPU hosts, e.g. containers without access to the NVLink fabric; the checks below
# need none of it. `--ddp` and `--fsdp` turn it off unless asked not to (`--nvlink-multicast`)
# or the variables are already set.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def disable_nvlink_multicast() -> None:
    """Set MULTICAST_OFF in this process's environment (where not already set). Call it
    before any process group, and so any NCCL communicator, exists."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


def ddp_check(dit: DiTConfig, config: TrainConfig, out: Path, rtol: float,
              wrapper: str = "ddp") -> dict | None:
    """Under torchrun: train data-parallel over all ranks (`wrapper` "ddp":
    DistributedDataParallel, or "fsdp": FSDP2's `fully_shard`), then (rank 0) the same run in
    one process with the whole global batch, and compare the per-step losses. Rank 0 writes
    `out` and returns the result; other ranks return None."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        torch.manual_seed(config.seed)
        model = MeanFlow(dit, config.adaptive_p).to(device)
        if wrapper == "fsdp":
            model = shard_fsdp2(model)
        else:
            model = DistributedDataParallel(
                model, device_ids=[local_rank] if device.type == "cuda" else None)
        parallel = train(model, dit, config, device, rank=rank, world=world)
        dist.barrier()
        result = None
        if rank == 0:
            torch.manual_seed(config.seed)
            single = train(MeanFlow(dit, config.adaptive_p).to(device), dit, config, device)
            diffs = [abs(a - b) / abs(b) for a, b in zip(parallel["loss"], single["loss"],
                                                         strict=True)]
            result = {
                "wrapper": wrapper,
                "world_size": world,
                "backend": dist.get_backend(),
                "model": asdict(dit),
                "train": asdict(config),
                "environment": environment(),
                "loss_ddp": parallel["loss"],
                "loss_single": single["loss"],
                "seconds_ddp": parallel["seconds"],
                "seconds_single": single["seconds"],
                "first_step_rel_diff": diffs[0],
                "max_rel_diff": max(diffs),
                "rtol": rtol,
                "passed": max(diffs) <= rtol,
            }
            write_json(out, result)
            print(f"{wrapper.upper()} over {world} ranks vs 1 process, {config.steps} steps, global batch "
                  f"{config.batch_size}: first-step relative difference "
                  f"{diffs[0]:.1e}, largest {max(diffs):.1e} (tolerance {rtol:.0e}) -> "
                  f"{'passed' if result['passed'] else 'FAILED'}; "
                  f"{parallel['seconds']:.1f} s vs {single['seconds']:.1f} s; wrote {out}",
                  flush=True)
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--ddp", action="store_true",
                      help="data-parallel check (run under torchrun): DDP vs one process")
    mode.add_argument("--fsdp", action="store_true",
                      help="the same check with FSDP2 (fully_shard per block) instead of DDP")
    mode.add_argument("--bench", action="store_true",
                      help="step time, peak memory and the attention's share of the step on "
                           "each attention at 256, 1024 and 4096 tokens (image sizes 32, 64, "
                           "128 with patch 2)")
    model = parser.add_argument_group(
        "model", "defaults: image 32, patch 2, width 256, depth 6, heads 4, or the preset's; "
                 "a flag given overrides the preset")
    model.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="a named model size: dit-b2 = DiT-B/2 (width 768, depth 12, "
                            "heads 12, patch 2; about 130 M parameters)")
    model.add_argument("--image-size", type=int, default=None)
    model.add_argument("--patch-size", type=int, default=None)
    model.add_argument("--width", type=int, default=None)
    model.add_argument("--depth", type=int, default=None)
    model.add_argument("--heads", type=int, default=None)
    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=int, default=400)
    run.add_argument("--batch-size", type=int, default=128, help="global batch")
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--warmup", type=int, default=50)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                     help="autocast dtype (default: bfloat16 on CUDA, float32 on CPU)")
    run.add_argument("--attention", choices=ATTENTIONS, default="jvp_attention")
    run.add_argument("--rtol", type=float, default=None,
                     help="--ddp: largest relative loss difference allowed (default 2e-2 in "
                          "bfloat16/float16, 1e-4 in float32)")
    run.add_argument("--bench-sizes", type=int, nargs="+", default=list(BENCH_IMAGE_SIZES))
    run.add_argument("--batch-per-size", nargs="+", default=[], metavar="SIZE=BATCH",
                     help="--bench: another batch at these image sizes, e.g. 128=2 keeps "
                          "the math path's O(N^2) memory in bounds at 4096 tokens")
    run.add_argument("--repeats", type=int, default=5)
    run.add_argument("--zero-tangents", nargs="+", choices=ZERO_TANGENTS, default=["pytorch"],
                     help="forward AD's zero tangents: PyTorch's kernels, or "
                          "jvp_attention.lean_zero_tangents (chapter 13: the same numbers, "
                          "less host time and no products of zeros), for every attention; "
                          "--bench runs each row with each given, one after the other, and "
                          "records it in the row")
    run.add_argument("--resume", type=Path, default=None, metavar="JSON",
                     help="--bench: keep the rows this earlier (cut) run measured or saw "
                          "fail, and run only the rest")
    run.add_argument("--compile-attentions", nargs="+", choices=ATTENTIONS, default=None,
                     help="--bench: only these attentions run compiled (default: all)")
    run.add_argument("--compile", nargs="+", choices=COMPILE_MODES, default=["eager"],
                     help="--bench: run the step eager and/or with the training forward "
                          "(DiT under torch.func.jvp, and the loss) under torch.compile in "
                          "these modes, e.g. --compile eager default reduce-overhead")
    run.add_argument("--backward-thread", choices=("device", "calling"), default="device",
                     help="where PyTorch's autograd engine runs the backward on CUDA: its "
                          "device thread (PyTorch's default) or the thread that calls "
                          ".backward() (torch.autograd.set_multithreading_enabled(False)), "
                          "which saves host time in a single-GPU eager loop (chapter 8)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--nvlink-multicast", action="store_true",
                        help="--ddp/--fsdp: leave NVLink multicast as NCCL and torch choose "
                             "(by default it is turned off: NCCL_NVLS_ENABLE=0, "
                             "TORCH_SYMM_MEM_DISABLE_MULTICAST=1, unless already set)")
    return parser.parse_args(argv)


def batch_per_size(pairs: list[str]) -> dict[int, int]:
    """{image size: batch} from SIZE=BATCH words."""
    batches = {}
    for pair in pairs:
        size, _, batch = pair.partition("=")
        if not (size.isdigit() and batch.isdigit()):
            raise SystemExit(f"--batch-per-size takes SIZE=BATCH (e.g. 128=2), got {pair!r}")
        batches[int(size)] = int(batch)
    return batches


def model_config(args: argparse.Namespace) -> DiTConfig:
    """The DiT of the command line: the preset (or the default DiTConfig), with the model
    flags that were given on top."""
    base = PRESETS[args.preset] if args.preset else DiTConfig()
    given = {field: getattr(args, field) for field in
             ("image_size", "patch_size", "width", "depth", "heads")
             if getattr(args, field) is not None}
    return replace(base, **given)


def main(argv=None) -> int:
    args = parse_args(argv)
    with torch.autograd.set_multithreading_enabled(args.backward_thread == "device"):
        return run_command(args, argv)


def run_command(args: argparse.Namespace, argv) -> int:
    """What `main` runs, with the autograd engine's threads set as asked."""
    if not args.bench:
        if len(args.zero_tangents) > 1:
            raise SystemExit("--zero-tangents takes one setting outside --bench, which runs "
                             "each row with each")
        jvp_attention.lean_zero_tangents(args.zero_tangents == ["lean"])
    cuda = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if dtype == "float32":  # true fp32 everywhere, so fp32 comparisons can be tight
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dit = model_config(args)
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                         warmup=args.warmup, seed=args.seed, dtype=dtype,
                         attention=args.attention)
    tag = "h200" if cuda and "H200" in torch.cuda.get_device_name() else ("cuda" if cuda
                                                                           else "cpu")
    if args.ddp or args.fsdp:
        wrapper = "fsdp" if args.fsdp else "ddp"
        world = int(os.environ.get("WORLD_SIZE", "0"))
        if world < 1:
            raise SystemExit(f"--{wrapper} runs under torchrun: torchrun --nproc_per_node=2 "
                             f"examples/meanflow_dit.py --{wrapper}")
        if not args.nvlink_multicast:
            disable_nvlink_multicast()
        rtol = args.rtol if args.rtol is not None else (1e-4 if dtype == "float32" else 2e-2)
        out = args.out or RESULTS / f"{wrapper}_{tag}x{world}.json"
        result = ddp_check(dit, config, out, rtol, wrapper)
        return 0 if result is None or result["passed"] else 1
    device = torch.device("cuda" if cuda else "cpu")
    parameters = parameter_count(dit)
    print(f"DiT{f' ({args.preset})' if args.preset else ''}: width {dit.width}, depth "
          f"{dit.depth}, heads {dit.heads}, patch {dit.patch_size}: {parameters:,} "
          f"parameters ({parameters / 1e6:.1f} M)", flush=True)
    if args.bench:
        batches = {size: args.batch_size for size in args.bench_sizes}
        batches |= batch_per_size(args.batch_per_size)
        out = args.out or RESULTS / f"bench_{tag}.json"
        argv = sys.argv[1:] if argv is None else list(argv)
        header = {"model": asdict(dit), "preset": args.preset, "parameters": parameters,
                  "argv": argv,
                  "command": shlex.join(["python", "examples/meanflow_dit.py", *argv]),
                  # each row says which zero tangents it ran with (`zero_tangents`)
                  "environment": {key: value for key, value in environment().items()
                                  if key != "zero_tangents"}}

        previous = json.loads(args.resume.read_text()) if args.resume else {"rows": ()}
        if args.resume:  # the rows kept from it were measured by these
            header["earlier_commands"] = [*previous.get("earlier_commands", ()),
                                          previous["command"]]

        def save(rows: list[dict], complete: bool = False) -> None:  # after every row
            write_json(out, {**header, "complete": complete, "rows": rows})

        rows = benchmark(dit, batches, device, dtype, tuple(args.bench_sizes),
                         repeats=args.repeats, compile_modes=tuple(args.compile), on_row=save,
                         compiled_attentions=args.compile_attentions,
                         previous=previous["rows"], zero_tangents=tuple(args.zero_tangents))
        save(rows, complete=True)
        print(summary_table(rows))
        print(f"wrote {out}")
        return 0
    torch.manual_seed(config.seed)
    model = MeanFlow(dit, config.adaptive_p).to(device)

    def report(step: int, losses: list[float]) -> None:
        recent = losses[-min(len(losses), 50):]
        print(f"step {step:5d}  loss (mean of last {len(recent)}) {sum(recent) / len(recent):.4f}",
              flush=True)

    history = train(model, dit, config, device, every=max(1, config.steps // 10),
                    callback=report)
    out = args.out or RESULTS / f"train_{tag}.json"
    write_json(out, {"model": asdict(dit), "train": asdict(config), "environment": environment(),
                     **history})
    print(f"{config.steps} steps in {history['seconds']:.1f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
