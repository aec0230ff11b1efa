"""rlspec: GRPO with lossless speculative rollouts."""
