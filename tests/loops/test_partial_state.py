"""The carried groups as a checkpoint stores them (rlspec/loops/partial.py), without an engine."""
import pytest

from rlspec.data.loading import Prompt, PromptSampler, PromptSet
from rlspec.loops.partial import PartialRollouts
from rlspec.messages import Answer, Group, RolloutBatch, Sampling


def carrier(n_prompts=10):
    prompts = [Prompt(str(i), str(i), [i, i + 1], i + 1) for i in range(n_prompts)]
    return PartialRollouts(PromptSampler(PromptSet("t", prompts), seed=1), prompts, groups_per_step=2,
                           group_size=2, over_provision=1.5, max_carry_versions=1)


def test_carried_groups_round_trip_through_the_data_position_and_plain_runs_refuse_them():
    part = carrier()
    groups = part.groups(part.draw(), Sampling(2, 1.0, 8, seed=4))
    assert len(groups) == 3 and [g.tag for g in groups] == [0, 1, 2]
    groups[2].answers[0] = Answer([5, 6], [-0.1, -0.2], [0, 0], resumes=1)
    done = RolloutBatch([g.prompt_ids for g in groups[:2] for _ in range(2)], [[1]] * 4, [[-0.1]] * 4, [False] * 4, 0,
                        tags=[0, 1], carry=[groups[2]], partial={"dropped_answers": 0, "resumed_answers": 0})
    assert [p.answer for p in part.returned(done)] == [str(groups[0].prompt_ids[0]), str(groups[1].prompt_ids[0])]
    state = part.state()
    again = carrier()
    again.load_state(state)
    assert again.carry == part.carry and again.owner == {2: part.owner[2]} and again.next_tag == 3
    assert again.sampler.state() == part.sampler.state()
    assert len(again.draw()) == 2  # one group carried: two new prompts fill the call to three
    with pytest.raises(ValueError, match="generation.partial.enabled=true"):
        PromptSampler(part.sampler.prompts, seed=1).load_state(state)
    with pytest.raises(ValueError, match="generation.partial.enabled=false"):
        carrier().load_state(part.sampler.state())
    assert Group([1], [Answer()], None, 0).answer_seed(0) is None
    assert groups[2].answer_seed(0) != groups[2].answer_seed(1) == groups[2].seed + 1
