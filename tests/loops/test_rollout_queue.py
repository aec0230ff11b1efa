"""RolloutQueue on its own: the queue against a stand-in Generator (a real Ray actor that records
the order its calls arrive in and answers with the policy version it holds), so submission order,
policy lag, stale batches and a dying Generator are checked without vLLM or a learner."""
from types import SimpleNamespace

import pytest
import ray

from conftest import compose
from rlspec.cluster.calls import ActorFailure, Call
from rlspec.data.loading import Prompt, PromptSampler, PromptSet
from rlspec.loops.preemption import StopRequest
from rlspec.loops.queue import RolloutQueue
from rlspec.loops.runlog import StageTimer

PROMPTS = 2  # per step


@ray.remote(num_cpus=0)
class StandInGenerator:
    """Calls in arrival order; `generate` answers with the version of the last refit."""

    def __init__(self, fail_at: int | None = None):
        self.version, self.log, self.fail_at = 0, [], fail_at

    def generate(self, token_ids, sampling):
        self.log.append(("generate", token_ids[0][0]))
        if self.fail_at is not None and len([e for e in self.log if e[0] == "generate"]) == self.fail_at:
            raise RuntimeError("engine died")
        return SimpleNamespace(policy_version=self.version)

    def refit(self, version: int):
        self.log.append(("refit", version))
        self.version = version

    def calls(self):
        return self.log


class Generators:
    """The handle the loop calls (`run.actors.generators`), over the stand-in."""

    def __init__(self, actor):
        self.actor = actor

    def generate(self, token_ids, sampling) -> Call:
        return Call("generator", "generate", self.actor.generate.remote(token_ids, sampling))

    def refit(self, version: int) -> Call:
        return Call("generator", "refit", self.actor.refit.remote(version))


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def queue_of(lag: int, capacity: int | None, steps: int, fail_at: int | None = None, first_step: int = 1,
             position: dict | None = None, queued: list[dict] = ()):
    cfg = compose([f"async_grpo.max_policy_lag={lag}", f"trainer.max_steps={steps}",
                   f"generation.num_prompts_per_step={PROMPTS}"])
    cfg.async_grpo.queue_capacity = capacity
    gens = Generators(StandInGenerator.remote(fail_at))
    messages = []
    run = SimpleNamespace(cfg=cfg, stop=StopRequest(), log=SimpleNamespace(write=messages.append),
                          actors=SimpleNamespace(generators=gens, timeout_s=60.0,
                                                 refit=SimpleNamespace(collective=False)))
    # prompt i's first token is i: the stand-in logs which batch each generate call carried
    prompts = PromptSet("stand-in", [Prompt(str(i), "0", [i, 1, 2], i + 1) for i in range(100)])
    sampler = PromptSampler(prompts, seed=0, shuffle=False)
    if position is not None:   # resumed: the restore's refit puts the checkpoint's policy in first
        sampler.load_state(position)
        ray.get(gens.actor.refit.remote(first_step - 1))
    return RolloutQueue(run, sampler, first_step=first_step, queued=queued), gens, messages


def run_steps(queue: RolloutQueue, gens: Generators, steps: int, first: int = 1) -> list[tuple[int, int, int]]:
    """(step, policy version of its batch, stale groups dropped) for each step, refitting the
    Generator to version `step` after each, as the loop does."""
    out = []
    for step in range(first, steps + 1):
        _, ro, dropped = queue.take(step, StageTimer())
        out.append((step, ro.policy_version, dropped))
        queue.refit([gens.refit(step)], [])
    queue.drain()
    return out


def test_each_batch_is_max_policy_lag_versions_old_and_calls_arrive_in_the_loops_order(local_ray):
    queue, gens, _ = queue_of(lag=1, capacity=None, steps=5)
    got = run_steps(queue, gens, 5)
    # step s trains on the batch version s - 2 sampled (the first step: version 0)
    assert got == [(1, 0, 0), (2, 0, 0), (3, 1, 0), (4, 2, 0), (5, 3, 0)]
    # gen(s+2) is submitted right after refit(s): it samples version s; prompts in order, 2 a step
    assert ray.get(gens.actor.calls.remote()) == [
        ("generate", 0), ("generate", 2), ("refit", 1), ("generate", 4), ("refit", 2), ("generate", 6),
        ("refit", 3), ("generate", 8), ("refit", 4), ("refit", 5)]
    assert queue.stale_groups == 0


def test_lag_zero_is_the_synchronous_order(local_ray):
    queue, gens, _ = queue_of(lag=0, capacity=None, steps=3)
    assert run_steps(queue, gens, 3) == [(1, 0, 0), (2, 1, 0), (3, 2, 0)]
    assert ray.get(gens.actor.calls.remote()) == [
        ("generate", 0), ("refit", 1), ("generate", 2), ("refit", 2), ("generate", 4), ("refit", 3)]


def test_a_queue_deeper_than_the_lag_regenerates_a_stale_batch_with_its_prompts(local_ray):
    queue, gens, messages = queue_of(lag=1, capacity=3, steps=4)
    assert queue.state() == {"epoch": 0, "cursor": 0, "seed": 0, "size": 100}
    got = run_steps(queue, gens, 4)
    # gen(3) went out with gen(1) and gen(2), before any refit: version 0 is 2 versions old at
    # step 3, so its 2 groups are dropped and the same prompts sampled again by version 2
    assert got[2] == (3, 2, PROMPTS) and queue.stale_groups == PROMPTS + got[3][2]
    calls = ray.get(gens.actor.calls.remote())
    assert calls[:3] == [("generate", 0), ("generate", 2), ("generate", 4)]
    assert calls.count(("generate", 4)) == 2  # regenerated, not replaced by new prompts
    assert any("2 versions old" in m and "regenerate 2 groups" in m for m in messages)


def test_a_generator_that_raises_surfaces_on_the_next_take_naming_it(local_ray):
    queue, gens, _ = queue_of(lag=1, capacity=None, steps=4, fail_at=2)
    queue.take(1, StageTimer())
    queue.refit([gens.refit(1)], [])
    with pytest.raises(ActorFailure, match=r"generator raised in generate: .*engine died"):
        queue.take(2, StageTimer())


def test_a_checkpoint_keeps_the_calls_out_and_a_queue_resumed_from_it_continues_in_order(local_ray):
    """Lag 1: the checkpoint after step 2 (taken after the refit, before the next call goes out)
    waits for step 3's call, already out, and keeps its result with the data position after it. A
    queue resumed from it (a Generator at version 2, as the restore's refit leaves it) trains step 3
    on that result, sends no call for it, and submits the uninterrupted run's next calls in its
    order: the same prompts, sampled by the same versions."""
    whole, gens, _ = queue_of(lag=1, capacity=None, steps=5)
    want = run_steps(whole, gens, 5)
    want_calls = ray.get(gens.actor.calls.remote())

    queue, gens, _ = queue_of(lag=1, capacity=None, steps=5)
    for step in (1, 2):
        queue.take(step, StageTimer())
        queue.refit([gens.refit(step)], [], fill=step != 2)
    position, queued = queue.checkpoint()
    assert [q["step"] for q in queued] == [3] and queued[0]["rollouts"].policy_version == 1
    assert position["cursor"] == 3 * PROMPTS   # after step 3's prompts
    done = ray.get(gens.actor.calls.remote())

    with pytest.raises(ValueError, match=r"queued rollouts are of steps \[3\], the run resumes at step 4"):
        queue_of(lag=1, capacity=None, steps=5, first_step=4, position=position, queued=queued)
    resumed, gens, _ = queue_of(lag=1, capacity=None, steps=5, first_step=3, position=position, queued=queued)
    assert run_steps(resumed, gens, 5, first=3) == want[2:]
    # the resumed Generator's calls are the rest of the uninterrupted run's (less the restore's refit)
    assert done + ray.get(gens.actor.calls.remote())[1:] == want_calls
