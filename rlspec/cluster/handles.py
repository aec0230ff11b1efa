"""Typed handles to the actors of a run. Every call names the worker class's own method
(`Generator.generate`), so an editor follows a call from the loop to the worker; several engines
or workers look like one (their work split and results joined by rlspec/cluster/fanout.py)."""
from __future__ import annotations

from typing import Any, Callable

from rlspec.cluster.calls import Call, fan_out, remote
from rlspec.messages import MiniBatch, Sampling, TrainBatch
from rlspec.workers.draft_trainer import DraftTrainer
from rlspec.workers.generator import Generator
from rlspec.workers.learner import Learner
from rlspec.workers.logprob import LogprobWorker


class Group:
    """Actors of one role. A lone actor is named by its role ("generator"), several by index
    ("generator[1]"), as ActorFailure messages name them."""

    role = ""
    index_always = False  # learner ranks are always named by index

    def __init__(self, handles: list[Any]):
        self.handles = handles

    def __len__(self) -> int:
        return len(self.handles)

    def name(self, i: int) -> str:
        return f"{self.role}[{i}]" if self.index_always or len(self.handles) > 1 else self.role

    def names(self) -> dict[str, Any]:
        return {f"{self.role}[{i}]": h for i, h in enumerate(self.handles)}

    def one(self, i: int, method: Callable, *args) -> Call:
        return remote(self.name(i), self.handles[i], method, *args)

    def each(self, method: Callable, *args) -> list[Call]:
        """The same call on every actor of the role (empty when none runs)."""
        return [self.one(i, method, *args) for i in range(len(self.handles))]

    def all(self, method: Callable, *args) -> list[Call]:
        """The same call on every actor, as one Call whose result is the first actor's (a list
        to wait on with others: empty when none runs)."""
        parts = self.each(method, *args)
        if len(parts) <= 1:
            return parts
        return [fan_out(self.role, method.__name__, parts, lambda rs: rs[0])]


class Generators(Group):
    role = "generator"

    def __init__(self, handles: list[Any], sticky: bool = False):
        super().__init__(handles)
        self.sticky = sticky  # speculation=history: a prompt always goes to the same engine

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Call:
        """Rollouts of every prompt, rows in prompt order: a call of new groups that needs them all
        (generate_groups)."""
        from rlspec.messages import fresh_groups

        return self.generate_groups(fresh_groups(prompt_ids, sampling), sampling, None, None)

    def generate_groups(self, groups: list, sampling: Sampling, needed: int | None,
                        max_carry_versions: int | None, start: int | None = None,
                        max_carries: int | None = None) -> Call:
        """Every generate call (Generator.generate_groups): the groups spread over the engines (by
        prompt under history), each engine needing its share of `needed` and starting its share of
        `start` at once; results in engine order, or with `needed` None (every group returned) in
        the order of `groups`."""
        method = Generator.generate_groups
        if len(self.handles) == 1:
            return self.one(0, method, groups, sampling, needed, max_carry_versions, start, max_carries)
        from rlspec.cluster import fanout

        E = len(self.handles)
        routes = (fanout.by_prompt([g.prompt_ids for g in groups], E) if self.sticky
                  else [list(range(lo, hi)) for lo, hi in fanout.split(len(groups), E)])
        used = [(e, r) for e, r in enumerate(routes) if r]
        sizes = [len(r) for _, r in used]
        starts = fanout.shares(start, sizes)
        parts = [self.one(e, method, [groups[i] for i in r], sampling, k, max_carry_versions, s, max_carries)
                 for (e, r), k, s in zip(used, fanout.shares(needed, sizes), starts)]
        order = [g.tag for g in groups] if needed is None else None
        return fan_out(self.role, method.__name__, parts, lambda ros: fanout.merge_groups(ros, order))

    def ping(self) -> list[Call]:
        return self.all(Generator.ping)

    def runner_info(self) -> list[Call]:
        """Every engine's model runner, async scheduling and CUDA graphs, in engine order."""
        return self.each(Generator.runner_info)

    def save_history(self, ckpt_dir: str) -> list[Call]:
        """speculation=history: every engine's store to ckpt_dir/history_E.pt."""
        return [self.one(e, Generator.save_history, f"{ckpt_dir}/history_{e}.pt") for e in range(len(self))]

    def load_history(self, ckpt_dir: str) -> list[Call]:
        """Engine E takes history_E.pt; with another engine count than at the save, prompts route
        elsewhere, so every engine takes every store."""
        from pathlib import Path

        saved = sorted(Path(ckpt_dir).glob("history_*.pt"))
        if not saved:
            return []
        if len(saved) == len(self):
            return [self.one(e, Generator.load_history, [f"{ckpt_dir}/history_{e}.pt"]) for e in range(len(self))]
        return self.each(Generator.load_history, [str(p) for p in saved])


class LogprobWorkers(Group):
    role = "logprob_worker"

    def compute_logprobs(self, batch: TrainBatch) -> Call:
        """([N, T] current, [N, T] reference or None), the rows spread over the workers."""
        if len(self.handles) == 1:
            return self.one(0, LogprobWorker.compute_logprobs, batch)
        from rlspec.cluster import fanout

        parts = [self.one(r, LogprobWorker.compute_logprobs, batch.shard(r, len(self.handles)))
                 for r in range(len(self.handles))]
        return fan_out(self.role, LogprobWorker.compute_logprobs.__name__, parts, fanout.merge_logprobs)

    def take_features(self) -> list[Any]:
        """Refs to every worker's draft features of its last recompute (they go to the
        DraftTrainer through the object store, not through the driver)."""
        return [h.take_features.remote() for h in self.handles]

    def save_reference(self, path: str) -> list[Call]:
        """The KL reference policy (the same on every worker: worker 0 writes it)."""
        return [self.one(0, LogprobWorker.save_reference, path)] if self.handles else []

    def load_reference(self, path: str) -> list[Call]:
        return self.all(LogprobWorker.load_reference, path)

    def ping(self) -> list[Call]:
        return self.all(LogprobWorker.ping)


class Learners(Group):
    role = "learner"
    index_always = True

    def train_step(self, parts: list[list[MiniBatch]], epochs: int = 1) -> list[Call]:
        """Rank r takes one optimizer step per mini-batch of parts[r] (its rows of each), epochs times."""
        return [self.one(r, Learner.train_step, parts[r], epochs) for r in range(len(self.handles))]

    def full_weights(self, dtype: str = "float32") -> list[Call]:
        return self.each(Learner.full_weights, dtype)

    def save_checkpoint(self, path: str) -> list[Call]:
        return self.each(Learner.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> list[Call]:
        return self.each(Learner.load_checkpoint, path)

    def save_pretrained(self, path: str, tokenizer_dir: str) -> list[Call]:
        return self.each(Learner.save_pretrained, path, tokenizer_dir)

    def ping(self) -> list[Call]:
        return self.each(Learner.ping)



class DraftTrainerHandle(Group):
    role = "draft_trainer"

    def update(self, n_steps: int, features: list[Any]) -> Call:
        return self.one(0, DraftTrainer.update, n_steps, *features)

    def weights(self) -> Call:
        return self.one(0, DraftTrainer.weights)

    def save(self, path: str) -> Call:
        return self.one(0, DraftTrainer.save, path)

    def load(self, path: str) -> Call:
        return self.one(0, DraftTrainer.load, path)
