"""The policy actors behind OpenRLHF's actor interface: the DeepSpeed one (``deepspeed_actor``,
with the fused head and the non-finite-gradient guard), the Megatron one and its KL reference
(``megatron_actor``, ``megatron_reference``), the loss every actor runs (``loss``), and rollout
routing replay's tables (``routes``)."""
