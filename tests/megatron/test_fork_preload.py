"""The Megatron ranks' two fork servers (tests/megatron/_dist.py) preload every module of their
lists. multiprocessing's fork server skips a preload that fails to import without a word, and each
rank then imports that module itself: the Megatron policy actor's preload failed that way on
flash-attn (the server did not have the OpenRLHF tests' stubs on its path), and every rank of the
actor's tests spent ~2 CPU-s importing OpenRLHF, DeepSpeed and datasets again (issue 57)."""

import importlib.util
import json
import sys

from ._dist import PRELOAD, TE_PRELOAD, spawn, spawn_te

ACTOR = "hapo_openrlhf.integrations.openrlhf.actors.megatron_actor"


def _expected(preload: list[str]) -> list[str]:
    """The list less the actor where OpenRLHF is not installed (its import then fails by design)."""
    return [m for m in preload if m != ACTOR or importlib.util.find_spec("openrlhf") is not None]


def _missing(preload: list[str]) -> list[str]:
    return [m for m in _expected(preload) if m not in sys.modules]


def _record(rank, out, preload):  # at the rank's entry, before its own code imports anything
    with open(out, "w") as f:
        json.dump(_missing(preload), f)


def test_a_rank_finds_every_module_of_the_preload_list_already_imported(tmp_path):
    assert ACTOR in PRELOAD  # the check covers the actor (the module whose preload had failed)
    out = tmp_path / "missing.json"
    spawn(_record, 1, str(out), PRELOAD)
    assert json.loads(out.read_text()) == [], "not preloaded by the ranks' fork server"


def test_a_te_rank_finds_every_module_of_the_te_preload_list_already_imported(tmp_path):
    out = tmp_path / "missing.json"
    spawn_te("tests.megatron.test_fork_preload:_record", 1, str(out), TE_PRELOAD, process_group=False)
    assert json.loads(out.read_text()) == [], "not preloaded by the TE ranks' fork server"
