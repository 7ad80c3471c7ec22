"""Answer extraction and string normalisation (no sympy here: fast, in-process)."""

from __future__ import annotations

import re

_BOX_CMDS = ("\\boxed", "\\fbox")


def strip_thinking(response: str) -> str:
    """The text after the last ``</think>`` (the whole text if there is none)."""
    idx = response.rfind("</think>")
    return response if idx < 0 else response[idx + len("</think>") :]


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if
    there is none or its braces never close (a truncated response)."""
    best = -1
    for cmd in _BOX_CMDS:
        best = max(best, text.rfind(cmd))
    if best < 0:
        return None
    i = best + (5 if text.startswith("\\fbox", best) else 6)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # "\boxed 5" form
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth, start = 0, i + 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{" and text[j - 1 : j] != "\\":
            depth += 1
        elif c == "}" and text[j - 1 : j] != "\\":
            depth -= 1
            if depth == 0:
                return text[start:j]
    return None


def extract_answer(response: str) -> str | None:
    return last_boxed(strip_thinking(response))


_REMOVE = (
    "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "\\$", "$", "^\\circ", "^{\\circ}",
    "\\%", "%", "\\text{ }",
)


def normalize(ans: str) -> str:
    """Light canonical form for string match: spacing, \\left/\\right, dfrac/tfrac,
    \\text{...}, trailing period, thousands commas in plain numbers, leading '+',
    trailing zeros of decimals, 'x =' prefixes."""
    s = str(ans).strip()
    for tok in _REMOVE:
        s = s.replace(tok, "")
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = s.lstrip("+")
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".")
    if s in ("-0",):
        s = "0"
    return s


_NUM = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def as_number(s: str):
    """A Fraction for plain ints, decimals, a/b and \\frac{a}{b}; None otherwise."""
    from fractions import Fraction

    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}", s) or re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    try:
        if m:
            v = Fraction(int(m.group(2)), int(m.group(3)))
            return -v if m.group(1) else v
        if _NUM.fullmatch(s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None
