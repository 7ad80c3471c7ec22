"""Every OpenRLHF name hapo overrides or calls, pinned to 0.11.2: an upgrade fails here, not mid-run."""

import inspect
import re
from importlib.metadata import version

import pytest
import torch

# inspect.signature of the pinned version (Ray's `_ray_trace_ctx` keyword is stripped)
PINNED = {
    "PolicyModelActor.forward": "(self, sequences: torch.LongTensor, action_mask: Union[int, list[int], NoneType] = None, attention_mask: Optional[torch.Tensor] = None, packed_seq_lens=None, mm_train_inputs_list=None) -> torch.Tensor",
    "PolicyModelActor.init_model_from_pretrained": "(self, strategy: openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy, pretrain, max_steps=None, vllm_engines=None)",
    "BaseModelActor.execute_batch": "(self, method_name: str, all_data, start_idx, end_idx)",
    "ActorPPOTrainer.training_step": "(self, experience: openrlhf.trainer.ppo_utils.experience.Experience, kl_ctl: float, step: int, loss_batch_info: Optional[Dict] = None) -> Dict[str, float]",
    "PolicyLoss.forward": "(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, action_mask: Optional[torch.Tensor] = None, rollout_log_probs: Optional[torch.Tensor] = None, dp_size: int = 1, batch_num_tokens: Optional[float] = None, global_batch_size: Optional[float] = None) -> torch.Tensor",
    "Actor.forward": "(self, sequences: torch.LongTensor, action_mask: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None, return_output=False, allgather_logits=False, return_logprobs=False, ring_attn_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, packed_seq_lens: Optional[list[int]] = None, return_entropy=False, **mm_inputs) -> torch.Tensor",
    "RemoteExperienceMaker.__init__": "(self, actor_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, critic_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, reward_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, initial_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, kl_controller, strategy, tokenizer, **kwargs)",
    "RemoteExperienceMaker.make_experience": "(self, samples_list: List[openrlhf.trainer.ppo_utils.experience.Experience]) -> List[openrlhf.trainer.ppo_utils.experience.Experience]",
    "RemoteExperienceMaker.compute_advantages_and_returns": "(self, experiences: List[openrlhf.trainer.ppo_utils.experience.Experience]) -> List[openrlhf.trainer.ppo_utils.experience.Experience]",
    "RemoteExperienceMaker._flatten_results": "(self, refs, duplicate_factor)",
    "PPOTrainer.__init__": "(self, pretrain: str, strategy: openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy, actor_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, critic_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, reward_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, reference_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, vllm_engines, **generate_kwargs) -> None",
    "BasePPOTrainer.train_step": "(self, rollout_samples, global_step: int) -> Tuple[Dict, int]",
    "RayActorGroup.async_run_method": "(self, method_name, *args, **kwargs)",
    "RayActorGroup.async_run_method_batch": "(self, method_name, **kwargs)",
    "train_ppo_ray.train": "(args)",
    "create_vllm_engines": "(num_engines: int, tensor_parallel_size: int, pretrain: str, seed: int, full_determinism: bool, enable_prefix_caching: bool, enforce_eager: bool, max_model_len: int, shared_pg=None, gpu_memory_utilization=None, vllm_enable_sleep=False, logprobs_mode=None, agent_func_path: Optional[str] = None, remote_rm_url: Optional[str] = None, max_images_per_prompt: int = 0)",
    "RolloutRayActor.generate": "(self, prompt_token_ids, sampling_params, multi_modal_data=None)",
    "RolloutRayActor.generate_responses": "(self, prompt: str, label: str, sampling_params, max_length: int, hf_tokenizer, num_samples: int = 1, images=None)",
    "RolloutRayActor.init_process_group": "(self, master_address, master_port, rank_offset, world_size, group_name, backend, use_ray)",
    "RolloutRayActor.update_weight": "(self, name, dtype, shape, empty_cache=False)",
    # patched inside vLLM's worker by the test shim's vLLM plugin (real vLLM rollouts on CPU)
    "WorkerWrap.init_process_group": "(self, master_address, master_port, rank_offset, world_size, group_name, backend='nccl', use_ray=False)",
    "WorkerWrap.update_weight": "(self, name, dtype, shape, empty_cache=False)",
    "stateless_init_process_group": "(master_address, master_port, rank, world_size, device)",
    "hierarchize": "(args)",
    # the Megatron policy actor implements the policy-actor interface the controller calls
    "BaseDistributedActor.__init__": "(self, world_size, rank, master_addr, master_port)",
    "RayActorGroup.__init__": "(self, num_nodes, num_gpus_per_node, ray_actor_type: Type[openrlhf.trainer.ray.launcher.BaseModelActor], pg: ray.util.placement_group.PlacementGroup = None, num_gpus_per_actor=1, duplicate_actors: int = 1, resources: Dict[str, float] = None, num_resources_per_node: int = None) -> None",
    "ActorPPOTrainer._init_vllm_sync_group": "(self, backend: str)",
    "PolicyModelActor.fit": "(self, kl_ctl: float = 0)",
    "PolicyModelActor.append": "(self, experience: openrlhf.trainer.ppo_utils.experience.Experience)",
    "PolicyModelActor.save_checkpoint": "(self, tag, client_states=None, metric_value=None, metric_key=None)",
    "PolicyModelActor.save_model": "(self)",
    "PolicyModelActor.broadcast_to_vllm": "(self)",
    "PolicyModelActor.get_checkpoint_states": "(self)",
    "split_experience_batch": "(experience: openrlhf.trainer.ppo_utils.experience.Experience) -> List[openrlhf.trainer.ppo_utils.experience.Experience]",
    "make_experience_batch": "(items: List[openrlhf.trainer.ppo_utils.experience.Experience], packing_samples=False) -> openrlhf.trainer.ppo_utils.experience.Experience",
    "remove_padding_in_sequences": "(items: List[openrlhf.trainer.ppo_utils.experience.Experience]) -> List[openrlhf.trainer.ppo_utils.experience.Experience]",
    # the asynchronous trainer's actors (trainer_async.py builds and subclasses them)
    "GenerateSamplesActor.__init__": "(self, pretrain, strategy, vllm_engines, *, vllm_lock, rollout_queue, rollout_slots, **generate_kwargs)",
    "TrainingActor.__init__": "(self, pretrain, strategy, actor_model_group, critic_model_group, reward_model_group, reference_model_group, vllm_engines, *, vllm_lock, rollout_queue, rollout_slots)",
    "TrainingActor.fit": "(self, global_step: int = 0) -> None",
    "TrainingActor.broadcast_to_vllm": "(self)",
    "PPOTrainerAsync.__init__": "(self, pretrain: str, strategy: openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy, actor_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, critic_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, reward_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, reference_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, vllm_engines, **generate_kwargs) -> None",
    "PPOTrainerAsync.fit": "(self) -> None",
    "SingleTurnAgentExecutor.execute": "(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None)",
}

# the policy-actor methods OpenRLHF's controller (trainer, experience maker, driver) calls
CONTROLLER_CALLS = ["init_model_from_pretrained", "execute_batch", "forward", "append", "fit", "broadcast_to_vllm",
                    "save_checkpoint", "get_checkpoint_states", "save_model", "empty_cache", "reload_states",
                    "offload_states", "get_master_addr_port"]


def _sig(obj) -> str:
    s = str(inspect.signature(obj))
    return re.sub(r", \*, _ray_trace_ctx=None|_ray_trace_ctx=None, |, _ray_trace_ctx=None", "", s)


def _upstream():
    from openrlhf.cli import train_ppo_ray
    from openrlhf.models import Actor, PolicyLoss
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer, PPOTrainer
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils import experience
    from openrlhf.trainer.ray.launcher import BaseDistributedActor, BaseModelActor, RayActorGroup
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor, create_vllm_engines
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
    from openrlhf.utils.config import hierarchize
    from openrlhf.utils.distributed_util import stateless_init_process_group

    from openrlhf.trainer import ppo_trainer_async as pta
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    P, T, R = PolicyModelActor.__ray_actor_class__, PPOTrainer.__ray_actor_class__, RolloutRayActor.__ray_actor_class__
    G, TA, PA = (pta.GenerateSamplesActor.__ray_actor_class__, pta.TrainingActor.__ray_actor_class__,
                 pta.PPOTrainerAsync.__ray_actor_class__)
    return {
        "PolicyModelActor.forward": P.forward, "PolicyModelActor.init_model_from_pretrained": P.init_model_from_pretrained,
        "BaseModelActor.execute_batch": BaseModelActor.execute_batch,
        "ActorPPOTrainer.training_step": ActorPPOTrainer.training_step,
        "PolicyLoss.forward": PolicyLoss.forward, "Actor.forward": Actor.forward,
        "RemoteExperienceMaker.__init__": RemoteExperienceMaker.__init__,
        "RemoteExperienceMaker.make_experience": RemoteExperienceMaker.make_experience,
        "RemoteExperienceMaker.compute_advantages_and_returns": RemoteExperienceMaker.compute_advantages_and_returns,
        "RemoteExperienceMaker._flatten_results": RemoteExperienceMaker._flatten_results,
        "PPOTrainer.__init__": T.__init__, "BasePPOTrainer.train_step": BasePPOTrainer.train_step,
        "RayActorGroup.async_run_method": RayActorGroup.async_run_method,
        "RayActorGroup.async_run_method_batch": RayActorGroup.async_run_method_batch,
        "train_ppo_ray.train": train_ppo_ray.train, "create_vllm_engines": create_vllm_engines,
        "RolloutRayActor.generate": R.generate, "RolloutRayActor.generate_responses": R.generate_responses,
        "RolloutRayActor.init_process_group": R.init_process_group, "RolloutRayActor.update_weight": R.update_weight,
        "hierarchize": hierarchize,
        "WorkerWrap.init_process_group": WorkerWrap.init_process_group, "WorkerWrap.update_weight": WorkerWrap.update_weight,
        "stateless_init_process_group": stateless_init_process_group,
        "BaseDistributedActor.__init__": BaseDistributedActor.__init__, "RayActorGroup.__init__": RayActorGroup.__init__,
        "ActorPPOTrainer._init_vllm_sync_group": ActorPPOTrainer._init_vllm_sync_group,
        **{f"PolicyModelActor.{m}": getattr(P, m) for m in ("fit", "append", "save_checkpoint", "save_model",
                                                            "broadcast_to_vllm", "get_checkpoint_states")},
        **{f: getattr(experience, f) for f in ("split_experience_batch", "make_experience_batch",
                                               "remove_padding_in_sequences")},
        "GenerateSamplesActor.__init__": G.__init__, "TrainingActor.__init__": TA.__init__, "TrainingActor.fit": TA.fit,
        "TrainingActor.broadcast_to_vllm": TA.broadcast_to_vllm, "PPOTrainerAsync.__init__": PA.__init__,
        "PPOTrainerAsync.fit": PA.fit, "SingleTurnAgentExecutor.execute": SingleTurnAgentExecutor.execute,
    }


def test_pinned_version():
    assert version("openrlhf") == "0.11.2"
    assert version("deepspeed") == "0.19.6"
    assert version("transformers") == "5.15.0"


@pytest.mark.parametrize("name", sorted(PINNED))
def test_upstream_signature_unchanged(name):
    assert _sig(_upstream()[name]) == PINNED[name]


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values() if p.name != "_ray_trace_ctx"]


def test_overrides_keep_upstream_signatures():
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import HapoPolicyModelActorImpl
    from hapo_openrlhf.integrations.openrlhf.actors.loss import HapoPolicyLoss
    from hapo_openrlhf.integrations.openrlhf.controller.trainer import HapoPPOTrainerImpl

    up = _upstream()
    assert _params(HapoPolicyLoss.forward) == _params(up["PolicyLoss.forward"])
    assert _params(HapoPolicyModelActorImpl.forward) == _params(up["PolicyModelActor.forward"])
    assert _params(HapoPolicyModelActorImpl.init_model_from_pretrained) == \
        _params(up["PolicyModelActor.init_model_from_pretrained"])
    assert [n for n, *_ in _params(HapoPPOTrainerImpl.__init__)] == [n for n, *_ in _params(up["PPOTrainer.__init__"])]
    assert _params(HapoPPOTrainerImpl.train_step)[:3] == _params(up["BasePPOTrainer.train_step"])[:3]


def test_call_sites_hapo_relies_on():
    """The source lines the seam depends on: the loss call and its 5-tuple, the experience
    maker's construction, the estimator hook, and the main block's closing train(args)."""
    from openrlhf.cli import train_ppo_ray
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ppo_utils import experience_maker
    from openrlhf.trainer.ray import ppo_actor

    actor_src = inspect.getsource(ppo_actor)
    assert "actor_loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = self.actor_loss_fn(" in actor_src
    assert "self.actor_loss_fn = PolicyLoss(" in actor_src
    assert "return_entropy=self.args.actor.entropy_coef is not None" in actor_src
    assert "self.experience_maker = RemoteExperienceMaker(" in inspect.getsource(ppo_trainer)
    em = inspect.getsource(experience_maker)
    assert "experiences = self.compute_advantages_and_returns(experiences)" in em
    assert "samples.action_log_probs = action_log_probs" in em
    cli_src = inspect.getsource(train_ppo_ray)
    assert cli_src.rstrip().endswith("train(args)")
    assert "from openrlhf.trainer.ppo_trainer import PPOTrainer" in cli_src
    assert "PolicyModelActor,\n" in cli_src


def test_cpu_shim_engine_factory_mirrors_upstream():
    import hapo_cpu_shim

    assert _params(hapo_cpu_shim.create_cpu_engines) == _params(_upstream()["create_vllm_engines"])


def test_vllm_plugin_is_registered_and_matches_workerwrap(tmp_path):
    """The vLLM plugin is found through its entry point where the shim is on the path, and
    OpenRLHF's WorkerWrap still has exactly the CUDA calls it maps to the CPU. Then, in a
    fresh process (the patch is global), the patched update_weight receives a broadcast
    tensor on the CPU, loads it into the model and records the engine's weights."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    from openrlhf.trainer.ray import vllm_worker_wrap

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("hapo_vllm_cpu_shim") == "hapo_vllm_cpu_plugin:install"
    src = inspect.getsource(vllm_worker_wrap.WorkerWrap.update_weight)
    assert src.count("cuda") == 2 and 'device="cuda"' in src and "torch.cuda.current_stream()" in src
    assert "from openrlhf.utils.distributed_util import stateless_init_process_group" in \
        inspect.getsource(vllm_worker_wrap.WorkerWrap.init_process_group)  # imported at call time: patchable

    import hapo_cpu_shim

    code = f"""
import sys, torch
from pathlib import Path
from types import SimpleNamespace
sys.path[:0] = {[str(hapo_cpu_shim.HERE), *hapo_cpu_shim.stub_path()]!r}
import hapo_vllm_cpu_plugin, hapo_cpu_shim
import openrlhf.utils.distributed_util as du
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
hapo_vllm_cpu_plugin.install(); hapo_vllm_cpu_plugin.install()  # idempotent (vLLM loads plugins per process)
assert du.stateless_init_process_group is hapo_cpu_shim.GlooBroadcaster
class Group:
    def broadcast(self, t, src, stream):
        assert t.device.type == "cpu" and stream is None
        t.fill_(3.0)
loaded = []
model = torch.nn.Linear(2, 2, bias=False)
model.load_weights = lambda weights: loaded.extend(weights)
w = WorkerWrap()
w.model_config = SimpleNamespace(dtype=torch.bfloat16, seed=5)
w.model_runner = SimpleNamespace(model=model)
w._model_update_with_ray, w._model_update_group = False, Group()
torch.distributed.get_rank = lambda: 0
empty, stream = torch.empty, torch.cuda.current_stream
w.update_weight("a", torch.bfloat16, [2, 2])
w.update_weight("b", torch.bfloat16, [3], empty_cache=True)
assert [n for n, _ in loaded] == ["a", "b"] and all((t == 3).all() and t.dtype == torch.bfloat16 for _, t in loaded)
rec = torch.load(Path({str(tmp_path)!r}) / "vllm_engine5_sync1.pt")
assert rec["updated"] == ["a", "b"] and set(rec["weights"]) == {{"weight"}}
assert torch.empty is empty and torch.cuda.current_stream is stream  # restored after each call
print("ok")
"""
    env = {**__import__("os").environ, "HAPO_OPENRLHF_DUMP_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-4000:]


def test_megatron_actor_offers_every_controller_call():
    """The Megatron actor answers every method the controller calls on a policy group, with
    upstream's parameters; and OpenRLHF still finds those calls where hapo expects them."""
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ppo_utils import experience_maker

    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import MegatronPolicyActorImpl

    up = PolicyModelActor.__ray_actor_class__
    for m in CONTROLLER_CALLS:
        assert _params(getattr(MegatronPolicyActorImpl, m)) == _params(getattr(up, m)), m
    src = inspect.getsource(ppo_trainer) + inspect.getsource(experience_maker)
    called = set(re.findall(r'method_name="(\w+)"', src))
    assert called <= set(CONTROLLER_CALLS), called
    # hapo's experience maker calls its own methods too: both policy actors answer them
    from hapo_openrlhf.integrations.openrlhf.controller import experience as hapo_experience
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import HapoPolicyModelActorImpl

    ours = set(re.findall(r'method_name="(\w+)"', inspect.getsource(hapo_experience)))
    assert ours == {"clear_behaviour_entropy", "pop_behaviour", "set_loss_state"}, ours
    for m in ours:
        assert callable(getattr(MegatronPolicyActorImpl, m)) and callable(getattr(HapoPolicyModelActorImpl, m)), m
    # ranks of one replica are consecutive actors: the controller's duplicate factor
    assert "duplicate_factor = args.ds.ring_attn_size * args.ds.tensor_parallel_size" in inspect.getsource(experience_maker)
    # weights go out in the engines' dtype, which WorkerWrap.update_weight asserts
    from openrlhf.trainer.ray import vllm_engine, vllm_worker_wrap

    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import VLLM_DTYPE

    assert VLLM_DTYPE == torch.bfloat16 and '"dtype": "bfloat16"' in inspect.getsource(vllm_engine)
    assert "assert dtype == self.model_config.dtype" in inspect.getsource(vllm_worker_wrap)


def test_megatron_rank_order_is_supported():
    """tp-pp-dp rank order (a data-parallel replica = consecutive ranks) is megatron-core's."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state as ps

    assert "order" in inspect.signature(ps.initialize_model_parallel).parameters
    assert "tp-pp-dp" in inspect.getsource(ps.initialize_model_parallel)
