"""Rollout-history drafting on vLLM's fast path (`speculation.history.drafter=device`): the drafter
of rlspec/speculation/history/device/store.py in the slot of vLLM's `ngram_gpu` proposer on Model Runner
V1, where the drafts are made on the engine's device from the runner's own token buffer, with no
copy to the host and async scheduling left on (vLLM turns it off for a custom proposer).

vLLM builds its `ngram_gpu` drafter from one name, `NgramProposerGPU`; rlspec's vLLM plugin
(`install`, a vllm.general_plugins entry point, run in every vLLM process before a model runner
exists) puts a subclass under that name. The subclass drafts from the history only for an engine
whose speculative_config names MARK as its model (rlspec.speculation.vllm_config), and is vLLM's
n-gram drafter for any other. The Generator feeds it through collective_rpc, as it feeds the
host drafter: drafters.DRAFTER_CALLS.

vLLM's CPU build has no accelerator, and the V1 runner's `ngram_gpu` path asks for pinned host
buffers and CUDA streams and events; on the CPU platform `install` also gives the runner CPU
stand-ins for those (rlspec/speculation/history/device/cpu.py), so the CPU tests run the drafter through the same runner
path a GPU runs."""
from __future__ import annotations

import sys

import torch

from rlspec.speculation.history.device.call import CallStats, Pending, append_sampled
from rlspec.speculation.history.device.cpu import cpu_stand_ins
from rlspec.speculation.history.device.live import LiveRows
from rlspec.speculation.history.device.store import DeviceHistory
from rlspec.speculation.history.host.proposer import own_prompt_lens
from rlspec.speculation.vllm_hooks import V1_RUNNER, history_settings, slots_changed

MARK = "rlspec-device-history"  # speculative_config model under method ngram_gpu: this drafter


def _proposer_class(base):
    class DeviceHistoryProposer(base):
        """vLLM's NgramProposerGPU, or, for an engine whose speculative model is MARK, the
        history drafter: propose() returns drafts [B, k] (-1 past a row's draft) and their counts,
        as vLLM's does, for the runner's rows."""

        def __init__(self, vllm_config, device, runner=None):
            spec = vllm_config.speculative_config
            self.history = None
            if spec.model != MARK:
                super().__init__(vllm_config, device, runner)
                return
            self.device, self.runner = device, runner
            self.k = int(spec.num_speculative_tokens)
            self.max_model_len = int(vllm_config.model_config.max_model_len)
            self.vocab = int(vllm_config.model_config.get_vocab_size())
            self.history = DeviceHistory(device, vocab_size=self.vocab, **settings(vllm_config))
            self.shadow_rows = shadow_rows(vllm_config)
            self.stats = CallStats(self.k, device)
            # each batch row's last draft, by source, and the rows' request ids then (rows move
            # between steps: the next step credits a request's accepted tokens by its id)
            rows = int(vllm_config.scheduler_config.max_num_seqs)
            self.pending = Pending(rows, self.k, device)
            self.pending_ids: list[str] = []
            # the call's rows by slot, the finished answers its running siblings read among them: a
            # request leaving the batch (vLLM's hook for request-scoped state) keeps its slot
            self.live, self.work = live_rows(vllm_config, self.history, device, self.k)
            self.batch_rows = torch.arange(rows, device=device)
            if runner is not None:
                removed = runner._on_request_state_removed
                runner._on_request_state_removed = \
                    lambda req_id, state: (self.live.finish(req_id), removed(req_id, state))[1]
                # V1's profile run does not call an ngram_gpu drafter (V2's calls its speculator)
                profile = runner.profile_run
                runner.profile_run = lambda *a, **kw: (profile(*a, **kw), profile_step(self, rows))[0]

        def load_model(self, *args, **kwargs) -> None:
            if self.history is None:
                super().load_model(*args, **kwargs)

        def propose(self, num_speculative_tokens, num_tokens_no_spec, token_ids_gpu, valid_sampled_token_ids_gpu,
                    valid_sampled_tokens_count):
            if self.history is None:
                return super().propose(num_speculative_tokens, num_tokens_no_spec, token_ids_gpu,
                                       valid_sampled_token_ids_gpu, valid_sampled_tokens_count)
            lengths = append_sampled(token_ids_gpu, num_tokens_no_spec, valid_sampled_token_ids_gpu,
                                     valid_sampled_tokens_count)
            batch = lengths.shape[0]
            k = max(0, min(int(num_speculative_tokens), self.k))  # 'auto': the scheduler's k for this batch size
            # The drafts' width is what the scheduler places next step. Without async scheduling it
            # places every column it is given (the runner then trims each row to its valid count):
            # k, none at k=0 or in a call that drafts nothing. Async scheduling places the
            # scheduler's own k a row and reads it from rows k_max wide (the runner's buffers).
            width = self.k if self.runner.use_async_scheduling else (k if self.drafting else 0)
            ids = self.runner.input_batch.req_ids[:batch]
            self.stats.accept(*self.pending.rows(self._last_rows(ids)), valid_sampled_tokens_count)
            self.pending_ids = list(ids)
            if self.drafting:   # the rows' new tokens, in every step of a drafting call
                at = self.live.step(ids, token_ids_gpu, self.batch_rows[:batch], lengths,
                                    lambda pos: self._prompt_lens(ids, pos), self.k + 1)
            if k == 0 or not self.drafting:  # no lookup at all (a call 'auto' or validation runs without)
                self.pending.n[:batch] = 0
                return (torch.full((batch, width), -1, dtype=torch.int32, device=self.device),
                        torch.zeros(batch, dtype=torch.int32, device=self.device))
            active = valid_sampled_tokens_count > 0
            drafts, counts, src = draft_rows(self, at, active, k)
            if self.full:  # 'auto' times steps: the lookup as always, every draft filled to k
                last = token_ids_gpu.gather(1, (lengths.long() - 1).clamp(min=0)[:, None])
                drafts = torch.where(active[:, None] & (drafts < 0), last.to(drafts.dtype), drafts)
                counts = torch.where(active, k, 0).int()
            # no draft past the model's length: vLLM verifies k + 1 positions from the row's end
            room = (self.max_model_len - 1 - lengths.long()).clamp(min=0)
            keep = torch.arange(k, device=self.device)[None] < room[:, None]
            drafts = torch.where(keep, drafts, -1)
            counts = torch.minimum(counts, room.int())
            self.pending.put(torch.arange(batch, device=self.device), src,
                             torch.zeros_like(counts) if self.full else counts)
            if not self.full:
                self.stats.add(active, counts, src)
            if k < width:
                drafts = torch.nn.functional.pad(drafts, (0, width - k), value=-1)
            return drafts, counts

        def _prompt_lens(self, ids: list[str], pos: list[int]) -> list[int]:
            """The own prompt lengths of batch rows `pos` (partial rollouts: a resumed answer's own
            prompt, not vLLM's, which holds its answer so far)."""
            plens = self.runner.input_batch.num_prompt_tokens[pos]
            return list(own_prompt_lens(plens, [ids[i] for i in pos], self.prompt_len_of) if self.prompt_len_of
                        else plens)

        def _last_rows(self, ids: list[str]) -> torch.Tensor:
            """Each row's batch row at the last step (-1: a request new since)."""
            if ids == self.pending_ids[: len(ids)]:  # none moved (the usual step): no host work
                return torch.arange(len(ids), device=self.device)
            at = {r: i for i, r in enumerate(self.pending_ids)}
            return torch.as_tensor([at.get(r, -1) for r in ids], dtype=torch.int64).to(self.device, non_blocking=True)

    DeviceHistoryProposer.drafting = True
    DeviceHistoryProposer.full = False
    DeviceHistoryProposer.prompt_len_of = {}
    return DeviceHistoryProposer


def _speculator_class(base):
    class DeviceHistorySpeculator(base):
        """Model Runner V2's NgramGPUSpeculator, or, for an engine whose speculative model is MARK,
        the history drafter over the runner's request states: drafts [B, K] int64 for the batch,
        K every row (V2 verifies K a row; where the history has none, the row's last sampled
        token fills the slot, as vLLM's n-gram speculator fills it)."""

        def __init__(self, vllm_config, device, req_states):
            spec = vllm_config.speculative_config
            self.history = None
            if spec.model != MARK:
                super().__init__(vllm_config, device, req_states)
                return
            self.vllm_config, self.device, self.req_states = vllm_config, device, req_states
            self.speculative_config = spec
            self.num_speculative_steps = self.k = int(spec.num_speculative_tokens)
            self.max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
            self.max_model_len = int(vllm_config.model_config.max_model_len)
            self.vocab = int(vllm_config.model_config.get_vocab_size())
            self.history = DeviceHistory(device, vocab_size=self.vocab, **settings(vllm_config))
            self.shadow_rows = shadow_rows(vllm_config)
            self.drafts = torch.zeros((self.max_num_reqs, self.k), dtype=torch.int64, device=device)
            self.stats = CallStats(self.k, device)
            # each request state's last draft, by source (a state's first verified step follows its
            # prefill, which samples one token: a state's earlier owner credits nothing to it)
            self.pending = Pending(self.max_num_reqs, self.k, device)
            # the call's rows by slot, the finished answers its running siblings read among them: a
            # request keeps its slot as vLLM frees its state (a preempted request's too: V2 frees it
            # alike; V2 frees a call's last requests at the next call's first step, when the call's
            # slots are already cleared)
            self.live, self.work = live_rows(vllm_config, self.history, device, self.k)
            freed = req_states.remove_request
            req_states.remove_request = lambda req_id: (self.live.finish(req_id), freed(req_id))[1]

        def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                    num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                    *args, dummy_run: bool = False, **kwargs):
            if self.history is None:
                return super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                                       aux_hidden_states, num_sampled, num_rejected, last_sampled,
                                       next_prefill_tokens, temperature, seeds, *args, dummy_run=dummy_run, **kwargs)
            n = input_batch.num_reqs
            if dummy_run:
                if kwargs.get("is_profile"):
                    profile_step(self, self.max_num_reqs)
                return self.drafts[:n]
            rs, idx = self.req_states, input_batch.idx_mapping[:n].long()
            fill = last_sampled.view(-1)[idx].long()
            self.stats.accept(*self.pending.rows(idx), num_sampled[:n])
            # 'auto': the scheduler's k for this step (V2 keeps that many of each row's drafts)
            step_k = kwargs.get("num_speculative_tokens")
            k = self.k if step_k is None else min(self.k, int(step_k))
            if self.drafting:   # the rows' new tokens, in every step of a drafting call
                ids = input_batch.req_ids[:n]

                def prompt_lens(pos: list[int]) -> list[int]:   # partial rollouts: a resumed answer's own
                    plens = rs.prompt_len.np[input_batch.idx_mapping_np[pos]]
                    return list(own_prompt_lens(plens, [ids[i] for i in pos], self.prompt_len_of)
                                if self.prompt_len_of else plens)
                at = self.live.step(ids, rs.all_token_ids.gpu, idx, rs.total_len.gpu[idx], prompt_lens, self.k + 1)
            if k <= 0 or not self.drafting:
                self.pending.n[idx] = 0
                self.drafts[:n] = fill[:, None]
                return self.drafts[:n]
            active = num_sampled[:n] > 0
            drafts, counts, src = draft_rows(self, at, active, k)
            self.pending.put(idx, src, torch.zeros_like(counts) if self.full else counts)
            if not self.full:
                self.stats.add(active, counts, src)
            drafts = torch.nn.functional.pad(drafts, (0, self.k - k), value=-1)
            self.drafts[:n] = torch.where(drafts >= 0, drafts.long(), fill[:, None])
            return self.drafts[:n]

    DeviceHistorySpeculator.drafting = True
    DeviceHistorySpeculator.prompt_len_of = {}
    DeviceHistorySpeculator.full = False  # V2 fills every row to k by itself
    return DeviceHistorySpeculator


def draft_rows(p, at, active, k: int):
    """A step's drafts for the batch's rows (their slots `at` [B] in p.live, active [B]), the
    call's finished answers read after them: drafts [B, k], counts [B], sources [B, k]. Where the
    drafter runs kernels, kernels.step in p.work's memory."""
    live, B = p.live, at.shape[0]
    if p.history.kernels and B:
        from rlspec.speculation.history.device import kernels
        return kernels.step(p.history, live, p.work, at, active, k)
    rows = live.rows(at)
    act = torch.cat([active, active.new_zeros(rows.shape[0] - B)])
    drafts, counts, src = p.history.propose(live.tok, live.n[rows], live.salt[rows], live.plen[rows], k, act,
                                            sources=True, done=len(live.done), at=rows, table=live.table,
                                            siblings=live.siblings(rows, min(p.history.max_siblings, len(rows))))
    return drafts[:B], counts[:B], src[:B]


def profile_step(p, rows: int) -> None:
    """One step at the engine's largest shape: `rows` running rows max_model_len - 1 long and as
    many finished answers, every row drafting k. vLLM sizes the KV cache from the peak memory of
    its profile run: run in it, the step's working tensors, which grow with rows x max_model_len
    (rlspec/speculation/history/device/memory.py), are kept out of the KV cache as the model's
    activations are. The call's rows are left as they were (nothing is written to them). A step
    in kernels with the live table allocates nothing (kernels.Workspace, allocated with the
    drafter): none is run."""
    live, dev = p.live, p.device
    if p.work is not None and live.table is not None:
        return
    S = min(2 * rows, live.tok.shape[0])
    with torch.inference_mode():   # V1 calls it after its profile run's own inference mode ends
        at = torch.arange(S, device=dev)
        ones = torch.ones(S, dtype=torch.int64, device=dev)
        act = at < rows
        p.history.propose(live.tok, (p.max_model_len - 1) * ones, ones, ones, p.k, act, sources=True,
                          done=S - rows, at=at, table=live.table)


def live_rows(vllm_config, history: DeviceHistory, device, k: int) -> tuple:
    """The call's rows (live.LiveRows): max_num_seqs running and as many finished answers, with
    the live table under speculation.history.device.lookup=table; and where the drafter runs
    kernels, their step's memory (kernels.Workspace), else None."""
    rows = int(vllm_config.scheduler_config.max_num_seqs)
    cfg = history_settings(vllm_config)
    table = bool(cfg) and cfg["device"].get("lookup", "scan") == "table"
    live = LiveRows(rows, rows, int(vllm_config.model_config.max_model_len), history.prompt_keys, device, table,
                    history.kernels)
    if not history.kernels:
        return live, None
    from rlspec.speculation.history.device.kernels import Workspace
    return live, Workspace(history, live, k)


def shadow_rows(vllm_config) -> int:
    return int(history_settings(vllm_config).get("shadow_rows", 32))


def settings(vllm_config) -> dict:
    """The store's settings, from the engine's config (the store is allocated with the runner,
    before vLLM sizes its KV cache); vLLM's defaults for an engine built without them."""
    cfg = history_settings(vllm_config)
    if not cfg:
        return {}
    kernels = str(cfg["device"].get("kernels", "auto")).lower()
    return {"max_tokens": cfg["device"]["max_tokens"], "max_match": cfg["max_match"], "min_prob": cfg["min_prob"],
            "prompt_keys": tuple(cfg["prompt_keys"]), "width": cfg["max_candidates"],
            "max_per_prompt": cfg["max_rollouts_per_prompt"], "global_source": bool(cfg["global_source"]),
            "kernels": None if kernels == "auto" else kernels == "true"}


def install() -> None:
    """rlspec's vLLM plugin: the subclass under vLLM's NgramProposerGPU name (and the CPU platform's
    stand-ins). Run where a model runner may be built, before it is; in a vLLM whose slots moved it
    installs nothing (the run that asks for the drafter stops at require_slots)."""
    if slots_changed(runner=False):
        return
    from vllm.platforms import current_platform
    from vllm.v1.spec_decode import ngram_proposer_gpu

    from vllm.v1.worker.gpu.spec_decode.ngram import speculator

    if getattr(ngram_proposer_gpu.NgramProposerGPU, "drafting", None) is None:
        cls = _proposer_class(ngram_proposer_gpu.NgramProposerGPU)
        ngram_proposer_gpu.NgramProposerGPU = cls
        if V1_RUNNER in sys.modules:  # imported before the plugin ran: its name too
            sys.modules[V1_RUNNER].NgramProposerGPU = cls
    if getattr(speculator.NgramGPUSpeculator, "drafting", None) is None:  # V2 imports it when it builds one
        speculator.NgramGPUSpeculator = _speculator_class(speculator.NgramGPUSpeculator)
    if current_platform.is_cpu():
        cpu_stand_ins(MARK)


# -- collective_rpc entry points (every worker: each drafts from its own store, the same records) --
def _proposer(worker):
    runner = worker.model_runner
    drafter = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)   # V2's name, V1's
    if getattr(drafter, "history", None) is None:
        raise RuntimeError(f"the engine's drafter is {type(drafter).__name__}, not rlspec's device history drafter")
    return drafter


def configure(worker) -> None:
    """RuntimeError unless this worker's runner drafts with the history (a worker process where
    install() did not run would draft with vLLM's n-gram drafter); the store itself was built with
    the runner, from the engine's config."""
    _proposer(worker)


def begin_call(worker, draft: bool = True, prompt_len_of: dict[str, int] | None = None) -> None:
    """As host.proposer.begin_call: prompt_len_of (rlspec's request id -> its own prompt's
    length) names the resumed answers of partial rollouts, whose prompt in vLLM holds their answer
    so far; both runners draft them under their own prompt."""
    p = _proposer(worker)
    p.drafting = draft
    p.prompt_len_of = prompt_len_of or {}
    p.stats = CallStats(p.k, p.device)
    p.pending.n.zero_()
    p.live.clear()
    if hasattr(p, "pending_ids"):
        p.pending_ids = []


def record(worker, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> None:
    _proposer(worker).history.insert(prompt_ids, response_ids)


def finish_call(worker, prompt_ids=None, response_ids=None) -> dict:
    """The call's counters (rows asked, rows drafted for, tokens drafted, per position) and the
    store's size; given the call's rows and the call drafted nothing ('auto' ran it without), what
    k_max drafts would have done, measured in shadow first (DeviceHistory.shadow, on up to
    speculation.history.shadow_rows responses)."""
    p = _proposer(worker)
    if prompt_ids is not None and int(p.stats.rows) == 0:
        p.history.shadow(p.stats.shadow, prompt_ids, response_ids, p.shadow_rows, p.k)
    return p.stats.finish(p.history.prompts(), p.history.stored()).as_dict()


def set_full(worker, full: bool) -> None:
    """'auto' times engine steps with every request drafting k tokens: the lookup runs as in any
    call (its cost is the step's), and a row's draft is filled to k with its last token."""
    _proposer(worker).full = full


def state_dict(worker) -> dict:
    return _proposer(worker).history.state_dict()


def load_state_dict(worker, state: dict) -> None:
    _proposer(worker).history.load_state_dict(state)
