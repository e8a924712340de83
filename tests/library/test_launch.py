"""Chapter 2's `CachedLauncher`: which launches skip Triton's per-launch Python, and that
those call the compiled kernel exactly as `JITFunction.run` would.

On CPU no kernel is compiled, so a stand-in kernel records what reaches Triton's path and
what reaches the compiled kernel's launcher."""

import inspect
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
import triton
from helpers import DEVICE, CompiledStandIn

import jvp_attention.launch as launch

REPO = Path(__file__).resolve().parents[2]


class _Kernel:
    """A `@triton.jit` kernel's stand-in, `kernel(x_ptr, n, scale, shape, BLOCK, FLAG=False)`:
    records the launches that go through Triton's `run`."""

    arg_names = ["x_ptr", "n", "scale", "shape", "BLOCK", "FLAG"]
    params = [types.SimpleNamespace(name=name, default=False if name == "FLAG" else object())
              for name in arg_names]

    def __init__(self):
        self.pre_run_hooks = []
        self.triton_launches = 0
        self.compiled = CompiledStandIn()

    def run(self, *args, grid, warmup, **kwargs):
        self.triton_launches += 1
        self.ptxas = os.environ.get("TRITON_PTXAS_PATH")  # what Triton would compile with
        return self.compiled


@pytest.fixture
def launcher(monkeypatch):
    """A CachedLauncher over the stand-in, as on a GPU: device 0, stream 7, an H200 (sm_90)."""
    active = types.SimpleNamespace(get_current_device=lambda: 0,
                                   get_current_stream=lambda device: 7,
                                   get_current_target=lambda: types.SimpleNamespace(arch=90))
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=active))
    cached = launch.CachedLauncher(_Kernel())
    cached.direct = True  # the stand-in is no JITFunction
    return cached


def _launch(launcher, x, n=64, scale=0.5, grid=(3, 2), **kwargs):
    return launcher[grid](x, n, scale, (n, 2 * n), BLOCK=16, **kwargs)


def test_a_repeated_launch_calls_the_compiled_kernel(launcher) -> None:
    x = torch.zeros(64, dtype=torch.float16)
    _launch(launcher, x)
    assert launcher.kernel.triton_launches == 1 and not launcher.kernel.compiled.launches
    _launch(launcher, x)
    _launch(launcher, torch.ones(64, dtype=torch.float16))  # same dtype and alignment
    assert launcher.kernel.triton_launches == 1
    # The arguments in signature order, keywords and defaults included, after the grid, the
    # stream and the kernel's handles, as JITFunction.run passes them (no hooks).
    x2 = launcher.kernel.compiled.launches[-1][9]
    assert launcher.kernel.compiled.launches[-1] == (
        3, 2, 1, 7, "function-handle", "packed-metadata", None, None, None,
        x2, 64, 0.5, (64, 128), 16, False)


def test_launches_through_triton_compile_with_the_sound_ptxas(launcher, monkeypatch) -> None:
    """Triton's path (which compiles) runs under `sound_compiler`; Triton's own settings are
    back afterwards."""
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    _launch(launcher, torch.zeros(64, dtype=torch.float16))
    assert launcher.kernel.ptxas == launch.sound_ptxas(90)
    assert "TRITON_PTXAS_PATH" not in os.environ
    launcher.kernel.pre_run_hooks.append(lambda *args, **kwargs: None)  # Triton's path again
    _launch(launcher, torch.zeros(64, dtype=torch.float16))
    assert launcher.kernel.triton_launches == 2 and launcher.kernel.ptxas == launch.sound_ptxas(90)


def test_a_callable_grid_sees_every_argument(launcher) -> None:
    """A grid that asks for a positional argument by name gets every argument, as from
    Triton; one that reads only meta-parameters (every grid of this library) gets the
    keywords, without a dictionary of all ~60 arguments built per launch."""
    x = torch.zeros(64, dtype=torch.float16)
    seen = []

    def grid(meta):
        seen.append(dict(meta))
        return (triton.cdiv(meta["n"], meta["BLOCK"]),)

    _launch(launcher, x, grid=grid)
    _launch(launcher, x, grid=grid)
    assert seen[-1] == {"x_ptr": x, "n": 64, "scale": 0.5, "shape": (64, 128), "BLOCK": 16,
                        "FLAG": False}
    assert launcher.kernel.compiled.launches[-1][:3] == (4, 1, 1)
    seen.clear()

    def meta_grid(meta):
        seen.append(dict(meta))
        return (triton.cdiv(64, meta["BLOCK"]), 2)

    _launch(launcher, x, grid=meta_grid)
    assert seen == [{"BLOCK": 16}]
    assert launcher.kernel.compiled.launches[-1][:3] == (4, 2, 1)


def test_a_tuned_launch_seen_before_goes_straight_to_its_kernel(launcher) -> None:
    """`KeyedAutotuner` remembers, per launch the `CachedLauncher` would match, the tile and
    the compiled kernel: from the third launch on (the first tunes, the second compiles the
    tile) no tuning key is built and the kernel gets the tile's meta-parameters, as through
    Triton's autotuner."""
    kernel = launcher.kernel
    kernel.fn = lambda x_ptr, n, scale, shape, BLOCK, FLAG=False: None  # Autotuner's base_fn
    config = triton.Config({"BLOCK": 32}, num_warps=4, num_stages=1)
    tuner = launch.KeyedAutotuner(kernel, [config], ["n"])
    tuner.launcher = launcher
    keys = []
    launch_key = tuner.launch_key
    tuner.launch_key = lambda *a: keys.append(a) or launch_key(*a)
    seen = []

    def grid(meta):
        seen.append(meta["BLOCK"])
        return (triton.cdiv(64, meta["BLOCK"]),)

    x = torch.zeros(64, dtype=torch.float16)
    tuner[grid](x, 64, 0.5, (64, 128))
    tuner[grid](x, 64, 0.5, (64, 128))
    assert kernel.triton_launches == 2 and len(tuner.launches) == 1 and len(keys) == 2
    tuner[grid](torch.ones(64, dtype=torch.float16), 64, 0.5, (64, 128))
    assert kernel.triton_launches == 2 and len(keys) == 2 and tuner.best_config is config
    last = kernel.compiled.launches[-1]
    assert last[:3] == (2, 1, 1) and seen[-1] == 32
    assert last[10:] == (64, 0.5, (64, 128), 32, False)
    tuner[grid](x, 48, 0.5, (64, 128))  # another value: through the autotuner and Triton
    assert kernel.triton_launches == 3 and len(keys) == 3


def test_a_remembered_launch_follows_a_retuned_tile(launcher) -> None:
    """Code that forces a tile resets what the autotuner tuned (a tile sweep, a test): the
    remembered launch then no longer holds the tuned tile and the launch tunes again, even
    when `KeyedAutotuner.launches` is left as it was."""
    kernel = launcher.kernel
    kernel.fn = lambda x_ptr, n, scale, shape, BLOCK, FLAG=False: None  # Autotuner's base_fn
    tuner = launch.KeyedAutotuner(kernel, [triton.Config({"BLOCK": 32}, num_warps=4)], ["n"])
    tuner.launcher = launcher
    x = torch.zeros(64, dtype=torch.float16)
    for _ in range(3):  # tune, compile the tile, then the remembered launch
        tuner[(1,)](x, 64, 0.5, (64, 128))
    assert tuner.launches and kernel.compiled.launches[-1][13] == 32
    tuner.configs = [triton.Config({"BLOCK": 16}, num_warps=4)]
    tuner.tuned, tuner.cache = {}, {}
    for _ in range(3):
        tuner[(1,)](x, 64, 0.5, (64, 128))
        assert tuner.best_config.kwargs == {"BLOCK": 16}
    assert kernel.compiled.launches[-1][13] == 16


def test_a_new_key_compiles_its_candidates_together_before_timing(launcher,
                                                                   monkeypatch) -> None:
    """Where the tuned tile is not in Triton's cache directory, every candidate of the launch
    being tuned is handed to Triton's asynchronous compile (`compile_candidates`): compiled
    on worker threads and all finished before the first is timed. A key whose tile the
    cache holds compiles none, and neither do a single worker or the interpreter."""
    from triton.runtime import _async_compile
    from triton.runtime.autotuner import Autotuner

    kernel = launcher.kernel
    kernel.fn = lambda x_ptr, n, scale, shape, BLOCK, FLAG=False: None  # Autotuner's base_fn
    configs = [triton.Config({"BLOCK": block}, num_warps=4) for block in (16, 32, 64)]
    tuner = launch.KeyedAutotuner(kernel, configs, ["n"])
    tuner.launcher = launcher
    tuner.do_bench = lambda call, quantiles=None: call() or [1.0, 1.0, 1.0]
    tuner.early_config_prune = None  # the stand-in has no head dims to prune by
    tuner.cache_results = True  # as on a GPU (Triton turns it off in the interpreter)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "COMPILE_WORKERS", 2)
    events, in_cache = [], []

    def run(*args, grid, warmup, **kwargs):
        mode, block = _async_compile.active_mode.get(), kwargs["BLOCK"]
        if warmup and mode is not None:
            def compile_tile():
                events.append(("compiled", block, threading.current_thread().name))
                return block
            # From Triton 3.9 a submit also takes what to do after a failed compile.
            on_failure = (() if "cleanup_fn" not in inspect.signature(mode.submit).parameters
                          else (lambda _: None,))
            return mode.submit(block, compile_tile, lambda _: events.append(("ready", block)),
                               *on_failure)
        events.append(("timed" if grid == (1,) else "launched", block))
        return kernel.compiled

    def check_disk_cache(self, tuning_key, candidates, bench_fn):
        if in_cache:
            self.cache[tuning_key] = candidates[0]
            return True
        bench_fn()
        return False

    kernel.run = run
    monkeypatch.setattr(Autotuner, "check_disk_cache", check_disk_cache)
    x = torch.zeros(64, dtype=torch.float16)
    tuner[(1,)](x, 64, 0.5, (64, 128))
    compiled = [e for e in events if e[0] == "compiled"]
    assert sorted(e[1] for e in compiled) == [16, 32, 64]
    assert all(e[2] != threading.current_thread().name for e in compiled)
    first_timed = events.index(("timed", 16))
    assert {e[0] for e in events[:first_timed]} == {"compiled", "ready"}
    assert [e for e in events[first_timed:] if e[0] == "timed"] == [
        ("timed", 16), ("timed", 32), ("timed", 64), ("timed", 16)]
    for setting in ("cached", "one worker", "interpreter"):
        events.clear()
        in_cache[:] = [True] if setting == "cached" else []
        if setting == "one worker":
            monkeypatch.setattr(launch, "COMPILE_WORKERS", 1)
        if setting == "interpreter":
            monkeypatch.setattr(launch, "COMPILE_WORKERS", 2)
            monkeypatch.setattr(launch, "interpreting", lambda: True)
        tuner[(1,)](x, len(setting), 0.5, (64, 128))  # a new key each time
        assert events and not [e for e in events if e[0] == "compiled"], setting


COMPILE_TOGETHER = """
import os, sys, threading
import torch, triton, triton.compiler, triton.language as tl
from triton.backends.compiler import GPUTarget

class Hopper:  # Triton's active driver, as far as compiling for an H200 needs one
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device): return 0
    def get_benchmarker(self): return None
    def __getattr__(self, name): raise AttributeError(name)

triton.runtime.driver.set_active(Hopper())
sys.path.insert(0, "tools")
import kernel_resources
import jvp_attention.launch as launch

threads, compile = set(), triton.compiler.compile
def compile_on_a_thread(*args, **kwargs):
    threads.add(threading.current_thread().name)
    return compile(*args, **kwargs)
triton.compiler.compile = compile_on_a_thread

launches = kernel_resources.launches_for(torch.bfloat16, 64, False, "none")
name, kernel, configs, bound = next(l for l in launches if l[0] == "_attention_forward_jvp")
tuner = launch.KeyedAutotuner(kernel, configs[:3], launch.AUTOTUNE_KEYS)
tile = set(configs[0].all_kwargs())
tuner.tuning_call = ((), {**{k: v for k, v in bound.items() if k not in tile}, "grid": (1,)})
tuner.compile_candidates(configs[:3])
print(len(kernel.device_caches[0][0]), len(threads - {threading.current_thread().name}))
"""


def test_candidates_compile_together_on_threads_for_hopper(tmp_path) -> None:
    """Triton's own compile, for an H200 on this CPU: the forward with the tangent's first
    three candidate tiles, as recorded from the launcher, compiled by `compile_candidates`
    on worker threads into the kernel's cache (no kernel runs). A subprocess, since Triton
    must not be in its interpreter for this; with a cache directory of its own, since
    compiles that another test left on disk finish so fast that one worker takes them all."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["JVP_ATTENTION_COMPILE_WORKERS"] = "2"
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    result = subprocess.run([sys.executable, "-c", COMPILE_TOGETHER], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    cached, worker_threads = map(int, result.stdout.split()[-2:])
    assert cached == 3 and worker_threads == 2


def test_a_failed_compile_of_candidates_together_falls_back_with_a_warning(
        launcher, monkeypatch) -> None:
    """Should Triton's asynchronous compile fail (a Triton that changed it), the launch warns
    once, is tuned as before, and later keys compile their candidates in turn."""
    from triton.runtime.autotuner import Autotuner

    kernel = launcher.kernel
    kernel.fn = lambda x_ptr, n, scale, shape, BLOCK, FLAG=False: None
    tuner = launch.KeyedAutotuner(
        kernel, [triton.Config({"BLOCK": block}, num_warps=4) for block in (16, 32)], ["n"])
    tuner.launcher, tuner.early_config_prune, tuner.cache_results = launcher, None, True
    tuner.do_bench = lambda call, quantiles=None: call() or [1.0, 1.0, 1.0]
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "COMPILE_WORKERS", 2)
    monkeypatch.setattr(Autotuner, "check_disk_cache",
                        lambda self, key, candidates, bench_fn: bench_fn() or False)
    timed = []

    def run(*args, grid, warmup, **kwargs):
        if warmup:
            raise TypeError("an asynchronous compile this Triton no longer has")
        timed.append(kwargs["BLOCK"])
        return kernel.compiled

    kernel.run = run
    x = torch.zeros(64, dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match="compiling candidate tiles together failed"):
        tuner[(1,)](x, 64, 0.5, (64, 128))
    assert timed == [16, 32, 16] and launch.COMPILE_WORKERS == 1
    tuner[(1,)](x, 48, 0.5, (64, 128))  # a new key: no warning, timed in turn
    assert timed[3:] == [16, 32, 16]


@pytest.mark.parametrize("change", ["alignment", "dtype", "value", "type", "keyword",
                                    "tuple"])
def test_what_triton_specialises_on_goes_through_triton(launcher, change: str) -> None:
    """A launch that differs in anything Triton's specialisation or cache key could see is
    launched by Triton (which compiles, or finds, the kernel for it)."""
    base = torch.zeros(72, dtype=torch.float16)
    _launch(launcher, base[:64])
    other = {"alignment": lambda: _launch(launcher, base[1:65]),  # 2 bytes off 16
             "dtype": lambda: _launch(launcher, base.float()[:64]),
             "value": lambda: _launch(launcher, base[:64], n=48),
             "type": lambda: _launch(launcher, base[:64], scale=1),
             "keyword": lambda: _launch(launcher, base[:64], FLAG=True),
             "tuple": lambda: launcher[(1,)](base[:64], 64, 0.5, (64, 64), BLOCK=16)}
    other[change]()
    assert launcher.kernel.triton_launches == 2


@pytest.mark.parametrize("setting", ["debug", "instrumentation", "fp sanitizer"])
def test_triton_options_that_change_the_code_go_through_triton(launcher, monkeypatch,
                                                               setting: str) -> None:
    """Triton compiles other code under its debug, instrumentation and (Triton 3.9)
    floating-point-sanitizer settings: a launch under a changed setting must reach Triton,
    never the kernel compiled under the old one."""
    x = torch.zeros(64, dtype=torch.float16)
    _launch(launcher, x)
    runtime, compilation = triton.knobs.runtime, triton.knobs.compilation
    knob, name, value = {"debug": (runtime, "debug", True),
                         "instrumentation": (compilation, "instrumentation_mode", "consan"),
                         "fp sanitizer": (compilation, "fpsan_homomorphic_casts", True)}[setting]
    # On a Triton without the knob, a stand-in attribute plays it (what getattr then reads).
    monkeypatch.setattr(knob, name, value, raising=False)
    _launch(launcher, x)
    assert launcher.kernel.triton_launches == 2
    _launch(launcher, x)
    assert launcher.kernel.triton_launches == 2  # then cached under the new setting


def test_the_memory_holds_no_tensor_and_stays_bounded(launcher, monkeypatch) -> None:
    monkeypatch.setattr(launch, "CACHED_LAUNCHES", 4)
    x = torch.zeros(64, dtype=torch.float16)
    for n in range(10):
        _launch(launcher, x, n=n)
    assert 0 < len(launcher.launches) <= 4

    def tensors(value):
        if isinstance(value, torch.Tensor):
            return 1
        return sum(map(tensors, value)) if isinstance(value, tuple) else 0

    assert not any(tensors(key) for key in launcher.launches)


def test_hooks_and_warmups_go_through_triton(launcher) -> None:
    """A profiler's launch hook must see every launch; a warm-up launches nothing."""
    x = torch.zeros(64, dtype=torch.float16)
    _launch(launcher, x)
    hook = triton.knobs.runtime.launch_enter_hook
    calls = []
    if hasattr(hook, "add"):
        hook.add(calls.append)
        try:
            _launch(launcher, x)
        finally:
            hook.remove(calls.append)
        assert launcher.kernel.triton_launches == 2
    launcher.run(x, 64, 0.5, (64, 128), grid=(1,), warmup=True, BLOCK=16)
    launcher.kernel.pre_run_hooks.append(lambda *a, **k: None)
    _launch(launcher, x)
    assert launcher.kernel.triton_launches == (4 if hasattr(hook, "add") else 3)
    assert not launcher.kernel.compiled.launches


def test_the_interpreter_launches_through_triton() -> None:
    """Under the interpreter the kernels are not JITFunctions: no direct launch."""
    from jvp_attention.tiles import range_partials_kernel

    assert launch.cached(range_partials_kernel).direct == isinstance(
        range_partials_kernel, triton.runtime.JITFunction)
    assert launch.cached(range_partials_kernel) is launch.cached(range_partials_kernel)


def _tiles(kept) -> set:
    return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept}


def test_two_column_tiles_count_as_the_columns_they_multiply(monkeypatch) -> None:
    """d = 72 cut into 64 + 16 columns may take d = 64's tiles (80 columns in registers);
    padded to 128 (the dK/dV kernel keeps one tile) it may not."""
    monkeypatch.setenv("JVP_ATTENTION_AUTOTUNE", "1")
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}) for m, n in
               [(128, 32), (64, 64), (128, 64), (128, 128)]]
    named = {"head_dim": 72, "value_dim": 72, "q_ptr": torch.empty(0, dtype=torch.bfloat16)}
    cut = {"BLOCK_D": 64, "D_TAIL": 16, "BLOCK_DV": 64, "DV_TAIL": 16}
    padded = {"BLOCK_D": 128, "BLOCK_DV": 128}
    assert _tiles(launch.prune_wide_tiles(configs, named, HAS_TANGENT=True, **cut)) == {
        (128, 32), (64, 64), (128, 64)}
    assert _tiles(launch.prune_wide_tiles(configs, named, HAS_TANGENT=True, **padded)) == {
        (128, 32), (64, 64)}
    d64 = {**named, "head_dim": 64, "value_dim": 64}
    assert _tiles(launch.prune_wide_tiles(configs, d64, HAS_TANGENT=True, BLOCK_D=64,
                                          BLOCK_DV=64)) == {(128, 32), (64, 64), (128, 64)}


def test_an_unhashable_argument_goes_through_triton(launcher) -> None:
    x = torch.zeros(64, dtype=torch.float16)
    for _ in range(2):
        launcher[(1,)](x, 64, 0.5, [64, 128], BLOCK=16)
    assert launcher.kernel.triton_launches == 2 and not launcher.launches


@pytest.mark.parametrize("dtype, storage, width, align", [
    (torch.float16, 72, 72, 8), (torch.bfloat16, 40, 40, 8), (torch.float16, 48, 44, 4),
    (torch.float16, 43, 40, 1), (torch.float32, 72, 72, 4), (torch.float16, 128, 20, 4),
])
def test_row_alignment_divides_every_row_stride_and_width(dtype, storage, width,
                                                          align) -> None:
    """ALIGN (`aligned` in the kernels) is the largest power of two, up to 16 bytes of
    elements, dividing every row stride and every width: the kernels' loads and stores assume
    it, so anything larger would read the wrong rows."""
    x = torch.zeros(2, 3, 5, storage, dtype=dtype)[..., :width]
    y = torch.zeros(2, 3, 7, 64, dtype=dtype)
    assert launch.row_alignment((x, y), (width, 64)) == align
    assert launch.row_alignment((y,), (64,)) == 16 // y.element_size()


@pytest.mark.parametrize("extra, align", [(0, 8), (1, 1), (2, 2), (4, 4), (8, 8)])
def test_row_alignment_divides_every_batch_and_head_stride(extra: int, align: int) -> None:
    """The batch and head strides count too (`head_base` writes them with ALIGN): batches
    `extra` elements apart from contiguous, and heads of the (B, N, H, D) layout at d = 72."""
    b, h, n, d = 2, 3, 5, 72
    storage = torch.zeros(b, h * n * d + extra, dtype=torch.bfloat16)
    x = storage[:, :h * n * d].unflatten(1, (h, n, d))
    assert launch.row_alignment((x,), (d,)) == align
    bnhd = torch.zeros(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2)
    assert launch.row_alignment((bnhd,), (d,)) == 8


# --- launches that a compiled graph may hold (torch.library.triton_op, chapter 7) ---------


def test_launchable_keeps_our_launch_path_on_real_tensors() -> None:
    import jvp_attention.forward as forward
    import jvp_attention.tiles as tiles

    q = torch.zeros(1)
    assert launch.launchable(forward._attention_forward_jvp, q) is forward._attention_forward_jvp
    assert launch.launchable(tiles.range_partials_kernel, q) is launch.cached(
        tiles.range_partials_kernel)


def test_forward_is_traced_only_where_its_choices_need_no_data(monkeypatch) -> None:
    """`traceable_forward`: not from the descriptors' row length, nor under the interpreter;
    a bf16 "accurate" call that carries is traced too (its copies come from an operator of
    their own, `graph_carry`)."""
    import jvp_attention.forward as forward

    def q_k(dtype, n, d=64):
        return torch.zeros(1, 2, n, d, dtype=dtype), torch.zeros(1, 2, n, d, dtype=dtype)

    q, k = q_k(torch.float16, 256)
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    assert not forward.traceable_forward(q, k, k)  # the interpreter runs this
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    for dtype, n, expected in [
            (torch.float16, 256, True),
            (torch.bfloat16, 1024, True),
            (torch.bfloat16, forward.FORWARD_TMA_MIN_KEYS - 1, True),
            (torch.float16, forward.FORWARD_TMA_MIN_KEYS, False)]:
        q, k = q_k(dtype, n)
        assert forward.traceable_forward(q, k, k) == expected, (dtype, n)
    # In a graph that runs its launches from Python, long rows too, up to
    # GRAPH_POINTER_MAX_SCORES (the call's kernels then read through pointers)
    monkeypatch.setattr(launch, "host_bound_graph", lambda q: True)
    q, k = q_k(torch.float16, forward.FORWARD_TMA_MIN_KEYS)
    assert forward.traceable_forward(q, k, k) and not forward.long_forward_rows(q, k.shape[2])
    monkeypatch.setattr(launch, "GRAPH_POINTER_MAX_SCORES", q.shape[1] * q.shape[2] ** 2 - 1)
    assert not forward.traceable_forward(q, k, k) and forward.long_forward_rows(q, k.shape[2])


def test_backward_is_traced_only_where_its_choices_need_no_data(monkeypatch) -> None:
    """`traceable_backward`: the first-order one not from the descriptors' row length, which
    the second-order one does not use; a carry does not keep either out of a graph."""
    import jvp_attention.backward as backward

    def qkv(dtype, n, d=64):  # 256 queries: descriptors need both loops long
        return (torch.zeros(1, 2, min(n, 256), d, dtype=dtype),
                *(torch.zeros(1, 2, n, d, dtype=dtype) for _ in range(2)))

    monkeypatch.setattr(launch, "interpreting", lambda: True)
    assert not backward.traceable_backward(*qkv(torch.float16, 256), False)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    long = backward.BACKWARD_TMA_MIN_TOKENS
    assert launch.carry_min_keys(64) <= 4 * long
    for dtype, n, tangent in [(torch.float16, 256, False), (torch.bfloat16, 4 * long, False),
                              (torch.bfloat16, 4 * long, True)]:
        assert backward.traceable_backward(*qkv(dtype, n), tangent), (dtype, n, tangent)
    q, k, v = (torch.zeros(1, 2, long, 64, dtype=torch.float16) for _ in range(3))
    assert not backward.traceable_backward(q, k, v, False)
    assert backward.traceable_backward(q, k, v, True)
    # In a graph that runs its launches from Python: pointers below GRAPH_TMA_MIN_TOKENS,
    # and in calls of up to GRAPH_POINTER_MAX_SCORES at any length
    for module in (launch, backward):
        monkeypatch.setattr(module, "host_bound_graph", lambda q: True)
    for n in (long, backward.GRAPH_TMA_MIN_TOKENS):
        q, k, v = (torch.zeros(1, 2, n, 64, dtype=torch.float16) for _ in range(3))
        assert backward.traceable_backward(q, k, v, False), n
        assert not backward.long_backward_rows(q, n, n), n
    monkeypatch.setattr(launch, "GRAPH_POINTER_MAX_SCORES", 2 * n * n - 1)
    assert not backward.traceable_backward(q, k, v, False)
    assert backward.long_backward_rows(q, n, n)


def test_cut_head_dims_are_padded_in_small_compiled_calls(monkeypatch) -> None:
    """Where the kernels need this library's ptxas (Hopper, Triton 3.6), a head dim cut in
    two enters a compiled graph in calls of up to PADDED_MAX_SCORES scores, padded to one
    column tile; larger calls keep the opaque operators. Real tensors keep the cut."""
    import jvp_attention.backward as backward
    import jvp_attention.forward as forward

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "needs_sound_ptxas", lambda q: True)
    small, large = ((torch.empty(shape, device="meta", dtype=torch.float16) for _ in range(3))
                    for shape in [(32, 16, 256, 72), (16, 16, 1024, 72)])
    small, large = tuple(small), tuple(large)
    assert launch.pads_in_graph(small[0], 256) and not launch.pads_in_graph(large[0], 1024)
    for q, k, v in (small, large):
        expected = launch.pads_in_graph(q, k.shape[-2])
        assert forward.traceable_forward(q, k, v) == expected
        assert backward.traceable_backward(q, k, v, False) == expected
        assert backward.traceable_backward(q, k, v, True)  # never cut
    monkeypatch.setattr(launch, "PADDED_MAX_SCORES", 0)
    assert not forward.traceable_forward(*small)
    assert launch.launch_column_tiles(small[0], 256, 72, 72) == launch.column_tiles(72, 72)
    assert launch.column_tiles(72, 72)["D_TAIL"] == 16  # what eager mode multiplies



@pytest.mark.gpu
def test_a_new_key_compiles_on_threads_and_computes_on_the_gpu(tmp_path, monkeypatch) -> None:
    """On the GPU, with an empty Triton cache: a new key's candidates compile on worker
    threads (with this library's ptxas where it applies), are timed, and the tuned tile's
    launch computes what it should."""
    import triton.compiler
    import triton.language as tl

    @triton.jit
    def scaled_copy(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n)
        tl.store(y_ptr + offsets, x * factor, mask=offsets < n)

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "COMPILE_WORKERS", 3)
    threads, compile = set(), triton.compiler.compile

    def compile_on_a_thread(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return compile(*args, **kwargs)

    monkeypatch.setattr(triton.compiler, "compile", compile_on_a_thread)
    configs = [triton.Config({"BLOCK": block}, num_warps=4) for block in (128, 256, 512)]
    tuner = launch.KeyedAutotuner(scaled_copy, configs, ["n"])
    tuner.early_config_prune = None  # no head dims to prune by
    x = torch.randn(3000, device="cuda")
    y = torch.empty_like(x)
    tuner[lambda meta: (triton.cdiv(3000, meta["BLOCK"]),)](x, y, 3000, 0.5)
    torch.testing.assert_close(y, x * 0.5)
    assert len(threads - {threading.current_thread().name}) >= 2, threads
    assert len(scaled_copy.device_caches[x.device.index][0]) == 3


@pytest.mark.gpu
def test_compiled_forward_jvp_is_launched_by_inductor() -> None:
    """Under torch.compile the forward with the tangent at a short, d = 64 shape is a kernel
    launch in Inductor's code (no call into our operator per step), with eager's outputs."""
    from torch._inductor.utils import run_and_get_code

    from jvp_attention import attention

    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, v, tq, tk, tv = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16)
                           for _ in range(6))

    def fwd_jvp(q, k, v, tq, tk, tv):
        return torch.func.jvp(attention, (q, k, v), (tq, tk, tv))

    (out, t_out), code = run_and_get_code(torch.compile(fwd_jvp), q, k, v, tq, tk, tv)
    source = "\n".join(code)
    assert "_attention_forward_kernel" in source
    assert "jvp_attention.forward_jvp" not in source
    eager_out, eager_t_out = fwd_jvp(q, k, v, tq, tk, tv)
    # Inductor times the tiles itself and may pick another than our autotuner: sums in
    # another order, within bf16's rounding
    torch.testing.assert_close(out, eager_out, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(t_out, eager_t_out, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("step", ["meanflow", "second_order"])
def test_compiled_training_step_is_launched_by_inductor(step: str) -> None:
    """Compiled, a MeanFlow step (the tangent under a stop-gradient) and a second-order step
    (the loss reads both outputs) at a short d = 64 shape launch the forward and backward
    kernels from Inductor's code, with no call into our operators, and match eager's
    gradients."""
    from torch._inductor.utils import run_and_get_code

    from jvp_attention import attention

    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    tq, tk, tv = (torch.randn_like(q) for _ in range(3))

    def grads(q, k, v, tq, tk, tv):
        out, t_out = torch.func.jvp(attention, (q, k, v), (tq, tk, tv))
        t_out = t_out.detach() if step == "meanflow" else t_out
        loss = (out.float() * t_out.float()).sum() + out.float().square().sum()
        return torch.autograd.grad(loss, (q, k, v))

    compiled, code = run_and_get_code(torch.compile(grads), q, k, v, tq, tk, tv)
    source = "\n".join(code)
    assert "_attention_forward_kernel" in source
    assert "_attention_backward_dq_kernel" in source
    assert "_attention_backward_dkdv_kernel" in source
    assert "torch.ops.jvp_attention" not in source
    for ours, eager in zip(compiled, grads(q, k, v, tq, tk, tv), strict=True):
        torch.testing.assert_close(ours, eager, rtol=2e-2, atol=2e-2)


def test_traced_twins_register_with_their_operators_signatures() -> None:
    """Outside the interpreter (as on a GPU), importing the autograd layer registers a traced
    twin of each operator, with the opaque operator's schema, without importing
    torch._inductor (`triton_op`'s kernel scan would, about a second of every process's
    first call: the twins give it no source to scan); on the CPU this runs in a subprocess
    without TRITON_INTERPRET, which only imports."""
    import subprocess
    import sys

    code = ("import sys, torch, jvp_attention.autograd as a\n"
            "ops = torch.ops.jvp_attention\n"
            "assert a._TRACED == {n: n + '_traced' for n in "
            "('forward', 'forward_jvp', 'backward', 'backward_tangent')}, a._TRACED\n"
            "for name, twin in a._TRACED.items():\n"
            "    opaque, traced = (str(getattr(ops, n).default._schema) for n in (name, twin))\n"
            "    assert traced == opaque.replace(name + '(', twin + '(', 1), (opaque, traced)\n"
            "assert 'torch._inductor.utils' not in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, check=False, cwd=os.path.dirname(os.path.dirname(
                                os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0, result.stderr[-2000:]


def test_fake_and_functional_tensors_are_in_a_compiled_graph() -> None:
    """`_launch` picks the traced twins for AOTAutograd's fake and functional tensors too,
    not only while Dynamo traces; plain tensors are not in a compiled graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import jvp_attention.autograd as autograd

    assert not autograd._in_compiled_graph((torch.zeros(2), 1.0, None))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(2))
    assert autograd._in_compiled_graph((fake, 1.0))


def test_descriptors_match_by_what_triton_compiles_for_them(launcher) -> None:
    """Chapter 11's kernels take host tensor descriptors: a launch whose descriptors differ
    only in tensor, shape or strides reuses the compiled kernel (they are read at launch,
    and passed through as they are), one with another block or dtype goes through Triton,
    and the memory keeps no tensor of theirs."""
    from jvp_attention import warp_specialized

    if not warp_specialized.GLUON:
        pytest.skip("this Triton has no Gluon")
    _descriptor = warp_specialized._descriptor
    x = torch.zeros(2, 3, 128, 64, dtype=torch.float16)
    launcher[(1,)](_descriptor(x, 64), 64, 0.5, (64, 128), BLOCK=16)
    other = torch.zeros(1, 5, 256, 64, dtype=torch.float16).transpose(1, 2)
    described = _descriptor(other, 64)
    launcher[(1,)](described, 64, 0.5, (64, 128), BLOCK=16)
    assert launcher.kernel.triton_launches == 1
    assert launcher.kernel.compiled.launches[-1][9] is described
    launcher[(1,)](_descriptor(x, 32), 64, 0.5, (64, 128), BLOCK=16)
    launcher[(1,)](_descriptor(x.bfloat16(), 64), 64, 0.5, (64, 128), BLOCK=16)
    assert launcher.kernel.triton_launches == 3

    def holds_tensor(value) -> bool:
        if isinstance(value, torch.Tensor) or hasattr(value, "block_shape"):
            return True
        return isinstance(value, tuple) and any(map(holds_tensor, value))

    assert not any(holds_tensor(key) for key in launcher.launches)


@pytest.mark.parametrize("residual", [False, True])
def test_carry_operators_return_what_their_functions_do(residual: bool) -> None:
    """The opaque operators through which a compiled graph makes the carry's copies
    (`graph_carry`) run the same functions: their real implementations (which a traced graph
    calls at run time, through the dispatcher) give the direct call's tensors, bit for bit,
    and their fake implementations the same shapes, dtypes and strides."""
    import jvp_attention.backward as backward
    import jvp_attention.forward as forward

    torch.manual_seed(0)
    q, k, v, tq, tk, tv, grad_out, dto = (
        torch.randn(2, 3, 40, 16, dtype=torch.bfloat16, device=DEVICE) for _ in range(8))
    out = torch.randn_like(q)
    out_residual = 1e-3 * torch.randn_like(q) if residual else None
    ops = torch.ops.jvp_attention
    cases = [
        (ops.value_operands, forward.value_operands, (v, tv)),
        *((ops.backward_operands, backward.backward_operands_and_delta,
           (q, k, v, grad_out, out, out_residual, zero_dq_sum)) for zero_dq_sum in (False, True)),
        (ops.second_order_operands, backward.second_order_operands,
         (q, k, v, tq, tk, tv, grad_out, dto, 0.25))]
    for operator, function, args in cases:
        expected = function(*args)
        through_operator = operator(*args)
        assert len(through_operator) == len(expected)
        for ours, theirs in zip(through_operator, expected, strict=True):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            assert torch.equal(ours, theirs), operator
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fakes = operator(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                               for a in args))
        for fake, real in zip(fakes, expected, strict=True):
            assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype,
                                                               real.stride()), operator


@pytest.mark.parametrize("width", [16, 24, 72])
def test_carry_reads_contiguous_tensors_flat_and_others_by_rows(width: int,
                                                                 monkeypatch) -> None:
    """The carry's passes read contiguous tensors as flat arrays and strided ones row by row
    (columns padded to a power of two): the two give the same exact copies and exponents,
    bit for bit, and each path is the one launched."""
    import jvp_attention.forward as forward

    launched = []

    class Spy:
        def __init__(self, launcher):
            self.launcher = launcher

        def __getitem__(self, grid):
            def launch_and_note(*args, **kwargs):
                launched.append(kwargs["FLAT"])
                return self.launcher[grid](*args, **kwargs)
            return launch_and_note

    cached = launch.cached
    monkeypatch.setattr(launch, "cached", lambda kernel: Spy(cached(kernel)))
    torch.manual_seed(0)
    v, tv = (torch.randn(2, 3, 40, width, dtype=torch.float16, device=DEVICE) * scale
             for scale in (3.0, 0.01))
    # the same values stored as (B, N, H, W): unit last stride, not contiguous
    strided = tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (v, tv))
    assert not strided[0].is_contiguous() and torch.equal(strided[0], v)
    flat = forward.value_operands(v, tv)
    assert launched == [True, 0b11]  # the range pass's FLAT, then the copies' (one bit each)
    by_rows = forward.value_operands(*strided)
    assert launched[2:] == [False, 0]
    for ours, theirs in zip(flat, by_rows, strict=True):
        assert torch.equal(ours, theirs)
    v_hat, tv_hat, exponents = flat
    for x, copy, exponent in ((v, v_hat, exponents[0]), (tv, tv_hat, exponents[1])):
        assert torch.equal(copy, (x.float() * 2.0 ** exponent.item()).half())


@pytest.mark.parametrize("scale, kept", [(1.0, True), (2.0**-6, True), (2.0**14 - 64, True),
                                         (2.0**14, False), (1e6, False), (2.0**-6.5, False),
                                         (1e-9, False)])
@pytest.mark.parametrize("layout", ["contiguous", "bnhd"])
def test_value_copies_keep_their_scale_inside_the_window(scale: float, kept: bool,
                                                          layout: str) -> None:
    """The forward's carry writes v and tv to float16 unshifted as its range pass reads
    them, and rewrites a copy only when its largest entry falls outside
    [COPY_LOW, COPY_HIGH): there the unshifted copy would overflow, or keep fewer bits than
    one shifted into [1/2, 1). Either way each copy is x times 2**e rounded to float16
    (exact but for entries that land below float16's normal range). Five tiles of 8192
    each: more than the copy launch's programs under the interpreter (4), so a rewrite
    takes two tiles in one program; "bnhd" (heads split off a projection: strided rows)
    is read and copied row by row, five blocks of 128 rows."""
    import jvp_attention.forward as forward

    torch.manual_seed(1)
    shape = (2, 5, 64, 64)
    x = torch.randn(shape, dtype=torch.float32, device=DEVICE)
    if layout == "bnhd":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    x = (x / x.abs().max() * scale).to(torch.bfloat16)  # largest entry: scale (bf16 rounded)
    assert x.is_contiguous() == (layout == "contiguous")
    other = torch.randn(shape, dtype=torch.bfloat16, device=DEVICE)
    v_hat, tv_hat, exponents = forward.value_operands(x, other)
    assert (exponents[0].item() == 0) == kept, exponents
    assert exponents[1].item() == 0
    assert torch.equal(v_hat, (x.float() * 2.0 ** exponents[0].item()).half())
    assert torch.equal(tv_hat, other.half())
    if not kept:
        assert 0.5 <= v_hat.abs().max().item() < 1.0
