"""Argument types shared by the benchmark scripts (without importing anything heavy)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse ``type=``: a positive integer, anything else argparse's one-line error."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)
