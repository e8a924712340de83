#!/usr/bin/env python3
"""Where a call's host time goes: the training-shapes steps of `training_shapes.py` with a
timer around each layer of the call path. Saved as JSON.

    python benchmarks/host_breakdown.py --out benchmarks/results/host_breakdown_h200.json
    python benchmarks/host_breakdown.py --smoke   # CPU: the tiny shape, Triton's interpreter

At DiT's shapes a call is bound by the host (chapter 8: about 0.36 ms per forward+JVP and
1.7 ms per MeanFlow step at (64, 12, 256, 64) on the H200, against 0.23 and 0.55 ms of GPU
work), and a profile of the CPU alone cannot say which layer costs what: with the kernels
mocked out the same MeanFlow step takes about 0.4 ms of Python. So the real step runs here
with each layer wrapped in a `time.perf_counter` timer, on whichever thread it runs (the
autograd engine runs the backward on a thread of its own on CUDA):

- `attention`: the public call (argument checks, dual unpacking, the autograd Function);
- `functorch lift (_apply)`: inside `torch.func.jvp`, the unwrapping of the inputs from the
  transform's level and the wrapping of the outputs around the autograd Function (chapter 7),
  and inside it `Function.apply (_apply_bound)`: PyTorch's `Function.apply` (the autograd
  node, saved tensors) around the forward launcher;
- the forward and backward launchers (`flash_attention_forward`, `flash_attention_backward`:
  our Python around the Triton launches, the launches included);
- `KeyedAutotuner.run`: our autotuner's dispatch of a tuned launch;
- `CachedLauncher.run`: our launch of a compiled kernel, which skips `JITFunction.run` for
  a launch that matches an earlier one (chapter 2);
- `CachedLauncher.launch`: the direct launch of a remembered kernel (the arguments in
  signature order, the grid, Triton's C launcher), which the autotuner calls itself for a
  tuned launch seen before, so `CachedLauncher.run` no longer counts those;
- `JITFunction.run`: Triton's launch (argument binding and specialisation, the cache lookup,
  launch metadata), and inside it the C launcher (`CudaLauncher.__call__`: scratch
  allocation, tensor-descriptor encoding, `cuLaunchKernelEx`);
- under the interpreter, `InterpretedFunction.run` in their place (it runs the kernel);
- `CallReplay`: a launcher's replay of a call seen before (its scratch tensors, the
  places of its tensors), and inside it
- `ReplayedLaunch`: a launch repeated from an earlier call at the same key (chapter 2's
  "Replaying a call"): from a call's third step on (the first tunes, the second records),
  its launches go straight to the C launcher (or the interpreter) and none of the layers
  from `KeyedAutotuner.run` to `JITFunction.run` runs.

The compiled columns (`ours_compiled`, `ours_cudagraphs`, CUDA only) run after the eager
ones, without the `attention` timer, which torch.compile would trace as a graph break; the
compiled graph calls our operators, whose launchers are timed as in eager mode (under CUDA
graphs a replay calls none of them).

Each layer's time is inclusive (the layers nest in this order) and is divided by the number
of steps: microseconds per call. Timers cost about a microsecond per wrapped call. The step
itself is timed by the same clock over the same steps; the `floor` implementation (`v.clone()`)
gives PyTorch's own cost of the step. The GPU is kept ahead of nothing here: choose shapes
where the host is the bound (the default, DiT-B/2 at 256 px), else calls wait for the GPU.

`--backward-thread calling` runs every step under
`torch.autograd.set_multithreading_enabled(False)`: on CUDA the autograd engine then runs the
backward on the thread that called `.backward()` instead of handing it to its device thread
(chapter 8, "The autograd engine's thread"). On CPU the engine uses the calling thread either
way.
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import training_shapes as ts  # noqa: E402  (sets TRITON_INTERPRET on CPU before triton)

bench = ts.bench
torch = ts.torch
SCHEMA = "jvp_attention.host_breakdown/1"
IMPLS = ("ours", "ours_compiled", "ours_cudagraphs", "floor")
# Layers that torch.compile would trace through (a timer there is a graph break): timed in
# eager columns only. Below them the compiled graph calls our operators, whose launchers run
# as in eager mode.
TRACED_LAYERS = ("attention", "functorch lift (_apply)", "Function.apply (_apply_bound)")


class LayerTimers:
    """Inclusive wall time and call counts of wrapped callables, on every thread."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._undo: dict[str, list[Callable[[], None]]] = {}

    def wrap(self, label: str, owner: object, name: str) -> None:
        """Time `owner.name` as `label`; a module function is replaced wherever a module of
        the package imported it by name."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                with self._lock:
                    self.seconds[label] = self.seconds.get(label, 0.0) + spent
                    self.calls[label] = self.calls.get(label, 0) + 1

        holders = [owner]
        if not isinstance(owner, type):  # a module: also where the function was imported
            holders += [module for module_name, module in list(sys.modules.items())
                        if module_name.split(".")[0] == "jvp_attention" and module is not owner
                        and getattr(module, name, None) is original]
        for holder in holders:
            setattr(holder, name, timed)
            self._undo.setdefault(label, []).append(
                functools.partial(setattr, holder, name, original))
        self.seconds.setdefault(label, 0.0)
        self.calls.setdefault(label, 0)

    def reset(self) -> None:
        for label in self.seconds:
            self.seconds[label], self.calls[label] = 0.0, 0

    def unwrap(self, label: str) -> None:
        """Put the original of `label` back (it is no longer timed)."""
        for undo in reversed(self._undo.pop(label, [])):
            undo()

    def restore(self) -> None:
        for label in list(self._undo):
            self.unwrap(label)


def call_layers() -> list[tuple[str, object, str]]:
    """(label, owner, attribute) of each layer of a call, outermost first; those that this
    Triton or device does not have are left out."""
    import jvp_attention.autograd as autograd
    import jvp_attention.backward as backward
    import jvp_attention.forward as forward
    import jvp_attention.launch as launch

    layers = [("attention", autograd, "attention"),
              ("functorch lift (_apply)", autograd, "_apply"),
              ("Function.apply (_apply_bound)", autograd, "_apply_bound"),
              ("forward launcher", forward, "flash_attention_forward"),
              ("backward launcher", backward, "flash_attention_backward"),
              ("KeyedAutotuner.run", launch.KeyedAutotuner, "run"),
              ("CachedLauncher.run", launch.CachedLauncher, "run")]
    if hasattr(launch.CachedLauncher, "launch"):
        layers.append(("CachedLauncher.launch", launch.CachedLauncher, "launch"))
    if hasattr(launch, "CallReplay"):
        layers.append(("CallReplay (a replayed call)", launch.CallReplay, "__call__"))
    if hasattr(launch, "ReplayedLaunch"):
        layers.append(("ReplayedLaunch (a replayed launch)", launch.ReplayedLaunch, "__call__"))
    if ts.HAS_CUDA:
        from triton.runtime.jit import JITFunction
        layers.append(("Triton JITFunction.run", JITFunction, "run"))
        try:
            from triton.backends.nvidia.driver import CudaLauncher
            layers.append(("Triton C launcher", CudaLauncher, "__call__"))
        except ImportError:
            pass
    else:
        from triton.runtime.interpreter import InterpretedFunction
        layers.append(("Triton interpreter (runs the kernel)", InterpretedFunction, "run"))
    return layers


def helper_layers() -> list[tuple[str, object, str]]:
    """(label, owner, attribute) of the helpers that the launchers call between their
    launches (`--helpers`): not layers of one nest but pieces of the launchers' own time,
    each inclusive of what it calls. `torch.empty` and `torch.empty_like` count every caller
    during the step (PyTorch's Python too), and `torch.cuda.device`'s enter and exit every
    device switch."""
    import jvp_attention.autograd as autograd
    import jvp_attention.launch as launch

    helpers = [("argument checks (check_arguments)", autograd, "check_arguments"),
               ("the carry (carried_operands: range pass and copies)", launch,
                "carried_operands"),
               ("tma_eligible", launch, "tma_eligible"),
               ("prepare_descriptors", launch, "prepare_descriptors"),
               ("row_strides", launch, "row_strides"),
               ("row_alignment", launch, "row_alignment"),
               ("torch.empty (every caller)", torch, "empty"),
               ("torch.empty_like (every caller)", torch, "empty_like")]
    if ts.HAS_CUDA:
        helpers += [("torch.cuda.device enter", torch.cuda.device, "__enter__"),
                    ("torch.cuda.device exit", torch.cuda.device, "__exit__")]
    return helpers


def breakdown(case: ts.Case, args: argparse.Namespace, timers: LayerTimers,
              helpers: frozenset[str] = frozenset()) -> dict:
    """Warm the case's step up, then time `args.steps` steps: per call, the step and each
    layer."""
    step = ts.make_step(case, "cuda" if ts.HAS_CUDA else "cpu", args)
    with torch.autograd.set_multithreading_enabled(args.backward_thread == "device"):
        return timed_steps(step, case, args, timers, helpers)


def timed_steps(step, case: ts.Case, args: argparse.Namespace, timers: LayerTimers,
                helpers: frozenset[str]) -> dict:
    """`breakdown`'s measurement of a step made for `case`."""
    if step.eager is not None:  # compiled: Triton compiles and tunes the kernels eagerly first
        step.eager()
    for _ in range(args.warmup_steps):  # compilation, CUDA-graph recording
        step()
    ts.synchronize()
    timers.reset()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    step_s = time.perf_counter() - start
    ts.synchronize()
    ts.clear_grads(step)
    if case.impl in ts.COMPILE_MODES:
        torch._dynamo.reset()  # drops the compiled code and the CUDA graphs' memory pools
    per_call = {label: {"us": round(seconds / args.steps * 1e6, 2),
                        "calls": round(timers.calls[label] / args.steps, 3)}
                for label, seconds in timers.seconds.items() if timers.calls[label]}
    row = {"shape": case.shape, "impl": case.impl, "mode": case.mode,
           "B": case.B, "H": case.H, "N": case.N, "d": case.d, "dtype": case.dtype,
           "steps": args.steps, "step_us": round(step_s / args.steps * 1e6, 2),
           "layers": {label: part for label, part in per_call.items() if label not in helpers}}
    if helpers:
        row["helpers"] = {label: part for label, part in per_call.items() if label in helpers}
    return row


def print_row(row: dict) -> None:
    print(f"{row['shape']:11} {row['impl']:15} {row['mode']:12} step {row['step_us']:9.1f} µs")
    for label, part in row["layers"].items():
        print(f"    {label:38} {part['us']:9.1f} µs  {part['calls']:6.2f} calls")
    for label, part in row.get("helpers", {}).items():
        print(f"      helper: {label:52} {part['us']:9.1f} µs  {part['calls']:6.2f} calls")


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny shape on CPU through Triton's interpreter (plumbing)")
    parser.add_argument("--shape", nargs="+", choices=list(ts.SHAPES), default=["dit-b2-256"])
    parser.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS),
                        help="columns (default: all; the compiled ones need CUDA)")
    parser.add_argument("--mode", nargs="+", choices=ts.MODES, default=list(ts.MODES))
    parser.add_argument("--dtype", choices=list(ts.DTYPES), default=None,
                        help="default bf16 on CUDA, fp16 on CPU")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per case (default 200 on CUDA, 2 on CPU)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="untimed steps first (default 5 on CUDA, 2 on CPU: a call is "
                             "replayed from its third step on)")
    parser.add_argument("--cpu-compile", action="store_true",
                        help="on CPU, run ours_compiled through the aot_eager backend "
                             "(plumbing)")
    parser.add_argument("--layout", choices=list(ts.LAYOUTS), default="contiguous",
                        help="the inputs' layout, as in training_shapes.py")
    parser.add_argument("--helpers", action="store_true",
                        help="also time the helpers the launchers call between their launches "
                             "(allocations, the carry, descriptor checks, device switches): "
                             "each row's `helpers`, apart from its nested `layers`")
    parser.add_argument("--backward-thread", choices=("device", "calling"), default="device",
                        help="where PyTorch's autograd engine runs the backward on CUDA: its "
                             "device thread (the default) or the thread that calls .backward() "
                             "(torch.autograd.set_multithreading_enabled(False))")
    parser.add_argument("--parameter-bias", action="store_true",
                        help="every call takes a learnable (1, H, N, N) additive bias, closed "
                             "over as a parameter (no tangent; its gradient in the backward): "
                             "a relative-position bias's call path (the floor ignores it)")
    parser.add_argument("--out", type=Path, help="the JSON file to write")
    args = parser.parse_args(None if argv is None else list(argv))
    if args.dtype is None:
        args.dtype = "bf16" if ts.HAS_CUDA else "fp16"
    if args.steps is None:
        args.steps = 200 if ts.HAS_CUDA else 2
    if args.warmup_steps is None:
        args.warmup_steps = 5 if ts.HAS_CUDA else 2
    # What training_shapes.make_step reads besides these.
    args.math_limit_gb = 100.0
    return args


def main(argv: Iterable[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():  # not hours in the interpreter
        raise SystemExit(f"{Path(__file__).name} needs a CUDA GPU (none found); "
                         "--smoke runs a tiny case on the CPU")
    shapes = ts.SMOKE_SHAPES if args.smoke else {name: ts.SHAPES[name] for name in args.shape}
    timers = LayerTimers()
    for label, owner, name in call_layers():
        timers.wrap(label, owner, name)
    helpers = frozenset(label for label, _, _ in helper_layers()) if args.helpers else frozenset()
    for label, owner, name in helper_layers() if args.helpers else ():
        timers.wrap(label, owner, name)
    rows, skipped = [], {}
    try:
        for shape, (b, h, n, d) in shapes.items():
            for impl in sorted(args.impl, key=lambda i: i in ts.COMPILE_MODES):  # eager first
                if impl in ts.COMPILE_MODES:
                    if not ts.HAS_CUDA and not (impl == "ours_compiled" and args.cpu_compile):
                        skipped[impl] = ("CUDA only" if impl == "ours_cudagraphs" else
                                         "on CPU only with --cpu-compile (aot_eager)")
                        print(f"{impl}: skipped ({skipped[impl]})")
                        continue
                    for label in TRACED_LAYERS:
                        timers.unwrap(label)
                for mode in args.mode:
                    row = breakdown(ts.Case(shape, impl, mode, b, h, n, d, args.dtype), args,
                                    timers, helpers)
                    print_row(row)
                    rows.append(row)
    finally:
        timers.restore()
    result = {**bench.run_record(SCHEMA, args.smoke),
              "settings": {"dtype": args.dtype, "layout": args.layout, "steps": args.steps,
                           "warmup_steps": args.warmup_steps,
                           "precision": bench.precision_mode(), "floor_op": ts.FLOOR_OP,
                           "helpers": args.helpers, "backward_thread": args.backward_thread,
                           "parameter_bias": args.parameter_bias},
              "rows": rows, "skipped": skipped}
    if args.out is not None:
        bench.write_json(args.out, result)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
