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
"""

from jvp_attention.autograd import attention, attention_jvp, sdpa
from jvp_attention.context_parallel import context_parallel_attention, shard_sequence
from jvp_attention.launch import get_precision, precision, set_precision
from jvp_attention.reference import AttentionOutputs, reference_attention, tiled_attention

__all__ = [
    "AttentionOutputs",
    "attention",
    "attention_jvp",
    "context_parallel_attention",
    "get_precision",
    "precision",
    "reference_attention",
    "sdpa",
    "set_precision",
    "shard_sequence",
    "tiled_attention",
]
__version__ = "0.2.0"  # the package's one version: pyproject.toml reads it from here
