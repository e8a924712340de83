"""context_parallel_attention (chapter 10) on 2 and 4 CPU processes over gloo.

Each world size starts its processes once (`run_on_processes`) and runs every check in them:

* `compare_with_one_process` on a list of cases: the output, the tangent under
  `torch.func.jvp`, the gradients of the plain backward, of the MeanFlow step (jvp, then a
  backward through the primal output) and through both outputs (second order), each rank's
  shard against `attention` on the whole sequence. float64 (PyTorch operations) must agree
  with the float64 truth to 1e-12; float32 (the kernels, in Triton's interpreter) is held to
  tests/helpers.py's rule (`allowed_error`, whose constants are checked against helpers'): at
  most FLOOR_FACTOR times `attention`'s own error on one process plus EPS_ROUNDINGS roundings
  at the problem's scale, and for gradients one rounding per rank (each block's gradient is
  rounded to the dtype before the sums). The float64 cases cover the methods'
  logic (causal in both layouts, GQA with fewer key/value heads than ranks, key-padding
  masks, 4 ranks); the float32 ones the library's kernels through the adapter, at 2 ranks.
* (2 ranks) `torch.autograd.forward_ad`, a gradient penalty through Ulysses, `vmap`, what the
  ring refuses (a gradient of its gradients, forward over forward), and every bad call:
  each must raise on *every* rank, with its message, instead of leaving one waiting.

One test per world size, so that pytest-xdist never starts the same processes twice. Last,
`benchmarks/context_parallel.py --smoke` runs as a user runs it (torchrun, two gloo processes,
PyTorch operations at tiny sizes) and writes its JSON. The file takes about a minute on two
cores.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_with_one_retry

import jvp_attention.context_parallel as cp
from jvp_attention import attention, context_parallel_attention, shard_sequence
from jvp_attention.context_parallel import CheckCase, compare_with_one_process, run_on_processes

REPO = Path(__file__).resolve().parents[2]
F64, F32 = torch.float64, torch.float32
TINY = {"batch": 1, "heads": 2, "kv_heads": 2, "length": 16, "head_dim": 8}
TWO_RANKS = [
    CheckCase("ulysses", F64, batch=2, heads=4, kv_heads=4, key_padding=True),
    CheckCase("ulysses", F64, heads=4, kv_heads=1, is_causal=True, layout="zigzag"),
    CheckCase("ring", F64, batch=2, heads=4, kv_heads=2, key_padding=True),
    CheckCase("ring", F64, heads=4, kv_heads=4, is_causal=True),
    CheckCase("ring", F64, batch=2, heads=4, kv_heads=2, is_causal=True, layout="zigzag",
              key_padding=True),
    CheckCase("ulysses", F32, **dict(TINY, kv_heads=1), is_causal=True, layout="zigzag",
              key_padding=True),
    CheckCase("ring", F32, **dict(TINY, kv_heads=1), is_causal=True, layout="zigzag",
              key_padding=True),
    # batch 2: sequence 1's second half is padding, so rank 1's own block (the causal
    # diagonal) shows its rows no key at all
    CheckCase("ring", F32, **dict(TINY, batch=2), is_causal=True, key_padding=True),
    # sequence 1 is padding throughout, masked by the dtype's lowest number, as Hugging Face
    # masks: its rows average the values, and the ring merges their LSE in fp64
    CheckCase("ring", F32, **dict(TINY, batch=2), key_padding=True,
              pad_value=torch.finfo(torch.float32).min),
]
FOUR_RANKS = [
    CheckCase("ulysses", F64, heads=8, kv_heads=2, is_causal=True, key_padding=True),
    CheckCase("ulysses", F64, heads=4, kv_heads=1, is_causal=True, layout="zigzag"),
    CheckCase("ring", F64, batch=2, heads=2, kv_heads=1, key_padding=True),
    CheckCase("ring", F64, heads=2, kv_heads=2, is_causal=True),
    CheckCase("ring", F64, batch=2, heads=4, kv_heads=2, is_causal=True, layout="zigzag",
              key_padding=True),
]


# --- what the processes run (imported by name in each of them) ------------------------------


def checks_on_ranks(cases: list[CheckCase], probes: bool) -> dict:
    """Every check of one world size, run on every rank; rank 0's result comes back."""
    results = {"cases": compare_with_one_process(cases)}
    if probes:
        results["errors"] = bad_calls()
        results["transforms"] = transforms()
    return results


def _sharded(*tensors: torch.Tensor) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return [shard_sequence(x, rank, world) for x in tensors]


def _inputs(heads: int = 2, length: int = 8, dtype: torch.dtype = F64) -> list[torch.Tensor]:
    """q, k, v, tq, tk, tv of the whole sequence, the same on every rank."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(1, heads, length, 4, generator=gen, dtype=dtype) for _ in range(6)]


def _raised(call) -> list[str]:
    """Every rank's exception, 'Type: message' (or 'no error'), gathered on every rank."""
    try:
        call()
        mine = "no error"
    except Exception as error:  # each rank reports what it raised, whatever it was
        mine = f"{type(error).__name__}: {error}"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def bad_calls() -> dict[str, list[str]]:
    """Calls that must fail on every rank: what each rank raised, by call."""
    rank = dist.get_rank()
    q, k, v = _sharded(*_inputs()[:3])
    keypad = torch.ones(1, 1, 1, q.shape[-2], dtype=torch.bool)
    odd = [x[..., :3, :] for x in (q, k, v)]
    return {
        "unequal shards": _raised(lambda: context_parallel_attention(
            q[..., : q.shape[-2] - rank, :], k, v)),
        "heads not divisible": _raised(lambda: context_parallel_attention(
            *(torch.cat([x, x[:, :1]], 1) for x in (q, k, v)))),
        "query-varying mask": _raised(lambda: context_parallel_attention(
            q, k, v, attn_mask=keypad.expand(1, 1, q.shape[-2], -1))),
        "per-head mask": _raised(lambda: context_parallel_attention(
            q, k, v, attn_mask=keypad.expand(1, 2, 1, -1), method="ring")),
        "learnable mask": _raised(lambda: context_parallel_attention(
            q, k, v, attn_mask=torch.zeros(1, 1, 1, q.shape[-2], dtype=F64,
                                           requires_grad=True))),
        "one rank's bad dtype": _raised(lambda: context_parallel_attention(
            q, k.float() if rank == 1 else k, v)),
        "ranks disagree on the method": _raised(lambda: context_parallel_attention(
            q, k, v, method=("ulysses", "ring")[rank])),
        "unknown method": _raised(lambda: context_parallel_attention(q, k, v, method="tree")),
        "odd zigzag shard": _raised(lambda: context_parallel_attention(
            *odd, layout="zigzag", is_causal=True)),
        "causal cross-attention": _raised(lambda: context_parallel_attention(
            q, k[..., :2, :], v[..., :2, :], is_causal=True, method="ring")),
        "ring gradient penalty": _raised(lambda: _gradient_penalty("ring", q, k, v)),
        "ring forward over forward": _raised(lambda: _forward_over_forward("ring", q, k, v)),
    }


def _gradient_penalty(method: str, q, k, v) -> torch.Tensor:
    """d/dq of |d/dq sum(out^2)|^2 (a double backward)."""
    q = q.detach().requires_grad_()
    if method == "one":
        out = attention(q, k, v, is_causal=True)
    else:
        out = context_parallel_attention(q, k, v, is_causal=True, method=method)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    return torch.autograd.grad(dq.square().sum(), q)[0]


def _forward_over_forward(method: str, q, k, v) -> torch.Tensor:
    """The tangent along k of the tangent along q (nested torch.func.jvp)."""
    def attend(a, b):
        if method == "one":
            return attention(a, b, v, is_causal=True)
        return context_parallel_attention(a, b, v, is_causal=True, method=method)

    def inner(b):
        return torch.func.jvp(lambda a: attend(a, b), (q,), (torch.ones_like(q),))[1]

    return torch.func.jvp(inner, (k,), (torch.ones_like(k),))[1]


def transforms() -> dict[str, float]:
    """Largest differences from one process (or, for forward_ad, from torch.func.jvp)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    whole = _inputs()
    q, k, v, tq, tk, tv = _sharded(*whole)
    found = {}
    for method in ("ulysses", "ring"):
        def attend(a, b, c, method=method):
            return context_parallel_attention(a, b, c, is_causal=True, method=method)

        _, tangent = torch.func.jvp(attend, (q, k, v), (tq, tk, tv))
        with torch.autograd.forward_ad.dual_level():
            duals = [torch.autograd.forward_ad.make_dual(x, t)
                     for x, t in zip((q, k, v), (tq, tk, tv), strict=True)]
            dual_tangent = torch.autograd.forward_ad.unpack_dual(attend(*duals)).tangent
        found[f"{method} forward_ad"] = (dual_tangent - tangent).abs().max().item()
        batched = torch.func.vmap(attend, in_dims=(0, None, None))(torch.stack([q, 2 * q]), k, v)
        one = torch.stack([attention(s * whole[0], *whole[1:3], is_causal=True) for s in (1, 2)])
        found[f"{method} vmap"] = (batched - shard_sequence(one, rank, world)).abs().max().item()
        unbatched = attend(q[0], k[0], v[0])  # (H, N, D), and (2, 1, H, N, D)
        one = shard_sequence(attention(*(x[0] for x in whole[:3]), is_causal=True), rank, world)
        found[f"{method} 3-d"] = (unbatched - one).abs().max().item()
        stacked = attend(*(torch.stack([x, x]) for x in (q, k, v)))
        found[f"{method} 5-d"] = (stacked - unbatched).abs().max().item()
        compiled = torch.compile(attend, backend="aot_eager")  # Dynamo + AOTAutograd, no codegen
        pairs = zip(torch.func.jvp(compiled, (q, k, v), (tq, tk, tv)),
                    torch.func.jvp(attend, (q, k, v), (tq, tk, tv)), strict=True)
        found[f"{method} compiled jvp"] = max((a - b).abs().max().item() for a, b in pairs)
        leaf = q.clone().requires_grad_()
        grads = [torch.autograd.grad(fn(leaf, k, v).square().sum(), leaf)[0]
                 for fn in (compiled, attend)]
        found[f"{method} compiled backward"] = (grads[0] - grads[1]).abs().max().item()
    penalty = _gradient_penalty("ulysses", q, k, v)
    one = shard_sequence(_gradient_penalty("one", *whole[:3]), rank, world)
    found["ulysses gradient penalty"] = (penalty - one).abs().max().item()
    nested = _forward_over_forward("ulysses", q, k, v)
    one = shard_sequence(_forward_over_forward("one", *whole[:3]), rank, world)
    found["ulysses forward over forward"] = (nested - one).abs().max().item()
    for name, value in found.items():  # the largest over the ranks
        found[name] = max(_all(value))
    return found


def _all(value: float) -> list[float]:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


# --- the tests -------------------------------------------------------------------------------


def test_the_allowance_is_the_suites_rule() -> None:
    """allowed_error uses tests/helpers.py's constants (plus a rounding per rank for
    gradients), and fails an error a little above them."""
    import helpers

    assert cp.FLOOR_FACTOR == helpers.FLOOR_FACTOR
    assert cp.EPS_ROUNDINGS == helpers.EPS_ROUNDINGS
    assert cp.UNIT_ROUNDOFF == helpers.UNIT_ROUNDOFF
    numbers = {"error": 0.0, "floor": 1e-6, "scale": 4.0}
    out = 2e-6 + 8 * 2.0**-24 * 4.0
    assert cp.allowed_error(F32, "tangent_out", numbers, 2) == pytest.approx(out)
    assert cp.allowed_error(F32, "second_dtk", numbers, 2) == pytest.approx(out + 2 * 2.0**-22)
    assert cp.allowed_error(F64, "dq", numbers, 4) == 4e-12


def assert_match_one_process(cases: list[CheckCase], report: dict, world: int,
                             device_type: str = "cpu") -> None:
    failures = []
    for case in cases:
        rows = report[case.label]
        assert len(rows) == 15, f"{case.label}: quantities {sorted(rows)}"
        for name, numbers in rows.items():
            allowed = cp.allowed_error(case.dtype, name, numbers, world, device_type)
            if not numbers["error"] <= allowed:  # also catches NaN
                failures.append(f"{case.label} {name}: error {numbers['error']:.2e} > allowed "
                                f"{allowed:.2e} (one process: {numbers['floor']:.2e})")
    assert not failures, "\n".join(failures)


EXPECTED_ERRORS = {  # call: (exception type on every rank, words of the message)
    "unequal shards": ("ValueError", "equal shards"),
    "heads not divisible": ("ValueError", "multiple of 2"),
    "query-varying mask": ("Unsupported", "key-padding mask"),
    "per-head mask": ("Unsupported", "key-padding mask"),
    "learnable mask": ("ValueError", "constant"),
    "ranks disagree on the method": ("ValueError", "calls differ"),
    "unknown method": ("ValueError", "method must be one of"),
    "odd zigzag shard": ("ValueError", "even length"),
    "causal cross-attention": ("ValueError", "same length"),
    "ring gradient penalty": ("Unsupported", "method='ulysses'"),
    "ring forward over forward": ("Unsupported", "method='ulysses'"),
}


def checks_over_gloo(world: int, cases: list[CheckCase], probes: bool) -> dict:
    """`checks_on_ranks` on `world` gloo processes. Once in many runs on a loaded two-core
    machine, a process was aborted by a C++ thread of gloo itself (`terminate called without
    an active exception`, no Python error); such a run is started once more. A Python
    error, a wrong number or a second abort still fails the test."""
    try:
        return run_on_processes(checks_on_ranks, world, cases, probes, backend="gloo")
    except RuntimeError as error:
        if "terminate called" not in str(error):
            raise
        warnings.warn(f"a gloo process aborted; starting the {world} processes once more:\n"
                      f"{error}", stacklevel=2)
        return run_on_processes(checks_on_ranks, world, cases, probes, backend="gloo")


def test_only_a_gloo_abort_starts_the_processes_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fails(*args: object, **kwargs: object) -> dict:
        calls.append(args)
        raise RuntimeError(errors.pop(0))

    monkeypatch.setattr(sys.modules[__name__], "run_on_processes", fails)
    errors = ["rank 0 failed; its output ends with:\nterminate called without an active "
              "exception", "rank 1 failed: AssertionError"]
    with pytest.warns(UserWarning, match="once more"), pytest.raises(RuntimeError,
                                                                     match="AssertionError"):
        checks_over_gloo(2, [], False)
    assert len(calls) == 2
    errors = ["rank 0 failed: ValueError"]
    with pytest.raises(RuntimeError, match="ValueError"):
        checks_over_gloo(2, [], False)
    assert len(calls) == 3


def test_two_ranks_match_one_process_and_refuse_bad_calls() -> None:
    results = checks_over_gloo(2, TWO_RANKS, True)
    assert_match_one_process(TWO_RANKS, results["cases"], 2)
    errors = results["errors"]
    for call, (kind, words) in EXPECTED_ERRORS.items():
        for rank, raised in enumerate(errors[call]):
            assert raised.startswith(kind + ":") and words in raised, (call, rank, raised)
    # Only rank 1 passes float32 keys: it names the dtype, rank 0 names rank 1.
    theirs, mine = errors["one rank's bad dtype"][1], errors["one rank's bad dtype"][0]
    assert theirs.startswith("TypeError") and "dtype" in theirs, theirs
    assert mine.startswith("ValueError") and "rank(s) [1]" in mine, mine
    for name, difference in results["transforms"].items():
        assert difference <= 1e-12, (name, difference)


def test_four_ranks_match_one_process() -> None:
    results = checks_over_gloo(4, FOUR_RANKS, False)
    assert_match_one_process(FOUR_RANKS, results["cases"], 4)


GPU_CASES = [
    CheckCase(method, dtype, batch=2, heads=8, kv_heads=kv, length=2048, head_dim=128,
              is_causal=causal, layout=layout, key_padding=True)
    for dtype in (torch.bfloat16, torch.float16, F32)
    for method, kv, causal, layout in (("ulysses", 2, True, "zigzag"), ("ring", 2, False,
                                                                        "contiguous"),
                                       ("ring", 1, True, "zigzag"))
]


@pytest.mark.gpu
def test_two_gpus_match_one_over_nccl() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    results = run_on_processes(checks_on_ranks, 2, GPU_CASES, False, backend="nccl")
    assert_match_one_process(GPU_CASES, results["cases"], 2, "cuda")


def test_no_process_group_says_what_to_do() -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(q, q, q)


def test_shard_sequence_layouts() -> None:
    x = torch.arange(12.0).view(1, 1, 12, 1)
    assert shard_sequence(x, 1, 3).flatten().tolist() == [4.0, 5.0, 6.0, 7.0]
    assert shard_sequence(x, 1, 3, "zigzag").flatten().tolist() == [2.0, 3.0, 8.0, 9.0]
    with pytest.raises(ValueError, match="equal chunks"):
        shard_sequence(x, 0, 5)
    with pytest.raises(ValueError, match="layout"):
        shard_sequence(x, 0, 2, "spiral")


def test_run_on_processes_needs_an_importable_function() -> None:
    def local():
        return 0

    local.__module__ = "__main__"
    with pytest.raises(ValueError, match="define it in a module"):
        run_on_processes(local, 2)


def test_case_labels_are_distinct() -> None:
    for cases in (TWO_RANKS, FOUR_RANKS, GPU_CASES):
        labels = [case.label for case in cases]
        assert len(set(labels)) == len(labels), labels


def test_benchmark_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "context_parallel.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                     os.environ.get("PYTHONPATH")])))
    result = run_with_one_retry([sys.executable, str(REPO / "benchmarks" / "context_parallel.py"),
                                 "--smoke", "--out", str(out)], cwd=tmp_path, env=env,
                                timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["schema"] == "jvp_attention.context_parallel/1" and record["complete"]
    assert record["world_size"] == 2 and record["backend"] == "gloo" and record["smoke"]
    for key in ("date", "command", "versions", "git", "settings", "definitions"):
        assert record[key], key
    cases = {(c["impl"], c["mode"]): c for c in record["cases"]}
    assert set(cases) == {(i, m) for i in ("one", "ulysses", "ring")
                          for m in ("fwd_jvp", "meanflow")}
    for case in cases.values():
        assert case["status"] == "ok" and case["ms"] > 0, case
        assert case["gpus"] == (1 if case["impl"] == "one" else 2)
        if case["impl"] != "one":  # gloo's operations, from the profiler
            assert 0 < case["comm_exposed_ms"] <= case["comm_ms"], case
    assert len(record["checks"]) == 2
    assert all(q["passed"] for rows in record["checks"].values() for q in rows.values())
    assert "| N | causal | mode | one | ulysses | ring |" in result.stdout


def test_benchmark_options_pass_through_torchrun() -> None:
    """The benchmark relaunches itself under torchrun, whose parser also reads the script's
    arguments and refuses one that is a prefix of several of its own options (`--n` was)."""
    import importlib.util

    from torch.distributed.run import get_args_parser

    spec = importlib.util.spec_from_file_location(
        "context_parallel_bench", REPO / "benchmarks" / "context_parallel.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    values = {"--lengths": "32768", "--heads": "4", "--head-dim": "64", "--batch": "1",
              "--dtype": "bf16", "--impls": "ring", "--modes": "fwd_jvp", "--reps": "1",
              "--warmup": "1", "--check-n": "0", "--processes": "2", "--out": "x.json"}
    argv = [item for option, value in values.items() for item in (option, value)]
    argv += ["--causal"]
    assert bench.parse_args(argv).lengths == [32768]
    parsed = get_args_parser().parse_args(["--standalone", "--nproc_per_node=2", "bench.py",
                                           *argv])
    assert parsed.training_script_args == argv
