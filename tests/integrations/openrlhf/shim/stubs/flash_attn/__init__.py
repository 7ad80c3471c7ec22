"""TEST-ONLY stand-in for flash-attn (a CUDA build that cannot be installed on the CPU test machine).

``openrlhf.models.ring_attn_utils`` imports ``flash_attn.bert_padding`` at module level;
those helpers are only *called* for packed samples (``--ds.packing_samples``), which the
CPU tests do not use, so they raise here. Put on the path only when flash-attn is absent.
"""

__version__ = "0.0.0+stub"
