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
    spec = SpeculationConfig(method="eagle3", num_speculative_tokens=3, online=OnlineDraftConfig(enabled=True, batch_size=4))
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
    from rlspec.cluster.ray_cluster import free_port
    from rlspec.engines.weight_sync import LearnerSource, RefitGroup, send_state
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
    from rlspec.cluster.memory import ACT_ELEMENTS, measure_layer

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
    from rlspec.cluster.memory import FORWARD_ELEMENTS, measure_layer

    h, i = 4096, 12288
    peak = measure_layer(h, i, 32, 8, 128, tokens=8192, device="cuda", peak=True, backward=False)
    model = 2 * (FORWARD_ELEMENTS[0] * h + FORWARD_ELEMENTS[1] * i)
    assert abs(peak / model - 1) < 0.02, (peak, model)
