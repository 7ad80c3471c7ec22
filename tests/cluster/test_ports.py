"""cluster/ports.py: rank 0's rendezvous port lies outside the kernel's ephemeral range and binds."""

from __future__ import annotations

import socket

from hapo_openrlhf.cluster.ports import (IANA_EPHEMERAL, LOWEST, candidate_ports, ephemeral_range,
                                         rendezvous_port)


def test_ephemeral_range_from_the_kernel_file_else_iana(tmp_path):
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ephemeral_range(f) == (32768, 60999)
    for bad in ("", "1 2 3", "x y", "60999 32768", "0 10"):
        f.write_text(bad)
        assert ephemeral_range(f) == IANA_EPHEMERAL, bad
    assert ephemeral_range(tmp_path / "absent") == IANA_EPHEMERAL


def test_candidates_skip_the_range_and_rays_worker_ports():
    ports = candidate_ports((32768, 60999))
    assert ports[0] == LOWEST == 20000 and ports[-1] == 65535
    assert 32767 in ports and 61000 in ports and 32768 not in ports and 60999 not in ports
    assert len(ports) == (32768 - 20000) + (65535 - 60999)


def test_port_is_outside_the_ephemeral_range_and_binds(tmp_path):
    f = tmp_path / "range"
    f.write_text("32768 60999")
    for _ in range(20):
        port = rendezvous_port(range_file=f)
        assert not 32768 <= port <= 60999 and port >= LOWEST
        with socket.socket() as s:  # nothing holds it
            s.bind(("", port))


class _Draws:
    def __init__(self, first):
        self.first = first

    def sample(self, population, k):
        rest = [p for p in population if p not in self.first]
        return (self.first + rest)[:k]


def test_a_port_in_use_is_skipped(tmp_path):
    f = tmp_path / "range"
    f.write_text("32768 60999")
    with socket.socket() as held:
        held.bind(("", rendezvous_port(range_file=f)))
        held.listen()
        taken = held.getsockname()[1]
        port = rendezvous_port(rng=_Draws([taken]), range_file=f)
        assert port != taken and not 32768 <= port <= 60999


def test_no_port_outside_the_range_falls_back_to_the_kernels_choice(tmp_path):
    f = tmp_path / "range"
    f.write_text(f"{LOWEST} 65535")  # the whole candidate span is ephemeral
    assert candidate_ports(ephemeral_range(f)) == []
    port = rendezvous_port(range_file=f)
    assert 0 < port <= 65535


def test_gpu_smoke_children_get_one_port_per_job_outside_the_range(tmp_path):
    """`hapo doctor --gpu-smoke`'s child jobs: no fixed port (one that another job on the node may
    hold), every rank of a job the same rendezvous port."""
    from hapo_openrlhf.gpu_smoke.common import one_rank_child, ranks_child

    lo, hi = ephemeral_range()
    code = "import json, os; print(json.dumps({'port': int(os.environ['MASTER_PORT']), 'rank': os.environ['RANK']}))"
    rc, res = one_rank_child(tmp_path / "one.log", code)
    assert rc == 0 and res["rank"] == "0" and not lo <= res["port"] <= hi
    rcs, res0 = ranks_child(tmp_path, "two", code, world=2)
    assert rcs == [0, 0] and not lo <= res0["port"] <= hi
    assert f'"port": {res0["port"]}, "rank": "1"' in (tmp_path / "two_rank1.log").read_text()
