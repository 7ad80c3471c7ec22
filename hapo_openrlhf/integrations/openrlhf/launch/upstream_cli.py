"""OpenRLHF 0.11.2's own ``train_ppo_ray`` command line, used as it is: its argument parser (to
check what an argv means to it) and its ``if __name__ == "__main__":`` block (run with an argv,
its final ``train(args)`` routed to a callback). ``flags`` (which builds the argv) and ``train``
(which runs it) both read it; it imports neither, so the two have no import circle."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import sys
from typing import Any, Callable


def _main_block(module) -> Any:
    tree = ast.parse(inspect.getsource(module))
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            return compile(ast.Module(body=node.body, type_ignores=[]), module.__file__, "exec")
    raise RuntimeError(f"{module.__name__} has no `if __name__ == '__main__':` block (OpenRLHF version changed?)")


def run_upstream_main(argv: list[str], train_fn: Callable[[Any], Any]) -> Any:
    """Run OpenRLHF's ``train_ppo_ray`` main block (parser + validation) with ``argv``;
    its closing ``train(args)`` calls ``train_fn(args)`` instead. Returns its result."""
    import openrlhf.cli.train_ppo_ray as cli

    result: dict[str, Any] = {}

    def _train(args):
        result["value"] = train_fn(args)

    ns = dict(vars(cli))
    ns.update(__name__="__main__", train=_train)
    old = sys.argv
    sys.argv = list(argv)
    try:
        exec(_main_block(cli), ns)
    finally:
        sys.argv = old
    return result.get("value")


@functools.lru_cache(maxsize=1)
def upstream_parser() -> argparse.ArgumentParser:
    """OpenRLHF's own ``train_ppo_ray`` argument parser, as its main block builds it (the
    block runs up to ``parse_args``, which is stopped there)."""
    import openrlhf.cli.train_ppo_ray as cli

    class _Built(Exception):
        pass

    def stop(self, *a, **k):
        raise _Built(self)

    ns = dict(vars(cli))
    ns.update(__name__="__main__")
    saved = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = stop
    try:
        exec(_main_block(cli), ns)
    except _Built as e:
        return e.args[0]
    finally:
        argparse.ArgumentParser.parse_args = saved
    raise RuntimeError("OpenRLHF's train_ppo_ray main block did not call parse_args (OpenRLHF version changed?)")


def upstream_option(flag: str) -> tuple[str | None, list[str]]:
    """What OpenRLHF's parser makes of ``flag`` (``--name``, no value): ``(dest, [])`` for an
    option or an unambiguous abbreviation of one (argparse's ``allow_abbrev``), ``(None,
    candidates)`` when it is ambiguous, ``(None, [])`` when it names no option."""
    parser = upstream_parser()
    actions = parser._option_string_actions  # argparse's own option table
    if flag in actions:
        return actions[flag].dest, []
    if not parser.allow_abbrev:
        return None, []
    hits = sorted(o for o in actions if o.startswith(flag) and o.startswith("--"))
    dests = {actions[o].dest for o in hits}
    if len(dests) == 1:
        return dests.pop(), []
    return None, hits


def parse_with_upstream(argv: list[str]) -> Any:
    """The hierarchical ``args`` OpenRLHF would train with (validated by its own code)."""
    return run_upstream_main(argv, lambda args: args)
