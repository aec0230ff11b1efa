"""rlspec's refit through vLLM's weight-transfer API, both ends, as vLLM builds them: the engine
backend and the trainer engine found through vLLM's factories by name; init and update infos
parsed from the dicts vLLM passes; a group round sent by the trainer engine through a client
and received bucket by bucket into load_weights; a tensors round loaded as given; a tensor in
another dtype than the engine's refused; and vLLM's own `nccl` and `ipc` payloads, as vLLM's
trainer engines write them, reaching vLLM's own engines inside rlspec's with each receiver's rank.
(The engines' own tests run all of it inside real vLLM workers.)"""
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from rlspec.refit.ports import free_port
from rlspec.refit import engine as refit_engine
from rlspec.refit.sender import ActorClient
from rlspec.refit.source import LearnerSource
from transfer_engine import Recorder
from transfer_engine import transfer_engine as engine


def update(e, info: dict) -> None:
    """What vLLM's update_weights does minus its device synchronize (no accelerator here; vLLM's CPU
    worker patches it in its own process)."""
    e.receive_weights(e.parse_update_info(info))


WEIGHTS = {"model.embed_tokens.weight": torch.randn(50, 8), "model.layers.0.w": torch.randn(8, 8),
           "model.norm.weight": torch.randn(8)}


def test_a_tensors_round_loads_as_given_and_ties_the_head():
    e = engine()
    refit_engine.register()  # registering again is a no-op
    update(e, {"mode": "tensors", "names": list(WEIGHTS), "tensors": list(WEIGHTS.values())})
    (got,) = e.model.calls
    assert [n for n, _ in got] == list(WEIGHTS) and all(torch.equal(dict(got)[k], v) for k, v in WEIGHTS.items())
    e = engine(tied=True)
    update(e, {"mode": "tensors", "names": list(WEIGHTS), "tensors": list(WEIGHTS.values())})
    (got,) = e.model.calls
    assert [n for n, _ in got] == [*WEIGHTS, "lm_head.weight"]
    assert torch.equal(dict(got)["lm_head.weight"], WEIGHTS["model.embed_tokens.weight"])


def test_a_tensor_in_another_dtype_than_the_engines_is_refused_by_name():
    e = engine(dtype=torch.float32)
    with pytest.raises(TypeError, match="model.layers.0.w arrives as torch.bfloat16, the engine computes in "
                                        "torch.float32"):
        update(e, {"mode": "tensors", "names": ["model.layers.0.w"],
                   "tensors": [WEIGHTS["model.layers.0.w"].bfloat16()]})
    with pytest.raises(ValueError, match="mode 'carrier_pigeon'"):
        update(e, {"mode": "carrier_pigeon"})
    with pytest.raises(RuntimeError, match="a nccl update, but this engine joined no transport"):
        update(e, {"mode": "nccl", "inner": {"names": [], "dtype_names": [], "shapes": []}})


class TiedModule(torch.nn.Module):
    """A Hugging Face-shaped module whose output layer is its embedding."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(tie_word_embeddings=True)
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(50, 8)
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8, bias=False)])
        self.model.norm = torch.nn.LayerNorm(8, bias=False)


class EngineClient:
    """The client protocol over one in-process engine (the Ray fan-out is ActorClient's part;
    tests/refit/test_refit_actors.py runs that across actors)."""

    def __init__(self, e):
        self.e, self.log = e, []

    def init_weight_transfer_engine(self, init_info):
        self.log.append("init")
        self.e.init_transfer_engine(self.e.parse_init_info({"transport": "group", "inner": init_info}))

    def start_weight_update(self):
        self.log.append("start")

    def update_weights(self, update_info):
        self.log.append("update")
        update(self.e, {"mode": "group", "inner": update_info})

    def finish_weight_update(self, weight_version=None):
        self.log.append("finish")


def test_a_group_round_arrives_bucket_by_bucket_with_the_tied_head():
    """The trainer engine (rank 0, from vLLM's trainer factory) sends a module's weights in 1 KiB
    buckets in the engine's dtype; the engine (rank 1) loads each bucket as it lands: several
    load_weights calls, together every tensor bit for bit, the tied output layer included."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    module = TiedModule()
    e = engine(dtype=torch.bfloat16)
    client = EngineClient(e)
    info = refit_engine.trainer_init_info("group", rank=0, address="127.0.0.1", port=free_port(), world_size=2,
                                           bucket_bytes=1024)
    refit_engine.register()
    source = LearnerSource(module, zero3=False, dtype=torch.bfloat16, bucket_bytes=1024)
    # the engine's side blocks in the rendezvous, as a receiver actor would
    sender = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    sender.send_weights()
    assert client.log == ["init", "start", "update", "finish"]
    assert len(e.model.calls) > 1
    got = dict(x for call in e.model.calls for x in call)
    want = {n: p.detach().bfloat16() for n, p in module.named_parameters()}
    want["lm_head.weight"] = want["model.embed_tokens.weight"]
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_a_source_that_disagrees_with_its_metadata_is_named():
    from rlspec.refit.group import RefitGroup, send_state

    source = LearnerSource(TiedModule(), zero3=False, dtype=torch.float32, bucket_bytes=1 << 20)
    meta = source.metadata()
    meta[1] = type(meta[1])("model.layers.0.other", meta[1].dtype, meta[1].shape)
    group = RefitGroup("127.0.0.1", free_port(), 0, 1, "gloo")
    with pytest.raises(ValueError, match="yields model.layers.0.weight .* declares model.layers.0.other"):
        send_state(group, meta, source, 1 << 20)


class Recording:
    """A receiver as ActorClient reaches it, in process: what each call brought."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, method):
        return SimpleNamespace(remote=lambda *a: self.calls.append((method, a)))


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_vllm_payloads_reach_vllm_engines_inside_rlspecs_with_each_receivers_rank(transport, monkeypatch):
    """vLLM's own trainer-side payloads (its worker init info and update info dataclasses, written
    as its trainer engines write them) pass through ActorClient to each receiver with its own
    first rank, and rlspec's engine hands them to vLLM's own engine class, which parses them. The
    transfer itself (NCCL, CUDA IPC) needs GPUs and has not run here."""
    import ray

    from vllm.distributed.weight_transfer import ipc_engine, nccl_engine
    from vllm.distributed.weight_transfer.nccl_common import worker_init_payload

    monkeypatch.setattr(ray, "wait", lambda refs, **kw: (refs, []))
    monkeypatch.setattr(ray, "get", lambda refs, **kw: refs)
    receivers = [("generator[0]", Recording(), 1), ("generator[1]", Recording(), 3), ("logprob_worker", Recording(), 5)]
    client = ActorClient(transport, receivers, timeout_s=5)
    client.version, client.draft = 7, False
    if transport == "nccl":
        init = worker_init_payload(nccl_engine.NCCLWeightTransferInitInfo(
            master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=6, packed=True))
        upd = asdict(nccl_engine.NCCLWeightTransferUpdateInfo(names=["model.norm.weight"], dtype_names=["bfloat16"],
                                                              shapes=[[8]]))
    else:
        init = {"packed": True}
        upd = asdict(ipc_engine.IPCWeightTransferUpdateInfo(names=["model.norm.weight"], dtype_names=["bfloat16"],
                                                            shapes=[[8]], ipc_handles={"GPU-0": ()},
                                                            tensor_sizes=[16]))
    client.init_weight_transfer_engine(init)
    client.start_weight_update()
    client.update_weights(upd)
    client.finish_weight_update()
    for _, r, first in receivers:
        (m0, (got_init,)), (m1, (draft,)), (m2, (got_upd,)), (m3, args3) = r.calls
        assert (m0, m1, m2, m3) == ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                                    "finish_weight_update")
        assert draft is False and args3 == (7, False)
        assert got_init["transport"] == transport and got_upd["mode"] == transport
        if transport == "nccl":
            assert got_init["inner"]["rank_offset"] == first and got_init["inner"]["world_size"] == 6
        e = engine(dtype=torch.bfloat16)
        # vLLM's engine class parses what it will get (its init would open NCCL: not on this machine)
        cls = refit_engine._inner_engine_class(transport)
        inner = cls(None, e.vllm_config, e.device, e.model)
        parsed = inner.parse_init_info(got_init["inner"])
        assert type(parsed).__name__ == ("NCCLWeightTransferInitInfo" if transport == "nccl" else
                                         "IPCWeightTransferInitInfo")
        assert inner.parse_update_info(got_upd["inner"]).names == ["model.norm.weight"]
    # a wire dtype other than the engine's is refused before vLLM's engine sees it
    e = engine(dtype=torch.float32)
    e.transport, e.inner = transport, object()
    with pytest.raises(TypeError, match="model.norm.weight arrives as torch.bfloat16"):
        update(e, {"mode": transport, "inner": upd})


def test_a_draft_update_retargets_vllms_inner_engine_too():
    e = engine()
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    e.inner = NCCLWeightTransferEngine(None, e.vllm_config, e.device, e.model)
    draft = Recorder()
    e.set_weight_update_target(draft, SimpleNamespace(dtype=torch.float32))
    assert e.model is draft and e.inner.model is draft
    e.reset_weight_update_target()
    assert e.model is not draft and e.inner.model is e.model


def test_the_ipc_buffer_holds_the_largest_tensor():
    """vLLM's packed IPC producer allocates one buffer and refuses a tensor larger than it (seen on an
    H100: the tiny policy's embedding against a 64 KiB bucket): under `ipc` the buffer grows to the
    largest tensor in the engine's dtype; vLLM's NCCL producer takes oversized tensors as they come."""
    source = LearnerSource(TiedModule(), zero3=False, dtype=torch.bfloat16, bucket_bytes=64)
    largest = 50 * 8 * 2  # the embedding in bfloat16
    ipc = refit_engine.trainer_init_info("ipc", rank=0, address="", port=0, world_size=2, bucket_bytes=64,
                                          source=source)
    assert ipc.packed and ipc.packed_buffer_size_bytes == largest
    big = refit_engine.trainer_init_info("ipc", rank=0, address="", port=0, world_size=2, bucket_bytes=1 << 20,
                                          source=source)
    assert big.packed_buffer_size_bytes == 1 << 20
    nccl = refit_engine.trainer_init_info("nccl", rank=0, address="127.0.0.1", port=1, world_size=2, bucket_bytes=64,
                                           source=source)
    assert nccl.packed_buffer_size_bytes == 64


def test_the_logprob_worker_opens_and_closes_each_ipc_update_as_vllms_workers_do(monkeypatch):
    """vLLM's IPC engine releases the learner buffers an update mapped in finish_weight_update; the
    log-prob worker's receiver hosts that engine and now runs its start and finish around every
    update, as the Generator's vLLM workers do (before, the buffers stayed mapped until the next
    refit). The mapping itself needs a GPU; the calls are checked here on vLLM's own engine class."""
    from conftest import logprob_worker

    w = logprob_worker(4)
    w.init_weight_transfer_engine({"transport": "ipc", "inner": {"packed": True}})
    inner = w.receiver.engine.inner
    assert type(inner).__name__ == "IPCWeightTransferEngine"
    calls = []
    monkeypatch.setattr(inner, "start_weight_update", lambda: calls.append("start"))
    closed = inner._packed_importer.close
    monkeypatch.setattr(inner._packed_importer, "close", lambda: (calls.append("close"), closed()))
    w.start_weight_update()
    inner.model.load_weights(list(w.policy.named_parameters()))  # what the IPC engine's receive ends in
    w.finish_weight_update(3)
    assert calls == ["start", "close"] and w.policy_version == 3


def test_a_logprob_workers_round_that_leaves_a_parameter_out_is_refused():
    """A LogprobWorker's round (here the tensors one, the object store's) lands in its model through
    the shared receiver; a round that leaves a parameter out fails at its finish naming it, and the
    worker's version stays; a whole round sets every parameter and the version."""
    from conftest import logprob_worker

    w = logprob_worker(4)
    weights = {n: p.detach() + 1.0 for n, p in w.policy.named_parameters()}
    left_out = sorted(weights)[0]
    with pytest.raises(RuntimeError, match=rf"weight refit 5: the round left out 1 parameters .*\({left_out}\)"):
        w.refit_tensors({n: t for n, t in weights.items() if n != left_out}, 5)
    assert w.policy_version == 0
    assert w.refit_tensors(weights, 6) >= 0 and w.policy_version == 6
    assert all(torch.equal(p, weights[n]) for n, p in w.policy.named_parameters())
