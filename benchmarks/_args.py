"""Arguments shared by the benchmark scripts (without importing anything heavy)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse ``type=``: a positive integer, anything else argparse's one-line error."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def add_threads_argument(ap) -> None:
    """``--threads``: torch's intra-op threads of a cost benchmark (default 2, as its figures in docs);
    anything but a positive integer is argparse's one-line error."""
    ap.add_argument("--threads", type=positive_int, default=2,
                    help="torch intra-op threads (the figures in docs are at 2; the suite's smoke run uses 1, as its "
                         "other processes do, so that its OpenMP threads do not spin against theirs)")
