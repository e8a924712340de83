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
# # Chapter 9: a training run that needs the JVP — MeanFlow on a small DiT
#
# Everything so far was checked one attention call at a time. This chapter trains a model
# whose *loss* needs a forward-mode derivative through the whole network: MeanFlow (Geng et
# al. 2025, "Mean Flows for One-step Generative Modeling"), a one-step generative model
# trained from scratch. Its regression target contains du/dt, the derivative of the
# network's own output along the flow, and that is a Jacobian-vector product through every
# layer, attention included.
#
# PyTorch's fused SDPA backends (flash, memory-efficient, cuDNN) raise under forward-mode
# AD, so such training runs today on the math backend, which materialises the N x N score
# matrix and its tangent. Here the model is an ordinary DiT that calls
# `F.scaled_dot_product_attention`; `with jvp_attention.sdpa():` routes those calls to the
# fused kernels, with no change to the model. We
#
# 1. derive the MeanFlow identity and check it, with `torch.func.jvp`, on a flow whose
#    average velocity is known in closed form;
# 2. train a small DiT on synthetic images (coloured blobs drawn on the fly, no download)
#    and watch its one-step samples improve;
# 3. time the same training step three ways (our kernels, in two precisions; PyTorch's
#    math path; jvp-flash-attention 0.14 when it is installed) at 256, 1024 and 4096 tokens,
#    and save the numbers.
#
# The model, data, loss and training loop live in `examples/meanflow_dit.py`, a script that
# also runs the data-parallel check (`torchrun --nproc_per_node=2 ... --ddp`);
# `examples/README.md` has the commands. On a machine without CUDA this notebook runs a few
# steps of a tiny model through Triton's interpreter, to prove the pipeline, not the model.

# %%
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
FULL_SIZE = DEVICE == "cuda"

import jvp_attention


def find_examples() -> Path:
    """examples/ of this checkout: beside the package, or beside the notebooks."""
    candidates = [Path(jvp_attention.__file__).resolve().parent.parent / "examples",
                  Path.cwd().parent / "examples", Path.cwd() / "examples"]
    for folder in candidates:
        if (folder / "meanflow_dit.py").is_file():
            return folder
    raise FileNotFoundError(f"examples/meanflow_dit.py not found in {candidates}")


EXAMPLES = find_examples()
sys.path.insert(0, str(EXAMPLES))
import meanflow_dit as mf

print(f"device {DEVICE}; Triton interpreter: {os.environ.get('TRITON_INTERPRET', '0')}")

# %% [markdown]
# ## The MeanFlow identity
#
# Flow matching joins data $x$ and noise $e$ by $z_t = (1 - t)\,x + t\,e$, with $t$ from 0
# (data) to 1 (noise). The conditional velocity is $\dot z_t = e - x$, and its average given
# $z_t$ is the instantaneous velocity field $v(z, t)$ of an ODE that carries noise to data.
# Sampling integrates that ODE in many small steps. MeanFlow learns instead the *average*
# velocity between two times $r \le t$ along the ODE's path,
#
# $$u(z_t, r, t) = \frac{1}{t - r} \int_r^t v(z_\tau, \tau)\, d\tau ,$$
#
# so that one step $z_r = z_t - (t - r)\,u(z_t, r, t)$ lands exactly, and one network
# evaluation $x = e - u(e, 0, 1)$ turns noise into a sample. The integral is not available
# for training, but an identity is: multiply by $t - r$ and differentiate in $t$, holding
# $r$ fixed,
#
# $$u(z_t, r, t) = v(z_t, t) - (t - r)\, \frac{d}{dt} u(z_t, r, t),
# \qquad \frac{d}{dt} u = v\, \partial_z u + 0\cdot\partial_r u + \partial_t u .$$
#
# The total derivative is the Jacobian-vector product of $u$ with the tangent $(v, 0, 1)$
# on its inputs $(z, r, t)$. Training regresses the network on the right-hand side with $v$
# replaced by the conditional velocity $e - x$ (as flow matching does) and the target held
# fixed (stop-gradient):
#
# ```python
# u, dudt = torch.func.jvp(net, (z, r, t), (v, zeros, ones))
# target = (v - (t - r) * dudt).detach()
# loss = (u - target).square().mean()
# ```
#
# At $r = t$ the correction vanishes and this is flow matching; the paper's ImageNet runs
# draw $r \ne t$ for a quarter of the batch, which `mf.sample_times` does too.
#
# A check where everything is known in closed form: for one-dimensional Gaussian data
# $x \sim \mathcal N(0, s^2)$, $z_t$ is Gaussian with standard deviation
# $\sigma_t = \sqrt{(1 - t)^2 s^2 + t^2}$, and the ODE maps quantiles to quantiles,
# $z_r = z_t\,\sigma_r / \sigma_t$. Hence the exact average velocity
# $u(z, r, t) = z\,(1 - \sigma_r/\sigma_t) / (t - r)$, and the instantaneous one
# $v(z, t) = z\,\sigma_t' / \sigma_t$, which is also $E[e - x \mid z_t = z]$. The identity
# must hold to rounding, and it fails if the derivative leaves out the $z$-direction
# (tangent $(0, 0, 1)$): the JVP has to go through the network's *input*, hence through
# every layer of it.

# %%
S = 0.5  # data standard deviation


def sigma(t):
    return ((1 - t) ** 2 * S**2 + t**2).sqrt()


def exact_u(z, r, t):
    return z * (1 - sigma(r) / sigma(t)) / (t - r)


def exact_v(z, t):
    return z * (t - (1 - t) * S**2) / sigma(t) ** 2


gen = torch.Generator().manual_seed(0)
t = 0.2 + 0.8 * torch.rand(1000, generator=gen, dtype=torch.float64)
r = t * torch.rand(1000, generator=gen, dtype=torch.float64)
z = sigma(t) * torch.randn(1000, generator=gen, dtype=torch.float64)
v = exact_v(z, t)
u, dudt = torch.func.jvp(exact_u, (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
_, dudt_partial = torch.func.jvp(exact_u, (z, r, t), (torch.zeros_like(z), torch.zeros_like(r),
                                                      torch.ones_like(t)))
identity_error = (u - (v - (t - r) * dudt)).abs().max().item()
partial_error = (u - (v - (t - r) * dudt_partial)).abs().max().item()
print(f"u = v - (t - r) du/dt with the JVP along (v, 0, 1): max error {identity_error:.1e}")
print(f"the same with only the partial derivative in t:      max error {partial_error:.1e}")
assert identity_error < 1e-12 and partial_error > 1e-2

# %% [markdown]
# ## The data
#
# Images of one to three soft coloured discs on black, at random places and sizes:
# `mf.blob_images` draws them on the fly. A global step's whole batch (images, noise, t, r)
# is a function of the seed and the step number alone, `mf.global_batch`, so that several
# ranks can each take a slice of the same batch (the data-parallel check relies on it).

# %%
import matplotlib.pyplot as plt


def image_grid(images: torch.Tensor, columns: int) -> torch.Tensor:
    """(n, 3, h, w) in [-1, 1] -> one (rows·h, columns·w, 3) picture in [0, 1]."""
    n, c, h, w = images.shape
    rows = -(-n // columns)
    padded = torch.full((rows * columns, c, h, w), -1.0)
    padded[:n] = images.detach().float().cpu()
    grid = padded.view(rows, columns, c, h, w).permute(0, 3, 1, 4, 2).reshape(rows * h,
                                                                                columns * w, c)
    return ((grid + 1) / 2).clamp(0, 1)


IMAGE_SIZE = 32 if FULL_SIZE else 8
real = mf.blob_images(32, IMAGE_SIZE, torch.Generator().manual_seed(1))
plt.figure(figsize=(8, 2))
plt.imshow(image_grid(real, 16))
plt.axis("off")
plt.title(f"training data ({IMAGE_SIZE}x{IMAGE_SIZE})")
plt.show()

# %% [markdown]
# ## The model
#
# `mf.DiT` is a small diffusion transformer: patch embedding with fixed sine-cosine
# positions, blocks with adaLN-Zero (the conditioning sets each LayerNorm's shift and scale
# and gates each residual branch, all zero at initialisation), an MLP, a final modulated
# linear layer and unpatchify. MeanFlow needs two times; the conditioning is the sum of an
# embedding of $t$ and one of the interval $t - r$. The times enter the sinusoidal features
# unscaled: scaled by 1000, as diffusion models scale their step numbers, the features'
# derivatives in $t$ reach 1000, and so does $du/dt$ in the target; in our small runs the loss
# then climbed instead of falling. Attention is a plain call to
# `F.scaled_dot_product_attention`, looked up when the block runs.
#
# First the point of the library, on this model: under forward-mode AD PyTorch's fused
# backends refuse (on CUDA we ask for flash attention; on a CPU, for its flash kernel),
# the math path works, and `jvp_attention.sdpa()` gives the same numbers as the math path
# from the fused kernels.

# %%
from torch.nn.attention import SDPBackend, sdpa_kernel

CHECK = mf.DiTConfig(image_size=IMAGE_SIZE, width=64 if FULL_SIZE else 32, depth=2,
                     heads=2)
torch.manual_seed(0)
net = mf.DiT(CHECK).to(DEVICE)
with torch.no_grad():  # leave adaLN-Zero's zeros, so that every layer matters
    for p in net.parameters():
        p.add_(0.05 * torch.randn_like(p))
x, noise, t, r = (b.to(DEVICE) for b in mf.global_batch(0, 4, IMAGE_SIZE))
z, v = (1 - t.view(-1, 1, 1, 1)) * x + t.view(-1, 1, 1, 1) * noise, noise - x
primals, tangents = (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t))

try:
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast(DEVICE, dtype=dtype,
                                                                 enabled=DEVICE == "cuda"):
        torch.func.jvp(net, primals, tangents)
    print("PyTorch's flash backend took the JVP")
except RuntimeError as error:
    print(f"PyTorch's flash backend under torch.func.jvp: {str(error).splitlines()[0][:150]}")

with sdpa_kernel(SDPBackend.MATH):
    u_math, dudt_math = torch.func.jvp(net, primals, tangents)
with jvp_attention.sdpa(strict=True):
    u_ours, dudt_ours = torch.func.jvp(net, primals, tangents)
for name, ours, ref in (("u", u_ours, u_math), ("du/dt", dudt_ours, dudt_math)):
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"DiT {name:6} sdpa() vs math path: relative error {err:.1e}")
    assert err < 1e-4, name

# %% [markdown]
# ## Training
#
# `mf.meanflow_loss` is the loss above, plus the paper's adaptive weighting: each sample's
# squared error is divided by (error + 10⁻³), with the weight held fixed, which evens out
# the contributions of easy and hard (t, r) pairs. The curve below shows the unweighted mean
# squared error. On the GPU the model is a DiT with 256 tokens (32x32 images, patch 2),
# width 256, 6 blocks and 4 heads, trained in bf16 autocast with a global batch of 128;
# every few hundred steps we draw one-step samples from the same fixed noise.

# %%
if FULL_SIZE:
    DIT = mf.DiTConfig(image_size=32, patch_size=2, width=256, depth=6, heads=4)
    TRAIN = mf.TrainConfig(steps=600, batch_size=128, lr=1e-3, warmup=50, dtype="bfloat16")
    SAMPLE_EVERY, N_SAMPLES = 200, 32
else:  # a few steps through the interpreter: the pipeline, not the model
    DIT = mf.DiTConfig(image_size=8, patch_size=2, width=32, depth=2, heads=2)
    TRAIN = mf.TrainConfig(steps=4, batch_size=4, lr=1e-3, warmup=2, dtype="float32")
    SAMPLE_EVERY, N_SAMPLES = 2, 8

torch.manual_seed(TRAIN.seed)
model = mf.MeanFlow(DIT, TRAIN.adaptive_p).to(DEVICE)
print(f"DiT: {DIT.tokens} tokens, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M "
      f"parameters; {TRAIN.steps} steps, batch {TRAIN.batch_size}, {TRAIN.dtype}")
fixed_noise = torch.randn(N_SAMPLES, DIT.channels, DIT.image_size, DIT.image_size,
                          generator=torch.Generator().manual_seed(123)).to(DEVICE)
snapshots = {0: mf.one_step_samples(model.net, fixed_noise).cpu()}


def on_checkpoint(step, losses):
    recent = losses[-min(50, len(losses)):]
    print(f"step {step:4d}  loss {sum(recent) / len(recent):.4f}  "
          f"({time.perf_counter() - start:.1f} s)", flush=True)
    with jvp_attention.sdpa(), torch.autocast(DEVICE, dtype=torch.bfloat16,
                                              enabled=TRAIN.dtype == "bfloat16"):
        snapshots[step] = mf.one_step_samples(model.net, fixed_noise).cpu()


start = time.perf_counter()
history = mf.train(model, DIT, TRAIN, torch.device(DEVICE), every=SAMPLE_EVERY,
                   callback=on_checkpoint)
print(f"{TRAIN.steps} steps in {history['seconds']:.1f} s")

# %%
losses = torch.tensor(history["loss"])
window = min(25, len(losses))
smooth = losses.unfold(0, window, 1).mean(1)
COLUMNS = min(16, N_SAMPLES)
panels = [(f"one-step samples after {step} steps", images) for step, images in snapshots.items()]
panels.append(("training data", mf.blob_images(N_SAMPLES, DIT.image_size,
                                                torch.Generator().manual_seed(7))))
rows_per_panel = -(-N_SAMPLES // COLUMNS)
fig, axes = plt.subplots(len(panels) + 1, 1, figsize=(12, 3 + 0.9 * rows_per_panel * len(panels)),
                         gridspec_kw={"height_ratios": [3] + [0.9 * rows_per_panel] * len(panels)})
axes[0].plot(losses, alpha=0.3, label="per step")
axes[0].plot(range(window - 1, len(losses)), smooth, label=f"mean of {window}")
axes[0].set_xlabel("step")
axes[0].set_ylabel("squared error")
axes[0].set_yscale("log")
axes[0].legend()
for ax, (title, images) in zip(axes[1:], panels, strict=True):
    ax.imshow(image_grid(images, COLUMNS))
    ax.set_axis_off()
    ax.set_title(title, fontsize=9)
fig.tight_layout()
if FULL_SIZE:  # kept with the JSON results, for runs executed as a plain script
    (EXAMPLES / "results").mkdir(exist_ok=True)
    fig.savefig(EXAMPLES / "results" / "training_h200_samples.png", dpi=80)
plt.show()
if FULL_SIZE:
    first, last = losses[:50].mean().item(), losses[-50:].mean().item()
    print(f"loss, mean of the first 50 steps {first:.3f} -> of the last 50 {last:.3f}")

# %% [markdown]
# ## The same training step three ways
#
# One optimisation step (forward with the JVP, backward, Adam) of one model, with the
# attention swapped underneath: our kernels through `jvp_attention.sdpa()` (in the default
# "accurate" precision, and in "fast" precision, which rounds each 16-bit product once as
# FlashAttention does; chapter 3 compares them), PyTorch's math path (what JVP training uses
# today; written out as `softmax(s QKᵀ) V` in PyTorch ops by `mf.math_attention`, because on
# CUDA `sdpa_kernel(SDPBackend.MATH)` under bf16 autocast raises in the backward of this
# torch.func.jvp, "expected input and grad types to match"), and jvp-flash-attention
# 0.14's `JVPAttn.fwd_dual` when that package imports (it is skipped with a note otherwise).
# The DiT has width 384, 6 blocks and 6 heads of 64; the batch of 8 images stays fixed while
# the image grows from 32² to 128² pixels, 256 to 4096 tokens, so the math path's memory
# grows with N² and ours with N. Each number is the median of a few steps after warm-up
# (autotuning included in the warm-up), in bf16 autocast, with `torch.cuda.synchronize`
# around each step; memory is the peak allocated during the timed steps (parameters and
# Adam state included).

# %%
if FULL_SIZE:
    BENCH = mf.DiTConfig(patch_size=2, width=384, depth=6, heads=6)
    BENCH_BATCH, BENCH_SIZES, REPEATS, WARMUP = 8, (32, 64, 128), 5, 2
    OUT = EXAMPLES / "results" / "training_h200.json"
else:
    BENCH = mf.DiTConfig(patch_size=2, width=32, depth=1, heads=2)
    BENCH_BATCH, BENCH_SIZES, REPEATS, WARMUP = 2, (8,), 1, 1
    OUT = Path(tempfile.gettempdir()) / "training_cpu.json"

if not FULL_SIZE:
    print("(on a CPU the kernels run in Triton's interpreter: these times say nothing about "
          "speed; the table exercises the code)")
rows = mf.benchmark(BENCH, BENCH_BATCH, torch.device(DEVICE), TRAIN.dtype, BENCH_SIZES,
                    warmup=WARMUP, repeats=REPEATS)

# %% [markdown]
# The results go to a JSON file (on the H200: `examples/results/training_h200.json`) with
# the training curve, so the numbers can be compared across machines and commits.

# %%
from dataclasses import asdict


def ratio(tokens, attention, key, over="math"):
    """`over`'s value divided by `attention`'s, at `tokens`, or None if either is missing."""
    found = {(r["tokens"], r["attention"]): r for r in rows}
    a, b = found.get((tokens, attention), {}), found.get((tokens, over), {})
    return b[key] / a[key] if key in a and key in b else None


largest = max(r["tokens"] for r in rows)
ours = ("jvp_attention", "jvp_attention_fast", "jvp_flash_attention")
summary = {
    "largest_tokens": largest,
    "speedup_over_math_at_largest": {a: ratio(largest, a, "step_ms") for a in ours},
    "memory_saving_over_math_at_largest": {a: ratio(largest, a, "peak_memory_gb") for a in ours},
}
results = {
    "environment": mf.environment(),
    "training": {"model": asdict(DIT), "train": asdict(TRAIN), "loss": history["loss"],
                 "seconds": history["seconds"]},
    "benchmark": {"model": asdict(BENCH), "batch": BENCH_BATCH, "warmup": WARMUP,
                  "repeats": REPEATS, "rows": rows},
    "summary": summary,
}
mf.write_json(OUT, results)
print(f"wrote {OUT}\n")
print(mf.summary_table(rows))
for attention, speedup in summary["speedup_over_math_at_largest"].items():
    if FULL_SIZE and speedup is not None and attention.startswith("jvp_attention"):
        print(f"at {largest} tokens the step on {attention} runs {speedup:.2f}x as fast as on "
              f"the math path (target >= 3x at 4096 tokens: {'met' if speedup >= 3 else 'NOT met'})")

# %% [markdown]
# Time and memory against the number of tokens, on logarithmic axes: a slope of 2 is
# O(N²), a slope of 1 is O(N).

# %%
import math

fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
for attention in mf.ATTENTIONS:
    measured = [r for r in rows if r["attention"] == attention and "step_ms" in r]
    if not measured:
        continue
    tokens = [r["tokens"] for r in measured]
    axes[0].plot(tokens, [r["step_ms"] for r in measured], "o-", label=attention)
    if all("peak_memory_gb" in r for r in measured):
        axes[1].plot(tokens, [r["peak_memory_gb"] for r in measured], "o-", label=attention)
    if len(measured) > 1 and all("peak_memory_gb" in r for r in measured):
        slope = (math.log(measured[-1]["peak_memory_gb"] / measured[-2]["peak_memory_gb"])
                 / math.log(tokens[-1] / tokens[-2]))
        print(f"{attention:20} memory grows as N^{slope:.2f} between {tokens[-2]} and "
              f"{tokens[-1]} tokens")
for ax, label in zip(axes, ("step time (ms)", "peak memory (GB)"), strict=True):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel(label)
    if ax.lines:
        ax.legend()
fig.tight_layout()
if FULL_SIZE:
    fig.savefig(EXAMPLES / "results" / "training_h200_scaling.png", dpi=80)
plt.show()

# %% [markdown]
# ## Several GPUs
#
# `examples/meanflow_dit.py --ddp`, run under `torchrun --nproc_per_node=2`, wraps the
# `MeanFlow` module (the DiT with its loss as `forward`, so the JVP runs inside DDP's
# forward) in `DistributedDataParallel`. Each rank takes its slice of the same global batch;
# DDP averages the gradients, which equals the gradient of the whole batch's mean loss. Rank
# 0 then trains the same model in one process on the whole batch and compares the two loss
# trajectories step by step. `--fsdp` does the same with FSDP2 (`fully_shard` on each DiT
# block): the JVP runs through the gathered parameters unchanged.
# `tests/library/test_training.py` runs both checks with two CPU processes over gloo.
