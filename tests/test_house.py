"""The house's rules, measured from the code's own imports (issue 56; docs/architecture.md)."""

import ast
import sys
from pathlib import Path

import hapo_openrlhf

ROOT = Path(hapo_openrlhf.__file__).parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports (at the top or inside a function: a deferred
    import still ties the two files together)."""
    mods = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10_000))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(old)
    return out


def test_no_import_circle():
    assert _circles(_imports()) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_algos_imports_nothing_of_the_package_outside_it():
    """The algorithm core stays pure torch: no module of algos/ imports another room."""
    outside = {m: sorted(d for d in deps if not d.startswith("hapo_openrlhf.algos"))
               for m, deps in _imports().items() if m.startswith("hapo_openrlhf.algos")}
    assert {m: d for m, d in outside.items() if d} == {}


def test_generation_imports_nothing_of_the_package_outside_it():
    """Sampling (the decoder, the KV-cache sampler, ``generate`` -> ``Rollout``) is a room of its own
    that the embedded trainer and the evaluation's Hugging Face engine both import; it imports neither
    (nor anything else of the package)."""
    outside = {m: sorted(d for d in deps if not d.startswith("hapo_openrlhf.generation"))
               for m, deps in _imports().items() if m.startswith("hapo_openrlhf.generation")}
    assert {m: d for m, d in outside.items() if d} == {}
    users = {m for m, deps in _imports().items() if any(d.startswith("hapo_openrlhf.generation") for d in deps)}
    assert {"hapo_openrlhf.local.trainer", "hapo_openrlhf.eval.engines"} <= users, users


def test_the_config_crosses_ray_typed():
    """The run config travels to the Ray actors as a plain dict (``args.hapo``), and every actor and
    the controller rebuild the typed ``RunConfig`` from it (``config.transported``): outside the one
    line that writes the transport, ``.hapo`` is only ever read through ``transported(...)``, and no
    module of integrations/ or megatron/ indexes a config dict (``hapo_cfg[...]``, ``["megatron"]``)."""
    import re

    untyped = []
    for room in ("integrations", "megatron"):
        for path in (ROOT / room).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if '"""' in line or "``" in line:
                    continue  # docstrings
                uses = re.findall(r"(\w+\()?[\w.]*\.hapo\b", code)
                writes = re.match(r"\s*args\.hapo = \{\*\*cfg\.to_dict\(\)", code)
                if (uses and not writes and any(u != "transported(" for u in uses)) or \
                        re.search(r"hapo_cfg\[|\[\"(megatron|algorithm|rollout|optim|openrlhf)\"\]", code):
                    untyped.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert untyped == []


def test_no_file_over_600_lines_and_at_most_three_functions_over_80():
    """Issue 56's size limits: a file holds one job; a long function is one that does several."""
    big, long = [], []
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > 600:
            big.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert big == [] and len(long) <= 3, (big, long)


# what may import the embedded trainer's package from outside it, and why
LOCAL_USERS = {
    "hapo_openrlhf.cli": "`hapo train` on backend local runs it",
    "hapo_openrlhf.experiment.runner": "an experiment's runs are embedded-trainer runs",
}


def test_the_embedded_trainer_is_imported_only_by_the_cli_and_named_users():
    users = sorted(m for m, deps in _imports().items() if not m.startswith("hapo_openrlhf.local")
                   and any(d.startswith("hapo_openrlhf.local") for d in deps))
    assert set(users) <= set(LOCAL_USERS), users
