"""TEST-ONLY stand-in for flash-attn (a CUDA build that cannot be installed on the CPU test machine).

``openrlhf.models.ring_attn_utils`` imports ``flash_attn.bert_padding`` at module level;
``bert_padding`` here implements those index helpers in plain PyTorch (as flash-attn's
own are) so the packed layout can be tested on CPU; there is no attention kernel. Put
on the path only when flash-attn is absent.
"""

__version__ = "0.0.0+stub"
