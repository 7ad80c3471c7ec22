"""PRIME's PRM group driven by the experience maker (``controller/prm.py``), on a recording stand-in
of OpenRLHF's ``RayActorGroup`` whose "PRM" is a fixed function with a version counter: the calls
in ``prm.update``'s order (the recipe's ``prime_ray_trainer.fit``), the q each order hands the
advantage (before: the score after the update; after: the update's own forwards'; none: the score,
no update), the update's rows laid back onto OpenRLHF's action masks (which start after each row's
padding), and the refusals. The real group under OpenRLHF's controller: test_e2e_prime.py."""

from types import SimpleNamespace

import pytest
import torch

from hapo_openrlhf.integrations.openrlhf.controller import prm as prm_ctl


class _Group:
    """Calls recorded; ``forward`` answers q = version + 0.01 x token id on the action mask; each
    ``prm_update`` bumps the version after computing its rows (as the update's forwards precede its
    optimizer step)."""

    def __init__(self):
        self.calls, self.version, self.buffer, self.outcomes = [], 0.0, [], []

    def _q(self, e):
        width = e.action_mask.shape[1]
        return (self.version + 0.01 * e.sequences[:, -width:].float()) * e.action_mask

    def async_run_method_batch(self, method_name, **kw):
        self.calls.append(method_name)
        if method_name == "forward":
            return [self._q(SimpleNamespace(sequences=s, action_mask=a)) for s, a in
                    zip(kw["sequences"], kw["action_mask"], strict=True)]
        assert method_name == "prm_append"
        self.buffer += list(zip(kw["experience"], kw["outcome"], strict=True))
        self.outcomes += [o.tolist() for o in kw["outcome"]]
        return [None] * len(kw["experience"])

    def async_run_method(self, method_name):
        self.calls.append(method_name)
        assert method_name in ("prm_update", "reload_states", "offload_states")
        if method_name != "prm_update":
            return [None]
        rows = {}
        for e, _ in self.buffer:
            q = self._q(e)
            for j, pos in enumerate(e.index):
                rows[pos] = q[j][e.action_mask[j].bool()]
        self.buffer, self.version = [], self.version + 1.0
        return [{"status": {"prm/loss": 0.5, "prm/grad_norm": 1.0}, "rows": rows}]


def _experiences():
    """Two micro-batches of two rows; the action masks start after each row's padding."""
    out = []
    for b, start in ((0, 0), (1, 2)):
        seq = torch.arange(12).reshape(2, 6) + 10 * b
        am = torch.zeros(2, 4, dtype=torch.bool)
        am[0, 1:4] = True  # a response after one padding position
        am[1, 0:2] = True
        out.append(SimpleNamespace(sequences=seq, action_mask=am, attention_mask=torch.ones(2, 6),
                                   index=[start, start + 1], rewards=torch.tensor([1.0, 0.0])))
    return out


def _maker(sleep=False):
    return SimpleNamespace(args=SimpleNamespace(ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1,
                                                                   enable_sleep=sleep)),
                           _flatten_results=lambda refs, dup: list(refs))


@pytest.mark.parametrize("order", ["before", "after", "none"])
def test_the_prm_runs_in_the_recipes_order_and_hands_the_advantage_its_q(monkeypatch, order):
    monkeypatch.setattr(prm_ctl.ray, "get", lambda refs: refs)
    group, exps = _Group(), _experiences()
    cfg = SimpleNamespace(prm=SimpleNamespace(update=order))
    status = prm_ctl.run(_maker(), group, exps, cfg)
    want_calls = {"before": ["prm_append", "prm_update", "forward"], "after": ["prm_append", "prm_update"],
                  "none": ["forward"]}[order]
    assert group.calls == want_calls
    assert status == ({} if order == "none" else {"prm/loss": 0.5, "prm/grad_norm": 1.0})
    for e in exps:
        tok = 0.01 * e.sequences[:, -4:].float()
        # before: the updated PRM (version 1) scored the batch; after / none: the PRM as it was (version 0)
        q_version = 1.0 if order == "before" else 0.0
        torch.testing.assert_close(e.process_q, (q_version + tok) * e.action_mask, rtol=0, atol=0)
        torch.testing.assert_close(e.prm_seen, tok * e.action_mask, rtol=0, atol=0)  # held out: before training
    # the outcomes the PRM trained on: the verifier's (reward > 0.5), micro-batch by micro-batch
    assert group.outcomes == ([] if order == "none" else [[1.0, 0.0], [1.0, 0.0]])


def test_sleep_mode_brings_the_group_on_and_off_the_gpu_around_its_work(monkeypatch):
    monkeypatch.setattr(prm_ctl.ray, "get", lambda refs: refs)
    group = _Group()
    prm_ctl.run(_maker(sleep=True), group, _experiences(), SimpleNamespace(prm=SimpleNamespace(update="before")))
    assert group.calls == ["reload_states", "prm_append", "prm_update", "forward", "offload_states"]


def test_outcomes_are_the_verifiers_before_any_length_penalty():
    e = SimpleNamespace(rewards=torch.tensor([1.0, 0.0, 0.7, 0.2]))
    assert prm_ctl.outcomes([e])[0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_an_update_missing_a_row_or_of_another_length_is_named(monkeypatch):
    monkeypatch.setattr(prm_ctl.ray, "get", lambda refs: refs)
    group = _Group()
    real = group.async_run_method

    def dropping(method_name):
        out = real(method_name)
        if method_name == "prm_update":
            out[0]["rows"].pop(next(iter(out[0]["rows"])))
        return out

    group.async_run_method = dropping
    with pytest.raises(RuntimeError, match="returned no q .* for rollout row 0"):
        prm_ctl.run(_maker(), group, _experiences(), SimpleNamespace(prm=SimpleNamespace(update="after")))


def test_the_prm_resumes_from_the_policys_checkpoint_or_names_why_not(tmp_path):
    """A run killed between the policy's save and the PRM's would pair a policy of one step with a
    PRM of another if each loaded its own newest: the PRM loads the tag the policy resumes from."""
    from hapo_openrlhf.integrations.openrlhf.actors.prm_actor import resume_tag

    (tmp_path / "_critic" / "global_step1").mkdir(parents=True)
    (tmp_path / "_critic" / "global_step2").mkdir()
    (tmp_path / "_critic" / "latest").write_text("global_step2")
    with pytest.raises(ValueError, match="the policy has none"):
        resume_tag(str(tmp_path))
    (tmp_path / "_actor").mkdir()
    (tmp_path / "_actor" / "latest").write_text("global_step1\n")  # the policy's newest: step 1
    assert resume_tag(str(tmp_path)) == "global_step1"
    (tmp_path / "_actor" / "latest").write_text("global_step3")
    with pytest.raises(ValueError, match=r"resumes from global_step3 but the PRM has no checkpoint of it \(it has "
                                         r"\['global_step1', 'global_step2'\]\)"):
        resume_tag(str(tmp_path))
