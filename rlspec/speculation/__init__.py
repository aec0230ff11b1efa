"""Speculative rollouts: rlspec config -> vLLM speculative_config, draft checks, and adaptive k."""

# where a history draft's token came from (both drafters count drafted and accepted tokens by it)
SOURCES = ("history", "siblings", "prompt", "global")
HISTORY, SIBLINGS, PROMPT, GLOBAL = range(4)

# The prompt's own sources, as both drafters read them (rlspec/speculation/history/host/store.py and
# history/device/store.py): answers of the running group read per prompt (the row's own included), and
# candidates of the longest match that vote (the highest ranked).
MAX_SIBLINGS, MAX_VOTERS = 16, 64
