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
# 3. train a DiT-B/2 (130 M parameters) at 256 tokens, and time its training step on four
#    attentions (our kernels, in two precisions; PyTorch's math path; jvp-flash-attention
#    0.14), eager and compiled, at 256, 1024 and 4096 tokens, with the attention's share of
#    the step from the profiler.
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
from dataclasses import replace
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
# ## A DiT-B/2 at 256 tokens
#
# The model above is small enough to show samples after a minute. The size people train
# MeanFlow at is DiT-B/2: 12 blocks of width 768 with 12 heads of 64, patch 2, about 130 M
# parameters (`mf.PRESETS["dit-b2"]`). The same loss and loop train it here at 256 tokens
# (32x32 images) with a batch of 32, in bf16 autocast, with Adam at the learning rate DiT
# uses (10⁻⁴); the loss must fall and no step may fail. On a CPU a tiny model takes its
# place.

# %%
if FULL_SIZE:
    B2 = replace(mf.PRESETS["dit-b2"], image_size=32)
    B2_TRAIN = mf.TrainConfig(steps=300, batch_size=32, lr=1e-4, warmup=50, dtype="bfloat16")
else:
    B2 = mf.DiTConfig(image_size=8, patch_size=2, width=32, depth=1, heads=2)
    B2_TRAIN = mf.TrainConfig(steps=3, batch_size=2, lr=1e-4, warmup=1, dtype="float32")
torch.manual_seed(B2_TRAIN.seed)
b2_model = mf.MeanFlow(B2, B2_TRAIN.adaptive_p).to(DEVICE)
print(f"DiT: {B2.tokens} tokens, width {B2.width}, depth {B2.depth}, heads {B2.heads}: "
      f"{mf.parameter_count(B2) / 1e6:.1f} M parameters; {B2_TRAIN.steps} steps, batch "
      f"{B2_TRAIN.batch_size}, {B2_TRAIN.dtype}")
b2_history = mf.train(b2_model, B2, B2_TRAIN, torch.device(DEVICE))
b2_losses = torch.tensor(b2_history["loss"])
head = b2_losses[:min(50, len(b2_losses))].mean().item()
tail = b2_losses[-min(50, len(b2_losses)):].mean().item()
print(f"{B2_TRAIN.steps} steps in {b2_history['seconds']:.1f} s "
      f"({1e3 * b2_history['seconds'] / B2_TRAIN.steps:.0f} ms per step, first steps included)")
print(f"loss, mean of the first 50 steps {head:.3f} -> of the last 50 {tail:.3f}")
assert torch.isfinite(b2_losses).all()
if FULL_SIZE:
    assert tail < head, "the DiT-B/2's loss did not fall"
del b2_model

# %% [markdown]
# ## The same training step on four attentions
#
# One optimisation step (forward with the JVP, backward, Adam) of the DiT-B/2, with the
# attention swapped underneath: our kernels through `jvp_attention.sdpa()` in the default
# "accurate" precision and in "fast" precision (one 16-bit rounding per product, as
# FlashAttention does; chapter 3 compares them), PyTorch's math path (what JVP training uses
# today; written out as `softmax(s QKᵀ) V` in PyTorch operations by `mf.math_attention`,
# because on CUDA `sdpa_kernel(SDPBackend.MATH)` under bf16 autocast raises in the backward
# of this torch.func.jvp, "expected input and grad types to match"), and
# jvp-flash-attention 0.14's `JVPAttn.fwd_dual`. Each runs eager, and with the training
# forward (the DiT under `torch.func.jvp`, and the loss) under `torch.compile`. The image
# grows from 32² to 128² pixels, 256 to 4096 tokens, with a batch of 32 images, and of 2 at
# 4096 tokens, where the math path's N² scores for 32 images would not fit in memory
# ("fast" precision runs eager only). At 1024 tokens they do not fit either: the math
# path's 12 layers keep scores, probabilities and their tangents for the backward, and
# 32 images run the H200's 140 GB out of memory (the saved run records it; a batch of 16
# there, `--batch-per-size 64=16`, compares all four).
#
# Every row also has the attention's share of the step: one more step runs under
# `torch.profiler`, and the CUDA kernel time of the attention's forward, JVP and backward is
# divided by all kernel time of the step (`mf.attention_profile` says how the backward's
# kernels are found; under `torch.compile` only our own operators and kernels, by name,
# can be found, since the math path's attention is fused into Inductor's kernels).
#
# Compiling a 130 M-parameter model takes about a minute per row, so the run is a command
# of its own, and this chapter reads what it saved. The saved run was made in parts: every
# eager row, then the compiled rows at 256 tokens, then the compiled rows at 1024 and 4096
# tokens, then jvp-flash-attention compiled with CUDA graphs, each added to the same file (`--resume` keeps what the file holds and runs the
# rest; the file's `notes` say which run made which row):
#
# ```bash
# python examples/meanflow_dit.py --bench --preset dit-b2 --batch-size 32 \
#     --batch-per-size 128=2 --compile eager --out examples/results/bench_dit_b2_h200.json
# python examples/meanflow_dit.py --bench --preset dit-b2 --batch-size 32 --bench-sizes 32 \
#     --compile eager default --compile-attentions jvp_attention math \
#     --resume examples/results/bench_dit_b2_h200.json \
#     --out examples/results/bench_dit_b2_h200.json
# python examples/meanflow_dit.py --bench --preset dit-b2 --batch-size 32 \
#     --batch-per-size 64=16 128=2 --compile eager default reduce-overhead \
#     --compile-attentions jvp_attention math \
#     --resume examples/results/bench_dit_b2_h200.json \
#     --out examples/results/bench_dit_b2_h200.json
# python examples/meanflow_dit.py --bench --preset dit-b2 --batch-size 32 \
#     --batch-per-size 64=16 128=2 --compile reduce-overhead \
#     --compile-attentions jvp_flash_attention \
#     --resume examples/results/bench_dit_b2_h200.json \
#     --out examples/results/bench_dit_b2_h200.json
# ```
#
# With CUDA graphs the peak memory is taken over the warm-up as well: the graphs' memory
# pool is allocated while they are recorded, and a replay allocates nothing.
#
# On a CPU the same benchmark runs first on a tiny model, through the interpreter, to check
# the code, not the speed.

# %%
import json

if not FULL_SIZE:
    print("(on a CPU the kernels run in Triton's interpreter: these times say nothing about "
          "speed; the table exercises the code)")
    tiny = mf.benchmark(mf.DiTConfig(patch_size=2, width=32, depth=1, heads=2), 2,
                        torch.device(DEVICE), "float32", (8,), warmup=1, repeats=1,
                        attentions=("jvp_attention", "math"))
    print(mf.summary_table(tiny))

BENCH_FILE = EXAMPLES / "results" / "bench_dit_b2_h200.json"
saved = json.loads(BENCH_FILE.read_text()) if BENCH_FILE.is_file() else None
if saved is None:
    print(f"\nno {BENCH_FILE.name} yet: run the command above on a GPU")
    rows = []
else:
    rows = saved["rows"]
    env = saved["environment"]
    print(f"\n{BENCH_FILE.name}: {saved['parameters'] / 1e6:.1f} M parameters, "
          f"{env.get('gpu', 'no GPU')}, torch {env['torch']}, triton {env.get('triton')}, "
          f"jvp_attention {env['jvp_attention']}"
          + ("" if saved.get("complete", True) else " (the run was cut short)"))
    for command in [*saved.get("earlier_commands", ()), saved["command"]]:
        print(f"command: {command}")
    print()
    print(mf.summary_table(rows))

# %% [markdown]
# The targets this library sets itself for a DiT-B/2 step: at least 1.5x the math path at
# 256 tokens, 2.5x at 1024 and 4x at 4096, and faster than jvp-flash-attention at every
# size, eager and compiled alike.

# %%
TARGETS = {256: 1.5, 1024: 2.5, 4096: 4.0}


def step_ms(tokens, attention, compile_mode):
    for row in rows:
        if (row["tokens"], row["attention"], row["compile"]) == (tokens, attention, compile_mode):
            return row.get("step_ms")
    return None


def verdict(ours, other, needed):
    """'2.31x (met)' for our speed-up over `other`, or why there is none."""
    if ours is None or other is None:
        return "n/a"
    speedup = other / ours
    return f"{speedup:.2f}x ({'met' if speedup >= needed else 'NOT met'})"


if not rows:
    print("no saved run: nothing to compare with the targets")
for compile_mode in dict.fromkeys(row["compile"] for row in rows):
    print(f"{compile_mode}:")
    for tokens, needed in TARGETS.items():
        ours = step_ms(tokens, "jvp_attention", compile_mode)
        print(f"  {tokens:5} tokens: over math {verdict(ours, step_ms(tokens, 'math', compile_mode), needed):18}"
              f" over jvp-flash-attention "
              f"{verdict(ours, step_ms(tokens, 'jvp_flash_attention', compile_mode), 1.0)}")

# %% [markdown]
# What the saved run (one H200, bf16 autocast) shows:
#
# - **Eager, the step is the host's, not the GPU's.** The profile adds up the step's GPU
#   kernels: 47.7 ms with our attention at 256 tokens against a 175.0 ms step, 63.0 ms
#   with the math path against 130.2 ms. The rest of the step is Python running the DiT
#   operation by operation under `torch.func.jvp`, and it varies from run to run on this
#   host (the previous run of the same command measured 137.9 ms for ours, 156.1 ms for
#   math), so eager steps at 256 tokens do not rank the attentions. At 1024 tokens (batch
#   16) ours is 1.23x the math path (169.8 against 209.6 ms) with 18.7 GB against 72.5 GB;
#   jvp-flash-attention's step is shorter (148.7 ms). At 4096 tokens (batch 2, from the
#   earlier run) ours is 1.74x the math path, and 10.2 GB against 120.4 GB; there
#   jvp-flash-attention took 143.8 ms and ours in "fast" precision 125.6 ms. These eager
#   gaps are host time, not kernels: compiled, the same step with our kernels takes 46.3 ms
#   at 4096 tokens, so about 110 ms of each eager step is Python, and our two precisions,
#   whose host work is nearly the same, differ by 42 ms at 256 tokens. So the eager rows
#   do not rank the attentions against jvp-flash-attention either; the compiled rows do.
#   Part of that Python is PyTorch's own zero tangents: one MeanFlow step of this
#   12-block DiT meets 124 of them (a bias, a buffer or a number beside a dual tensor),
#   each shaped by Python meta kernels at about 0.1 ms of host time on the repository's
#   CPU machine. Chapter 13 measures them and removes most of that cost
#   (`jvp_attention.lean_zero_tangents`, `--zero-tangents lean` here); the eager rows above
#   were measured without it. The same zero tangents cost the device too, eager and
#   compiled: each of the step's 66 linear layers multiplies its input by a tensor of zeros
#   in its JVP (a fifth of the step's matrix products), which the lean kernels also remove
#   (from a compiled step when they are on while it is traced, under a compile-cache key of
#   their own: chapter 13). On an
#   H100 machine (`examples/results/bench_dit_b2_zero_tangents_h100.json`, each row run with
#   PyTorch's zero tangents and then with the lean kernels, one run), the eager steps'
#   host time before the backward fell in five of six pairs (114.6 to 86.3 ms for ours at
#   256 tokens, 152.5 to 104.3 ms for the math path at 1024), but the steps themselves moved
#   by -24 to +10 ms, within eager steps' spread from run to run (ours at 256 tokens:
#   175 and 138 ms in the two H200 runs above). Compiled in the default mode at 1024
#   tokens, with each setting under its own cache key, the lean step took 53.7 ms against
#   61.2 with ours and 80.4 against 84.7 with the math path (1.50x and 1.38x the math path;
#   the first lean runs had been served PyTorch's graphs by torch 2.11's compile cache and
#   were measured again; the file's `note` says so). With CUDA graphs (`reduce-overhead`,
#   measured again later on the same H100 kind under the cache keys), 50.9 against 57.7 ms
#   with ours and 72.4 against 78.8 with the math path (1.42x and 1.37x the math path, each
#   with the same zero tangents): the lean kernels take 12% off our step, while the
#   attention's kernels took 10.8 against 10.4 ms (the lean kernels act outside them).
#   An eager loop on one GPU can also run its backward on the calling thread
#   (`--backward-thread calling`, recorded in the file's environment), which took 0.17 to
#   0.38 ms off each MeanFlow call of a lone attention on an H100 (chapter 8, "The autograd
#   engine's thread"). Timed once each way on an H100 at 256 tokens (five steps each,
#   `examples/results/bench_dit_b2_256_calling_thread_h100.json` and
#   `..._device_thread_h100.json`), our step with the lean zero tangents took 95.2 ms with
#   the backward on the calling thread against 119.0 on the device thread, the math path's
#   96.7 against 98.6; with PyTorch's zero tangents ours took 105.7 against 156.3 and the
#   math path 155.8 against 120.2. Those moves, of either sign, are far larger than what
#   the setting saves (12 attention calls a step at 0.2 to 0.4 ms): the eager step's
#   spread from run to run again, which hides it.
# - **Against jvp-flash-attention, compiled.** Under `torch.compile` with CUDA graphs its
#   step takes 161.5 ms at 256 tokens, 211.4 at 1024 and 188.6 at 4096: slower than its
#   own eager steps (132.5, 148.7, 143.8 ms). `torch.compile` records three graph breaks in
#   it (four graphs), so the host work stays. Ours with CUDA graphs is 6.1x, 4.0x and 4.3x
#   faster than it in the same mode, and 5.0x, 2.8x and 3.3x faster than its fastest
#   (eager) step. Its `default`-mode rows were not run.
# - **The targets ask more than attention can give.** The math path spends 17.7 of its
#   63.0 ms of GPU work in attention at 256 tokens, and 112.0 of 193.1 ms at 1024. With an
#   attention that took no time at all the step's GPU work would be 1.39x and 2.38x shorter
#   than the math path's: below the 1.5x and 2.5x targets. Ours reaches 1.32x and 2.09x in
#   GPU work (attention 3.1 ms = 6.6% and 12.9 ms = 14% of the step's kernels); the rest
#   of the DiT bounds the step.
# - **Compiled with CUDA graphs** (`mode="reduce-overhead"`), which takes the host out,
#   ours is 26.4 ms against the math path's 28.0 ms at 256 tokens (1.06x; 4.8 against
#   5.8 GB), 53.5 against 65.5 ms at 1024 tokens (1.22x; 7.9 against 16.9 GB) and 43.5
#   against 76.8 ms at 4096 tokens and 2 images (1.76x; 4.8 against 24.0 GB).
# - **Compiled without CUDA graphs** (`default`), the step is bound by host work again:
#   at 256 tokens ours takes 63.3 ms for 16.7 ms of kernels, the math path 39.1 ms
#   (Inductor fuses the math path's attention into its own kernels; our operators are
#   opaque launches, about 1.5 ms of host time per MeanFlow call at these shapes, chapter
#   8). At 1024 tokens ours wins, 55.3 against 72.5 ms (1.31x), with 36.4 ms of kernels,
#   and at 4096 tokens 46.3 against 81.0 ms (1.75x; 4.9 against 24.0 GB).
#   Since then chapter 7's traced twins let Inductor launch our kernels in the graph.
#   Measured again with them in another session
#   (`examples/results/bench_dit_b2_twins_h200.json`, same H200 kind), the compiled step
#   at 256 tokens took 28.9 ms against the math path's 45.7 ms (1.58x; the math path took
#   39.1 ms in the run above: host-bound steps vary from run to run), and with CUDA graphs
#   27.1 against 28.7 ms (1.06x). That meets the 1.5x target at 256 tokens in the default
#   mode only: with CUDA graphs, which take the host out of both, the two steps are within
#   6%. At 1024 tokens the twins then called the same opaque operators (the bf16 carry,
#   tensor descriptors). That session's one 1024-token row ran on a host slowed in every
#   phase, the optimizer's included (the file's notes); run again alone in a fresh process
#   (2026-12-02), the step took 63.6 ms against the math path's 68.1 ms (1.07x), 58.7 ms
#   of it in the host's forward and backward: the opaque operators' Python, twelve layers
#   of it, bound the step, not the kernels. Since then a graph without CUDA graphs traces
#   the split products and the backward's pointer kernels at these lengths instead of
#   calling the opaque operators (`host_bound_graph`, chapter 7), and the same command
#   run again (`examples/results/bench_dit_b2_twins_1024_h200.json`, a fresh process,
#   batch 16) gives 57.4 ms against the math path's 68.3 ms (1.19x; 7.9 against 17.0 GB at peak).
#   The host's forward and backward take 25.1 ms (15.8 + 9.3) of the 57.4, so the step no
#   longer waits on the host. The attention kernels take 17.0 ms (42% of the step), up from
#   12.7 ms in the run before: the split products and pointer loads cost more GPU time than the carried
#   copies and tensor descriptors, and save more host time than that. The other 40 ms or so
#   of the step are everything else (the DiT's other layers, the optimizer): with an
#   attention that took no time at all the step would still be at most about 1.7x shorter
#   than the math path's 68.3 ms, so the 2.5x target at 1024 tokens is out of reach for
#   any attention; the rest of the model bounds it.
# - **At 4096 tokens the bound is the attention's arithmetic.** Compiled, our attention is
#   19.3 of the step's 33.0 ms of kernels (59%): its forward with the tangent runs at about
#   400 TFLOP/s and its backward at about 300, near what chapter 8 measures for the
#   kernels alone, and the other 13.7 ms is the rest of the DiT. Even at the H200's
#   measured bf16 peak (about 790 TFLOP/s) the attention's 6.8 TFLOP per step would take
#   8.6 ms, so the step could not be shorter than about 22 ms: 3.6x the math path's
#   81.0 ms, below the 4x target. This is an estimate from kernel times, not a measured
#   bound; the math path's own attention time is not attributed under `torch.compile`.
# - Memory: 10.2 GB for our eager step at 256 tokens against 16.7 GB for the math path;
#   at 4096 tokens and 2 images, 10.2 GB against 120.4 GB.
# - **Run again on 2026-12-04** (`examples/results/bench_dit_b2_rerun_h200.json`, same H200
#   kind, with the lean call path, the carry from 1024 keys and the traced twins), eager
#   and `default` only. Compiled, ours took 36.5 ms against the math path's 44.0 ms at 256
#   tokens (1.21x; 28.9 against 45.7 ms in the twins' run, so the host-bound compiled step
#   still varies by a quarter between runs) and 58.3 against 69.6 ms at 1024 tokens,
#   batch 16 (1.19x, as the run above: 57.4 against 68.3). Eager at 256 tokens ours took
#   114.4 ms against 143.6 ms (1.25x; 175.0 against 130.2 ms in the saved run), but the
#   "fast" precision, whose kernels are shorter, took 163.7 ms in the same run: eager steps
#   still rank the host, not the attentions. The attention kernels took 2.6 ms (5.5% of the
#   step's kernel time) in the eager step at 256 tokens and 16.8 ms (42%) in the compiled
#   step at 1024 tokens. So the targets stand where the points above put them: 1.5x at 256
#   tokens met in one compiled run (the twins') and not in this one, and 2.5x at 1024
#   tokens out of reach for any attention, the rest of the model bounding the step.
# - **Compiled, with the graph's carry** (`examples/results/bench_dit_b2_1024_compiled_h200.json`,
#   2026-12-04, same H200 kind): after the run above a compiled graph carries at 1024
#   tokens as eager mode does (chapter 2's `graph_carry`) instead of tracing the split
#   products. The compiled (`default`) step at 1024 tokens, batch 16, then took 56.3 ms
#   against the math path's 72.0 ms (1.28x; 1.19x above), with 14.0 ms of attention kernels
#   (37% of the step's kernel time, 16.8 ms above) and 7.9 GB of peak memory against
#   17.0 GB.
# - **The first run's other cells, measured again**
#   (`examples/results/bench_dit_b2_refresh_h200.json`, 2026-12-04, same H200 kind, the
#   code of the run above): 1024 tokens eager and with CUDA graphs, 4096 tokens in every
#   mode. Eager, ours took 150.7 ms against the math path's 207.8 ms at 1024 tokens
#   (1.38x; 1.23x in the first run) and 124.7 against 278.9 ms at 4096 tokens (2.24x;
#   1.74x), "fast" 175.4 and 143.6 ms. With CUDA graphs, 56.6 against 65.1 ms at 1024
#   tokens (1.15x; 1.22x) and 42.7 against 77.6 ms at 4096 tokens (1.82x; 1.76x). Compiled
#   in the default mode at 4096 tokens, 55.5 against 83.2 ms (1.50x; 46.3 against 81.0 ms,
#   1.75x, in the first run) for the same attention kernels (19.5 ms, 19.3 then): that
#   step is bound by the host, whose forward took 28.6 ms and backward 22.6 ms against the
#   math path's 22.0 and 16.4 ms. At 4096 tokens each of our calls reads through tensor
#   descriptors, so the graph keeps its opaque operators (chapter 7): about 0.5 ms more
#   host time per call than the math path's attention, which Inductor fuses, 24 calls a
#   step. How much of that shows depends on the host's speed, which differed between the
#   two runs. With CUDA graphs, which take that host work out, the same step takes 42.7 ms.

# %% [markdown]
# Step time and the attention's share against the number of tokens (eager). On logarithmic
# axes a slope of 2 is O(N²) and a slope of 1 is O(N); the share says how much of the step a
# faster attention could still save.

# %%
eager = [row for row in rows if row["compile"] == "eager" and "step_ms" in row]
if eager:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for attention in mf.ATTENTIONS:
        measured = [row for row in eager if row["attention"] == attention]
        if not measured:
            continue
        tokens = [row["tokens"] for row in measured]
        axes[0].plot(tokens, [row["step_ms"] / row["batch"] for row in measured], "o-",
                     label=attention)
        shares = [(row["tokens"], row["attention_share"]) for row in measured
                  if row.get("attention_share") is not None]
        if shares:
            axes[1].plot(*zip(*shares, strict=True), "o-", label=attention)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("step time per image (ms)")
    axes[1].set_ylabel("attention's share of the step")
    axes[1].set_ylim(0, 1)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The small model's training curve and the DiT-B/2's go to a JSON file (on the H200:
# `examples/results/training_h200.json`), so they can be compared across machines and
# commits.

# %%
from dataclasses import asdict

results = {
    "environment": mf.environment(),
    "training": {"model": asdict(DIT), "train": asdict(TRAIN), "loss": history["loss"],
                 "seconds": history["seconds"]},
    "dit_b2_training": {"model": asdict(B2), "train": asdict(B2_TRAIN),
                        "parameters": mf.parameter_count(B2), "loss": b2_history["loss"],
                        "seconds": b2_history["seconds"]},
}
OUT = (EXAMPLES / "results" / "training_h200.json" if FULL_SIZE
       else Path(tempfile.gettempdir()) / "training_cpu.json")
mf.write_json(OUT, results)
print(f"wrote {OUT}")

# %% [markdown]
# ## Several GPUs
#
# `examples/meanflow_dit.py --ddp`, run under `torchrun --nproc_per_node=2`, wraps the
# `MeanFlow` module (the DiT with its loss as `forward`, so the JVP runs inside DDP's
# forward) in `DistributedDataParallel`. Each rank takes its slice of the same global batch;
# DDP averages the gradients, which equals the gradient of the whole batch's mean loss. Rank
# 0 then trains the same model in one process on the whole batch and compares the two loss
# trajectories step by step. `--fsdp` does the same with FSDP2 (`fully_shard` on each DiT
# block): the JVP runs through the gathered parameters unchanged. PyTorch 2.11's FSDP2 does
# not gather a block's weights again for a backward taken through `torch.func.jvp`
# (pytorch/pytorch#182641: "setStorage: ... storage of size 0"), so before 2.13 the example
# keeps them gathered from the forward to the backward (`reshard_after_forward=False`:
# ZeRO-2's memory, the same gradients).
# `tests/library/test_training.py` runs both checks with two CPU processes over gloo.
