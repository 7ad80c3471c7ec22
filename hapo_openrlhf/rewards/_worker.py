"""math-verify worker: JSON lines on stdin -> JSON lines on stdout.

Run as ``python -m hapo_openrlhf.rewards._worker`` by ``MathVerifier``; a separate
interpreter (not multiprocessing) so it never re-imports the caller's ``__main__``
and can be killed at any time.
"""

from __future__ import annotations

import json
import logging
import sys


def symbolic_equal(pred: str, golds: list[str]) -> bool:
    from math_verify import parse, verify

    p = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
    if not p:
        return False
    for g in golds:
        gp = parse(f"\\boxed{{{g}}}", parsing_timeout=None)
        if gp and verify(gp, p, timeout_seconds=None):
            return True
    return False


def main() -> None:
    # the parent enforces the time limit; silence math-verify's "timeout disabled" notice
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (import cost is paid before "ready")

    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            resp = {"ok": symbolic_equal(req["pred"], req["golds"])}
        except Exception as e:  # noqa: BLE001 - any parser failure is "not equal", counted
            resp = {"error": repr(e)[:200]}
        out.write(json.dumps(resp) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
