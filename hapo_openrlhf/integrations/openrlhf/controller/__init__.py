"""The controller (OpenRLHF's PPO trainer, synchronous and asynchronous): hapo's experience maker
(``experience``: the whole batch's advantages through ``algos.step``), the step limit, the method
state in the checkpoint, preemption and ``metrics.jsonl`` (``trainer``, ``trainer_async``)."""
