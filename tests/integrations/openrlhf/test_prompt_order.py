"""The OpenRLHF controller's prompt order follows ``train.seed`` (controller/trainer.py,
``seed_prompt_order``): upstream's loader -- built by ``DeepspeedStrategy.setup_dataloader`` in
the controller process, where no process group exists -- samples with torchdata's RandomSampler,
seeded from whatever state the process's global torch RNG is in (two launches of one config drew
different prompts). Seeded, the order is the seed's alone, and a resume's loaded state still wins."""

from types import SimpleNamespace

import pytest
import torch


def _loader():
    from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy

    # the controller's call (ppo_trainer.prepare_datasets): batch 1, shuffled, no process group
    return DeepspeedStrategy.setup_dataloader(SimpleNamespace(), list(range(40)), 1, True, True, None)


def _order(loader, n=12):
    it = iter(loader)
    return [int(next(it)[0]) for _ in range(n)]


def test_the_prompt_order_is_the_seeds_alone():
    from hapo_openrlhf.integrations.openrlhf.controller.trainer import seed_prompt_order

    orders = []
    for noise in (0, 1, 2):  # the controller process's global RNG in three different states
        torch.manual_seed(1000 + noise)
        torch.rand(noise)
        a, b = _loader(), _loader()
        orders.append((_order(a), _order(b)))
        seed_prompt_order(a, 7)
        orders[-1] += (_order(a),)
    assert orders[0][0] != orders[1][0]  # unseeded, the order follows the process's RNG
    assert orders[0][2] == orders[1][2] == orders[2][2]  # seeded: the seed's order
    assert sorted(orders[0][2]) != orders[0][2]  # and still shuffled
    seeded = _loader()
    seed_prompt_order(seeded, 8)
    assert _order(seeded) != orders[0][2]
    # a resume: the loader's saved state (OpenRLHF's data_loader_state_dict) continues where it was
    run = _loader()
    seed_prompt_order(run, 7)
    it = iter(run)
    first = [int(next(it)[0]) for _ in range(5)]
    state = run.state_dict()
    rest = [int(next(it)[0]) for _ in range(5)]
    resumed = _loader()
    seed_prompt_order(resumed, 7)
    resumed.load_state_dict(state)
    assert first + [int(x[0]) for _, x in zip(range(5), iter(resumed))] == first + rest


def test_a_loader_without_a_generator_is_refused_by_name():
    from hapo_openrlhf.integrations.openrlhf.controller.trainer import seed_prompt_order

    with pytest.raises(RuntimeError, match="samples with SequentialSampler, which has no generator"):
        seed_prompt_order(torch.utils.data.DataLoader(list(range(4))), 7)


class _Ref:
    def __init__(self, responses):
        self.responses = responses


class _Engine:
    """An engine stand-in: each prompt's n responses, its id in the tokens (observation = prompt id,
    then the sample's k), a score 1 for the prompts named in ``good``."""

    def __init__(self, good):
        self.good = good
        self.get_num_unfinished_requests = SimpleNamespace(remote=lambda: 0)
        self.generate_responses = SimpleNamespace(remote=self._generate)

    def _generate(self, *, prompt, label, num_samples, **kw):
        p = int(prompt.split()[-1])
        return _Ref([{"observation_tokens": [p, 100 + k, 200 + k], "action_ranges": [(1, 3)], "prompt": prompt,
                      "label": label, "reward": float(p in self.good), "scores": float(p in self.good),
                      "rollout_log_probs": None, "truncated": False} for k in range(num_samples)])


class _Ray:
    """ray.wait / ray.get for _generate_vllm: the requests complete in the order ``finish`` gives."""

    def __init__(self, finish):
        self.finish = finish

    def get(self, x):
        return [self.get(r) for r in x] if isinstance(x, list) else (x.responses if isinstance(x, _Ref) else x)

    def wait(self, pending, num_returns=1, timeout=None):
        pick = min(pending, key=lambda r: self.finish(int(r.responses[0]["prompt"].split()[-1])))
        return [pick], [r for r in pending if r is not pick]


@pytest.mark.parametrize("filtering", [False, True])
def test_the_rollout_is_in_the_order_its_prompts_were_sent(monkeypatch, filtering):
    """Upstream's own ``_generate_vllm`` (OpenRLHF 0.11.2) collects responses as requests complete;
    with ``dispatch_order`` the batch is in the prompts' order whatever the completion order -- each
    prompt's responses in the order its engine returned them, dynamic filtering's replacements after
    the batch's prompts, in the order they were sent. Without it, the rows follow completion."""
    from openrlhf.trainer.ppo_utils import samples_generator as sg

    from hapo_openrlhf.integrations.openrlhf.controller.trainer import dispatch_order

    def rows(finish, wrapped):
        monkeypatch.setattr(sg, "ray", _Ray(finish))
        gen = object.__new__(sg.SamplesGenerator)
        args = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=2), algo=SimpleNamespace(
            advantage=SimpleNamespace(is_correction_level="off"), dynamic_filtering_range=(0.5, 1.5)))
        gen.args, gen.vllm_engines, gen.tokenizer = args, [_Engine(good={0, 2, 4, 5, 6})], None
        if wrapped:
            dispatch_order(gen)
        loader = iter([(None, [f"prompt {i}"], [f"label {i}"], [None]) for i in range(8)])
        experiences, consumed, _ = gen._generate_vllm(loader, 4, filtering, max_new_tokens=2, max_len=64)
        return [(int(e.sequences[0, 0]), int(e.sequences[0, 1])) for e in experiences], consumed

    scrambled = lambda p: (5 * p + 7) % 11  # noqa: E731  a completion order unlike the dispatch order
    got, consumed = rows(scrambled, True)
    # prompts 1 and 3 are filtered out (score 0) when filtering: 4 and 5 are sent in their place
    want = [0, 2, 4, 5] if filtering else [0, 1, 2, 3]
    assert got == [(p, 100 + k) for p in want for k in range(2)] and consumed == (6 if filtering else 4)
    assert rows(lambda p: -p, True)[0] == got  # another completion order: the same rows
    unwrapped = rows(scrambled, False)[0]
    assert sorted(unwrapped) == sorted(got) and unwrapped != got  # upstream alone: completion order
