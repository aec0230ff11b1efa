"""vLLM's CPU platform has no accelerator, and the V1 runner's `ngram_gpu` path asks for pinned host
buffers and CUDA streams and events: the stand-ins rlspec's vLLM plugin gives a CPU runner of the
device drafter's engine (rlspec/speculation/history/device/proposer.py), so the CPU tests run the drafter
through the runner path a GPU runs."""
from __future__ import annotations

import contextlib

import torch


def cpu_stand_ins(mark: str) -> None:
    """On vLLM's CPU platform, what the V1 runner's ngram_gpu path needs an accelerator for: pinned
    staging buffers (plain host memory: there is no device to copy to), CUDA events and streams
    (no-ops: every copy is synchronous), the staged copy of token rows (a plain copy). The buffers
    and events are swapped only while a runner of this drafter's engine is built (speculative model
    `mark`): any other engine in the process is built as vLLM builds it."""
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    if getattr(cpu_model_runner, "_rlspec_stand_ins", False):
        return
    cpu_model_runner._rlspec_stand_ins = True
    inner = cpu_model_runner._torch_cuda_wrapper
    building = [False]   # a runner of MARK's engine is being built
    runner_init = cpu_model_runner.CPUModelRunner.__init__

    def init(self, vllm_config, *args, **kwargs):
        spec = vllm_config.speculative_config
        building[0] = spec is not None and spec.model == mark
        try:
            runner_init(self, vllm_config, *args, **kwargs)
        finally:
            building[0] = False

    @contextlib.contextmanager
    def wrapper():
        if not building[0]:
            with inner():
                yield
            return
        zeros, event = torch.zeros, torch.cuda.Event

        def unpinned_zeros(*args, pin_memory=False, **kwargs):
            return zeros(*args, **kwargs)

        torch.zeros, torch.cuda.Event = unpinned_zeros, Event
        try:
            with inner():
                yield
        finally:
            torch.zeros, torch.cuda.Event = zeros, event

    cpu_model_runner.CPUModelRunner.__init__ = init
    cpu_model_runner._torch_cuda_wrapper = wrapper
    gpu_model_runner.update_ngram_gpu_tensors_incremental = copy_rows
    gpu_model_runner.copy_num_valid_draft_tokens = copy_counts


class Event:
    """torch.cuda.Event on a CPU runner: every copy is synchronous, so there is nothing to wait for
    (any constructor arguments, as torch.cuda.Event(blocking=True), are taken and ignored)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True


def copy_rows(input_batch, token_ids_gpu_tensor, num_tokens_no_spec_gpu, new_reqs, device, **buffers) -> None:
    """update_ngram_gpu_tensors_incremental on a CPU runner, as vLLM's does it without its staging
    buffers: the rows of requests new to the batch (or resumed) copied whole from the input batch,
    rows that moved gathered from where they were, every running row's length synced. The other
    rows keep what the drafter appended (its sampled tokens): under async scheduling the input
    batch's host copy holds placeholders (-1) for the tokens still on the device."""
    now = input_batch.req_id_to_index
    if not now:
        return
    before = input_batch.prev_req_id_to_index
    if before is None:   # the first step: every row whole
        fresh = list(now.values())
    else:
        new_ids = {r.req_id for r in new_reqs}
        moved = [(before[r], i) for r, i in now.items() if r not in new_ids and r in before and before[r] != i]
        if moved:
            src, dst = (torch.tensor(x, dtype=torch.long) for x in zip(*moved))
            token_ids_gpu_tensor[dst] = token_ids_gpu_tensor[src].clone()
        fresh = [now[r] for r in new_ids if r in now]
    for idx in fresh:
        n = int(input_batch.num_tokens_no_spec[idx])
        token_ids_gpu_tensor[idx, :n] = input_batch.token_ids_cpu_tensor[idx, :n]
    rows = torch.tensor(list(now.values()), dtype=torch.long)
    num_tokens_no_spec_gpu[rows] = input_batch.num_tokens_no_spec_cpu_tensor[rows].to(num_tokens_no_spec_gpu.dtype)


def copy_counts(counts_cpu, stream, event, counts, batch_size) -> None:
    """copy_num_valid_draft_tokens on a CPU runner: a plain copy."""
    if counts is not None and batch_size > 0:
        n = min(batch_size, counts.shape[0])
        counts_cpu[:n].copy_(counts[:n])
