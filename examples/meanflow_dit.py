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
    torchrun --nproc_per_node=2 examples/meanflow_dit.py --ddp       # 2 ranks == 1 rank?
    torchrun --nproc_per_node=2 examples/meanflow_dit.py --fsdp      # the same with FSDP2

Each writes a JSON file (see --out). examples/README.md has the commands and the
measured results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
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
                  device: torch.device) -> torch.Tensor:
    """One optimisation step on `batch` (this rank's part). Returns the per-sample errors."""
    x, noise, t, r = (b.to(device, non_blocking=True) for b in batch)
    with attention_context(config.attention), autocast(device, config.dtype):
        loss, error = model(x, noise, t, r)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
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


def benchmark_step(dit: DiTConfig, batch_size: int, attention: str, device: torch.device,
                   dtype: str = "bfloat16", warmup: int = 2, repeats: int = 5) -> dict:
    """Median time and peak memory of one training step (forward + JVP, backward, Adam).

    Failures (out of memory, an attention that refuses the shapes) are recorded, not raised.
    """
    result = {"attention": attention, "tokens": dit.tokens, "batch": batch_size,
              "image_size": dit.image_size, "dtype": dtype}
    config = TrainConfig(batch_size=batch_size, dtype=dtype, attention=attention, warmup=1)
    model = optimizer = None
    try:
        torch.manual_seed(0)
        model = MeanFlow(dit).to(device)
        optimizer, _ = make_optimizer(model, config)
        batch = tuple(b.to(device) for b in global_batch(0, batch_size, dit.image_size))
        for _ in range(warmup):
            training_step(model, optimizer, batch, config, device)
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            training_step(model, optimizer, batch, config, device)
            synchronize(device)
            times.append(time.perf_counter() - start)
        result["step_ms"] = 1e3 * statistics.median(times)
        if device.type == "cuda":
            result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    except Exception as error:  # recorded in the table: OOM, or a backend that refuses
        message = f"{type(error).__name__}: {error}"
        result["error"] = message.splitlines()[0][:300]
    finally:
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


BENCH_IMAGE_SIZES = (32, 64, 128)  # with patch 2: 256, 1024, 4096 tokens


def benchmark(dit: DiTConfig, batch_size: int, device: torch.device, dtype: str = "bfloat16",
              image_sizes=BENCH_IMAGE_SIZES, warmup: int = 2, repeats: int = 5,
              attentions=ATTENTIONS) -> list[dict]:
    """`benchmark_step` for every attention and image size; jvp-flash-attention is skipped
    with a note when it does not import."""
    rows = []
    for size in image_sizes:
        config = replace(dit, image_size=size)
        for attention in attentions:
            if attention == "jvp_flash_attention":
                missing = jvp_flash_attention_available()
                if missing is not None:
                    rows.append({"attention": attention, "tokens": config.tokens,
                                 "batch": batch_size, "image_size": size, "dtype": dtype,
                                 "skipped": f"not importable ({missing})"})
                    continue
            rows.append(benchmark_step(config, batch_size, attention, device, dtype, warmup,
                                       repeats))
            print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row: dict) -> str:
    head = f"{row['tokens']:>6} tokens  batch {row['batch']:>3}  {row['attention']:<20}"
    if "step_ms" in row:
        memory = row.get("peak_memory_gb")
        memory = f"{memory:7.2f} GB" if memory is not None else "      n/a"
        return f"{head} {row['step_ms']:9.1f} ms {memory}"
    return f"{head} {row.get('error') or row.get('skipped')}"


def summary_table(rows: list[dict]) -> str:
    """Markdown table: step time and peak memory per token count, and the speed-up of
    jvp_attention over the math path."""
    by_key = {(r["tokens"], r["attention"]): r for r in rows}
    lines = ["| tokens | attention | step (ms) | peak memory (GB) | math / this |",
             "|---:|---|---:|---:|---:|"]
    for tokens in sorted({r["tokens"] for r in rows}):
        math_row = by_key.get((tokens, "math"), {})
        for attention in ATTENTIONS:
            row = by_key.get((tokens, attention))
            if row is None:
                continue
            if "step_ms" not in row:
                lines.append(f"| {tokens} | {attention} | {row.get('error') or row.get('skipped')}"
                             " | | |")
                continue
            memory = row.get("peak_memory_gb")
            speedup = (f"{math_row['step_ms'] / row['step_ms']:.2f}x"
                       if "step_ms" in math_row else "")
            lines.append(f"| {tokens} | {attention} | {row['step_ms']:.1f} | "
                         f"{'' if memory is None else f'{memory:.2f}'} | {speedup} |")
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
    return info


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Data parallel: 2 ranks give the loss trajectory of 1 rank with the same global batch
# ---------------------------------------------------------------------------------------------

def shard_fsdp2(model: MeanFlow) -> nn.Module:
    """FSDP2: each DiT block, then the rest of the model, as one `fully_shard` unit."""
    from torch.distributed.fsdp import fully_shard

    for block in model.net.blocks:
        fully_shard(block)
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
                      help="step time and peak memory on the three attentions at 256, 1024 and "
                           "4096 tokens (image sizes 32, 64, 128 with patch 2)")
    model = parser.add_argument_group("model")
    model.add_argument("--image-size", type=int, default=32)
    model.add_argument("--patch-size", type=int, default=2)
    model.add_argument("--width", type=int, default=256)
    model.add_argument("--depth", type=int, default=6)
    model.add_argument("--heads", type=int, default=4)
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
    run.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--nvlink-multicast", action="store_true",
                        help="--ddp/--fsdp: leave NVLink multicast as NCCL and torch choose "
                             "(by default it is turned off: NCCL_NVLS_ENABLE=0, "
                             "TORCH_SYMM_MEM_DISABLE_MULTICAST=1, unless already set)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if dtype == "float32":  # true fp32 everywhere, so fp32 comparisons can be tight
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dit = DiTConfig(image_size=args.image_size, patch_size=args.patch_size, width=args.width,
                    depth=args.depth, heads=args.heads)
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
    if args.bench:
        rows = benchmark(dit, args.batch_size, device, dtype, tuple(args.bench_sizes),
                         repeats=args.repeats)
        out = args.out or RESULTS / f"bench_{tag}.json"
        write_json(out, {"model": asdict(dit), "environment": environment(), "rows": rows})
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
