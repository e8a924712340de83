"""Time every tile of an autotuned kernel's list (the forward+JVP kernel, or the dQ or dK/dV
kernel of the first- or the second-order backward) at given shapes and head dims, on a GPU:
what the autotuner chooses from, and how far the best tile of one head dim is from another's.
Times are GPU time per call from the profiler (short calls are bound by host work, so wall
time would hide the kernels): `ms` the swept kernel's, `call_ms` all of the call's kernels,
`kernels` each of them, largest first (where a call's time goes: the carry's range pass and
copies, the row statistics, the forward with its JVP before a backward). `--precision fast`
(or `accurate`) times the call in that precision, whatever the library's default.
The second-order key side's two passes (backward_dv_tangent, backward_dk_tangent) are one
kernel to the profiler, so their `ms` is both passes'; backward_dkdv_tangent sweeps the
single pass (`jvp_attention.backward.SPLIT_KEY_SIDE` off while it runs).

    python tools/tile_sweep.py --shape 64 12 256 --shape 32 12 1024 --head-dims 64 72 80 \
        --json sweep.json

Each tile runs alone (the autotuner's list is narrowed to it); a tile that cannot launch
(shared memory) is reported with its error. `auto` is the autotuner's own choice. With
`--check` each row also has `error_vs_math`: the call's largest error against a float64
reference (every output the call makes: O and tO, or the gradients), as a multiple of the
error of PyTorch's math attention (softmax(s QKᵀ) V) in the same dtype; the tests accept up
to 2. The references run on slices of the batch and heads whose float64 scores take at
most REFERENCE_CHUNK_BYTES each (the float64 scores of (4, 16, 4096) take 8.6 GB, and a
backward through both outputs keeps several such tensors), so any shape that can be timed
can be checked; it takes longer at long sequences. The rows also have `reproducible`:
whether REPEATS more calls gave bitwise the outputs of the first, which one call's error
can miss (a tile whose compiled form raced returned a wrong dtK in one call of eight,
chapter 6).
`--pair-tails on` (or `off`) times the forward with its half-full tail tiles paired (or
not) whatever the library would choose (chapter 2's `pair_tails`). `--key-layout transposed`
(or `stored`) has the dK/dV kernels accumulate dims x keys (or keys x dims) whatever the
library would choose (chapter 5's `TRANSPOSED`); the second order's key-side passes tune
their layout with their tile, and `--tiles` gives it as a fifth field ("64,16,8,2,1"), so
that one run times both layouts.
"""

import argparse
import json
import os
import shlex
import sys
import time
import unittest.mock
from contextlib import ExitStack
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # --smoke: Triton's interpreter, set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if HAS_CUDA else "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402

import jvp_attention  # noqa: E402
from jvp_attention import backward, forward  # noqa: E402
from jvp_attention.launch import tile_configs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def kernel_ms(call, calls: int) -> dict[str, float]:
    """GPU time per call of each kernel the call launches, from the profiler; on CPU (the
    interpreter's smoke run) the call's wall time, as "wall"."""
    call()
    if not HAS_CUDA:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return {"wall": (time.perf_counter() - start) / calls * 1e3}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / calls / 1e3 for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA}


def tile_name(config) -> str:
    kw = config.kwargs
    layout = " transposed" if kw.get("TRANSPOSED") else ""
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']} w{config.num_warps} s{config.num_stages}{layout}"


# Which autotuned kernel to sweep: (its autotuner, its kernel's name in the profiler, the call
# that runs it, FLOPs of that kernel's work as a multiple of the forward's 4*B*H*N*N*d or None).
KERNELS = {
    "forward_jvp": (forward._attention_forward_jvp, "_attention_forward_kernel", "fwd_jvp", 3),
    "backward_dq": (backward._backward_dq, "_attention_backward_dq_kernel", "meanflow", None),
    "backward_dkdv": (backward._backward_dkdv, "_attention_backward_dkdv_kernel", "meanflow",
                      None),
    "backward_dq_tangent": (backward._backward_dq_tangent, "_attention_backward_dq_kernel",
                            "second_order", None),
    "backward_dkdv_tangent": (backward._backward_dkdv_tangent,
                              "_attention_backward_dkdv_kernel", "second_order", None),
    "backward_dv_tangent": (backward._backward_dv_tangent,
                            "_attention_backward_dkdv_kernel", "second_order", None),
    "backward_dk_tangent": (backward._backward_dk_tangent,
                            "_attention_backward_dkdv_kernel", "second_order", None),
}


def make_inputs(shape: tuple[int, int, int, int], dtype: torch.dtype, mode: str):
    """Primals, tangents and output cotangents for a call in `mode`, seeded."""
    torch.manual_seed(0)
    backward_too, both = mode != "fwd_jvp", mode == "second_order"
    primals = [torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=backward_too)
               for _ in range(3)]
    tangents = [torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=both)
                for _ in range(3)]
    grads = [torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(2)]
    return primals, tangents, grads


def make_call(inputs, mode: str, attention=None):
    """`torch.func.jvp(attention)` on `inputs`, then for "meanflow" the backward through the
    primal output, for "second_order" the backward through both outputs. The call returns
    what it computed: (O, tO), or the gradients."""
    attention = attention or jvp_attention.attention
    primals, tangents, grads = inputs

    def call():
        out, t_out = torch.func.jvp(attention, tuple(primals), tuple(tangents))
        if mode == "second_order":
            return torch.autograd.grad((out, t_out), (*primals, *tangents), grads)
        if mode == "meanflow":
            return torch.autograd.grad(out, primals, grads[0])
        return out, t_out

    return call


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(s Q Kᵀ) V in PyTorch operations, in the inputs' dtype."""
    return torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v


REPEATS = 7  # calls compared with the first one by `--check`


def reproducible(call, first) -> bool:
    """Whether REPEATS more calls return bitwise the tensors `first` (one call's)."""
    first = [x.detach().clone() for x in first]
    return all(torch.equal(a, b.detach()) for _ in range(REPEATS)
               for a, b in zip(first, call(), strict=True))


# Bytes the float64 scores of one slice of the reference may take.
REFERENCE_CHUNK_BYTES = 2**30


def reference_slices(shape: torch.Size) -> list[tuple[slice, slice]]:
    """(batch, heads) slices of inputs of `shape` (B, H, N, d) whose float64 scores take at
    most REFERENCE_CHUNK_BYTES each (a single head if even one is larger): whole batch
    entries where their heads fit, else heads in groups."""
    b, h, n = shape[:3]
    per_head = n * n * 8
    heads = max(1, min(h, REFERENCE_CHUNK_BYTES // per_head))
    batch = max(1, REFERENCE_CHUNK_BYTES // (per_head * h)) if heads == h else 1
    return [(slice(i, i + batch), slice(j, j + heads))
            for i in range(0, b, batch) for j in range(0, h, heads)]


def sliced_call(inputs, mode: str, attention, dtype: torch.dtype) -> list[torch.Tensor]:
    """What the call in `mode` through `attention` returns on `inputs` cast to `dtype` (new
    leaves, requires_grad kept), computed slice by slice (`reference_slices`) and put back
    together: attention and its gradients are independent across batch entries and heads."""
    by_batch: dict[tuple[int, int], list[list[torch.Tensor]]] = {}
    for batch, heads in reference_slices(inputs[0][0].shape):
        part = [[x.detach()[batch, heads].to(dtype).requires_grad_(x.requires_grad)
                 for x in group] for group in inputs]
        outputs = [y.detach() for y in make_call(part, mode, attention)()]
        by_batch.setdefault((batch.start, batch.stop), []).append(outputs)
    rows = [[torch.cat(pieces, dim=1) for pieces in zip(*parts, strict=True)]
            for parts in by_batch.values()]
    return [torch.cat(pieces, dim=0) for pieces in zip(*rows, strict=True)]


def accuracy_check(inputs, mode: str):
    """A function of the call's outputs giving their largest error against the float64
    reference as a multiple of the math attention's in the inputs' dtype."""
    truth = sliced_call(inputs, mode, math_attention, torch.float64)
    math = sliced_call(inputs, mode, math_attention, inputs[0][0].dtype)
    floors = [(m.double() - t).abs().max().item() for m, t in zip(math, truth, strict=True)]
    del math

    def error_vs_math(outputs) -> float:
        return max((o.detach().double() - t).abs().max().item() / max(f, 1e-30)
                   for o, t, f in zip(outputs, truth, floors, strict=True))

    return error_vs_math


def sweep(shape: tuple[int, int, int, int], dtype: torch.dtype, calls: int,
          tiles: list | None = None, kernel: str = "forward_jvp",
          check: bool = False, auto_only: bool = False) -> list[dict]:
    """One row per tile (and one for the autotuner's choice among them) at `shape` =
    (B, H, N, d); `tiles`: configurations to try in place of the kernel's list; `check`:
    each row's `error_vs_math` too (see the module's docstring); `auto_only`: the
    autotuner's choice alone."""
    tuner, name, mode, multiple = KERNELS[kernel]
    inputs = make_inputs(shape, dtype, mode)
    call = make_call(inputs, mode)
    error_vs_math = accuracy_check(inputs, mode) if check else None
    b, h, n, d = shape
    every = list(tuner.configs)
    candidates = tiles or every
    rows = []
    # backward_dkdv_tangent is the key side in one pass; the dv/dk passes run by default.
    split_key_side = backward.SPLIT_KEY_SIDE
    backward.SPLIT_KEY_SIDE = kernel != "backward_dkdv_tangent"
    try:
        for config in [None] if auto_only else [*candidates, None]:
            tuner.configs = candidates if config is None else [config]
            forget_tiles(tuner)
            row = {"kernel": kernel, "B": b, "H": h, "N": n, "d": d,
                   "tile": "auto" if config is None else tile_name(config)}
            try:
                times = kernel_ms(call, calls)
                row |= {"ms": round(times.get(name, times.get("wall", float("nan"))), 4),
                        "call_ms": round(sum(times.values()), 4),
                        "kernels": {kernel_name: round(ms, 4) for kernel_name, ms in
                                    sorted(times.items(), key=lambda item: -item[1])}}
                if multiple and HAS_CUDA:
                    row["tflops"] = round(multiple * 4 * b * h * n * n * d / row["ms"] / 1e9, 1)
                if config is None:
                    row["chosen"] = tile_name(tuner.best_config)
                if error_vs_math is not None:
                    first = call()
                    row["error_vs_math"] = round(error_vs_math(first), 3)
                    row["reproducible"] = reproducible(call, first)
            except Exception as error:  # noqa: BLE001 - a tile that cannot launch is a row
                row["error"] = f"{type(error).__name__}: {str(error)[:120]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        backward.SPLIT_KEY_SIDE = split_key_side
        tuner.configs = every
        forget_tiles(tuner)
    return rows


def forget_tiles(tuner) -> None:
    """Make `tuner` choose its tile again at its next launch: the tuned keys, Triton's
    timings and the launches it remembers with their tiles (`KeyedAutotuner.launches`)."""
    tuner.tuned.clear()
    tuner.cache.clear()
    tuner.launches.clear()


def pairing_tails(setting: str):
    """A context in which the forward pairs its tail tiles (`pair_tails`, chapter 2) as the
    library chooses ("auto"), wherever a tail tile is at most half full ("on": also for
    single products, carried or "fast"), or nowhere ("off")."""
    chosen = forward.pair_tails

    def pair(tiles: dict, head_dim: int, value_dim: int, paired: bool) -> dict:
        return chosen(tiles, head_dim, value_dim, paired if setting == "auto" else setting == "on")

    return unittest.mock.patch.object(forward, "pair_tails", pair)


# The autotuned dK/dV kernels, whose launches say how they lay out their accumulators.
KEY_SIDE_TUNERS = ("_backward_dkdv", "_backward_dkdv_tangent", "_backward_dv_tangent",
                   "_backward_dk_tangent")


def carries_layout(tuner) -> bool:
    """Whether `tuner`'s tiles carry their dK/dV layout (the second order's key side,
    chapter 5's `laid_out`) rather than take it from the launch (the first order's)."""
    return any("TRANSPOSED" in config.kwargs for config in tuner.configs)


def in_layout(configs: list, setting: str) -> list:
    """`configs` with the layout `setting` asks ("stored", "transposed"; "library": each
    tile's own, stored where it has none), duplicates dropped."""
    laid = []
    for config in configs:
        transposed = (config.kwargs.get("TRANSPOSED", False) if setting == "library"
                      else setting == "transposed")
        tile = triton.Config({**config.kwargs, "TRANSPOSED": transposed},
                             num_warps=config.num_warps, num_stages=config.num_stages)
        if tile_name(tile) not in map(tile_name, laid):
            laid.append(tile)
    return laid


def laying_out_keys(setting: str) -> ExitStack:
    """A context in which the dK/dV kernels accumulate keys x dims ("stored"), dims x keys
    ("transposed") or as the library chooses ("library"): the tiles that carry their
    layout take it, the other launches have their TRANSPOSED argument overridden."""
    stack = ExitStack()
    if setting == "library":
        return stack
    for name in KEY_SIDE_TUNERS:
        tuner = getattr(backward, name)
        if carries_layout(tuner):
            stack.enter_context(unittest.mock.patch.object(
                tuner, "configs", in_layout(tuner.configs, setting)))
            continue

        def run(*args, _run=tuner.run, **kwargs):
            return _run(*args, **{**kwargs, "TRANSPOSED": setting == "transposed"})

        stack.enter_context(unittest.mock.patch.object(tuner, "run", run))
    return stack


def parse_tiles(text: str, tuner, setting: str) -> list:
    """--tiles 'M,N,warps,stages[,transposed];...' as configurations of `tuner`: a fifth
    field 1 (or 0) lays a second-order key-side tile out transposed (or stored)."""
    fields = [tuple(int(x) for x in tile.split(",")) for tile in text.split(";")]
    if any(len(tile) not in (4, 5) for tile in fields):
        raise ValueError(f"a tile is M,N,warps,stages[,transposed]: {text!r}")
    if not carries_layout(tuner):
        if any(len(tile) == 5 for tile in fields):
            raise ValueError("only the second order's key-side passes take a layout per "
                             "tile; use --key-layout for the others")
        return tile_configs(fields)
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "TRANSPOSED": bool(rest and rest[0])},
                             num_warps=w, num_stages=st) for m, n, w, st, *rest in fields]
    return in_layout(configs, setting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", nargs=3, type=int, action="append", metavar=("B", "H", "N"),
                        help="batch, heads, tokens (repeatable); default 64 12 256")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 72])
    parser.add_argument("--kernel", choices=KERNELS, default="forward_jvp",
                        help="the autotuned kernel to sweep; the first-order backward's kernels "
                        "are timed inside a MeanFlow call (forward+JVP, then the primal "
                        "backward), the *_tangent ones inside a backward through both outputs")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tiles", help="try these tiles instead of the kernel's list: "
                        "'M,N,warps,stages;...', for the second order's key-side passes "
                        "'M,N,warps,stages,transposed' too (1: dims x keys) "
                        "(tools/kernel_resources.py checks them for spills without a GPU)")
    parser.add_argument("--check", action="store_true",
                        help="also compare each tile's outputs with a float64 reference "
                        "(error_vs_math: a multiple of PyTorch's math attention's error)")
    parser.add_argument("--auto-only", action="store_true",
                        help="time the autotuner's choice alone, not each tile: the call as "
                        "users get it (run with JVP_ATTENTION_TMA=0 and =1 to compare "
                        "pointer loads with tensor descriptors)")
    parser.add_argument("--pair-tails", choices=("auto", "on", "off"), default="auto",
                        help="the forward's paired tail tiles (chapter 2): as the library "
                        "chooses, wherever a tail tile is at most half full (also for single "
                        "products), or nowhere")
    parser.add_argument("--key-layout", choices=("library", "stored", "transposed"),
                        default="library",
                        help="the dK/dV kernels' accumulators (chapter 5): as the library lays "
                        "them out, keys x dims, or dims x keys")
    parser.add_argument("--precision", choices=("accurate", "fast"),
                        help="the 16-bit products' rounding (jvp_attention.precision; default: "
                        "the library's, JVP_ATTENTION_PRECISION or accurate)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--smoke", action="store_true",
                        help="(1, 1, 16, 16) in fp16, once per tile: checks the plumbing (on "
                        "CPU through Triton's interpreter, timed by the wall clock)")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.head_dims, args.dtype, args.calls = [[1, 1, 16]], [16], "fp16", 1
    elif not HAS_CUDA:
        parser.error("the sweep times kernels on a CUDA GPU (--smoke checks the plumbing on "
                     "CPU)")
    try:
        tiles = args.tiles and parse_tiles(args.tiles, KERNELS[args.kernel][0], args.key_layout)
    except ValueError as error:
        parser.error(str(error))
    precision = jvp_attention.precision(args.precision or jvp_attention.get_precision())
    with precision, pairing_tails(args.pair_tails), laying_out_keys(args.key_layout):
        rows = [row for b, h, n in (args.shape or [[64, 12, 256]]) for d in args.head_dims
                for row in sweep((b, h, n, d), DTYPES[args.dtype], args.calls, tiles,
                                 args.kernel, args.check, args.auto_only)]
    if args.json:
        args.json.write_text(json.dumps({"command": shlex.join(["python", *sys.argv]),
                                         "dtype": args.dtype,
                                         "precision": args.precision
                                         or jvp_attention.get_precision(),
                                         "pair_tails": args.pair_tails,
                                         "key_layout": args.key_layout,
                                         "gpu": torch.cuda.get_device_name() if HAS_CUDA
                                         else None,
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
