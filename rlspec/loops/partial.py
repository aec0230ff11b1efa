"""Partial rollouts (generation.partial): a step's generate call holds more groups than the step
trains on and returns as soon as the step's groups are complete, so no step waits for its longest
answer (APRIL, arXiv 2509.18521). The unfinished groups are carried to the next call, which resumes
them first with the weights it has (VLLMEngine.generate_groups); their tokens keep the behaviour
log-prob and policy version that sampled them, so the learner's off-policy correction (TIS /
behaviour PPO, per token) applies to each token as sampled.

    call s:    carried groups of call s-1 + new prompts up to over_provision x P groups
               -> the first P groups to complete (trained at step s), the rest carried

With refill, the call also holds P - 1 spare groups (new prompts, or spares of call s-1 never
started), one started each time a group completes before the P-th: the batch stays at
over_provision x P groups until the call returns, instead of thinning as groups complete. A spare
never started is carried as it was (no tokens), first in line for the next call.

Every group is trained once or still carried; an answer is never trained twice. An answer whose
oldest token trails the resuming weights by more than max_carry_versions is started again and
counted. A group carried out of max_carries calls is run to its end by the next and trained
there, so no group (the long answers the feature is for) is carried for ever. The carried groups
(with the prompts they belong to) are part of the data position a checkpoint saves, so a resumed
run continues them exactly.
"""
from __future__ import annotations

import math
from dataclasses import asdict, replace

from rlspec.data.loading import Prompt, PromptSampler
from rlspec.messages import Answer, Group, RolloutBatch, Sampling, fresh_groups


def groups_in_flight(groups_per_step: int, over_provision: float) -> int:
    """The groups a generate call holds at its start: over_provision x the step's, never fewer
    (the simulator's rollout_partial holds as many per engine)."""
    return max(groups_per_step, math.ceil(groups_per_step * over_provision))


class PartialRollouts:
    """The carried groups between a run's generate calls, and the prompts they belong to."""

    def __init__(self, sampler: PromptSampler, prompts: list[Prompt], groups_per_step: int, group_size: int,
                 over_provision: float, max_carry_versions: int, refill: bool = False, max_carries: int | None = None):
        self.sampler, self.prompts = sampler, prompts
        self.index = {id(p): i for i, p in enumerate(prompts)}
        self.P, self.G = groups_per_step, group_size
        self.in_flight = groups_in_flight(groups_per_step, over_provision)
        # refill: the groups a call starts at once (VLLMEngine.generate_groups' start), P - 1 spares
        # beside them; None: every group at once
        self.start = self.in_flight if refill else None
        self.spares = groups_per_step - 1 if refill else 0
        self.max_carry_versions, self.max_carries = max_carry_versions, max_carries
        self.carry: list[Group] = []
        self.owner: dict[int, int] = {}  # a carried group's tag -> its prompt's index in `prompts`
        self.next_tag = 0
        self.totals = {"dropped_answers": 0, "resumed_answers": 0, "forced_groups": 0}  # over the run

    def groups(self, fresh: list[Prompt], sampling: Sampling) -> list[Group]:
        """The call's groups: every carried one, then one for each prompt of `fresh` (seeded by
        its position in the call, as a whole call seeds prompt i)."""
        new = fresh_groups([p.token_ids for p in fresh], replace(sampling, n=self.G), first_tag=self.next_tag)
        for g, p in zip(new, fresh):
            self.owner[g.tag] = self.index[id(p)]
        self.next_tag += len(new)
        return self.carry + new

    def draw(self) -> list[Prompt]:
        """New prompts for the next call: enough to hold over_provision x P groups (and the spares)
        beside the carried."""
        return self.sampler.next_batch(max(0, self.in_flight + self.spares - len(self.carry)))

    def returned(self, ro: RolloutBatch) -> list[Prompt]:
        """The prompts of the groups `ro` completed (in its row order); its unfinished groups are
        carried from here."""
        prompts = [self.prompts[self.owner.pop(t)] for t in ro.tags]
        self.carry = list(ro.carry)
        for k in self.totals:
            self.totals[k] += ro.partial.get(k, 0)
        return prompts

    # -- checkpoint: the data position ----------------------------------------------------------------
    def state(self) -> dict:
        """The sampler's position with the carried groups (PromptSampler.load_state reads its own
        keys only)."""
        return {**self.sampler.state(), "partial": {
            "carry": [asdict(g) for g in self.carry], "owner": dict(self.owner), "next_tag": self.next_tag,
            "totals": dict(self.totals)}}

    def load_state(self, state: dict) -> None:
        part = state.get("partial")
        self.sampler.load_state({k: v for k, v in state.items() if k != "partial"})
        if part is None:
            raise ValueError("the checkpoint was saved without partial rollouts (generation.partial.enabled=false); "
                             "resume it with the setting it was saved with")
        self.carry = [Group(g["prompt_ids"], [Answer(**a) for a in g["answers"]], g["seed"], g["tag"],
                            g.get("carried", 0)) for g in part["carry"]]
        self.owner = {int(k): v for k, v in part["owner"].items()}
        self.next_tag, self.totals = part["next_tag"], {**dict.fromkeys(self.totals, 0), **part["totals"]}
