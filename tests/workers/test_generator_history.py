"""A history run's store through the Generator's checkpoint calls (save_history / load_history), as
`trainer.resume` restores it: a Generator actor on the tiny policy."""
import pytest

from conftest import heldout_prompts, sampling, start_generator


def call(method, *args):
    import ray
    return ray.get(method.remote(*args), timeout=600)


def test_merged_states_keep_their_format_version_and_admission_limit():
    from rlspec.speculation.history.state import merge_states

    a = {"version": 2, "admit_below": "5", "prompts": [["1", []]]}
    b = {"version": 2, "admit_below": str(1 << 63), "prompts": [["2", []]]}
    assert merge_states([a, b]) == {"version": 2, "admit_below": str(1 << 63), "prompts": [["1", []], ["2", []]]}
    with pytest.raises(ValueError, match="different format versions"):
        merge_states([a, {"prompts": []}])


@pytest.fixture(scope="module")
def gen(ray_session):
    import ray

    actor = start_generator(["speculation=history"])
    yield actor
    ray.kill(actor)


def test_a_calls_seconds_cover_the_drafters_work_around_the_engine(gen, tokenizer):
    """A batch's seconds (step records' engine_seconds and tokens/s, bench_rollout's tokens/s) are
    the whole call's: the drafter's end-of-call work, made to take 2 s here, is in them."""
    import ray

    def slow_finish_call(g, seconds: float) -> None:  # in the actor (nested: Ray pickles it by value)
        import time

        from rlspec.speculation.history.host import proposer as history_proposer

        finish = getattr(history_proposer.finish_call, "unslowed", history_proposer.finish_call)
        slowed = lambda *args, **kwargs: time.sleep(seconds) or finish(*args, **kwargs)  # noqa: E731
        slowed.unslowed = finish
        history_proposer.finish_call = slowed if seconds else finish

    prompts = heldout_prompts(tokenizer, 2)
    ray.get(gen.__ray_call__.remote(slow_finish_call, 2.0), timeout=60)
    ro = call(gen.generate, prompts, sampling(1, 0.0, 8))
    assert ro.seconds >= 2.0, ro.seconds
    ray.get(gen.__ray_call__.remote(slow_finish_call, 0.0), timeout=60)


def test_a_history_run_resumed_from_its_saved_store_drafts_as_before(gen, tokenizer, tmp_path):
    """An epoch of sampled rollouts becomes history and is saved; a greedy training call drafts from
    it (and joins it); the saved store loaded back, the same call drafts the same tokens again."""
    prompts = heldout_prompts(tokenizer, 8)
    call(gen.generate, prompts, sampling(4, 1.0, 48, seed=1))
    saved = str(tmp_path / "history_0.pt")
    call(gen.save_history, saved)
    first = call(gen.generate, prompts, sampling(1, 0.0, 48))
    call(gen.load_history, [saved])
    again = call(gen.generate, prompts, sampling(1, 0.0, 48))
    assert first.spec.accepted_tokens > 0, first.spec
    assert again.response_ids == first.response_ids
    assert (again.spec.drafts, again.spec.draft_tokens, again.spec.accepted_per_pos) == \
        (first.spec.drafts, first.spec.draft_tokens, first.spec.accepted_per_pos)
