"""Every worker computes on the device it owns: models, batches, buffers and collectives there,
results back on the host. No GPU here, so the `meta` device plays it (tests/device_check.py: an op
mixing devices raises as CUDA does, results read back as zeros). Each test builds the worker on
`meta`, feeds it what the driver sends (host tensors) and runs its real step."""
import pytest
import torch

from conftest import host_batch, logprob_worker, tiny_paths
from device_check import OnDevice
from rlspec.messages import MiniBatch


def test_logprob_worker_computes_on_its_device_and_returns_host_tensors():
    w = logprob_worker(4, capture={"layer_ids": [1, 2, 3], "topk": 8}, device="meta")
    assert next(w.policy.parameters()).device.type == "meta"
    batch = host_batch()
    with OnDevice():
        cur, ref = w.compute_logprobs(batch)
        feats = w.take_features()
    assert cur.device.type == "cpu" and cur.shape == batch.loss_mask.shape and ref is None
    assert feats and all(f[k].device.type == "cpu" for f in feats for k in ("ids", "aux_hidden", "topk_logp"))


def test_shared_prompt_forward_stays_on_the_models_device():
    """Planned on the host rows, run on the device rows: no tensor of the plan stays behind."""
    from rlspec.algo.logprobs import prompt_plan, sequence_logprobs

    w = logprob_worker(4, device="meta")
    host = host_batch()
    b = host.to("meta")
    plan = prompt_plan(host.input_ids, host.attention_mask, host.prompt_lengths)
    assert len(plan.prompts) == len(b) // 2  # groups of 2 share their prompt
    with OnDevice():
        lp, ent = sequence_logprobs(w.policy, b.input_ids, b.attention_mask, 1.0, with_entropy=True, plan=plan)
    assert lp.device.type == "meta" and ent.shape == lp.shape == b.loss_mask.shape


class EagerEngine(torch.nn.Module):
    """What the Learner needs of DeepSpeed's engine, over a plain module: DeepSpeed itself cannot
    put a model on `meta` (it copies parameters out), so this one test steps without it."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.opt = self.optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        self.boundary = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_gradient_accumulation_boundary(self, is_boundary):
        self.boundary = is_boundary

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()

    def step(self):
        if self.boundary:
            self.opt.step()

    def get_global_grad_norm(self):
        return 0.0

    def was_step_applied(self):
        return True


def test_learner_step_moves_its_batch_onto_its_device(monkeypatch):
    import rlspec.workers.learner as learner_mod
    from rlspec.config import AlgoConfig, GenerationConfig, ModelConfig, TrainerConfig

    def eager(module, trainer, samples, world):
        engine = EagerEngine(module)
        return engine, torch.optim.lr_scheduler.LambdaLR(engine.opt, lambda s: 1.0)

    monkeypatch.setattr(learner_mod, "init_distributed", lambda *a, **kw: None)
    monkeypatch.setattr(learner_mod, "make_engine", eager)
    learner = learner_mod.Learner(paths=tiny_paths(), model=ModelConfig(),
                                  algo=AlgoConfig(off_policy_correction="none"),
                                  trainer=TrainerConfig(micro_batch_size=4, dtype="float32"),
                                  generation=GenerationConfig(num_prompts_per_step=4, num_generations_per_prompt=2),
                                  rank=0, world_size=1, rendezvous=("127.0.0.1", 0), threads=1, device="meta")
    batch = host_batch()
    with OnDevice():
        sums, stats = learner.train_step([MiniBatch(batch, float(batch.loss_mask.sum()), float(len(batch)))])
    assert stats["skipped"] == 0.0 and stats["micro_batches"] == 2.0 and "loss" in sums
    assert all(p.grad is None or p.grad.device.type == "meta" for p in learner.engine.module.parameters())


def test_draft_trainer_trains_on_its_device_and_pushes_host_tensors():
    from rlspec.config import GenerationConfig, OnlineDraftConfig, SpeculationConfig
    from rlspec.workers.draft_trainer import DraftTrainer

    feats = logprob_worker(4, capture={"layer_ids": [1, 2, 3], "topk": 8})
    feats.compute_logprobs(host_batch())
    spec = SpeculationConfig(method="eagle3", num_speculative_tokens=3,
                             online=OnlineDraftConfig(enabled=True, batch_size=4))
    t = DraftTrainer(paths=tiny_paths("eagle3"), speculation=spec, generation=GenerationConfig(dtype="float32"), seed=0,
                     threads=1, device="meta")
    with OnDevice():
        st = t.update(2, feats.take_features())
        pushed = t.weights()
    assert st["optimizer_steps"] == 2
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in pushed.values())


def test_weight_sender_sends_from_its_device_in_the_engines_dtype():
    """The learner's parameters on its device, the group's buffers on the group's (the host for
    gloo): the source yields device tensors in the receivers' dtype, and each bucket is moved
    explicitly onto the group's device."""
    from rlspec.refit.ports import free_port
    from rlspec.refit.group import RefitGroup, send_state
    from rlspec.refit.source import LearnerSource

    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to("meta")
    group = RefitGroup("127.0.0.1", free_port(), 0, 1, "gloo")
    sent = []
    group.broadcast = lambda flat: sent.append(flat) or flat
    source = LearnerSource(module, False, torch.bfloat16, 64)
    with OnDevice():
        assert all(t.device.type == "meta" and t.dtype == torch.bfloat16 for _, t in source)
        send_state(group, source.metadata(), source, 64)
    assert sent and all(f.device.type == "cpu" and f.dtype == torch.bfloat16 for f in sent)
    assert sum(f.numel() for f in sent) == sum(p.numel() for p in module.parameters())


def test_the_stand_in_device_catches_a_host_tensor_fed_to_a_device_model():
    from device_check import DeviceMismatch
    from rlspec.algo.logprobs import sequence_logprobs

    w = logprob_worker(4, device="meta")
    b = host_batch()
    with OnDevice(), pytest.raises(DeviceMismatch, match="cpu.*meta"):
        sequence_logprobs(w.policy, b.input_ids, b.attention_mask)
