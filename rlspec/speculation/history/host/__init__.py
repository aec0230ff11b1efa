"""The host history drafter: the store (index.py) over numba-compiled arrays, hosted as vLLM's
custom proposer (proposer.py)."""
