"""The device history drafter: the store as tensors on the engine's device (store.py), in vLLM's
ngram_gpu slot on both model runners (proposer.py)."""
