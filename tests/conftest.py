"""Shared pytest set-up: the Triton interpreter on machines without a GPU, and the `gpu` marker.

Triton reads `TRITON_INTERPRET` when `@triton.jit` runs, that is when a kernel module is
imported, so the variable is set here, at conftest import time, before any test module imports
triton. Importing torch to ask about CUDA is safe: torch does not import triton eagerly.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when there is no CUDA device."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="skipped: needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny-tensor tests: on 2 shared cores a contended
    thread pool makes them about ten times slower (xdist already runs a process per core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
