"""tools/tile_sweep.py: one row per tile and one for the autotuner's choice, every kernel it
sweeps, and the autotuner left as it was (the sweep narrows its list while it runs)."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import triton

from jvp_attention import backward, forward, launch

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "tile_sweep.py"
sys.path.insert(0, str(SCRIPT.parent))

import tile_sweep  # noqa: E402


@pytest.mark.parametrize("kernel", sorted(tile_sweep.KERNELS))
def test_sweep_restores_the_autotuner(kernel: str) -> None:
    tuner = tile_sweep.KERNELS[kernel][0]
    configs = list(tuner.configs)
    rows = tile_sweep.sweep((1, 1, 16, 16), tile_sweep.DTYPES["fp16"], 1, kernel=kernel)
    assert [row["tile"] for row in rows] == [*map(tile_sweep.tile_name, configs), "auto"]
    assert all(row["ms"] > 0 and "error" not in row for row in rows), rows
    assert rows[-1]["chosen"] in {tile_sweep.tile_name(c) for c in configs}
    assert tuner.configs == configs and not tuner.tuned and not tuner.launches


def test_auto_only_times_the_autotuners_choice_alone() -> None:
    """--auto-only: one row, the call as users get it, and the autotuner left as it was."""
    tuner = tile_sweep.KERNELS["backward_dq"][0]
    configs = list(tuner.configs)
    rows = tile_sweep.sweep((1, 1, 16, 16), tile_sweep.DTYPES["fp16"], 1, kernel="backward_dq",
                            auto_only=True)
    assert [row["tile"] for row in rows] == ["auto"] and rows[0]["ms"] > 0, rows
    assert rows[0]["chosen"] in {tile_sweep.tile_name(c) for c in configs}
    assert tuner.configs == configs and not tuner.tuned and not tuner.launches


def test_the_kernels_are_the_library_autotuners() -> None:
    tuners = {name: entry[0] for name, entry in tile_sweep.KERNELS.items()}
    assert tuners["forward_jvp"] is forward._attention_forward_jvp
    assert tuners["backward_dq"] is backward._backward_dq
    assert tuners["backward_dkdv"] is backward._backward_dkdv
    assert tuners["backward_dq_tangent"] is backward._backward_dq_tangent
    assert tuners["backward_dkdv_tangent"] is backward._backward_dkdv_tangent
    assert tuners["backward_dv_tangent"] is backward._backward_dv_tangent
    assert tuners["backward_dk_tangent"] is backward._backward_dk_tangent


def test_smoke_run_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--precision", "fast",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert "--smoke" in data["command"] and data["dtype"] == "fp16"
    assert {row["tile"] for row in data["rows"]} >= {"auto"}
    assert all(row["kernel"] == "forward_jvp" and row["N"] == 16 for row in data["rows"])
    assert data["command"].startswith("python ") and data["precision"] == "fast"
    # On CPU the interpreter's wall time stands for the call's kernels.
    assert all(set(row["kernels"]) == {"wall"} for row in data["rows"]), data["rows"]


@pytest.mark.parametrize("kernel", ["forward_jvp", "backward_dk_tangent"])
def test_check_puts_each_tile_at_the_math_paths_error(kernel: str) -> None:
    """--check: every row says how far the call's outputs are from float64, as a multiple of
    PyTorch's math attention's error in the same dtype (the tests accept 2)."""
    rows = tile_sweep.sweep((1, 2, 24, 16), tile_sweep.DTYPES["fp16"], 1, kernel=kernel,
                            check=True)
    assert all(0 < row["error_vs_math"] <= 2 for row in rows), rows


def test_check_flags_a_wrong_output() -> None:
    inputs = tile_sweep.make_inputs((1, 2, 24, 16), tile_sweep.DTYPES["fp16"], "fwd_jvp")
    error_vs_math = tile_sweep.accuracy_check(inputs, "fwd_jvp")
    out, t_out = tile_sweep.make_call(inputs, "fwd_jvp")()
    assert error_vs_math((out, t_out)) <= 2
    assert error_vs_math((out * 1.01, t_out)) > 5
    assert error_vs_math((out, t_out * 1.01)) > 5


def test_reference_slices_bound_the_scores_and_cover_every_head(monkeypatch) -> None:
    """The float64 reference runs on slices whose scores fit REFERENCE_CHUNK_BYTES (8.6 GB
    for one slice at (4, 16, 4096) ran an 80 GB GPU out of memory), covering each head once."""
    monkeypatch.setattr(tile_sweep, "REFERENCE_CHUNK_BYTES", 3 * 24 * 24 * 8)
    for shape, expected in (((2, 2, 24, 16), 2), ((2, 5, 24, 16), 4), ((1, 1, 64, 16), 1)):
        slices = tile_sweep.reference_slices(torch.Size(shape))
        covered = torch.zeros(shape[:2], dtype=torch.int64)
        for batch, heads in slices:
            covered[batch, heads] += 1
            n = shape[2]
            scores = len(range(*batch.indices(shape[0]))) * len(range(*heads.indices(shape[1])))
            assert scores * n * n * 8 <= max(tile_sweep.REFERENCE_CHUNK_BYTES, n * n * 8)
        assert torch.equal(covered, torch.ones_like(covered)) and len(slices) == expected


@pytest.mark.parametrize("mode", ["fwd_jvp", "second_order"])
def test_sliced_reference_is_the_whole_call(mode: str, monkeypatch) -> None:
    inputs = tile_sweep.make_inputs((2, 3, 24, 16), tile_sweep.DTYPES["fp16"], mode)
    whole = tile_sweep.sliced_call(inputs, mode, tile_sweep.math_attention, torch.float64)
    monkeypatch.setattr(tile_sweep, "REFERENCE_CHUNK_BYTES", 24 * 24 * 8)  # one head a slice
    assert len(tile_sweep.reference_slices(inputs[0][0].shape)) == 6
    sliced = tile_sweep.sliced_call(inputs, mode, tile_sweep.math_attention, torch.float64)
    assert len(whole) == len(sliced) == (2 if mode == "fwd_jvp" else 6)
    for a, b in zip(whole, sliced, strict=True):
        assert a.shape == inputs[0][0].shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12)


class _Compiled:
    function = packed_metadata = None

    def __init__(self):
        self.blocks = []

    def run(self, *args):
        self.blocks.append(args[-2])  # BLOCK, before FLAG


class _Kernel:
    """A `@triton.jit` kernel's stand-in, `kernel(x_ptr, n, BLOCK, FLAG=False)`."""

    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]
    params = [types.SimpleNamespace(name=name, default=False) for name in arg_names]
    pre_run_hooks = []

    def __init__(self):
        self.compiled = _Compiled()
        self.fn = lambda x_ptr, n, BLOCK, FLAG=False: None  # Autotuner's base_fn

    def run(self, *args, grid, warmup, **kwargs):
        self.compiled.blocks.append(kwargs["BLOCK"])
        return self.compiled


def test_forgetting_the_tiles_forgets_the_launches_remembered_with_them(monkeypatch):
    """The sweep forces each tile by replacing the tile list and forgetting what was tuned
    (`forget_tiles`): on a GPU the autotuner also remembers launches with their tiles
    (`KeyedAutotuner.launches`), which must go too, or the old tile would run again."""
    active = types.SimpleNamespace(get_current_device=lambda: 0,
                                   get_current_stream=lambda device: 7,
                                   get_current_target=lambda: types.SimpleNamespace(arch=80))
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=active))
    kernel = _Kernel()
    tuner = launch.KeyedAutotuner(kernel, [triton.Config({"BLOCK": 32}, num_warps=4)], ["n"])
    tuner.launcher = launch.CachedLauncher(kernel)
    tuner.launcher.direct = True  # as on a GPU
    x = torch.zeros(64, dtype=torch.float16)
    for _ in range(3):  # tune, compile the tile, then the remembered launch
        tuner[(1,)](x, 64)
    assert kernel.compiled.blocks[-1] == 32 and tuner.launches
    tuner.configs = [triton.Config({"BLOCK": 16}, num_warps=4)]
    tile_sweep.forget_tiles(tuner)
    for _ in range(3):
        tuner[(1,)](x, 64)
    assert kernel.compiled.blocks[-3:] == [16, 16, 16]


def test_pair_tails_setting_overrides_the_librarys_choice() -> None:
    """--pair-tails on pairs the half-full tail tiles of single products too (d = 72 carried
    or "fast"), off pairs none, auto keeps the library's choice; the forward's own function
    comes back afterwards."""
    tiles = launch.column_tiles(72, 72)
    chosen = forward.pair_tails
    for setting, expected in (("on", True), ("off", False), ("auto", False)):
        with tile_sweep.pairing_tails(setting):
            paired = forward.pair_tails(tiles, 72, 72, False)
        assert paired == {"PAIR_D": expected, "PAIR_DV": expected}, setting
    with tile_sweep.pairing_tails("off"):
        assert forward.pair_tails(tiles, 72, 72, True) == {"PAIR_D": False, "PAIR_DV": False}
    assert forward.pair_tails is chosen


@pytest.mark.parametrize("setting", ["stored", "transposed"])
def test_key_layout_setting_overrides_the_librarys_choice(setting: str, monkeypatch) -> None:
    """--key-layout stored|transposed: the first-order dK/dV launch takes that layout
    whatever the library passes, the second order's passes tune only tiles in it, the
    gradients stay right (--check), and the tuners come back as they were."""
    seen = []
    first_order = backward._backward_dkdv

    def spy(*args, _run=first_order.run, **kwargs):
        seen.append(kwargs["TRANSPOSED"])
        return _run(*args, **kwargs)

    monkeypatch.setattr(first_order, "run", spy)
    before = {name: (getattr(backward, name).run, getattr(backward, name).configs)
              for name in tile_sweep.KEY_SIDE_TUNERS}
    with tile_sweep.laying_out_keys(setting):
        for kernel in ("backward_dkdv", "backward_dk_tangent"):
            rows = tile_sweep.sweep((1, 2, 24, 16), tile_sweep.DTYPES["fp16"], 1,
                                    kernel=kernel, check=True, auto_only=True)
            assert all(0 < row["error_vs_math"] <= 2 for row in rows), rows
        layouts = {config.kwargs["TRANSPOSED"] for name in tile_sweep.KEY_SIDE_TUNERS
                   for config in getattr(backward, name).configs
                   if tile_sweep.carries_layout(getattr(backward, name))}
    assert seen and set(seen) == {setting == "transposed"}, seen
    assert layouts == {setting == "transposed"}
    assert {name: (getattr(backward, name).run, getattr(backward, name).configs)
            for name in tile_sweep.KEY_SIDE_TUNERS} == before


def test_tiles_carry_the_second_order_layout() -> None:
    """--tiles: a fifth field lays a second-order key-side tile out transposed (1) or stored
    (0, or none); the first order's kernels take no such field."""
    tuner = backward._backward_dk_tangent
    tiles = tile_sweep.parse_tiles("16,32,4,2;64,16,8,2,1;64,16,8,2,0", tuner, "library")
    assert [tile_sweep.tile_name(t) for t in tiles] == [
        "16x32 w4 s2", "64x16 w8 s2 transposed", "64x16 w8 s2"]
    assert [tile_sweep.tile_name(t) for t in tile_sweep.parse_tiles(
        "16,32,4,2;64,16,8,2,0", tuner, "transposed")] == [
        "16x32 w4 s2 transposed", "64x16 w8 s2 transposed"]
    with pytest.raises(ValueError, match="--key-layout"):
        tile_sweep.parse_tiles("64,16,8,2,1", backward._backward_dkdv, "library")
    with pytest.raises(ValueError, match="M,N,warps,stages"):
        tile_sweep.parse_tiles("64,16,8", tuner, "library")


def test_reproducible_compares_every_repeat_bitwise() -> None:
    """--check's `reproducible`: REPEATS more calls, each output bitwise equal to the first
    call's; one call that differs in one output (a racing tile) makes it false."""
    first = (torch.zeros(3), torch.ones(2))
    calls = iter(range(100))

    def steady():
        next(calls)
        return (torch.zeros(3), torch.ones(2))

    assert tile_sweep.reproducible(steady, first)
    assert 100 - len(list(calls)) == tile_sweep.REPEATS
    outputs = [(torch.zeros(3), torch.ones(2))] * (tile_sweep.REPEATS - 1)
    outputs.insert(2, (torch.zeros(3), torch.tensor([1.0, 1.5])))
    racing = iter(outputs)
    assert not tile_sweep.reproducible(lambda: next(racing), first)
