"""jvp_attention: fused flash attention with its forward-mode derivative, in Triton.

This file is hand-written (the only one besides ``__main__.py``); every other module is
generated from the numbered notebooks by ``tools/export.py``.
"""

from jvp_attention.reference import AttentionOutputs, reference_attention, tiled_attention

__all__ = ["AttentionOutputs", "reference_attention", "tiled_attention"]
__version__ = "0.1.0"
