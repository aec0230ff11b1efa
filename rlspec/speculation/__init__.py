"""Speculative rollouts: rlspec config -> vLLM speculative_config, draft checks, and adaptive k."""

# where a history draft's token came from (both drafters count drafted and accepted tokens by it)
SOURCES = ("history", "siblings", "prompt", "global")
HISTORY, SIBLINGS, PROMPT, GLOBAL = range(4)
