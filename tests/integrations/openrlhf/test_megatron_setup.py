"""The Megatron actor's multi-node set-up on 4 gloo ranks with faked host names:
tensor-parallel peers on two hosts are refused (naming the hosts); a hub model id is
downloaded by one rank per host while the others read the cache offline."""

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    if os.environ.get("HAPO_REQUIRE_MEGATRON") == "1":
        raise RuntimeError("HAPO_REQUIRE_MEGATRON=1 but megatron-core is not installed")
    pytest.skip("megatron-core not installed (the megatron extra)", allow_module_level=True)

from tests.megatron._dist import init_megatron, spawn


LAYOUTS = {"paired": ["a", "a", "b", "b"], "split": ["a", "b", "a", "b"]}  # host of each of 4 ranks


def _worker(rank, out):
    import socket

    import huggingface_hub
    import torch.distributed as dist

    from hapo_openrlhf.integrations.openrlhf.actors import megatron_actor as ma

    init_megatron(tp=2)
    from megatron.core import parallel_state as ps

    mine = {}
    for name, hosts in LAYOUTS.items():  # both host layouts in one set of processes
        socket.gethostname = lambda hosts=hosts: hosts[rank]
        calls = []

        def fake_download(repo, allow_patterns=None, local_files_only=False, calls=calls):
            calls.append(local_files_only)
            return f"/cache/{repo}"

        huggingface_hub.snapshot_download = fake_download
        path = ma.resolve_pretrained("org/model")
        err = None
        try:
            ma.check_tp_peers_share_a_node(ps.get_tensor_model_parallel_group())
        except RuntimeError as e:
            err = str(e)
        mine[name] = (str(path), calls, err)
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    if rank == 0:
        torch.save(got, out)


def test_one_download_per_node_and_tp_peers_on_one_node(tmp_path):
    out = tmp_path / "got.pt"
    spawn(_worker, 4, str(out))
    everyone = torch.load(out)
    for name, hosts in LAYOUTS.items():
        got = [e[name] for e in everyone]
        assert all(p == "/cache/org/model" for p, _, _ in got)
        # the first rank of each host downloads; every other rank reads the cache offline
        first = {h: hosts.index(h) for h in hosts}
        for r, (_, calls, _) in enumerate(got):
            assert calls == ([False] if first[hosts[r]] == r else [True]), (name, r, calls)
        errs = [e for _, _, e in got]
        if name == "split":  # TP groups are ranks {0, 1} and {2, 3}: each spans hosts a and b
            assert all(e and "different nodes ['a', 'b']" in e for e in errs), errs
        else:
            assert errs == [None] * 4
