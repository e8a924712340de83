"""Real third-party models with every SDPA call routed through `jvp_attention.sdpa(strict=True)`.

Each test builds a model from its config with random weights (no hub access: nothing is
downloaded), and runs the same computation three times:

* ours: the model in the test dtype inside `jvp_attention.sdpa(strict=True)`;
* PyTorch math: the same model in the same dtype, not routed, under
  `sdpa_kernel(SDPBackend.MATH)`: the floor, PyTorch's own error;
* truth: a float64 deep copy of the model (its weights are the test dtype's weights, upcast
  exactly), on PyTorch's math path. The truth is kept independent of the library under test.

Where PyTorch's math path differentiates to NaN (Llama with left padding: rows that see no
key), the math run and the truth use `explicit_attention`, SDPA written out in PyTorch
operations, in the test dtype and in float64.

The computation: `y, ty = torch.func.jvp(f, inputs, tangents)` where `f` is the model as a
function of its input embeddings / hidden states (so the JVP goes through every layer), then
the parameter gradients of `loss = (y * w1).sum() + (ty * w2).sum()` with fixed random
weights `w1`, `w2`: the backward runs through both the output and its tangent.

Accuracy rule (as in `helpers.assert_accurate`, at model level): for every quantity (y, ty,
each parameter's gradient),

    max |ours - truth|  <=  2 * max |math - truth|  +  eps,
    eps = EPS_ROUNDINGS * unit_roundoff(dtype) * scale,

where `scale` is the largest true entry of the quantity's group (y; ty; all the gradients
together). A group scale, not the quantity's own: some gradients are exactly zero in exact
arithmetic (a key projection's bias: softmax does not see a shift of every score of a row)
and both runs leave rounding noise there, so an eps at their own scale (~1e-17) would make
the check a coin toss. `check_against_truth` prints one line per quantity and names, on
failure, each one that missed, with its ratio error / floor.

Routing: `sdpa(strict=True)` yields an `SDPARouting` whose `routed` counts the calls it
routed (and `fell_through` those it passed on); a spy on `jvp_attention.autograd.attention`
checks that the library was really called, and the unrouted math run counts the model's SDPA
calls by wrapping `F.scaled_dot_product_attention`. The routed count must equal the model's,
non-zero; with strict=True a call the library cannot take raises rather than falling through.

On CPU the kernels run in Triton's interpreter (tests/conftest.py), which computes bf16 dot
products wrongly: CPU tests use float32 and float16; bf16 runs on the GPU only. The models
are tiny on CPU (hidden 32-64, sequences 8-12, batch x heads <= 8: the interpreter's time
grows with the kernels' programs); `gpu`-marked variants run realistic sizes. The tiny tests
run on the GPU too, where they also take bf16.
"""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvp_attention
import jvp_attention.autograd as api

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
CPU_DTYPES = (torch.float32, torch.float16)
GPU_DTYPES = (torch.float32, torch.bfloat16)

FLOOR_FACTOR = 2.0
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
EPS_ROUNDINGS = 4.0

# The real SDPA, captured before any test can patch it (sdpa() swaps the attribute).
_TORCH_SDPA = F.scaled_dot_product_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dtype_params(dtypes: tuple[torch.dtype, ...]) -> list:
    return [pytest.param(d, id=_name(d)) for d in dtypes]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# bf16 runs on the GPU only: Triton's interpreter computes bf16 dot products wrongly.
BF16_NEEDS_GPU = pytest.mark.skipif(not HAS_CUDA, reason="bf16 needs a GPU: Triton's "
                                    "interpreter computes bf16 dot products wrongly")
# The interpreter runs ~0.2 s per kernel program on CPU; cases another test already covers
# in the same dtype run on the GPU only.
GPU_ONLY_FOR_TIME = pytest.mark.skipif(not HAS_CUDA, reason="skipped on CPU for the "
                                       "interpreter's time; the same dtype runs in a sibling case")


def _case(dtype: torch.dtype, *values, gpu_only: bool = False, id: str = ""):  # noqa: A002
    marks = [BF16_NEEDS_GPU] if dtype == torch.bfloat16 else []
    if gpu_only:
        marks.append(GPU_ONLY_FOR_TIME)
    return pytest.param(dtype, *values, marks=marks, id="-".join(filter(None, (_name(dtype),
                                                                             id))))


def _cpu_or_gpu_dtypes() -> list:
    """fp32 and fp16 everywhere, bf16 on the GPU."""
    return [_case(d) for d in (*CPU_DTYPES, torch.bfloat16)]


def _import_transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed (it is "
                               "in the test extra: pip install -e '.[test]')")


def _import_timm():
    """timm imports torchvision, which fails to import with the CPU build of PyTorch that CI
    installs (and is not installed there): skip, saying so, rather than error."""
    try:
        import timm  # noqa: F401
        from timm.models.vision_transformer import VisionTransformer
    except Exception as error:  # ImportError, or torchvision's RuntimeError on a CPU torch
        pytest.skip(f"timm not importable ({type(error).__name__}: {error}); it is not in "
                    "the test extra because it needs torchvision, which fails to import with "
                    "the CPU build of PyTorch that CI uses")
    return VisionTransformer


# --- routing and call counting ------------------------------------------------------------


@dataclass
class _Counts:
    """SDPA calls seen by one run."""

    calls: int = 0  # routed to jvp_attention (ours) or made by the model (unrouted runs)
    attention_calls: int = 0  # calls of jvp_attention.autograd.attention (ours)
    fell_through: dict = field(default_factory=dict)  # by reason (ours)


@contextmanager
def routed() -> Iterator[_Counts]:
    """`jvp_attention.sdpa(strict=True)`, with a spy on the `attention` it routes to; the
    routed count comes from the `SDPARouting` that sdpa() yields where it has one."""
    counts = _Counts()
    with mock.patch.object(api, "attention", wraps=api.attention) as spy:
        with jvp_attention.sdpa(strict=True) as routing:
            yield counts
    counts.attention_calls = spy.call_count
    # attention() calls itself once more under autocast (after its casts): count the calls
    # sdpa() routed where it says, the spy's otherwise.
    counts.calls = getattr(routing, "routed", spy.call_count)
    counts.fell_through = dict(getattr(routing, "fell_through", None) or {})


@contextmanager
def unrouted(implementation: Callable | None = None) -> Iterator[_Counts]:
    """Not routed: torch's SDPA on its math backend (or `implementation`), counting calls.

    The module attribute is wrapped (as sdpa() does) rather than watched by a
    TorchFunctionMode: nn.MultiheadAttention's functional forward handles a mode itself and
    runs its body with the mode off, so a mode never sees its SDPA call."""
    counts = _Counts()

    def counted(*args, **kwargs):
        counts.calls += 1
        return (implementation or _TORCH_SDPA)(*args, **kwargs)

    with sdpa_kernel(SDPBackend.MATH), mock.patch.object(F, "scaled_dot_product_attention",
                                                         counted):
        yield counts


def explicit_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                       scale=None, enable_gqa=False):
    """SDPA written out in PyTorch operations, for models with rows that see no key.

    PyTorch's math path gives such a row zeros in the forward but NaN gradients (its softmax
    of an all -inf row is NaN, and the backward multiplies through it), in float64 too. Here
    masked scores are the dtype's most negative finite number, so the softmax of an empty
    row is finite (uniform), and the row is then multiplied by 0: zeros out, zero tangent and
    zero gradients, which is what SDPA's forward and jvp_attention give."""
    assert dropout_p == 0.0
    if enable_gqa:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = (x.repeat_interleave(repeats, dim=-3) for x in (key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device)
    if is_causal:
        visible = visible.tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        visible = visible & attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask
        visible = visible & (attn_mask != -math.inf)
    visible = visible.expand(scores.shape)
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1) * visible.any(-1, keepdim=True)
    return weights @ value


# --- one run: output, tangent and parameter gradients --------------------------------------


def run(model: torch.nn.Module, f: Callable, inputs: tuple, tangents: tuple,
        weights: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """y, ty = jvp(f, inputs, tangents); the gradients of (y * w1).sum() + (ty * w2).sum()
    with respect to the model's parameters. Returns every quantity detached, by name."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    y, ty = torch.func.jvp(lambda *xs: f(model, *xs), inputs, tangents)
    w1, w2 = (w.to(device=y.device, dtype=y.dtype) for w in weights)
    loss = (y * w1).sum() + (ty * w2).sum()
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    results = {"y": y.detach(), "ty": ty.detach()}
    results.update({f"grad {n}": g for (n, _), g in zip(params, grads, strict=True)
                    if g is not None})
    return results


def run_three_ways(model: torch.nn.Module, f: Callable, inputs: tuple, tangents: tuple,
                   autocast: torch.dtype | None = None, explicit: bool = False
                   ) -> tuple[dict, dict, dict, _Counts, _Counts]:
    """(ours, math, truth, ours' call counts, the math run's call counts) for one problem.

    `model`, `inputs`, `tangents` are in the test dtype; with `autocast` the model is fp32
    and ours and math run under torch.autocast(dtype=autocast); the truth never does. With
    `explicit` the math run and the truth use `explicit_attention` instead of PyTorch's."""
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        probe = f(model, *inputs)
    weights = tuple(torch.randn(probe.shape, generator=generator).to(probe.dtype)
                    for _ in range(2))
    amp = (lambda: torch.autocast(DEVICE, dtype=autocast)) if autocast else nullcontext
    reference = explicit_attention if explicit else None

    with amp(), unrouted(reference) as math_counts:
        math_results = run(model, f, inputs, tangents, weights)
    with amp(), routed() as counts:
        ours = run(model, f, inputs, tangents, weights)
    model64 = copy.deepcopy(model).double()
    as64 = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    with unrouted(reference):
        truth = run(model64, f, as64, tuple(t.double() for t in tangents),
                    tuple(w.double() for w in weights))
    return ours, math_results, truth, counts, math_counts


# --- the accuracy rule ---------------------------------------------------------------------


def _group(name: str) -> str:
    return "grad" if name.startswith("grad ") else name


def check_against_truth(ours: dict, math_results: dict, truth: dict, dtype: torch.dtype,
                        label: str) -> None:
    """Every quantity within FLOOR_FACTOR x PyTorch math's error + eps of the float64 truth.

    Prints a line per quantity (seen with `pytest -s`, or on failure); raises naming each
    quantity that missed, with its error, floor (math's error), allowance and ratio."""
    assert ours.keys() == truth.keys() == math_results.keys(), (
        f"{label}: the runs differ in which parameters got a gradient: ours "
        f"{sorted(ours.keys() ^ truth.keys())}, math {sorted(math_results.keys() ^ truth.keys())}")
    scales: dict[str, float] = {}
    for name, t in truth.items():
        scales[_group(name)] = max(scales.get(_group(name), 0.0), t.abs().max().item())
    failures, lines, ratios = [], [], {}
    for name, t in truth.items():
        o, m = ours[name].double(), math_results[name].double()
        if not torch.isfinite(t).all():
            failures.append(f"{name}: the float64 truth is not finite")
            continue
        if not torch.isfinite(o).all():
            failures.append(f"{name}: ours has {(~torch.isfinite(o)).sum().item()} NaN/inf")
            continue
        error, floor = (o - t).abs().max().item(), (m - t).abs().max().item()
        if not math.isfinite(floor):
            failures.append(f"{name}: PyTorch's math path is not finite here, no floor; "
                            "compare on an explicit reference (explicit_attention)")
            continue
        allowed = FLOOR_FACTOR * floor + EPS_ROUNDINGS * UNIT_ROUNDOFF[dtype] * scales[
            _group(name)]
        ratios[name] = error / floor if floor else math.inf if error else 0.0
        line = (f"{name}: error {error:.3g}, math {floor:.3g}, ratio {ratios[name]:.3g}, "
                f"allowed {allowed:.3g} ({error / allowed:.0%} of it)")
        lines.append(line)
        if not error <= allowed:
            failures.append(line)
    worst = max(ratios, key=ratios.get, default=None)
    print(f"\n{label} ({_name(dtype)}): worst ratio {ratios.get(worst, 0):.3g} ({worst})\n  "
          + "\n  ".join(lines))
    assert not failures, f"{label} ({_name(dtype)}): {len(failures)} quantities missed:\n  " + (
        "\n  ".join(failures))


def check_routing(counts: _Counts, math_counts: _Counts, label: str) -> None:
    """Every SDPA call the model makes reached jvp_attention; none fell through."""
    assert math_counts.calls > 0, f"{label}: the model made no SDPA call at all"
    assert counts.attention_calls > 0, f"{label}: jvp_attention.attention was never called"
    assert not counts.fell_through, f"{label}: calls fell through: {counts.fell_through}"
    assert counts.calls == math_counts.calls, (
        f"{label}: {counts.calls} calls were routed to jvp_attention but the model makes "
        f"{math_counts.calls} SDPA calls; with strict=True none may fall through")


# --- models --------------------------------------------------------------------------------


def tiny_llama(transformers, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128):
    config = transformers.LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=100,
        max_position_embeddings=4096, attn_implementation="sdpa",
        # ~1/sqrt(hidden) instead of 0.02: scores of order 1, so attention is not uniform.
        initializer_range=hidden**-0.5)
    return transformers.LlamaModel(config).eval()


def llama_forward(mask):
    def f(model, x):
        return model(inputs_embeds=x, attention_mask=mask).last_hidden_state
    return f


def left_padding_mask(batch: int, n: int, pad: int) -> torch.Tensor:
    """(batch, n) 0/1: the last row starts with `pad` padding tokens."""
    mask = torch.ones(batch, n, dtype=torch.long, device=DEVICE)
    mask[-1, :pad] = 0
    return mask


def _inputs(*shape: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x, t = (torch.randn(shape, generator=generator) for _ in range(2))
    return x.to(DEVICE, dtype), t.to(DEVICE, dtype)


def check_llama(model, dtype, batch, n, padding: int, label: str,
                autocast: torch.dtype | None = None) -> None:
    hidden = model.config.hidden_size
    x, tx = _inputs(batch, n, hidden, dtype=dtype)
    mask = left_padding_mask(batch, n, padding) if padding else None
    # Left padding: the padded query rows see no key at all (HF's mask is causal AND key
    # padding: row i < pad of the padded sequence sees nothing). SDPA's forward gives such a
    # row zeros, but PyTorch's math path differentiates it to NaN (the gradients of every
    # parameter below it are NaN, in float64 as well), so there is no PyTorch floor or truth:
    # the math run and the float64 truth use `explicit_attention`, SDPA written out in
    # PyTorch operations that gives those rows zeros and zero derivatives (as jvp_attention
    # does). The hidden states at padded positions stay well defined (residual stream and
    # MLP), so every position is compared, not only the unpadded ones.
    ours, math_results, truth, counts, math_counts = run_three_ways(
        model, llama_forward(mask), (x,), (tx,), autocast=autocast, explicit=bool(padding))
    check_routing(counts, math_counts, label)
    check_against_truth(ours, math_results, truth, autocast or dtype, label)


def tiny_bert(transformers, hidden=32, layers=2, heads=2, intermediate=64, positions=64):
    config = transformers.BertConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate, vocab_size=100, max_position_embeddings=positions,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
        initializer_range=hidden**-0.5)
    return transformers.BertModel(config, add_pooling_layer=False).eval()


def bert_forward(mask):
    def f(model, x):
        return model(inputs_embeds=x, attention_mask=mask).last_hidden_state
    return f


def check_bert(model, dtype, batch, n, label: str) -> None:
    x, tx = _inputs(batch, n, model.config.hidden_size, dtype=dtype, seed=1)
    mask = torch.ones(batch, n, dtype=torch.long, device=DEVICE)
    mask[-1, n - n // 3:] = 0  # key padding at the end of the last sequence
    ours, math_results, truth, counts, math_counts = run_three_ways(
        model, bert_forward(mask), (x,), (tx,))
    check_routing(counts, math_counts, label)
    # Padded query rows still see the unpadded keys: every position is finite and compared.
    check_against_truth(ours, math_results, truth, dtype, label)


def decoder_layer(d_model=32, heads=2, feedforward=64):
    return torch.nn.TransformerDecoderLayer(d_model, heads, dim_feedforward=feedforward,
                                            dropout=0.0, batch_first=True).eval()


def check_decoder(layer, dtype, batch, n_tgt, n_mem, causal_hint: bool, memory_padding: bool,
                  label: str) -> None:
    d_model = layer.self_attn.embed_dim
    tgt, t_tgt = _inputs(batch, n_tgt, d_model, dtype=dtype, seed=2)
    memory, t_memory = _inputs(batch, n_mem, d_model, dtype=dtype, seed=3)
    tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(n_tgt, device=DEVICE,
                                                                    dtype=dtype)
    key_padding = None
    if memory_padding:  # bool, True = padding: the last memory keys of the last sequence
        key_padding = torch.zeros(batch, n_mem, dtype=torch.bool, device=DEVICE)
        key_padding[-1, n_mem - n_mem // 4:] = True

    def f(layer, tgt, memory):
        # With tgt_is_causal=True nn.MultiheadAttention drops the float mask and calls SDPA
        # with is_causal=True; with False it passes the -inf float mask itself.
        # (The float mask in the inputs' dtype: float64 for the truth.)
        return layer(tgt, memory, tgt_mask=tgt_mask.to(tgt.dtype), tgt_is_causal=causal_hint,
                     memory_key_padding_mask=key_padding)

    ours, math_results, truth, counts, math_counts = run_three_ways(
        layer, f, (tgt, memory), (t_tgt, t_memory))
    # Self- and cross-attention both call SDPA (need_weights=False in TransformerDecoderLayer).
    assert math_counts.calls == 2, (
        f"{label}: expected 2 SDPA calls, the math run made {math_counts.calls}")
    check_routing(counts, math_counts, label)
    check_against_truth(ours, math_results, truth, dtype, label)


def vit(VisionTransformer, img, patch, embed, depth, heads):  # noqa: N803 - a class
    return VisionTransformer(img_size=img, patch_size=patch, embed_dim=embed, depth=depth,
                             num_heads=heads, num_classes=10).eval()


def check_vit(model, dtype, batch, img, label: str) -> None:
    x, tx = _inputs(batch, 3, img, img, dtype=dtype, seed=4)

    def f(model, images):  # the tokens after the last block's norm: (B, 1 + patches, D)
        return model.forward_features(images)

    ours, math_results, truth, counts, math_counts = run_three_ways(model, f, (x,), (tx,))
    check_routing(counts, math_counts, label)
    check_against_truth(ours, math_results, truth, dtype, label)


def _build(factory, dtype, seed=0):
    torch.manual_seed(seed)
    model = factory().to(DEVICE, dtype)
    if HAS_CUDA and dtype in (torch.float16, torch.bfloat16):
        _layer_norms_in_fp32(model)
    return model


def _layer_norms_in_fp32(model: torch.nn.Module) -> None:
    """Compute each nn.LayerNorm of a 16-bit model in fp32 (rounding its output back).

    PyTorch (2.11, CUDA): torch.func.jvp through a 16-bit nn.LayerNorm gives an fp32 tangent
    (its forward-AD formula uses the fp32 mean and rstd it saves), and the next Linear then
    refuses fp32 tangent x 16-bit weight ("expected mat1 and mat2 to have the same dtype"):
    the unrouted PyTorch run fails before any attention. Mixed-precision models keep their
    norms in fp32 anyway (autocast runs layer_norm in fp32). All three runs see this model;
    the float64 truth's copy takes the plain path."""
    def forward(self, x):
        if x.dtype not in (torch.float16, torch.bfloat16):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        weight, bias = (None if p is None else p.float() for p in (self.weight, self.bias))
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias,
                            self.eps).to(x.dtype)

    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.forward = types.MethodType(forward, module)


# --- CPU-sized tests (they also run on the GPU) ----------------------------------------------


@pytest.mark.parametrize(("dtype", "padding"), [
    _case(torch.float32, 0, id="causal"),
    _case(torch.float32, 3, id="left_padding"),
    _case(torch.float16, 0, id="causal", gpu_only=True),  # fp16 causal: the autocast test
    _case(torch.float16, 3, id="left_padding"),
    _case(torch.bfloat16, 0, id="causal"),
    _case(torch.bfloat16, 3, id="left_padding"),
])
def test_llama(dtype: torch.dtype, padding: int) -> None:
    """HF LlamaModel with GQA (4 query heads, 2 kv heads: on CPU the kernels' time grows with
    batch x query heads), 2 layers, inputs_embeds. Pure causal (batch 1; SDPA gets
    is_causal=True, enable_gqa=True, no mask) or left padding (batch 2, the second row's
    first 3 tokens padding; SDPA gets a bool causal+padding mask with rows that see no key,
    and repeated kv heads)."""
    transformers = _import_transformers()
    model = _build(lambda: tiny_llama(transformers), dtype)
    check_llama(model, dtype, batch=2 if padding else 1, n=8, padding=padding,
                label=f"llama padding={padding}")


@pytest.mark.parametrize("autocast", _cpu_or_gpu_dtypes()[1:])
def test_llama_under_autocast(autocast: torch.dtype) -> None:
    """An fp32 Llama under torch.autocast (fp16 on CPU, whose autocast casts SDPA's inputs
    too; bf16 on the GPU): HF's rotary embedding gives fp32 q and k while v comes out of an
    autocast linear in the low dtype; SDPA under autocast casts all three to it, and sdpa()
    must apply the same rule rather than refuse mixed dtypes. Compared with PyTorch math
    under the same autocast, with eps in the autocast dtype's roundings."""
    transformers = _import_transformers()
    model = _build(lambda: tiny_llama(transformers), torch.float32)
    check_llama(model, torch.float32, batch=1, n=8, padding=0, label="llama autocast",
                autocast=autocast)


@pytest.mark.parametrize("dtype", _cpu_or_gpu_dtypes())
def test_bert(dtype: torch.dtype) -> None:
    """HF BertModel (bidirectional encoder; hidden 32, 2 heads, 2 layers), batch 2 x 12
    tokens with a key-padding attention_mask on the second row."""
    transformers = _import_transformers()
    model = _build(lambda: tiny_bert(transformers), dtype)
    check_bert(model, dtype, batch=2, n=12, label="bert")


@pytest.mark.parametrize(("dtype", "causal_hint", "memory_padding"), [
    _case(torch.float32, True, False, id="is_causal"),
    _case(torch.float32, False, True, id="float_mask-memory_padding"),
    _case(torch.float16, True, False, id="is_causal", gpu_only=True),
    _case(torch.float16, False, True, id="float_mask-memory_padding"),
    _case(torch.bfloat16, True, False, id="is_causal"),
    _case(torch.bfloat16, False, True, id="float_mask-memory_padding"),
])
def test_transformer_decoder_layer(dtype: torch.dtype, causal_hint: bool,
                                   memory_padding: bool) -> None:
    """nn.TransformerDecoderLayer (d_model 32, 2 heads): causal self-attention (is_causal=True,
    or the -inf float mask from generate_square_subsequent_mask) and cross-attention with
    Nq=8 != Nk=12 (with a memory key-padding mask, which MultiheadAttention merges into a
    float mask)."""
    layer = _build(decoder_layer, dtype)
    check_decoder(layer, dtype, batch=2, n_tgt=8, n_mem=12, causal_hint=causal_hint,
                  memory_padding=memory_padding,
                  label=f"decoder layer causal_hint={causal_hint} padding={memory_padding}")


@pytest.mark.parametrize("dtype", _cpu_or_gpu_dtypes())
def test_vit(dtype: torch.dtype) -> None:
    """timm VisionTransformer (img 32, patch 8: 17 tokens with the class token), JVP with
    respect to the image."""
    VisionTransformer = _import_timm()  # noqa: N806 - a class
    model = _build(lambda: vit(VisionTransformer, img=32, patch=8, embed=64, depth=2,
                               heads=4), dtype)
    check_vit(model, dtype, batch=2, img=32, label="vit tiny")


# --- realistic sizes, GPU only -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("padding", [0, 100], ids=["causal", "left_padding"])
@pytest.mark.parametrize("dtype", _dtype_params(GPU_DTYPES))
def test_llama_gpu(dtype: torch.dtype, padding: int) -> None:
    """Llama with hidden 1024, 16 query heads / 4 kv heads (head dim 64), 2 layers, seq 512."""
    transformers = _import_transformers()
    model = _build(lambda: tiny_llama(transformers, hidden=1024, layers=2, heads=16,
                                      kv_heads=4, intermediate=2816), dtype)
    check_llama(model, dtype, batch=2, n=512, padding=padding,
                label=f"llama-1024 padding={padding}")


@pytest.mark.gpu
@pytest.mark.parametrize("padding", [0, 100], ids=["causal", "left_padding"])
def test_llama_bf16_autocast_gpu(padding: int) -> None:
    """The fp32 Llama above under torch.autocast("cuda", dtype=torch.bfloat16): SDPA receives
    fp32 q, k (after rotary) and a bf16 v; routed, they must be cast as autocast casts them."""
    transformers = _import_transformers()
    model = _build(lambda: tiny_llama(transformers, hidden=1024, layers=2, heads=16,
                                      kv_heads=4, intermediate=2816), torch.float32)
    check_llama(model, torch.float32, batch=2, n=512, padding=padding,
                label=f"llama-1024 autocast padding={padding}", autocast=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _dtype_params(GPU_DTYPES))
def test_bert_gpu(dtype: torch.dtype) -> None:
    """BERT-base-like: hidden 768, 12 heads, intermediate 3072, 12 layers, seq 384."""
    transformers = _import_transformers()
    model = _build(lambda: tiny_bert(transformers, hidden=768, layers=12, heads=12,
                                     intermediate=3072, positions=512), dtype)
    check_bert(model, dtype, batch=2, n=384, label="bert-base")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _dtype_params(GPU_DTYPES))
def test_transformer_decoder_layer_gpu(dtype: torch.dtype) -> None:
    """d_model 512, 8 heads, target 256, memory 384, float causal mask and memory padding."""
    layer = _build(lambda: decoder_layer(d_model=512, heads=8, feedforward=2048), dtype)
    check_decoder(layer, dtype, batch=4, n_tgt=256, n_mem=384, causal_hint=False,
                  memory_padding=True, label="decoder layer 512")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _dtype_params(GPU_DTYPES))
def test_vit_small_gpu(dtype: torch.dtype) -> None:
    """ViT-S/16 at 224 px: embed 384, 6 heads, depth 12, 197 tokens."""
    VisionTransformer = _import_timm()  # noqa: N806 - a class
    model = _build(lambda: vit(VisionTransformer, img=224, patch=16, embed=384, depth=12,
                               heads=6), dtype)
    check_vit(model, dtype, batch=4, img=224, label="vit-s/16")
