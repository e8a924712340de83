"""Replaying a call (chapters 2 and 5): a forward or backward call at a key seen before
repeats the earlier call's launches with its own tensors, skipping the launchers'
decisions. It must give the bits that the whole path gives, be keyed by everything those
decisions read, and step aside where a replay would not be the same launch.

On CPU a replay runs the interpreter's recorded launch with the new tensors (there is no C
launcher); the tests marked `gpu` check the direct launch of the compiled kernel.
"""

import gc
import os
import weakref
from contextlib import ExitStack
from unittest import mock

import pytest
import torch
from helpers import DEVICE, HAS_CUDA, CompiledStandIn

import jvp_attention.forward as forward
import jvp_attention.launch as launch
from jvp_attention.forward import FORWARD_REPLAYS, flash_attention_forward

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = (1, 2, 24, 16) if not HAS_CUDA else (4, 8, 256, 64)


def _inputs(dtype=torch.float16, shape=SHAPE, seed=0, heads_kv=None):
    generator = torch.Generator().manual_seed(seed)
    kv_shape = (shape[0], heads_kv or shape[1], *shape[2:])
    made = [torch.randn(s, generator=generator, dtype=torch.float32).to(DEVICE, dtype)
            for s in (shape, kv_shape, kv_shape, shape, kv_shape, kv_shape)]
    return made[:3], tuple(made[3:])


def _flat(result) -> list[torch.Tensor]:
    outputs, extra = (result if isinstance(result, tuple) and len(result) == 2
                      and isinstance(result[1], tuple) else (result, ()))
    return [t for t in (*outputs, *extra) if t is not None]


def _settle(*args, **kwargs):
    """Calls until a replay is recorded: on a GPU the first call at a key tunes, the
    second launches through Triton and the third is the first direct launch."""
    for _ in range(3):
        flash_attention_forward(*args, **kwargs)


def _whole_path(*args, **kwargs):
    """The call as the whole path makes it (no replay recorded or used)."""
    launch.forget_replays()
    result = flash_attention_forward(*args, **kwargs)
    launch.forget_replays()
    return result


@pytest.mark.parametrize("tangents", [False, True], ids=["plain", "tangents"])
@pytest.mark.parametrize("residuals", [False, True], ids=["", "residuals"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_replay_gives_the_whole_paths_bits(tangents, residuals, causal) -> None:
    (q, k, v), tan = _inputs()
    kwargs = dict(is_causal=causal, tangents=tan if tangents else None, residuals=residuals)
    _settle(q, k, v, **kwargs)
    assert len(FORWARD_REPLAYS) == 1
    (q2, k2, v2), tan2 = _inputs(seed=1)
    kwargs2 = dict(kwargs, tangents=tan2 if tangents else None)
    replayed = _flat(flash_attention_forward(q2, k2, v2, **kwargs2))
    whole = _flat(_whole_path(q2, k2, v2, **kwargs2))
    assert len(replayed) == len(whole) == 2 + 2 * tangents + (1 + tangents) * residuals
    for a, b in zip(replayed, whole, strict=True):
        assert torch.equal(a, b)


def test_a_replay_skips_the_decisions() -> None:
    """At a key seen before none of the launcher's checks or choices run again (patched
    with `mock`, which, unlike the tests' `monkeypatch`, keeps the replays)."""
    (q, k, v), tan = _inputs(heads_kv=1)  # GQA
    expected = _flat(flash_attention_forward(q, k, v, tangents=tan))
    _settle(q, k, v, tangents=tan)

    def refuse(*args, **kwargs):
        raise AssertionError("a replayed call decided again")

    names = ("check_kernel_shapes", "takes_warp_specialized", "tma_eligible",
             "launch_column_tiles", "kernel_meta", "row_alignment", "carries")
    with ExitStack() as patches:
        for name in names:
            patches.enter_context(mock.patch.object(forward, name, refuse))
        replayed = _flat(flash_attention_forward(q, k, v, tangents=tan))
    for a, b in zip(replayed, expected, strict=True):
        assert torch.equal(a, b)


def _key_count_after(*calls) -> int:
    launch.forget_replays()
    for args, kwargs in calls:
        _settle(*args, **kwargs)
    return len(FORWARD_REPLAYS)


def test_keys_hold_what_the_decisions_read() -> None:
    """Each of these differs from the first call in one thing a decision reads: each must
    get a replay of its own."""
    (q, k, v), tan = _inputs()
    transposed = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    storage = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    unaligned = storage[1:].view(q.shape).copy_(q)  # 2 bytes past a 16-byte boundary
    calls = [((q, k, v), {}),
             ((q, k, v), {"is_causal": True}),
             ((q, k, v), {"scale": 0.5}),
             ((q, k, v), {"residuals": True}),
             ((q, k, v), {"tangents": tan}),
             ((q, k, v), {"tangents": tan, "precision": "fast"}),
             ((q.float(), k.float(), v.float()), {}),
             (tuple(transposed), {}),
             ((unaligned, k, v), {})]
    assert _key_count_after(*calls) == len(calls)
    with mock.patch.dict(os.environ, {"JVP_ATTENTION_TMA": "0"}):
        assert _key_count_after(calls[0]) == 1
    with mock.patch.dict(os.environ, {"JVP_ATTENTION_TMA": "auto"}):
        _settle(q, k, v)
    assert len(FORWARD_REPLAYS) == 2  # the switch is part of the key


def test_mask_tangents_copies_and_traced_calls_are_not_replayed() -> None:
    (q, k, v), tan = _inputs()
    bias = torch.zeros(q.shape[2], k.shape[2], dtype=q.dtype, device=q.device)
    column_strided = q.transpose(2, 3).contiguous().transpose(2, 3)  # last stride != 1
    calls = [((q, k, v, bias), {"tangents": tan, "mask_tangent": bias}),
             ((column_strided, k, v), {})]
    assert _key_count_after(*calls) == 0
    # A fake tensor (a traced call's) has no address: no key.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(q)
        assert launch.call_facts(fake, k, v) is None


def test_forget_replays_empties_every_table() -> None:
    (q, k, v), _ = _inputs()
    _settle(q, k, v)
    assert FORWARD_REPLAYS and FORWARD_REPLAYS in [t for t in launch.REPLAY_TABLES]
    launch.forget_replays()
    assert not any(launch.REPLAY_TABLES)


class _Tuner:
    """Stands in for a KeyedAutotuner: its memory of tuned tiles."""

    def __init__(self, tuned):
        self.tuned = tuned
        self.best_config = None


def test_a_direct_replay_steps_aside_for_hooks_and_new_tiles(monkeypatch) -> None:
    """`usable`: while a launch hook is installed (a profiler's), or once the autotuner
    holds another tile for the key (a tile sweep), the call takes the whole path."""
    import triton

    tile = object()
    tuner = _Tuner({"key": tile})
    direct = launch.DirectLaunch(None, (1, 1, 1), (), 0, (tuner, "key", tile))
    replay = launch.ReplayedLaunch(False, direct)
    assert replay.usable()
    tuner.tuned = {"key": object()}
    assert not replay.usable()
    tuner.tuned = {}
    assert not replay.usable()
    tuner.tuned = {"key": tile}
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *args: None)
    assert not replay.usable()
    untuned = replay._replace(recorded=direct._replace(tuned=None))
    assert not untuned.usable()
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    assert untuned.usable()
    interpreted = launch.InterpretedLaunch(None, (1,), (), {})
    assert replay._replace(recorded=interpreted).usable()  # the interpreter's: always


def test_a_direct_replay_hands_the_launcher_addresses(monkeypatch) -> None:
    """A direct replay gives Triton's C launcher each tensor's address (None kept), in the
    leading arguments and in the pool's places inside tuples (the carry's), so that the
    launcher takes them as they are instead of asking the driver about every pointer; the
    other arguments and the grid go as recorded."""
    monkeypatch.setattr(launch, "driver", mock.Mock(**{"active.get_current_stream.return_value": 7}))
    compiled = CompiledStandIn()
    a, b, c = (torch.arange(4.0) + i for i in range(3))
    pool = (a, b, None, c, None)
    rest = (3, 0.5, (launch.PoolPlace(3), launch.PoolPlace(0)), True)
    direct = launch.DirectLaunch(compiled, (2, 1, 1), (None, None) + rest, 0)
    launch.ReplayedLaunch(False, direct, placed=True)((b, None), pool)
    [args] = compiled.launches
    assert args == (2, 1, 1, 7, "function-handle", "packed-metadata", None, None, None, b.data_ptr(), None,
                    3, 0.5, (c.data_ptr(), a.data_ptr()), True)
    assert all(type(x) is not torch.Tensor for x in args[9:])
    # The interpreter's replay still takes the tensors themselves.
    kernel = mock.Mock()
    interpreted = launch.InterpretedLaunch(kernel, (2,), (None, None) + rest, {"BLOCK": 16})
    launch.ReplayedLaunch(False, interpreted, placed=True)((b, None), pool)
    kernel.run.assert_called_once_with(b, None, 3, 0.5, (c, a), True, grid=(2,), warmup=False,
                                       BLOCK=16)


class CudaLauncher:
    """Stands in for Triton 3.6's CUDA launcher object (`native_launch` knows it by its
    class's name): records what its C function is handed."""

    num_ctas, global_scratch_size, global_scratch_align, profile_scratch_size = 1, 128, 128, 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)


def _native_replay(launcher, n_pool=2):
    """`call_replay` of one direct launch (grid (2, 3, 1)) whose compiled kernel has
    `launcher`: its leading tensors are the pool's 0 and a None."""
    compiled = CompiledStandIn()
    compiled.run = launcher
    direct = launch.DirectLaunch(compiled, (2, 3, 1), (None, None, 5, True), 0)
    return launch.call_replay([(direct, (0, None), False)], n_pool, [])


def test_a_replay_calls_the_c_function_with_a_workspace_of_its_own(monkeypatch) -> None:
    """Under the Triton it knows, a direct replay calls the launcher's C function itself:
    the workspace in which the kernel builds its tensor descriptors (blocks x CTAs x bytes)
    is allocated with the call's scratch tensors and handed over by address, with the
    launcher's flags, no profiling scratch, and the tensors' addresses."""
    monkeypatch.setattr(launch, "driver", mock.Mock(**{"active.get_current_stream.return_value": 7}))
    launcher = CudaLauncher()
    replay = _native_replay(launcher)
    assert replay.scratch == (((2 * 3 * 128,), torch.int8, torch.device("cuda", 0)),)
    [(replayed, slots)] = replay.launches
    assert slots == (0, 3)  # the pool, the workspace, then the None at the end
    a, workspace = torch.arange(4.0), torch.empty(768, dtype=torch.int8)
    replayed((a, None), (a, torch.ones(2), workspace, None))
    assert launcher.calls == [(2, 3, 1, 7, "function-handle", False, True, workspace.data_ptr(),
                               None, "packed-metadata", None, None, None, a.data_ptr(), None, 5, True)]
    launcher.global_scratch_size = 0  # no descriptors: no workspace
    replay = _native_replay(launcher)
    assert replay.scratch == () and replay.launches[0][1] == (0, 2)
    replay.launches[0][0]((a, None), (a, torch.ones(2), None))
    assert launcher.calls[-1][7] is None


@pytest.mark.parametrize("other", ["triton", "profiling", "launcher"])
def test_a_replay_calls_an_unknown_launcher_as_triton_does(monkeypatch, other) -> None:
    """Under another Triton, with a launcher that wants profiling scratch too, or with a
    launcher object of another kind, the replay calls the launcher object (which allocates
    what it needs) and allocates no workspace itself."""
    launcher = CudaLauncher()
    if other == "triton":
        monkeypatch.setattr(launch.triton, "__version__", "3.7.0")
    elif other == "profiling":
        launcher.profile_scratch_size = 64
    else:
        launcher = mock.Mock()
    replay = _native_replay(launcher)
    assert replay.scratch == () and replay.launches[0][0].native is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=str)
@pytest.mark.parametrize("tangents", [False, True], ids=["plain", "tangents"])
def test_direct_replay_gpu(dtype, tangents) -> None:
    """On the GPU a replay calls the compiled kernel's C launcher, once the autotuner has
    settled the key's tile, and gives the whole path's bits."""
    (q, k, v), tan = _inputs(dtype)
    kwargs = dict(tangents=tan if tangents else None, residuals=True)
    _settle(q, k, v, **kwargs)
    (call_replay,) = FORWARD_REPLAYS.values()
    ((replay, _),) = call_replay.launches  # one launch: no carry at these lengths
    assert isinstance(replay.recorded, launch.DirectLaunch)
    assert replay.recorded.tuned is not None
    (q2, k2, v2), tan2 = _inputs(dtype, seed=1)
    kwargs2 = dict(kwargs, tangents=tan2 if tangents else None)
    replayed = _flat(flash_attention_forward(q2, k2, v2, **kwargs2))
    whole = _flat(_whole_path(q2, k2, v2, **kwargs2))
    for a, b in zip(replayed, whole, strict=True):
        assert torch.equal(a, b)


def test_a_patched_decision_is_not_met_by_a_replay(monkeypatch) -> None:
    """The tests' own guard (conftest): a `monkeypatch` change forgets the replays, so that
    a test comparing two settings of a decision at one key compares two launches."""
    (q, k, v), _ = _inputs()
    _settle(q, k, v)
    assert FORWARD_REPLAYS
    monkeypatch.setattr(forward, "carries", lambda q, n_keys: True)
    assert not FORWARD_REPLAYS


def _backward_call(seed, second, dtype=torch.float16, precision=None, bias=False,
                   mask_grad=False):
    """A backward call (first order, or `second`: through the tangent) on a forward's
    outputs from `seed`'s inputs (with `bias`, an additive mask of the scores' shape, whose
    gradient the call returns with `mask_grad`), to make again and again."""
    from jvp_attention.backward import flash_attention_backward

    (q, k, v), tan = _inputs(dtype, seed=seed)
    mask = _masks(seed, q, k.shape[2])["bias"] if bias else None
    fwd = flash_attention_forward(q, k, v, mask, tangents=tan, precision=precision)
    grad_out, grad_tangent_out = (torch.randn_like(fwd.out) for _ in range(2))
    return lambda: flash_attention_backward(
        q, k, v, fwd.out, fwd.lse, grad_out, mask, tangents=tan if second else None,
        tangent_out=fwd.tangent_out if second else None, mu=fwd.mu if second else None,
        grad_tangent_out=grad_tangent_out if second else None, mask_grad=mask_grad,
        precision=precision)


def _backward_replayed_and_whole(call) -> tuple[tuple, tuple]:
    """The backward `call(1)` replayed, after three calls of `call(0)` that record one
    replay, and on the whole path."""
    from jvp_attention.backward import BACKWARD_REPLAYS

    settle = call(0)
    for _ in range(3):
        settle()
    assert len(BACKWARD_REPLAYS) == 1
    later = call(1)
    replayed = later()
    launch.forget_replays()
    return replayed, later()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] if not HAS_CUDA
                         else [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("precision", ["accurate", "fast"])
@pytest.mark.parametrize("order", ["first", "second"])
def test_backward_replay(dtype, precision, order) -> None:
    """The backward's launches (the row statistics where they run, dQ, dK/dV or the
    second order's passes) replayed from its inputs and new buffers give the whole path's
    bits (on the GPU through the C launcher, here through the interpreter)."""
    def call(seed):
        return _backward_call(seed, order == "second", dtype=dtype, precision=precision)

    replayed, whole = _backward_replayed_and_whole(call)
    assert len(replayed) == (6 if order == "second" else 3)
    for a, b in zip(replayed, whole, strict=True):
        assert torch.equal(a, b)


def test_a_replay_keeps_no_tensor_alive() -> None:
    """A recorded replay holds none of the recorded call's tensors: neither their memory
    nor (in the backward) gradients that autograd could otherwise take over uncopied."""
    from jvp_attention.backward import BACKWARD_REPLAYS, flash_attention_backward

    (q, k, v), tan = _inputs()
    refs = [weakref.ref(x) for x in (q, k, v, *tan)]
    for _ in range(3):
        fwd = flash_attention_forward(q, k, v, tangents=tan)
        grad_out = torch.randn_like(fwd.out)
        grads = flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out)
        refs += [weakref.ref(x) for x in (*_flat(fwd), grad_out, *grads)]
    assert FORWARD_REPLAYS and BACKWARD_REPLAYS
    del q, k, v, tan, fwd, grad_out, grads
    gc.collect()
    assert all(ref() is None for ref in refs)


def _training_step(seed: int, order: str, heads_kv=None, mask=None,
                   **options) -> list[torch.Tensor]:
    """`torch.func.jvp(attention)`, then a backward through the primal output (MeanFlow,
    "first") or through both outputs ("second"): the outputs and the gradients. `mask`:
    (seed, q, n_k) -> the call's attn_mask, closed over (no tangent); its gradient too
    where it requires one."""
    import jvp_attention

    (q, k, v), tangents = _inputs(seed=seed, heads_kv=heads_kv)
    if mask is not None:
        options["attn_mask"] = mask(seed, q, k.shape[2])
    for x in (q, k, v):
        x.requires_grad_(True)
    out, t_out = torch.func.jvp(lambda a, b, c: jvp_attention.attention(a, b, c, **options),
                                (q, k, v), tangents)
    loss = (out * torch.randn_like(out)).sum()
    if order == "second":
        loss = loss + (t_out * torch.randn_like(t_out)).sum()
    loss.backward()
    trained = mask is not None and options["attn_mask"].requires_grad
    return [out.detach(), t_out.detach(), q.grad, k.grad, v.grad,
            *([options["attn_mask"].grad] if trained else [])]


def _replayed_and_whole(step, recorded=lambda: None) -> tuple[list, list, list]:
    """`step(seed)` replayed (after three steps that record it; then `recorded()` checks
    the replays) and on the whole path, from one seed, and the `ReplayedLaunch`es the
    replayed step ran."""
    from jvp_attention.backward import BACKWARD_REPLAYS

    for seed in range(3):
        step(seed)
    assert FORWARD_REPLAYS and BACKWARD_REPLAYS
    recorded()
    launches = []
    real = launch.ReplayedLaunch.__call__

    def counted(self, tensors, pool=()):
        launches.append(self)
        return real(self, tensors, pool)

    torch.manual_seed(5)
    with mock.patch.object(launch.ReplayedLaunch, "__call__", counted):
        replayed = step(5)
    launch.forget_replays()
    torch.manual_seed(5)
    return replayed, step(5), launches


@pytest.mark.parametrize("order", ["first", "second"])
def test_replayed_training_call_gives_the_whole_paths_gradients(order) -> None:
    """As training calls it, causal, grouped heads (GQA 2:1), "accurate" (its rounding
    residuals reach the backward): replayed calls give the whole path's outputs and
    gradients bit for bit."""
    replayed, whole, launches = _replayed_and_whole(
        lambda seed: _training_step(seed, order, heads_kv=1, is_causal=True, enable_gqa=True))
    assert len(launches) >= 3  # the forward's launch and the backward's (dQ, key side)
    for a, b in zip(replayed, whole, strict=True):
        assert torch.equal(a, b)


def test_the_backward_key_holds_deterministic_algorithms() -> None:
    """Deterministic algorithms change the backward's kernels (chapter 12 then sums dQ in
    a fixed order): a call under them is keyed apart from one without."""
    from jvp_attention.backward import BACKWARD_REPLAYS, flash_attention_backward

    (q, k, v), _ = _inputs()
    fwd = flash_attention_forward(q, k, v)
    grad_out = torch.randn_like(fwd.out)
    for _ in range(3):  # until recorded (on a GPU the first call tunes)
        flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out)
    keys = set(BACKWARD_REPLAYS)
    assert len(keys) == 1
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out)
    finally:
        torch.use_deterministic_algorithms(was)
    assert len(set(BACKWARD_REPLAYS) - keys) == 1


def test_one_tensor_passed_thrice_is_keyed_apart() -> None:
    """The backward's replay finds its tensors by identity: recorded from a call with one
    tensor as q, k and v, it must not serve a later call with three (it would pass that
    call's q as k and v too), nor the other way round."""
    from jvp_attention.backward import flash_attention_backward

    def backward(q, k, v, seed):
        fwd = flash_attention_forward(q, k, v)
        grad_out = torch.randn(fwd.out.shape, generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float32).to(fwd.out)
        return lambda: flash_attention_backward(q, k, v, fwd.out, fwd.lse, grad_out)

    (x, _, _), _ = _inputs(seed=0)
    (q, k, v), _ = _inputs(seed=1)
    for first, later in (((x, x, x), (q, k, v)), ((q, k, v), (x, x, x))):
        launch.forget_replays()
        settle = backward(*first, 0)
        for _ in range(3):
            settle()
        call = backward(*later, 1)
        replayed = call()
        launch.forget_replays()
        for a, b in zip(replayed, call(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("order", ["first", "second"])
def test_a_carried_call_is_replayed_with_copies_of_its_own(monkeypatch, order) -> None:
    """A carried call (bf16 "accurate" from carry_min_keys keys; here forced on fp16, as the
    interpreter's bf16 products are wrong) replays the carry's range pass and copies too,
    into copies and factors it allocates anew, and gives the whole path's bits."""
    from jvp_attention import backward

    monkeypatch.setattr(forward, "carries", lambda q, n_keys: True)
    monkeypatch.setattr(backward, "carries", lambda q, n_keys: True)

    def recorded() -> None:
        (replay,) = FORWARD_REPLAYS.values()
        assert len(replay.launches) == 3  # the range pass, the copies, the attention
        assert len(replay.scratch) == 4  # partial maxima, the copies of v and tv, factors

    replayed, whole, launches = _replayed_and_whole(lambda seed: _training_step(seed, order),
                                                    recorded)
    assert sum(replay.placed for replay in launches) == 4  # the forward's carry, the backward's
    for a, b in zip(replayed, whole, strict=True):
        assert torch.equal(a, b)


def test_a_carried_copy_of_a_column_strided_input_is_not_replayed(monkeypatch) -> None:
    """The carry reads the copy that `unit_last_stride` made of a column-strided input, a
    tensor in no pool: such a call takes the whole path every time, and gives its bits."""
    monkeypatch.setattr(forward, "carries", lambda q, n_keys: True)
    (q, k, v), tan = _inputs()
    column_strided = v.transpose(2, 3).contiguous().transpose(2, 3)  # last stride != 1
    _settle(q, k, column_strided, tangents=tan)
    assert not FORWARD_REPLAYS
    replayed = _flat(flash_attention_forward(q, k, column_strided, tangents=tan))
    whole = _flat(_whole_path(q, k, v, tangents=tan))
    for a, b in zip(replayed, whole, strict=True):
        assert torch.equal(a, b)


def _masks(seed: int, q: torch.Tensor, n_k: int) -> dict[str, torch.Tensor]:
    """A key-padding mask broadcast over heads and queries (a stride-0 view, as `attention`
    passes one on) and an additive bias of the scores' shape, both drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    batch, heads, n_q = q.shape[:3]
    keep = torch.rand(batch, 1, 1, n_k, generator=generator) > 0.3
    keep[..., 0] = True  # no row left without keys
    bias = torch.randn(batch, heads, n_q, n_k, generator=generator)
    return {"padding": keep.to(q.device).expand(batch, heads, n_q, n_k),
            "bias": bias.to(q.device, q.dtype)}


@pytest.mark.parametrize("kind", ["padding", "bias"])
@pytest.mark.parametrize("tangents", [False, True], ids=["plain", "tangents"])
def test_a_masked_call_is_replayed_with_its_own_mask(kind, tangents) -> None:
    """A mask without a tangent is one more input of the call: a replay reads the call's
    own mask (drawn anew here for each call) and gives the whole path's bits."""
    def call(seed):
        (q, k, v), tan = _inputs(seed=seed)
        mask = _masks(seed, q, k.shape[2])[kind]
        return (q, k, v, mask), {"tangents": tan if tangents else None}

    for seed in range(3):
        args, kwargs = call(seed)
        flash_attention_forward(*args, **kwargs)
    assert len(FORWARD_REPLAYS) == 1
    args, kwargs = call(5)
    replayed = _flat(flash_attention_forward(*args, **kwargs))
    whole = _flat(_whole_path(*args, **kwargs))
    for a, b in zip(replayed, whole, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("order", ["first", "second"])
def test_a_masked_training_call_is_replayed(order) -> None:
    """`attention` with a key-padding mask under `torch.func.jvp`, then the backward: the
    forward and the backward replay with each call's own mask, bit for bit."""
    def padding(seed, q, n_k):
        return _masks(seed, q, n_k)["padding"][:, :1, :1]  # (B, 1, 1, Nk)

    replayed, whole, launches = _replayed_and_whole(
        lambda seed: _training_step(seed, order, mask=padding))
    assert len(launches) >= 3
    for a, b in zip(replayed, whole, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("order", ["first", "second"])
def test_a_learnable_bias_call_is_replayed_with_gradient_buffers_of_its_own(order) -> None:
    """A backward that returns an additive mask's gradient (a learnable bias, without a
    tangent) replays with new gradient buffers and gives the whole path's bits, the mask's
    gradients among them; asking for them or not is part of the key."""
    from jvp_attention.backward import BACKWARD_REPLAYS

    second = order == "second"

    def call(seed, mask_grad=True):
        return _backward_call(seed, second, bias=True, mask_grad=mask_grad)

    replayed, whole = _backward_replayed_and_whole(call)
    assert len(replayed) == len(whole) == (8 if second else 4)  # ..., dmask (, dmask_tangent)
    assert replayed[-1].shape == whole[-1].shape == (*SHAPE[:3], SHAPE[2])
    for a, b in zip(replayed, whole, strict=True):
        assert torch.equal(a, b)
    without = call(2, mask_grad=False)
    for _ in range(3):
        without()
    assert len(BACKWARD_REPLAYS) == 2


@pytest.mark.parametrize("order", ["first", "second"])
def test_a_training_call_with_a_learnable_bias_is_replayed(order) -> None:
    """`attention` with a (1, H, N, N) bias that requires grad, closed over by the function
    `torch.func.jvp` differentiates (a parameter: no tangent), then the backward: the
    forward and the backward replay, and the outputs and every gradient, the bias's among
    them, are the whole path's bits."""
    from jvp_attention.backward import BACKWARD_REPLAYS

    def learnable(seed, q, n_k):  # (1, H, Nq, Nk)
        return _masks(seed, q, n_k)["bias"][:1].clone().requires_grad_(True)

    replayed, whole, launches = _replayed_and_whole(
        lambda seed: _training_step(seed, order, mask=learnable))
    assert len(replayed) == 6  # the bias's gradient last
    assert len(BACKWARD_REPLAYS) == 1
    assert len(launches) >= 3  # the forward's launch, the backward's dQ and key side
    assert replayed[-1].abs().max() > 0
    for a, b in zip(replayed, whole, strict=True):
        assert torch.equal(a, b)


def test_a_call_recorded_inside_another_spoils_the_outer_recording() -> None:
    """A recording keeps its launches from any recording around it: the outer call could not
    repeat them, so it is not replayed."""
    (q, k, v), _ = _inputs()
    _settle(q, k, v)
    launch.forget_replays()
    own = launch.InterpretedLaunch(None, (1,), (), {})  # a launch of the outer call's own
    with launch.Recording((), True) as alone:
        launch.RECORDER.launches.append(own)
    assert alone.replay is not None
    with launch.Recording((), True) as outer:
        launch.RECORDER.launches.append(own)
        _settle(q, k, v)
    assert FORWARD_REPLAYS  # the inner calls are recorded as usual
    assert outer.replay is None
