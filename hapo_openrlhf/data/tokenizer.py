"""The tiny models' tokenizer, and loading any model's: a byte-level ``tokenizers`` BPE with no
merges, one token per UTF-8 byte, deterministic, nothing to download; saved as a normal Hugging
Face directory beside the model, so every tool (eval, OpenRLHF, vLLM) loads it by path."""

from __future__ import annotations

from pathlib import Path

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"


def build_tokenizer():
    """One token per UTF-8 byte: a byte-level BPE without merges.

    Byte-level (Qwen2 / GPT-2 style) rather than plain characters because
    ``AutoTokenizer`` on a ``qwen2`` model directory rebuilds a Qwen2 tokenizer
    (byte-level pre-tokenizer and decoder) around the saved vocabulary: with
    this vocabulary every loader (ours, transformers, vLLM, OpenRLHF) splits
    text identically.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate([PAD, EOS, UNK, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
