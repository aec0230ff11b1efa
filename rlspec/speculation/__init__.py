"""Speculative rollouts: rlspec config -> vLLM speculative_config, draft checks, and adaptive k."""
