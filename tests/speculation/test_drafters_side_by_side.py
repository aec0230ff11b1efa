"""The device drafter against the host drafter through the Generator, around a weight refit (what
a training step does between calls): the same history, prompts, seeds and refit, each drafter in
its own engine. A call of 3 prompts x 100 samples (T=0.6, top-p 0.95, 12 tokens) drafts from its
own answers only (more samples than the engine runs at once: its last rows start after siblings
finished, which both drafters keep readable until the call ends) and records them; perturbed policy
weights are refit through refit_tensors; the calls after the refit draft the new policy's answers
from the old one's and then from their predecessors too. The device drafter accepts about as many
tokens as the host drafter (at least 0.9x) on every call, at a fixed k=8 and under 'auto' (k up to
8). 'auto' plans here from given step costs (speculation.auto_step_costs), not from timing the
engine: on CPU the device drafter's torch lookups cost several times the host's numba ones, and
timed costs would compare the backends' speeds, not their drafts."""

import pytest
import torch

from helpers.auto_k import gpu_like_step_costs
from rlspec.messages import Sampling

CALLS = 3   # the first call, then two after the refit


def _perturbed(path, scale, seed):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in m.named_parameters()}


def _accepted_by_call(drafter, prompts, weights, k_overrides):
    """Per call: tokens accepted, drafted and generated."""
    import ray

    from conftest import start_generator

    gen = start_generator(["speculation=history", f"speculation.history.drafter={drafter}", *k_overrides])
    out = []
    for call in range(CALLS):
        if call == 1:
            ray.get(gen.refit_tensors.remote(weights, 1), timeout=300)
        s = Sampling(100, 0.6, 12, seed=100 + call, top_p=0.95)
        ro = ray.get(gen.generate.remote(prompts, s), timeout=900)
        out.append((ro.spec.accepted_tokens, ro.spec.draft_tokens, sum(map(len, ro.response_ids))))
    ray.kill(gen)
    return out


@pytest.mark.slow  # four engines, three calls of 300 samples each
@pytest.mark.parametrize("k", ["8", "auto"])
def test_the_device_drafter_accepts_about_as_much_as_the_host_around_a_refit(ray_session, tokenizer, tiny_policy,
                                                                              tmp_path, k):
    from conftest import heldout_prompts

    prompts = heldout_prompts(tokenizer, 3)
    weights = _perturbed(tiny_policy, 0.02, 7)
    over = ["speculation.num_speculative_tokens=8"] if k == "8" else [
        "speculation.num_speculative_tokens=auto", "speculation.max_speculative_tokens=8",
        f"speculation.auto_step_costs={gpu_like_step_costs(tmp_path / 'costs.json')}"]
    host = _accepted_by_call("host", prompts, weights, over)
    device = _accepted_by_call("device", prompts, weights, over)
    print(f"k={k}: accepted / drafted / generated tokens by call, host {host}, device {device}")
    assert host[0][0] > 0 and host[1][0] > 0 and host[2][0] > 0   # the host drafts every call
    for call, (h, d) in enumerate(zip(host, device)):
        assert d[0] >= 0.9 * h[0], (call, host, device)
