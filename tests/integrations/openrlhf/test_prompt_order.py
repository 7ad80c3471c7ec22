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
