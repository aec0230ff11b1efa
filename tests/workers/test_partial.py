"""Generate calls in the Generator (VLLMEngine.generate_groups) through the real vLLM engine: a whole
call samples as vLLM's parallel sampling; a partial call stops once the groups it needs are
complete, aborts the rest and hands their tokens back; the next call resumes them. Each engine runs
in its own Ray actor, as in training."""
import pytest

from conftest import heldout_prompts, sampling, start_generator


def call(method, *args):
    import ray
    return ray.get(method.remote(*args), timeout=600)


def groups_of(prompts, n, seed=None, first_tag=0):
    from rlspec.messages import Sampling, fresh_groups

    return fresh_groups(prompts, Sampling(n, 1.0, 1, seed), first_tag)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return heldout_prompts(tokenizer, 6)


@pytest.fixture(scope="module")
def engines(ray_session):
    import ray

    actors = {"none": start_generator(["speculation=none"]), "ngram": start_generator(["speculation=ngram"]),
              "history": start_generator(["speculation=history"])}
    yield actors
    for a in actors.values():
        ray.kill(a)


@pytest.fixture(scope="module")
def auto_engine(ray_session, tmp_path_factory):
    """History drafting under 'auto' k (k <= 3), planned from fixed step costs: whether a call drafts
    follows its acceptance, not this machine's load."""
    import ray

    from helpers.auto_k import gpu_like_step_costs

    costs = gpu_like_step_costs(tmp_path_factory.mktemp("auto") / "costs.json", k_max=3)
    actor = start_generator(["speculation=history", "speculation.num_speculative_tokens=auto",
                             "speculation.max_speculative_tokens=3", f"speculation.auto_step_costs={costs}"])
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="module")
def async_engine(ray_session):
    """The device history drafter on an engine scheduling asynchronously (as on GPUs)."""
    import ray

    actor = start_generator(["generation.async_scheduling=true", "speculation=history",
                             "speculation.history.drafter=device"])
    yield actor
    ray.kill(actor)


def _vllm_generate(gen, prompt_ids, s):
    """vLLM's own LLM.generate of prompt_ids with s.n samples a prompt, seeded as the engine seeds a
    call (per request: prompt i's seed, vLLM's j-th sample seed + j; or the reseeded engine)."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    engine = gen.engine
    if engine.engine_seeded:
        torch.manual_seed(s.seed)
    params = [SamplingParams(n=s.n, temperature=s.temperature, max_tokens=s.max_tokens, logprobs=0, detokenize=False,
                             seed=None if engine.engine_seeded else s.request_seed(i)) for i in range(len(prompt_ids))]
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
    rows = [c for o in outs for c in o.outputs]
    return [list(c.token_ids) for c in rows], [[float(st[t].logprob) for t, st in zip(c.token_ids, c.logprobs)]
                                                for c in rows]


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_a_whole_call_samples_what_vllms_parallel_sampling_samples(engines, prompts, method):
    """Seeded sampling at T=1: a whole call (new groups, all needed, an engine request an answer)
    gives the tokens and behaviour log-probs that vLLM's LLM.generate gives for n samples a prompt.
    Where requests carry seeds (no speculation on this CPU; GPUs) answer j is seeded as vLLM seeds
    the j-th of n; under speculation on this CPU both reseed the engine and add the rows in the
    same order (an n-gram engine: its drafts depend on the rows' own tokens only)."""
    import sys

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    actor, s = engines[method], sampling(3, 1.0, 40, seed=11)
    got = call(actor.generate, prompts, s)
    want_ids, want_logprobs = ray.get(actor.__ray_call__.remote(_vllm_generate, prompts, s), timeout=600)
    assert got.response_ids == want_ids
    assert got.logprobs == want_logprobs
    assert got.tags == list(range(len(prompts))) and got.carry == []
    assert got.partial["new_tokens"] == got.num_tokens and got.partial["resumed_answers"] == 0
    assert got.token_versions == [[0] * len(r) for r in got.response_ids]


@pytest.mark.parametrize("method", ["ngram", "history", "history-auto",
                                    pytest.param("async-device", marks=pytest.mark.slow)])  # one more engine
def test_aborted_answers_resume_to_the_uninterrupted_greedy_answers(engines, prompts, method, request):
    """Greedy (groups of two answers, each the prompt's greedy answer): a call that needs one group
    of six returns the first complete one and aborts the others mid-answer; the next call resumes
    them (prompt plus partial answer) and every answer, joined, is the uninterrupted greedy answer
    token for token, its behaviour log-probs equal to the uninterrupted ones within float32
    rounding of a prefill against a decode (1e-4). Under 'auto' k each partial call keeps to the
    k its planner scheduled (no draft wider than the call's largest). async-device: aborts and
    resumes under vLLM's async scheduling, the device history drafter drafting."""
    fixture = {"history-auto": "auto_engine", "async-device": "async_engine"}.get(method)
    actor = request.getfixturevalue(fixture) if fixture else engines[method]
    n, max_tokens = 2, 48
    whole = call(actor.generate, prompts, sampling(1, 0.0, max_tokens))  # vLLM: greedy needs n=1
    first = call(actor.generate_groups, groups_of(prompts, n), sampling(n, 0.0, max_tokens), 1)
    assert len(first.tags) == 1 and len(first.carry) == len(prompts) - 1
    cut = [a for g in first.carry for a in g.answers if not a.done]
    assert any(0 < len(a.response_ids) for a in cut), "no answer was stopped mid-way"
    assert all(a.resumes == 1 for a in cut)
    assert all(len(a.logprobs) == len(a.versions) == len(a.response_ids) for a in cut)
    second = call(actor.generate_groups, first.carry, sampling(n, 0.0, max_tokens), None)
    assert second.carry == [] and sorted(first.tags + second.tags) == list(range(len(prompts)))
    if method == "history-auto":
        for ro in (first, second):
            k_call = max((k for _, _, k in ro.draft_schedule), default=0)
            assert ro.spec.draft_tokens <= k_call * ro.spec.drafts, (ro.draft_schedule, ro.spec)
        assert first.spec.drafts + second.spec.drafts > 0
    got = {}
    for ro in (first, second):
        for g, tag in enumerate(ro.tags):
            for j in range(n):
                got[(tag, j)] = (ro.response_ids[g * n + j], ro.logprobs[g * n + j], ro.truncated[g * n + j])
    for i in range(len(prompts)):
        for j in range(n):
            ids, lps, trunc = got[(i, j)]
            assert ids == whole.response_ids[i]
            assert trunc == whole.truncated[i]
            assert max((abs(a - b) for a, b in zip(lps, whole.logprobs[i])), default=0.0) < 1e-4


@pytest.mark.parametrize("refill", [False, True])
def test_over_calls_every_group_is_returned_once_and_no_token_is_lost(engines, tokenizer, refill):
    """Six partial calls (3 groups of 3 needed, 6 in flight; with refill 2 spares beside them,
    started as groups complete) through the driver's PartialRollouts: each call returns exactly the
    groups it needed, each complete, with its own prompt; no group comes back twice; every group
    made is returned or still carried; and every token sampled is in a returned answer or a carried
    one (tokens sampled = tokens returned + tokens carried); a spare never started is carried
    without a token; no engine step of a call holds more rows than its groups in flight."""
    from collections import Counter

    from rlspec.data.loading import Prompt, PromptSampler, PromptSet
    from rlspec.loops.partial import PartialRollouts
    from rlspec.messages import Sampling

    prompts = [Prompt(str(i), "", ids, i + 1) for i, ids in enumerate(heldout_prompts(tokenizer, 16, seed=9))]
    part = PartialRollouts(PromptSampler(PromptSet("test", prompts), seed=0), prompts, groups_per_step=3,
                           group_size=3, over_provision=2.0, max_carry_versions=2, refill=refill)
    seen, sampled, returned, resumed, spares = Counter(), 0, 0, 0, 0
    for c in range(6):
        s = Sampling(3, 1.0, 48, seed=c + 1)
        groups = part.groups(part.draw(), s)
        assert len(groups) == (8 if refill else 6)
        ro = call(engines["ngram"].generate_groups, groups, s, 3, 2, part.start)
        got = part.returned(ro)
        spares += ro.partial["spares_started"]
        unstarted = ro.carry[len(ro.carry) - ro.partial["spares_unstarted"]:]
        assert all(not a.response_ids and not a.done and a.resumes == 0 for g in unstarted for a in g.answers)
        assert ro.partial["spares_started"] + ro.partial["spares_unstarted"] == (2 if refill else 0)
        assert len(ro.tags) == 3 and len(ro.response_ids) == 9
        steps, rows = ro.step_rows  # spares start only as groups complete: 6 x 3 rows held, not 8 x 3
        each = [n + waiting for n, waiting in call(engines["ngram"].engine_steps)]
        assert 0 < steps == len(each) and rows == sum(each) and max(each) <= 18, each
        assert sorted(ro.tags + [g.tag for g in ro.carry]) == sorted(g.tag for g in groups)
        assert [p.token_ids for p in got] == ro.prompt_ids[::3]
        assert all(len(r) == len(lp) == len(v) for r, lp, v in zip(ro.response_ids, ro.logprobs, ro.token_versions))
        seen.update(ro.tags)
        sampled += ro.partial["new_tokens"]
        returned += ro.num_tokens
        resumed += ro.partial["resumed_answers"]
    carried = sum(len(a.response_ids) for g in part.carry for a in g.answers)
    assert max(seen.values()) == 1 and len(seen) + len(part.carry) == part.next_tag
    assert sampled == returned + carried
    assert resumed > 0 and part.totals["dropped_answers"] == 0  # the weights never moved: nothing too old
    assert (spares > 0) == refill
    print(f"6 calls: {len(seen)} groups returned, {len(part.carry)} carried, {resumed} answers resumed; "
          f"{sampled} tokens sampled = {returned} returned + {carried} carried")


def test_a_group_carried_max_carries_times_is_run_to_its_end_and_returned_first(engines, prompts):
    """A group started and carried out of max_carries (2) calls unfinished is due: a call that needs
    one group, with a complete one waiting, still runs the due group to its end and returns it
    (partial/forced_groups 1); the complete group is carried as it is. Below the bound the same
    call returns the complete group at once and the unfinished one is carried once more (without
    the bound a group that loses every race is never trained)."""
    from rlspec.messages import Answer

    actor = engines["ngram"]
    s = sampling(2, 1.0, 48, seed=3)

    def pair(carried):
        waiting, done = groups_of(prompts[:2], 2, seed=3)
        waiting.carried = carried
        done.answers = [Answer([5, 6], [-0.5, -0.5], [0, 0], done=True) for _ in range(2)]
        return [waiting, done]

    below = call(actor.generate_groups, pair(1), s, 1, 8, None, 2)
    assert below.tags == [1] and below.partial["forced_groups"] == 0 and below.partial["new_tokens"] == 0
    assert [g.tag for g in below.carry] == [0] and below.carry[0].carried == 2  # started, carried once more
    due = call(actor.generate_groups, pair(2), s, 1, 8, None, 2)
    assert due.tags == [0] and due.partial["forced_groups"] == 1 and len(due.response_ids) == 2
    assert all(len(r) > 0 for r in due.response_ids)
    assert [g.tag for g in due.carry] == [1] and due.carry[0].done


def test_over_calls_with_max_carries_every_group_trains_within_the_bound(engines, tokenizer):
    """Ten calls that each need one group of six in flight (five carried every call) with
    max_carries=1: no group is carried unfinished out of more than one call (a group due in a call
    leaves it complete, returned then or first in line after), and the calls report the groups
    they forced."""
    from rlspec.data.loading import Prompt, PromptSampler, PromptSet
    from rlspec.loops.partial import PartialRollouts
    from rlspec.messages import Sampling

    prompts = [Prompt(str(i), "", ids, i + 1) for i, ids in enumerate(heldout_prompts(tokenizer, 40, seed=5))]
    part = PartialRollouts(PromptSampler(PromptSet("test", prompts), seed=0), prompts, groups_per_step=1,
                           group_size=2, over_provision=6.0, max_carry_versions=8, max_carries=1)
    for c in range(10):
        s = Sampling(2, 1.0, 48, seed=c + 1)
        groups = part.groups(part.draw(), s)
        due = {g.tag for g in groups if g.carried >= 1 and not g.done}
        ro = call(engines["ngram"].generate_groups, groups, s, 1, 8, None, 1)
        part.returned(ro)
        assert len(ro.tags) == 1 and ro.partial["forced_groups"] == len(due & set(ro.tags))
        assert all(g.done for g in ro.carry if g.tag in due), c
        assert all(g.done or g.carried <= 1 for g in ro.carry), c
    assert part.totals["forced_groups"] > 0


def test_a_resumed_answer_is_drafted_under_its_own_prompt():
    """vLLM's prompt of a resumed answer holds the answer so far; history finds the prompt's
    earlier answers and siblings by the prompt rlspec names (request ids as vLLM makes them:
    rlspec's id, '-', 8 random characters; or rlspec's id alone under
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION). Ids differ between calls, so an aborted request's
    late output never meets a later call's request."""
    import numpy as np

    from rlspec.engines.vllm_engine import VLLMEngine
    from rlspec.speculation.history.host.proposer import own_prompt_lens

    rid = VLLMEngine.request_id
    own = {rid(4, 0, 1): 12, rid(4, 2, 0): 9}
    for suffix in ("-abcdefgh", ""):
        ids = [rid(4, 0, 1) + suffix, "0_other-12345678", rid(4, 2, 0) + suffix, rid(4, 2, 1) + suffix]
        got = own_prompt_lens(np.array([30, 25, 41, 41]), ids, own)
        assert got.tolist() == [12, 25, 9, 41], suffix
    assert rid(4, 0, 1) != rid(5, 0, 1)
