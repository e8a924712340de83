"""jvp_attention: fused flash attention with its forward-mode derivative, in Triton.

This file and ``__main__.py`` are hand-written; every other module is generated from the
numbered notebooks by ``tools/export.py``.

Public API:
    attention: SDPA-compatible attention that works under torch.func.jvp / forward_ad.
    attention_jvp: the same fused pass with explicit tangents (torch.compile friendly).
    sdpa: a context manager routing F.scaled_dot_product_attention to `attention`.
    context_parallel_attention: `attention` over a sequence sharded across the ranks of a
        torch.distributed group (Ulysses all-to-all or a ring), with its JVP.
    shard_sequence: a rank's shard of a whole sequence, in the contiguous or zig-zag layout.
    set_precision: "accurate" (default) or "fast" rounding of 16-bit products.
    precision: a context manager running a block in one precision mode.
    get_precision: the precision mode in effect.
    lean_zero_tangents: faster zero tangents for any model under torch.func.jvp (a
        function and a context manager, like torch.set_grad_enabled).
    reference_attention, tiled_attention: chapter 1's attention and its JVP in PyTorch
        operations (the ground truth, whole and in key blocks).
    AttentionOutputs: what those two return (the output, LSE, tangent and mu).
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and the API reference read; at run time, see below
    from jvp_attention.autograd import attention, attention_jvp, sdpa
    from jvp_attention.context_parallel import context_parallel_attention, shard_sequence
    from jvp_attention.launch import get_precision, precision, set_precision
    from jvp_attention.reference import AttentionOutputs, reference_attention, tiled_attention
    from jvp_attention.zero_tangents import lean_zero_tangents

# The package imports a module on first use (PEP 562), so that importing one module (the
# references, say, or chapter 7 building the autograd layer itself) imports nothing else and
# the custom operators are registered once, by jvp_attention.autograd, when it is first used.
_HOME = {
    "attention": "autograd", "attention_jvp": "autograd", "sdpa": "autograd",
    "context_parallel_attention": "context_parallel", "shard_sequence": "context_parallel",
    "get_precision": "launch", "precision": "launch", "set_precision": "launch",
    "AttentionOutputs": "reference", "reference_attention": "reference",
    "tiled_attention": "reference", "lean_zero_tangents": "zero_tangents",
}
_MODULES = ("accuracy", "autograd", "backward", "context_parallel", "forward",
            "hopper_backward", "launch", "reference", "tiles", "warp_specialized",
            "zero_tangents")


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"jvp_attention.{name}")
    if name not in _HOME:
        raise AttributeError(f"module 'jvp_attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jvp_attention.{_HOME[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME) | set(_MODULES))


__all__ = [
    "AttentionOutputs",
    "attention",
    "attention_jvp",
    "context_parallel_attention",
    "get_precision",
    "lean_zero_tangents",
    "precision",
    "reference_attention",
    "sdpa",
    "set_precision",
    "shard_sequence",
    "tiled_attention",
]
__version__ = "0.2.0"  # the package's one version: pyproject.toml reads it from here
