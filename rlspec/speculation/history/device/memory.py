"""The device history drafter's memory on the engine's device, in bytes, from its settings and the
engine's shape (pure Python: the dry run's memory plan, rlspec/cluster/memory.py, reads it before
anything starts).

Resident, allocated with the model runner before vLLM profiles memory (so vLLM's profile counts
it as it counts the weights): the ring (DeviceHistory: an int32 token and an int64 prompt salt per
arena token; `width` int64 positions and a fill count per bucket), the count table (an int64
key, an int32 token and an int32 count per entry) and the call's rows (live.LiveRows: a
max_model_len-wide int32 row per running request and per finished answer kept, 2 x rows, and under
lookup=table their live tables).

Working, a step's transient tensors: the running rows and the finished ones (2 x rows) are
drafted together, the scan reading a copy of their slots' rows in int32. Per row, its phases are: the stored candidates
(prompt_keys x width of them, each comparing max_match tokens and reading k), the batch's windows
(LIVE_PER_COLUMN bytes per column of max_model_len + 1 and one per sibling read: its [B, G-1, L+1]
match mask), the batch's candidates (G x levels), the vote (voters squared) and the count table's
lookup. The per-phase constants are fitted to allocations counted under torch's profiler; the
estimate adds the phases as if all were alive at once, an upper bound (tests/speculation/
test_device_memory.py: measured <= planned at shapes and settings the fit did not use; about 2x the
peak at a few hundred columns, where the phases are alike, approaching 1x as max_model_len grows and
the windows dominate). The KV cache itself is sized from the real step: vLLM's profile run executes
one at the engine's largest shape (device.proposer.profile_step)."""
from __future__ import annotations

import math

STORED_PER_MATCH, STORED_PER_DRAFT, STORED_FIXED = 33, 8, 24
CANDIDATE_HELD = 25    # per candidate, beside its drafted positions: held through the live phase
LIVE_PER_COLUMN = 46
# the count table's lookup, per row: per context length and entry of a bucket, and per pair of
# context lengths (each length's window hashed)
COUNT_PER_ENTRY, COUNT_PER_PAIR = 21, 43
VOTE_PER_PAIR = 10     # the vote, per row and pair of voters: their agreement mask and its count
COUNT_ENTRY = 16       # int64 key, int32 token, int32 count
COUNT_WIDTH = 16       # the count table's entries per bucket (device.counts.WIDTH)


def ring_buckets(max_tokens: int, levels: int, width: int) -> int:
    """DeviceHistory's default bucket count: one per key of each level, over the width (a power of
    two, at least 16)."""
    return max(16, 1 << math.ceil(math.log2(max(1, levels * max_tokens // width))))


def count_buckets(max_tokens: int, width: int) -> int:
    """The count table's default: four entries per ring token (both drafters: DeviceHistory and the host store)."""
    return max(16, 1 << math.ceil(math.log2(max(1, 4 * max_tokens // width))))


def store_bytes(max_tokens: int, levels: int, width: int, global_source: bool, count_width: int) -> int:
    """The ring's and the count table's tensors (DeviceHistory.nbytes)."""
    n = ring_buckets(max_tokens, levels, width)
    ring = 12 * max_tokens + 8 * n * width + 8 * n
    return ring + (COUNT_ENTRY * count_buckets(max_tokens, count_width) * count_width if global_source else 0)


def table_width(max_model_len: int) -> int:
    """A live table's entries per row and key length (live.LiveTable: a power of two, at least
    twice the positions a row holds)."""
    return 1 << max(4, (2 * (max_model_len + 1) - 1).bit_length())


def live_bytes(rows: int, max_model_len: int, levels: int, table: bool) -> int:
    """The call's rows (live.LiveRows): per slot (2 x rows: running and finished) a token row, a
    length, a prompt length and a salt, and per finished slot its place in the ring; with the
    table, per slot and key length an int64 fingerprint, a used flag and an int32 head per entry
    and an int32 link per position."""
    per_slot = 4 * max_model_len + 24
    if table:
        per_slot += levels * (13 * table_width(max_model_len) + 4 * (max_model_len + 1))
    return 2 * rows * per_slot + 8 * max(rows, 1) + 8 * levels


def workspace_bytes(rows: int, k: int, levels: int, max_match: int, max_siblings: int) -> int:
    """A kernel step's memory (kernels.Workspace), for 2 x rows slots: per slot six int64s, a flag,
    an int32 count, its context, its live positions and their rows (G x levels each), three int32
    drafts and two int64 rows of k; and the kernels' constants."""
    S = 2 * rows
    G = min(max_siblings, S)
    return S * (6 * 8 + 1 + 4 + 8 * max_match + 16 * G * levels + 12 * k + 16 * k) + 8 * levels + 16


def working_bytes(rows: int, max_model_len: int, k: int, levels: int, width: int, max_match: int,
                  max_siblings: int, max_voters: int, global_source: bool, count_width: int) -> int:
    """A step's peak transient bytes with `rows` running rows and as many finished answers, an
    upper bound: the sum of its phases, as if all were alive at once (stored candidates; the
    batch's rows' windows; their candidates, G x levels a row; the vote among the longest match's
    candidates; the count table's lookup, with every context length 1..max_match counted), each per
    row, beside the token rows."""
    B, L = 2 * rows, max_model_len
    C, G = levels * width, min(max_siblings, B)
    per_candidate = STORED_PER_MATCH * max_match + STORED_PER_DRAFT * k + STORED_FIXED
    held = C * (STORED_PER_DRAFT * k + CANDIDATE_HELD)    # the stored candidates' results, through the rest
    stored = C * per_candidate
    live = (L + 1) * (LIVE_PER_COLUMN + G - 1)
    live_match = G * levels * per_candidate + 2 * (L + 1)
    vote = VOTE_PER_PAIR * min(max_voters, C + G * levels) ** 2
    counts = COUNT_PER_ENTRY * max_match * count_width + COUNT_PER_PAIR * max_match ** 2 if global_source else 0
    return B * (held + stored + live + live_match + vote + counts) + 4 * B * L
