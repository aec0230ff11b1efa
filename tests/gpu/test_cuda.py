"""On a CUDA GPU (marked gpu: the default suite deselects them, `pytest -m gpu` runs them). The
`meta` stand-in (tests/device_check.py) proves where tensors live but computes nothing; here the
workers' real steps run on the GPU and their values are checked against the same step on the host,
the refit's NCCL group broadcasts, and the memory model's per-token activation figures are held
against the CUDA allocator. The other worker tests (tests/workers/test_learner.py among them) run
on the GPU as they stand wherever one is visible: workers take the first CUDA device they see."""
import pytest
import torch

from conftest import host_batch, logprob_worker, tiny_paths

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_logprob_worker_on_the_gpu_matches_the_host():
    capture = {"layer_ids": [1, 2, 3], "topk": 8}
    gpu, cpu = logprob_worker(4, capture=capture), logprob_worker(4, capture=capture, device="cpu")
    assert next(gpu.policy.parameters()).is_cuda and not next(cpu.policy.parameters()).is_cuda
    batch = host_batch()
    (g, _), (c, _) = gpu.compute_logprobs(batch), cpu.compute_logprobs(batch)
    assert g.device.type == "cpu"
    torch.testing.assert_close(g, c, atol=1e-4, rtol=0)
    fg, fc = gpu.take_features(), cpu.take_features()
    assert len(fg) == len(fc)
    for a, b in zip(fg, fc):
        assert torch.equal(a["ids"], b["ids"]) and a["aux_hidden"].device.type == "cpu"
        # captured in bfloat16: a few elements round to the neighbouring value, one step (2**-7) apart
        torch.testing.assert_close(a["aux_hidden"], b["aux_hidden"], atol=1e-3, rtol=2 ** -7)


def test_draft_trainer_on_the_gpu_takes_the_hosts_steps():
    """Two online EAGLE-3 head steps from the same seed and features: the pushed weights agree."""
    from rlspec.config import GenerationConfig, OnlineDraftConfig, SpeculationConfig
    from rlspec.workers.draft_trainer import DraftTrainer

    feats = logprob_worker(4, capture={"layer_ids": [1, 2, 3], "topk": 8}, device="cpu")
    feats.compute_logprobs(host_batch())
    features = feats.take_features()
    spec = SpeculationConfig(method="eagle3", num_speculative_tokens=3,
                             online=OnlineDraftConfig(enabled=True, batch_size=4))
    pushed = {}
    for device in ("cuda", "cpu"):
        t = DraftTrainer(paths=tiny_paths("eagle3"), speculation=spec, generation=GenerationConfig(dtype="float32"),
                         seed=0, threads=1, device=device)
        assert next(t.head.parameters()).device.type == device
        st = t.update(2, features)
        assert st["optimizer_steps"] == 2
        pushed[device] = t.weights()
    assert pushed["cuda"].keys() == pushed["cpu"].keys()
    for k, v in pushed["cuda"].items():
        assert v.device.type == "cpu"
        torch.testing.assert_close(v, pushed["cpu"][k], atol=1e-4, rtol=1e-3)


def test_the_refit_group_broadcasts_over_nccl_from_gpu_weights():
    """One rank (a second would need a second GPU: NCCL refuses two ranks on one): the learner's
    source yields its GPU weights in the engine's dtype and every bucket goes through NCCL."""
    from rlspec.refit.ports import free_port
    from rlspec.refit.group import RefitGroup, send_state
    from rlspec.refit.source import LearnerSource
    from rlspec.models import load_causal_lm

    model = load_causal_lm(tiny_paths().model).cuda()
    group = RefitGroup("127.0.0.1", free_port(), 0, 1, "nccl", timeout_s=120)
    sent = []
    broadcast = group.broadcast
    group.broadcast = lambda flat: sent.append(broadcast(flat).clone()) or flat
    source = LearnerSource(model, False, torch.bfloat16, 1 << 16)
    send_state(group, source.metadata(), source, 1 << 16)
    assert len(sent) > 1 and all(f.is_cuda and f.dtype == torch.bfloat16 for f in sent)
    want = torch.cat([t.detach().reshape(-1).to(torch.bfloat16) for _, t in LearnerSource(model, False, None, 1 << 16)])
    assert torch.equal(torch.cat(sent), want.cuda())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_memory_model_holds_on_the_gpu_at_qwen3_8b_width(checkpointing):
    """Qwen3-8B's decoder layer, bfloat16, 2048 tokens: what autograd keeps per token on the GPU
    (its SDPA kernels) within 10% of ACT_ELEMENTS (fitted on the CPU), nothing but the layer's input
    under checkpointing, and the allocator's peak over forward and backward (backward's transients
    beside what is kept, or the recomputed layer's) below twice the model's figure."""
    from memory_probe import measure_layer
    from rlspec.cluster.memory import ACT_ELEMENTS

    h, i, heads, kv, hd = 4096, 12288, 32, 8, 128
    e = ACT_ELEMENTS
    model = 2 * (e[0] * h + e[1] * i + e[2] * heads * hd + e[3] * kv * hd)
    kept = measure_layer(h, i, heads, kv, hd, tokens=2048, checkpointing=checkpointing, device="cuda")
    peak = measure_layer(h, i, heads, kv, hd, tokens=2048, checkpointing=checkpointing, device="cuda", peak=True)
    print(f"checkpointing={checkpointing}: kept {kept / 1024:.1f} KiB/token, peak {peak / 1024:.1f} KiB/token, "
          f"model {model / 1024:.1f} KiB/token")
    if checkpointing:
        assert kept <= 2 * h + 64  # the layer's input alone (counted by the previous layer) and a few scalars
        assert peak < 2 * model
    else:
        assert abs(kept / model - 1) < 0.10
        assert 0.9 * model <= peak < 2 * model


def test_a_log_prob_pass_peaks_where_the_memory_model_says():
    """Without autograd (a log-prob recompute), one Qwen3-8B layer over 8192 tokens peaks at
    FORWARD_ELEMENTS (2h + 3i) above its input, within 2%."""
    from memory_probe import measure_layer
    from rlspec.cluster.memory import FORWARD_ELEMENTS

    h, i = 4096, 12288
    peak = measure_layer(h, i, 32, 8, 128, tokens=8192, device="cuda", peak=True, backward=False)
    model = 2 * (FORWARD_ELEMENTS[0] * h + FORWARD_ELEMENTS[1] * i)
    assert abs(peak / model - 1) < 0.02, (peak, model)


def _ipc_receiver(conn) -> None:
    """A receiving process on the same GPU: rlspec's engine backend, built by vLLM's factory with
    the engine's bfloat16, hosting vLLM's own IPC engine; it serves the client protocol over a pipe
    and records what load_weights gets."""
    from transfer_engine import transfer_engine

    e = transfer_engine(torch.bfloat16, tied=True, device=torch.device("cuda", 0))
    calls = {"init": lambda info: e.init_transfer_engine(e.parse_init_info({"transport": "ipc", "inner": info})),
             "start": lambda: e.start_weight_update(),
             "update": lambda info: e.receive_weights(e.parse_update_info({"mode": "ipc", "inner": info})),
             "finish": lambda: e.finish_weight_update(),
             "calls": lambda: e.model.calls}
    while True:
        method, args = conn.recv()
        if method == "stop":
            return
        try:
            conn.send(("ok", calls[method](*args)))
        except Exception as err:  # the parent raises it
            conn.send(("error", repr(err)))


def test_the_learners_weights_reach_another_process_through_vllms_ipc_engine():
    """vLLM's CUDA IPC transport end to end on one GPU (the `ipc` refit of colocated plans):
    vLLM's trainer engine, from its factory over rlspec's LearnerSource, packs the tiny policy's GPU
    weights into buffers of its largest tensor (141 KiB, above the 64 KiB asked for) and hands their IPC
    handles through the client protocol; rlspec's
    engine in a second process hands them to vLLM's IPC engine, which maps them and loads each
    bucket as it lands: several load_weights calls, together every tensor bit for bit in bfloat16,
    the tied output layer included. (vLLM's `nccl` engine needs a GPU per rank: not on one GPU.)"""
    import multiprocessing as mp

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rlspec.refit import engine as refit_engine
    from rlspec.refit.source import LearnerSource
    from rlspec.models import load_causal_lm

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_receiver, args=(child,), daemon=True)
    proc.start()

    def call(method, *args):
        parent.send((method, args))
        if not parent.poll(120):
            raise TimeoutError(f"the receiving process did not answer {method} within 120 s")
        status, value = parent.recv()
        if status == "error":
            raise RuntimeError(f"receiver, {method}: {value}")
        return value

    class PipeClient:  # vLLM's weight-sync client protocol over the pipe
        log = []

        def init_weight_transfer_engine(self, info):
            self.log.append("init")
            call("init", info)

        def start_weight_update(self):
            self.log.append("start")
            call("start")

        def update_weights(self, info):
            self.log.append("update")
            call("update", info)

        def finish_weight_update(self, weight_version=None):
            self.log.append("finish")
            call("finish")

    try:
        model = load_causal_lm(tiny_paths().model).cuda()
        refit_engine.register()
        source = LearnerSource(model, False, torch.bfloat16, 1 << 16)
        info = refit_engine.trainer_init_info("ipc", rank=0, address="", port=0, world_size=2, bucket_bytes=1 << 16,
                                               source=source)
        client = PipeClient()
        sender = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        sender.send_weights()
        got_calls = call("calls")
    finally:
        parent.send(("stop", ()))
        proc.join(30)
    assert client.log[:2] == ["init", "start"] and client.log[-1] == "finish"
    assert client.log.count("update") > 1 and len(got_calls) > 1
    got = dict(x for c in got_calls for x in c)
    want = {n: t.detach().cpu() for n, t in LearnerSource(model, False, torch.bfloat16, 1 << 16)}
    assert "lm_head.weight" in want and set(got) == set(want)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v) for k, v in want.items())
