"""Typed messages between the driver and the actors (and the error one actor passes up when another
it called has died). Every rollout carries its policy version."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Sampling:
    """How one generate call samples: n samples per prompt, prompt-major."""
    n: int
    temperature: float
    max_tokens: int
    seed: int | None = None   # the call's seed (None: the engine's own generator)
    top_p: float = 1.0
    top_k: int = -1
    rollout: bool = True      # a training rollout (False: validation); only rollouts feed adaptive k

    def request_seed(self, i: int) -> int | None:
        """The seed of the call's i-th prompt: every prompt its own noise (two copies of a prompt
        get different groups), a function of the call's seed and i only (a resumed run draws the
        same)."""
        if self.seed is None:
            return None
        return (self.seed * 0x9E3779B1 + (i + 1) * 0x85EBCA77) % (2**31 - 1)

    @classmethod
    def of(cls, generation, seed: int | None, n: int | None = None, temperature: float | None = None,
           rollout: bool = True) -> "Sampling":
        """The rollout sampling a GenerationConfig sets (n and temperature overridable)."""
        g = generation
        return cls(g.num_generations_per_prompt if n is None else n,
                   g.temperature if temperature is None else temperature, g.max_new_tokens, seed, g.top_p, g.top_k,
                   rollout)


def step_moments(steps: list[tuple[int, float]]) -> list[float]:
    """[count, sum n, sum n^2, sum t, sum n t] over engine steps of n running sequences taking t
    seconds: the sufficient statistics of a least-squares line t = a + b n, additive over calls
    and engines."""
    return [float(len(steps)), float(sum(n for n, _ in steps)), float(sum(n * n for n, _ in steps)),
            sum(t for _, t in steps), sum(n * t for n, t in steps)]


def add_moments(a: list[float] | None, b: list[float] | None) -> list[float] | None:
    return a if b is None else b if a is None else [x + y for x, y in zip(a, b)]


@dataclass
class SpecStats:
    """Speculative-decoding counters over one generate call (differences of vLLM's counters)."""
    drafts: int = 0                   # verification steps that had a draft
    draft_tokens: int = 0             # tokens proposed
    accepted_tokens: int = 0          # proposed tokens the target accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [k] accepted at draft position i

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verification: accepted drafts plus the one the target adds."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    def __sub__(self, other: "SpecStats") -> "SpecStats":
        return self + SpecStats(-other.drafts, -other.draft_tokens, -other.accepted_tokens,
                                [-a for a in other.accepted_per_pos])

    def __add__(self, other: "SpecStats") -> "SpecStats":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
        return SpecStats(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                         self.accepted_tokens + other.accepted_tokens,
                         [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))])


@dataclass
class Answer:
    """One sample of a group under partial rollouts, finished or not: its tokens so far, each with
    the behaviour log-prob and the policy version that sampled it."""
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    truncated: bool = False  # done by the length limit
    resumes: int = 0         # calls that continued it after an abort


@dataclass
class Group:
    """A prompt's G answers as a partial-rollout call takes and returns them (rlspec/loops/partial.py).
    seed: the group's sampling seed (answer j samples with seed + j, as vLLM seeds a request of
    n > 1; a resumed answer with a seed of its own, Group.answer_seed); tag: the driver's name for
    the group (its prompt); carried: how many calls it has been carried out of after starting
    (VLLMEngine.generate_groups runs a group carried generation.partial.max_carries times to the
    end)."""
    prompt_ids: list[int]
    answers: list[Answer]
    seed: int | None
    tag: int
    carried: int = 0  # calls it was started in and carried out of unfinished

    @property
    def done(self) -> bool:
        return all(a.done for a in self.answers)

    def answer_seed(self, j: int) -> int | None:
        """Answer j's seed in the call that samples it now: the group's seed + j the first time
        (what vLLM gives the j-th of n samples), a function of the resume count after that."""
        a = self.answers[j]
        if self.seed is None:
            return None
        return (self.seed + j + a.resumes * 0x9E3779B1) % (2**31 - 1)


def fresh_groups(prompt_ids: list[list[int]], sampling: Sampling, first_tag: int = 0) -> list[Group]:
    """A call's new groups: prompt i's sampling.n answers, none started, seeded as the call seeds
    its i-th prompt (Sampling.request_seed), tagged first_tag + i."""
    return [Group(list(p), [Answer() for _ in range(sampling.n)], sampling.request_seed(i), first_tag + i)
            for i, p in enumerate(prompt_ids)]


@dataclass
class RolloutBatch:
    """Generator output for one request of P prompts x n samples (N = P * n, prompt-major)."""
    prompt_ids: list[list[int]]      # [N][P_i]
    response_ids: list[list[int]]    # [N][R_i]
    logprobs: list[list[float]]      # [N][R_i] behaviour log-probs of the sampled tokens
    truncated: list[bool]            # [N] stopped by the length limit
    policy_version: int              # weights version that sampled every token here
    seconds: float = 0.0             # wall time inside the engine
    spec: SpecStats | None = None    # speculation counters for this call (None: no speculation)
    draft_schedule: list[list[int]] | None = None  # 'auto': [first, last, k] batch-size ranges used
    # step_moments() of the call's decode steps (prefill steps left out): engine step cost vs batch
    decode_moments: list[float] | None = None
    history: dict | None = None      # speculation=history: the drafter's counters (HistoryStats)
    # the call's groups (VLLMEngine.generate_groups; partial rollouts, rlspec/loops/partial.py, carry
    # some): per token, the policy version that sampled it (None: every token policy_version's;
    # policy_version is then the oldest), the rows' groups' tags (one a group) and the groups the
    # call left unfinished, for the next call to resume (a whole call leaves none)
    token_versions: list[list[int]] | None = None
    tags: list[int] | None = None
    carry: list[Group] | None = None
    partial: dict | None = None       # the call's counts (VLLMEngine.generate_groups)
    # [engine steps, rows summed over them] over every step of the call, prefill steps included
    # (a step's rows: the requests running or waiting before it); additive like decode_moments
    step_rows: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.response_ids))

    def select(self, idx: list[int]) -> "RolloutBatch":
        return RolloutBatch([self.prompt_ids[i] for i in idx], [self.response_ids[i] for i in idx],
                            [self.logprobs[i] for i in idx], [self.truncated[i] for i in idx],
                            self.policy_version, self.seconds, self.spec, self.draft_schedule,
                            self.decode_moments, self.history,
                            None if self.token_versions is None else [self.token_versions[i] for i in idx],
                            step_rows=self.step_rows)

    def versions(self) -> list[list[int]]:
        """[N][R_i] the policy version that sampled each token."""
        if self.token_versions is not None:
            return self.token_versions
        return [[self.policy_version] * len(r) for r in self.response_ids]

    @staticmethod
    def concat(parts: list["RolloutBatch"], mixed_versions: bool = False) -> "RolloutBatch":
        """Rows of every part in order. Parts of different policy versions only with
        mixed_versions (dynamic-sampling rounds under async GRPO); the result then carries the
        oldest version, which bounds its lag (behaviour log-probs stay per token)."""
        versions = {p.policy_version for p in parts}
        if len(versions) > 1 and not mixed_versions:
            raise ValueError("cannot concatenate rollouts of different policy versions")
        per_token = any(p.token_versions is not None for p in parts)
        return RolloutBatch(
            [x for p in parts for x in p.prompt_ids], [x for p in parts for x in p.response_ids],
            [x for p in parts for x in p.logprobs], [x for p in parts for x in p.truncated],
            min(versions),  # per-call seconds and spec counters are totalled by the caller
            token_versions=[x for p in parts for x in p.versions()] if per_token else None)


@dataclass
class TrainBatch:
    """Padded tensors for log-prob recompute and the update. T = longest prompt + response - 1;
    position t holds the token predicted from positions <= t (targets are input_ids shifted)."""
    input_ids: torch.Tensor          # [N, T+1] prompt + response, right-padded
    attention_mask: torch.Tensor     # [N, T+1]
    loss_mask: torch.Tensor          # [N, T] 1 on response tokens that carry loss
    advantages: torch.Tensor         # [N]
    behaviour_logprobs: torch.Tensor  # [N, T] from the Generator (0 off the response)
    old_logprobs: torch.Tensor | None = None  # [N, T] recomputed by the LogprobWorker
    ref_logprobs: torch.Tensor | None = None  # [N, T] reference policy, when KL is on
    policy_version: int = 0
    prompt_lengths: torch.Tensor | None = None  # [N] tokens of each row's prompt

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, idx: slice | torch.Tensor, width: int | None = None) -> "TrainBatch":
        """Rows idx, cut to the first `width` input positions (None: all): the padding past the
        longest chosen row is dropped."""
        t_cols = slice(None, None if width is None else width - 1)

        def pick(t, cols=t_cols):
            return None if t is None else t[idx][:, cols]

        return TrainBatch(pick(self.input_ids, slice(width)), pick(self.attention_mask, slice(width)),
                          pick(self.loss_mask), self.advantages[idx], pick(self.behaviour_logprobs),
                          pick(self.old_logprobs), pick(self.ref_logprobs), self.policy_version,
                          None if self.prompt_lengths is None else self.prompt_lengths[idx])

    def to(self, device: torch.device | str) -> "TrainBatch":
        """Every tensor on `device` (a worker moves its batch in once, where it arrives)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TrainBatch(move(self.input_ids), move(self.attention_mask), move(self.loss_mask),
                          move(self.advantages), move(self.behaviour_logprobs), move(self.old_logprobs),
                          move(self.ref_logprobs), self.policy_version, move(self.prompt_lengths))

    def shard(self, rank: int, world: int) -> "TrainBatch":
        return self.rows(slice(rank * len(self) // world, (rank + 1) * len(self) // world))


@dataclass
class MiniBatch:
    """One optimizer step's rows on one learner rank, with its global mini-batch's loss
    denominators (loss-carrying tokens and sequences over all ranks)."""
    batch: TrainBatch
    num_tokens: float
    num_seqs: float
    # Micro-batches every rank runs for this step (0: as many as the rows need).
    micro_batches: int = 0
    # Loss-carrying tokens and sequences of the rows trained, over all ranks, where rows with zero
    # gradient were left out (None: every row is trained): the denominators of the step's metrics.
    trained_tokens: float | None = None
    trained_seqs: float | None = None


@dataclass
class StepRecord:
    """One step's figures, as written to summary.json's `records`."""
    step: int
    policy_version: int
    loss: float
    reward_mean: float
    accuracy: float
    stage_seconds: dict[str, float]
    step_seconds: float
    generated_tokens: int
    tokens_per_second: float
    logprob_mismatch: float
    # Speculation (None without it): tokens per verification, and the raw counters.
    acceptance_length: float | None = None
    spec: dict | None = None  # drafts, drafted_tokens, accepted_tokens, acceptance_per_pos [k]
    # Engine wall time of the step's generate calls, and how much of it the learner waited for
    # (equal in the synchronous loop; async GRPO hides the rest behind training).
    engine_seconds: float = 0.0
    exposed_generation_seconds: float = 0.0
    overlap_fraction: float = 0.0          # 1 - exposed / generation time, >= 0
    policy_lag_max: int = 0                # learner version minus the oldest behaviour version trained on
    stale_groups_dropped: int = 0          # groups past async_grpo.max_policy_lag, never trained on
    # pi_prox / pi_behav over the loss-carrying tokens: mean, max, capped_frac (above the cap).
    importance_weight: dict = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)
    # step_moments() of every engine decode step this step (what `rlspec.sim calibrate` fits the
    # engine's per-sequence cost from)
    decode_step_moments: list[float] | None = None


class PeerDied(RuntimeError):
    """Raised inside an actor whose call to another actor found that one dead (a learner's refit
    reaching a Generator), so the driver names the dead actor rather than the one that noticed."""

    def __init__(self, actor: str, method: str, detail: str):
        super().__init__(actor, method, detail)  # args: what unpickling in the driver rebuilds it from
        self.actor, self.method, self.detail = actor, method, detail

    def __str__(self) -> str:
        return f"{self.actor} died during {self.method}: {self.detail}"


def error_line(e: BaseException) -> str:
    """An exception's type and the line of its message that says the cause."""
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # Ray's messages start with context; the cause is usually the last non-empty line.
    return f"{type(e).__name__}: {lines[-1] if lines else text}"
