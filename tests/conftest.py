"""Shared pytest set-up: the Triton interpreter on machines without a GPU, and the `gpu` marker.

Triton reads `TRITON_INTERPRET` when `@triton.jit` runs, that is when a kernel module is
imported, so the variable is set here, at conftest import time, before any test module imports
triton. Importing torch to ask about CUDA is safe: torch does not import triton eagerly.

The tests live in two folders: library/ (the package's modules, one test file per module or
aspect of one) and repository/ (docs, notebooks, the exporter, executed notebooks, benchmark
tooling). Both import the shared `helpers` module from this folder, which is put on sys.path
here: pytest imports this conftest before it collects any test module, whatever the import mode
or the test paths given on the command line.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The interpreter without its repeated patching (site/fast_interpreter.py), here and, through
# site/sitecustomize.py on PYTHONPATH, in every Python process the tests start.
SITE = str(Path(TESTS) / "site")
sys.path.insert(0, SITE)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SITE, os.environ.get("PYTHONPATH")]))
import fast_interpreter  # noqa: E402, F401

# The longest tests on CPU (30 to 150 s each on 2 cores), run first: under xdist the short
# tests then fill the end of the run, where one of these would leave the other workers idle.
LONGEST_FIRST = ("test_notebooks.py::test_notebook_runs", "::test_backward_fuzz",
                 "::test_second_order_fuzz", "::test_forward_fuzz",
                 "test_first_call_bench.py::", "test_context_parallel.py::test_two_ranks")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the longest tests first; skip tests marked `gpu` when there is no CUDA device."""
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONGEST_FIRST))
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="skipped: needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# What CUDA reports once a kernel has faulted: the process's CUDA context is lost, and every
# later CUDA call in it fails with the same message.
LOST_CONTEXT = ("an illegal memory access was encountered", "unspecified launch failure",
                "misaligned address", "an illegal instruction was encountered")
lost_by: list[str] = []  # the test that lost this process's CUDA context, once one has


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Remember a test that failed because the CUDA context was lost."""
    yield
    if call.excinfo is not None and not lost_by:
        message = str(call.excinfo.value)
        if any(text in message for text in LOST_CONTEXT):
            lost_by.append(f"{item.nodeid} ({message.splitlines()[0][:100]})")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip, with the culprit named, every later test of a process whose CUDA context a test
    lost: they would fail only because of it and bury the one that did (that test keeps its
    failure, so the run fails). Under xdist this is per worker. A subprocess is the way to
    test a fault (tests/library/test_tile_changes.py)."""
    if lost_by:
        pytest.skip(f"not run: the CUDA context of this process was lost by {lost_by[0]}")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny-tensor tests: on 2 shared cores a contended
    thread pool makes them about ten times slower (xdist already runs a process per core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _forget_replays() -> None:
    launch = sys.modules.get("jvp_attention.launch")
    if launch is not None:
        launch.forget_replays()


def _then_forget_replays(change):
    def changed(*args, **kwargs):
        change(*args, **kwargs)
        _forget_replays()
    return changed


@pytest.fixture(autouse=True)
def fresh_replays(monkeypatch):
    """Each test's launches decide afresh: the launchers replay a call at a key seen before
    (chapter 2, "Replaying a call"), and a test that patches one of their decisions (the
    carry, say) must neither meet an earlier call's replay, its own or another test's, nor
    leave one behind. So replays are forgotten before and after each test and after each
    of its `monkeypatch` changes."""
    for name in ("setattr", "delattr", "setitem", "delitem", "setenv", "delenv"):
        setattr(monkeypatch, name, _then_forget_replays(getattr(monkeypatch, name)))
    _forget_replays()
    yield
    _forget_replays()
