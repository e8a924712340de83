"""jvp_attention: fused flash attention with its forward-mode derivative, in Triton.

This file and ``__main__.py`` are hand-written; every other module is generated from the
numbered notebooks by ``tools/export.py``.

Public API:
    attention: SDPA-compatible attention that works under torch.func.jvp / forward_ad.
    attention_jvp: the same fused pass with explicit tangents (torch.compile friendly).
    sdpa: a context manager routing F.scaled_dot_product_attention to `attention`.
    set_precision: "accurate" (default) or "fast" rounding of 16-bit products.
"""

from jvp_attention.autograd import attention, attention_jvp, sdpa
from jvp_attention.forward import set_precision
from jvp_attention.reference import AttentionOutputs, reference_attention, tiled_attention

__all__ = [
    "AttentionOutputs",
    "attention",
    "attention_jvp",
    "reference_attention",
    "sdpa",
    "set_precision",
    "tiled_attention",
]
__version__ = "0.2.0"  # the package's one version: pyproject.toml reads it from here
