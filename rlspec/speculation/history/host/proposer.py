"""vLLM's side of rollout-history drafting: the custom proposer (speculative_config method
'custom_class', which Model Runner V1 runs) over rlspec/speculation/history/host/index.py's HistoryIndex, and
the functions the Generator sends through collective_rpc (they run in every worker, where
`worker.model_runner.drafter` is the proposer). The proposer reads each row's request id and prompt
length from the runner's input batch, as vLLM's own suffix proposer does, so rows are matched to
requests exactly.

vLLM schedules the drafts of one worker only, the first of the last pipeline stage (its executors'
output rank); under tensor parallelism the other workers hold no store and draft nothing.
The store's settings come with the engine's config (rlspec/speculation/vllm_hooks.py's
`history_settings`, as the device drafter's do); `configure` builds the store and compiles its
functions before any engine step. Every Generator imports this
module, whatever its method: the store (and numba) is imported only where history drafts."""
from __future__ import annotations

import time

import numpy as np

from rlspec.config import HistoryConfig
from rlspec.speculation.vllm_hooks import history_settings

PROPOSER = "rlspec.speculation.history.host.proposer.HistoryProposer"


class HistoryProposer:
    """vLLM's custom proposer (speculative_config method 'custom_class') over a HistoryIndex of the
    settings in the engine's config; the Generator feeds it through collective_rpc (the functions
    below)."""

    def __init__(self, vllm_config):
        from rlspec.speculation.history.host.index import HistoryIndex

        spec = vllm_config.speculative_config
        self.k_max = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab = int(vllm_config.model_config.get_vocab_size())  # drafted ids stay below it
        self.cfg = HistoryConfig(**history_settings(vllm_config))
        self.index: HistoryIndex | None = None   # configure's store; none on a worker whose drafts vLLM does not read
        self.k_of_batch: list[int] | None = None  # 'auto': k per running batch size
        self.full = False  # 'auto' times steps: every draft filled to k, as if every request matched
        self.runner = None  # the V1 model runner (configure): its input batch's request ids and prompt lengths
        # partial rollouts: a resumed answer's request carries its answer so far in vLLM's prompt; its
        # prompt (the identity history drafts by) is the first this-many tokens (begin_call)
        self.prompt_len_of: dict[str, int] = {}

    def load_model(self, *args, **kwargs) -> None:  # no model to load
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **kwargs) -> list[list[int]]:
        t0 = time.perf_counter()
        n = len(sampled_token_ids)
        if self.index is None:
            return [[] for _ in range(n)]
        k = self.k_max
        if self.k_of_batch is not None:
            k = min(k, self.k_of_batch[min(n, len(self.k_of_batch) - 1)])
        lens = [len(s) for s in sampled_token_ids]
        nums = num_tokens_no_spec
        if self.full:  # 'auto' times the engine verifying k drafts a row: no lookup, the last token k times
            drafts = [[int(token_ids_cpu[i, int(nums[i]) - 1])] * k if lens[i] else [] for i in range(n)]
        else:
            batch = self.runner.input_batch if self.runner is not None else None
            keys = batch.req_ids[:n] if batch is not None else list(range(n))
            prompt_lens = batch.num_prompt_tokens[:n] if batch is not None else np.zeros(n, np.int64)
            if self.prompt_len_of:
                prompt_lens = own_prompt_lens(prompt_lens, keys, self.prompt_len_of)
            drafts = self.index.propose_rows(token_ids_cpu, nums, lens, keys, prompt_lens, k, self.max_model_len)
        out = [d[: max(0, self.max_model_len - int(nums[i]) - 1)] for i, d in enumerate(drafts)]
        if not self.full:
            cell = self.index.stats.propose_timing.setdefault((max(n, 1).bit_length() - 1, k), [0, 0.0])
            dt = time.perf_counter() - t0
            cell[0] += 1
            cell[1] += dt
            self.index.stats.propose_seconds += dt
        return out


def own_prompt_lens(prompt_lens, req_ids, prompt_len_of: dict[str, int]) -> np.ndarray:
    """Rows' prompt lengths with those of resumed answers (partial rollouts) set to their own
    prompt's: vLLM's request id is the one rlspec gave, plus '-' and 8 random characters unless
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set."""
    out = np.array(prompt_lens, np.int64)
    for i, rid in enumerate(req_ids):
        n = prompt_len_of.get(rid)
        n = prompt_len_of.get(rid.rpartition("-")[0]) if n is None else n
        if n is not None:
            out[i] = n
    return out


# -- collective_rpc entry points --
def _proposer(worker) -> HistoryProposer:
    drafter = worker.model_runner.drafter
    if not isinstance(drafter, HistoryProposer):
        raise RuntimeError(f"the engine's drafter is {type(drafter).__name__}, not rlspec's HistoryProposer")
    return drafter


def reads_drafts(worker) -> bool:
    """Whether vLLM schedules this worker's drafts: the executor reads those of its output rank,
    the first worker of the last pipeline stage, and no other worker's."""
    pc = worker.parallel_config
    return worker.rank == pc.world_size - pc.tensor_parallel_size * pc.prefill_context_parallel_size


def configure(worker) -> None:
    """The store of the engine's settings (speculation.history), its functions compiled now rather
    than in the first engine step; on a worker whose drafts vLLM does not read, none."""
    from rlspec.speculation.history.host.index import HistoryIndex

    p = _proposer(worker)
    p.runner = worker.model_runner
    p.index = None
    if reads_drafts(worker):
        HistoryIndex.warm_up(p.cfg, p.k_max)
        p.index = HistoryIndex(p.cfg, p.k_max, p.vocab)


# The calls below answer None, and do nothing, on a worker with no store; the Generator reads the
# first worker's answer, the output rank's without pipeline parallelism.
def begin_call(worker, draft: bool = True, prompt_len_of: dict[str, int] | None = None) -> None:
    """A call starts (draft: whether it drafts); prompt_len_of: the prompt length of each request
    (rlspec's id) that resumes an answer (partial rollouts)."""
    p = _proposer(worker)
    p.prompt_len_of = prompt_len_of or {}
    if p.index is not None:
        p.index.begin_call(draft)


def record(worker, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> None:
    index = _proposer(worker).index
    if index is not None:
        index.record(prompt_ids, response_ids)


def finish_call(worker, prompt_ids: list[list[int]] | None, response_ids: list[list[int]] | None) -> dict | None:
    """The call's counters; given the call's rows and the call drafted nothing, measured in shadow
    first (`HistoryIndex.shadow`, up to speculation.history.shadow_rows responses)."""
    index = _proposer(worker).index
    if index is None:
        return None
    if prompt_ids is not None and index.stats.rows == 0:
        index.shadow(prompt_ids, response_ids, index.cfg.shadow_rows)
    return index.stats.as_dict()


def set_k(worker, k_of_batch: list[int] | None) -> None:
    _proposer(worker).k_of_batch = k_of_batch


def set_full(worker, full: bool) -> None:
    """'auto' times engine steps with every request drafting k tokens and no lookup (the engine's
    cost of verifying them); the planner scales the verification by the fraction of k that calls
    really draft, and adds the drafter's own time as calls measure it (HistoryStats.propose_timing)."""
    _proposer(worker).full = full


def state_dict(worker) -> dict | None:
    index = _proposer(worker).index
    return None if index is None else index.state_dict()


def load_state_dict(worker, state: dict) -> None:
    index = _proposer(worker).index
    if index is not None:
        index.load_state_dict(state)
