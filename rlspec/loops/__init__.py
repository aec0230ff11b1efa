"""The driver: one GRPO step and its five timed stages, the synchronous driver, the async rollout
queue, checkpoints, the run log and preemption. Calls actors only through rlspec.cluster handles."""
