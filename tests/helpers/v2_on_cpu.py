"""Model Runner V2's request states on this CPU, run as a child process (tests/speculation/
test_device_proposer.py): vLLM's own RequestState, InputBatch and post_update kernel, their Triton
kernels in Triton's interpreter, driving the device speculator in the order V2's runner calls it.

vLLM turns Triton off where Triton has no CPU backend, and its request states ask for pinned
memory. So, before vLLM is imported: TRITON_INTERPRET=1 (the child's environment), a backend entry
named "cpu" whose driver is active (vLLM's check; the interpreter needs no driver), and vLLM's own
fallback for platforms without pinned memory (is_uva_available false: plain buffers, explicit
copies). Prints the drafts of every step and the drafter's counters as JSON."""
import json
import os
import sys
import types
from dataclasses import asdict

import numpy as np
import torch


def enable() -> None:
    """The three settings above, and Triton's interpreter typing comparisons as compiled Triton
    does; before vLLM is imported."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    assert "vllm" not in sys.modules, "enable() before vLLM is imported"
    import triton.backends

    class _Driver:
        @staticmethod
        def is_active() -> bool:
            return True

        @staticmethod
        def get_current_target():
            # torch's inductor (vLLM compiles a few CPU ops with it, e.g. the vocabulary shard's
            # mask under tensor parallelism) hashes the Triton target into its cache key and
            # takes a RuntimeError as "no Triton target"
            raise RuntimeError("no Triton target on this CPU: Triton's interpreter runs vLLM's kernels")

    triton.backends.backends.setdefault("cpu", types.SimpleNamespace(driver=_Driver, compiler=None))
    interpreter_comparisons_are_int1()
    interpreter_log1p()
    from vllm.v1.worker.gpu import buffer_utils

    buffer_utils.is_uva_available = lambda: False


def interpreter_comparisons_are_int1() -> None:
    """Triton's interpreter tags a comparison's result with its operands' type, not int1: a mask
    made of a compared int64 scalar and a block mask (`mask & (idx >= 0)`, as vLLM's gumbel
    sampler and n-gram speculator store with) then broadcasts as int64, and the masked store
    refuses it ("mask has unsupported dtype"). The result tagged int1, as compiled Triton types it."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    for name in [n for n in vars(builder) if n.startswith(("create_icmp", "create_fcmp"))]:
        setattr(builder, name, lambda self, lhs, rhs, _cmp=getattr(builder, name):
                interpreter.TensorHandle(_cmp(self, lhs, rhs).data, tl.int1))


def interpreter_log1p() -> None:
    """Triton's interpreter runs no libdevice function (their stubs return None). V2's rejection
    sampler resamples a rejected position from the residual max(p - q, 0) with libdevice's log1p
    (vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py): numpy's, elementwise, in the
    operand's dtype."""
    import triton.language as tl
    import triton.language.extra.libdevice as libdevice
    from triton.runtime import interpreter

    libdevice.log1p = lambda x: tl.tensor(interpreter.TensorHandle(np.log1p(x.handle.data), x.handle.dtype), x.type)


def main() -> None:
    enable()
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers, post_update
    from vllm.v1.worker.gpu.spec_decode.ngram import speculator
    from vllm.v1.worker.gpu.states import RequestState

    from rlspec.config.speculation import DeviceHistoryConfig, HistoryConfig
    from rlspec.speculation.history.device.proposer import MARK, _speculator_class, begin_call
    from rlspec.speculation.vllm_hooks import CONFIG_KEY

    K, SLOTS, WIDTH = 4, 4, 64
    dev = torch.device("cpu")
    states = RequestState(SLOTS, WIDTH, 256, K, 100, dev, use_dense_all_token_ids=True)
    # the defaults, the running rows' lookup and whether kernels run as the command line names them
    # (scan or table; auto, true or false)
    lookup, kernels = (sys.argv[1:] + ["scan", "auto"][len(sys.argv) - 1:])[:2]
    history = asdict(HistoryConfig(device=DeviceHistoryConfig(lookup=lookup, kernels=kernels)))
    cfg = types.SimpleNamespace(speculative_config=types.SimpleNamespace(model=MARK, num_speculative_tokens=K),
                                scheduler_config=types.SimpleNamespace(max_num_seqs=SLOTS),
                                model_config=types.SimpleNamespace(max_model_len=WIDTH, get_vocab_size=lambda: 100),
                                additional_config={CONFIG_KEY: history})
    spec = _speculator_class(speculator.NgramGPUSpeculator)(cfg, dev, states)
    buffers = InputBuffers(SLOTS, 256, dev)
    p, q = [5, 6, 7, 8], [9, 9, 9, 9]
    spec.history.insert([p], [[20, 21, 22, 23, 24, 25, 26]])
    begin_call(types.SimpleNamespace(model_runner=types.SimpleNamespace(speculator=spec)))
    out = {"has_triton": bool(HAS_TRITON), "steps": []}

    def add(req_id, prompt):
        states.add_request(req_id, len(prompt), prompt, 0, 32)
        states.apply_staged_writes()

    def step(req_ids, sampled):
        """One verified step: the rows' sampled tokens posted by vLLM's kernel, then propose."""
        n = len(req_ids)
        batch = InputBatch.make_dummy(n, n, buffers, is_padding=False)
        idx = np.array([states.req_id_to_index[r] for r in req_ids], dtype=np.intp)
        batch.req_ids, batch.idx_mapping_np = list(req_ids), idx
        batch.idx_mapping = torch.from_numpy(idx).to(torch.int64)
        width = max(len(s) for s in sampled)
        tokens = torch.tensor([s + [-1] * (width - len(s)) for s in sampled], dtype=torch.int64)
        num_sampled = torch.tensor([len(s) for s in sampled], dtype=torch.int32)
        post_update(batch.idx_mapping, states.num_computed_tokens.gpu, states.last_sampled_tokens, None, tokens,
                    num_sampled, torch.zeros(n, dtype=torch.int32), None, states.all_token_ids.gpu,
                    states.total_len.gpu)
        drafts = spec.propose(batch, None, None, None, None, num_sampled, torch.zeros(n, dtype=torch.int32),
                              states.last_sampled_tokens, states.next_prefill_tokens, None, None)
        out["steps"].append(drafts.tolist())

    add("a", p)
    add("b", p)
    add("c", q)
    step(["a", "b", "c"], [[20], [20], [40]])                 # prefills: a and b follow the history
    step(["c", "b", "a"], [[41], [21, 22, 30], [21, 22, 23]])   # reordered; b leaves the history at 30
    step(["a", "b"], [[24, 25], [31, 32, 33]])
    b_slot = states.req_id_to_index["b"]
    states.remove_request("b")                                # b finished: V2 frees its slot ...
    add("d", p)                                               # ... and the next request takes it
    step(["a", "d"], [[26], [20]])
    step(["a", "d"], [[27], [21, 22, 30]])                    # d follows b's answer: its sibling, finished
    step(["d"], [[31, 32]])
    out["slot_reused"] = states.req_id_to_index["d"] == b_slot
    out["stats"] = spec.stats.finish(0, 0).as_dict()
    # the next call: V2 frees the last call's requests at its first step, after the call began
    begin_call(types.SimpleNamespace(model_runner=types.SimpleNamespace(speculator=spec)))
    states.remove_request("d")
    states.remove_request("a")
    add("e", p)
    step(["e"], [[20]])
    step(["e"], [[21, 22, 30]])                               # d's answer was the last call's: not e's sibling
    out["next_call"] = spec.stats.finish(0, 0).as_dict()
    out["table"] = spec.live.table is not None
    out["kernels"] = spec.history.kernels and spec.live.kernels and spec.work is not None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
