"""Adaptive draft length (`speculation.num_speculative_tokens=auto`).

Speculation pays when the tokens one verification emits outweigh what drafting k tokens and
verifying k+1 cost, and both sides move: acceptance drifts with the policy, and the cost of a step
depends on how many sequences are still running (a rollout batch shrinks as sequences finish).
So k is chosen per batch-size bucket, from two measured things:
- step costs t(B, k): seconds of one engine step with B running sequences drafting k tokens
  (k=0: the draft still reads the new tokens to keep its KV cache in step; OFF: no draft at all),
  timed on the engine itself at start (`calibrate` in the Generator: round-robin over k,
  median per (B, k), made non-decreasing in k), plus a per-bucket offset measured on every call's
  own decode steps (`observe_steps`); or given (`speculation.auto_step_costs`, load_step_costs),
  then used as they are;
- acceptance: the conditional probability a_i that draft position i is accepted given the ones
  before it were, from vLLM's per-position counters after every generate call (accepted over
  reached, counts of earlier calls decayed).
Expected tokens per verification with k drafts: L(k) = 1 + sum_{i<k} prod_{j<=i} a_j; the planner
picks argmax_k L(k) / t(B, k) per bucket, and switches speculation off for a whole call when it
predicts no speculation to be faster (a prediction from measured costs and acceptance, not a
guarantee: the benchmarks page reports how close it lands; on Model Runner V2, OFF is k=0).
Whether a mixed schedule beats OFF for a whole call is judged on the previous call's batch-size
trajectory (how many sequences were still running at each token index): a k=0 bucket still pays
the draft's forward, OFF does not. Probing measures the positions the plan would not reach: the
first call drafts, per bucket, the longest k whose step costs at most `probe_max_cost` times a step
without drafting; later probes (every `probe_every`-th training call, and every training call while
some position was never measured) draft, in the buckets that speculate, the longest k whose step
costs at most `probe_max_cost` times the planned k's. A probing step thus costs at most that factor
times a step that emits at least as many tokens as no speculation's (predicted from measured
costs). Only training rollouts feed the estimates (not validation calls, whose lengths and
temperature differ).

A drafter that drafts per request (speculation=history: nothing where nothing matches, fewer than
k tokens where its history stops agreeing) is planned per request row instead of per draft: a_i
is measured over every row asked for a draft (a row that drafted nothing accepted nothing), and
the fill scales the verification part of a step's cost: with g_i the share of rows drafting
position i among those that drafted position i-1 (measured like a_i), a row drafts
D(k) = sum_{i<k} prod_{j<=i} g_j tokens on average, and a step costs
t(B, 0) + D(k) / k (t(B, k) - t(B, 0)), t(B, k) being timed with every row drafting k tokens. A
model drafter always drafts k: D(k) = k and the cost is t(B, k). Calls that drafted nothing are
measured in shadow (rlspec/speculation/history/stats.py: replay_in_shadow).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

OFF = -1  # speculation off for the call: no draft forward at all


@dataclass
class DraftPlan:
    off: bool                                  # the whole call runs without speculation
    k_by_bucket: dict[int, int]                # bucket batch size -> k (0 .. k_max)
    schedule: list[tuple[int, int, int]]       # vLLM's (first, last, k) batch-size ranges

    def k_at(self, batch_size: int) -> int:
        if self.off:
            return 0
        for lo, hi, k in self.schedule:
            if lo <= batch_size <= hi:
                return k
        return self.schedule[-1][2]


def expected_tokens(accept: list[float], k: int) -> float:
    """L(k): tokens one verification emits with k drafts, given conditional acceptances a_i."""
    total, run = 1.0, 1.0
    for a in accept[:k]:
        run *= a
        total += run
    return total


def non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of a sequence (pool adjacent violators): measured
    step costs ordered by draft length, where timing noise made a longer draft look cheaper."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def bucket_ranges(buckets: list[int], max_batch: int) -> list[tuple[int, int, int]]:
    """(first, last, bucket): each batch size goes to the bucket nearest in log scale."""
    bs = sorted(buckets)
    out, lo = [], 1
    for i, b in enumerate(bs):
        hi = max_batch if i == len(bs) - 1 else int(math.sqrt(b * bs[i + 1]))
        hi = max(hi, lo)
        out.append((lo, hi, b))
        lo = hi + 1
        if lo > max_batch:
            break
    return out


@dataclass
class DraftLengthPlanner:
    k_max: int
    max_batch: int
    step_seconds: dict[tuple[int, int], float]   # (bucket, k or OFF) -> seconds per engine step
    accept: list[float] = field(default_factory=list)  # [k_max] conditional acceptance a_i
    decay: float = 0.9   # weight left on earlier counts each time a position or cost is measured again
    probe_max_cost: float = 1.5  # a probing step costs at most this x the step it replaces (OFF, or the planned k)
    counts: list[list[float]] = field(default_factory=list, repr=False)  # per position: [accepted, reached]
    # per position: the share of rows drafting it among those that drafted the one before (empty:
    # every row drafts k), as a_i is for acceptance
    fill: list[float] = field(default_factory=list)
    fill_counts: list[list[float]] = field(default_factory=list, repr=False)  # per position: [drafted, reached]
    calibrated: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)  # step costs as timed
    cost_counts: dict[int, list[float]] = field(default_factory=dict, repr=False)  # bucket: [sum offset, n]
    # a drafter that runs outside the timed engine work (speculation=history: its lookups), as calls
    # measure it: (log2 batch bin, k) -> [steps, seconds], earlier calls decayed; charged to drafting
    # modes only (k >= 0), never to OFF, whose steps never call it
    drafter: dict[tuple[int, int], list[float]] = field(default_factory=dict, repr=False)
    fixed: bool = False   # step costs given (speculation.auto_step_costs): used as they are

    def __post_init__(self):
        self.calibrated = dict(self.step_seconds)

    @property
    def buckets(self) -> list[int]:
        return sorted({b for b, _ in self.step_seconds})

    def bucket_of(self) -> dict[int, int]:
        """Every batch size up to max_batch -> the bucket whose costs it takes."""
        return {n: b for lo, hi, b in bucket_ranges(self.buckets, self.max_batch) for n in range(lo, hi + 1)}

    def cost(self, bucket: int, k: int, table: dict[tuple[int, int], float] | None = None,
             lookup: bool = True) -> float:
        """Seconds of a step at this bucket with k drafts (or OFF): the timed cost with every row
        drafting k, its verification part scaled by D(k)/k (positions not yet measured count as
        filled), plus the drafter's own time where it runs outside the timed work."""
        table = self.step_seconds if table is None else table
        t = table[(bucket, k)]
        if k == OFF:
            return t
        lookup = self.drafter_seconds(bucket, k) if lookup else 0.0
        if k == 0 or not self.fill:
            return t + lookup
        drafted, run = 0.0, 1.0
        for i in range(k):
            run *= self.fill[i] if self.fill_counts[i][1] > 0 else 1.0
            drafted += run
        base = table[(bucket, 0)]
        return base + drafted / k * (t - base) + lookup

    def drafter_seconds(self, batch: int, k: int) -> float:
        """The drafter's measured seconds per step at this batch size and k: its (bin, k) cell, else
        the bin's mean over k, else the per-row mean of every measurement times the batch (0 before
        any call measured it)."""
        if not self.drafter:
            return 0.0
        b = max(batch, 1).bit_length() - 1
        cell = self.drafter.get((b, k))
        if cell and cell[0] > 0:
            return cell[1] / cell[0]
        same = [c for (bb, _), c in self.drafter.items() if bb == b and c[0] > 0]
        if same:
            return sum(c[1] for c in same) / sum(c[0] for c in same)
        rows = sum(c[0] * (1 << bb) * 1.5 for (bb, _), c in self.drafter.items())
        return batch * sum(c[1] for c in self.drafter.values()) / rows if rows else 0.0

    def observe_drafter(self, timing: list[list]) -> None:
        """One call's drafter timing, [bin, k, steps, seconds] per cell (HistoryStats.propose_timing)."""
        if self.fixed:
            return
        touched = {(int(b), int(k)) for b, k, _, _ in timing}
        for key in touched:
            c = self.drafter.setdefault(key, [0.0, 0.0])
            c[0], c[1] = self.decay * c[0], self.decay * c[1]
        for b, k, steps, seconds in timing:
            c = self.drafter[(int(b), int(k))]
            c[0] += steps
            c[1] += seconds

    def tokens_per_second(self, bucket: int, k: int) -> float:
        """Per-sequence emitted tokens per second at this bucket with k drafts (or OFF)."""
        t = self.cost(bucket, k)
        return (1.0 if k == OFF else expected_tokens(self.accept, k)) / t

    def plan(self, lengths: list[int] | None = None, probe: bool = False) -> DraftPlan:
        """k per bucket; OFF for the call when it is predicted faster over `lengths` (the last
        call's response lengths) or, without them, when no bucket beats OFF.

        Probing measures acceptance at draft positions the plan alone would not reach, at a bounded
        cost: before anything is measured, every bucket drafts the largest k whose step costs at
        most probe_max_cost x a step without drafting (none where even k=1 costs more; the call
        runs OFF if that holds everywhere). With probe=True, every bucket that speculates drafts
        the largest k whose step costs at most probe_max_cost x its planned k's step. Either way a
        probing step costs at most probe_max_cost x a step that emits no fewer tokens than no
        speculation's, as predicted from the measured costs."""
        first = not self.accept
        best, probing = {}, {}
        for b in self.buckets:
            rates = {k: self.tokens_per_second(b, k) for k in range(self.k_max + 1) if (b, k) in self.step_seconds}
            best[b] = max(rates, key=rates.get)
            if first:
                probing[b] = self.probe_k(b, OFF, 0)
            elif probe and best[b] > 0 and best_is_spec(rates, self, b):
                probing[b] = self.probe_k(b, best[b], best[b])
        ranges = bucket_ranges(self.buckets, self.max_batch)
        plan = DraftPlan(off=False, k_by_bucket=best, schedule=[(lo, hi, best[b]) for lo, hi, b in ranges])
        # whether to speculate at all is judged on the plan itself, never on its probing variant
        # (whose deeper positions are unmeasured, so it always looks slower)
        if first:
            plan.off = all(k == 0 for k in probing.values())  # drafting costs too much everywhere
        elif lengths:
            plan.off = self.call_seconds(plan, lengths) >= self.call_seconds(None, lengths)
        else:
            plan.off = all(self.tokens_per_second(b, best[b]) <= self.tokens_per_second(b, OFF) for b in self.buckets)
        if probing and not plan.off:
            best = {**best, **probing}
            plan = DraftPlan(off=False, k_by_bucket=best, schedule=[(lo, hi, best[b]) for lo, hi, b in ranges])
        return plan

    def probe_k(self, bucket: int, base: int, floor: int) -> int:
        """The largest k >= max(floor, 1) whose step costs at most probe_max_cost x the step at
        `base` (a k, or OFF); floor when there is none."""
        limit = self.probe_max_cost * self.cost(bucket, base)
        ks = [k for k in range(max(floor, 1), self.k_max + 1)
              if (bucket, k) in self.step_seconds and self.cost(bucket, k) <= limit]
        return max(ks, default=floor)

    def unmeasured(self) -> bool:
        """Some draft position has never been reached by a measured draft (probing continues on
        every training call until each is, or none is affordable)."""
        return not self.counts or any(c[1] <= 0 for c in self.counts)

    def call_seconds(self, plan: DraftPlan | None, lengths: list[int]) -> float:
        """Predicted engine seconds to generate responses of these lengths (plan None: OFF).
        Sequences advance L(k) tokens per step; a step's batch is those not yet finished."""
        bucket_of = self.bucket_of()
        total = 0.0
        for t in range(max(lengths, default=0)):
            running = min(sum(1 for n in lengths if n > t), self.max_batch)
            b = bucket_of[running]
            k = OFF if plan is None else plan.k_at(running)
            total += self.cost(b, k) / (1.0 if k == OFF else expected_tokens(self.accept, k))
        return total

    def observe(self, drafts: int, accepted_per_pos: list[int], k_min: int,
                drafted_per_pos: list[int] | None = None, fresh: bool = True) -> None:
        """Update a_i from one call's counters. Only positions every draft of the call covered
        (i < k_min, the smallest k > 0 the call's schedule used) are measured without bias. a_i is
        accepted over reached, both counted with earlier calls' counts decayed: a call of a few
        drafts (batch 1, or the probe that alone measures the last positions) moves it by what it
        measured, not as much as a call of thousands. A per-request drafter passes the rows it was
        asked for as `drafts` and, per position, how many of them drafted it (the fill g_i is taken
        over those that drafted the position before, as a_i over those accepted). fresh=False
        adds a second measurement of the same call (earlier counts are not decayed again)."""
        if drafts <= 0 or k_min <= 0:
            return
        decay = self.decay if fresh else 1.0
        if drafted_per_pos is not None:
            if not self.fill_counts:
                self.fill_counts = [[0.0, 0.0] for _ in range(self.k_max)]
                self.fill = [1.0] * self.k_max
            self._count(self.fill_counts, self.fill, drafts, drafted_per_pos, k_min, decay)
        if not self.accept:
            self.accept = [0.0] * self.k_max
        if not self.counts:
            self.counts = [[0.0, 0.0] for _ in range(self.k_max)]
        self._count(self.counts, self.accept, drafts, accepted_per_pos, k_min, decay)

    def _count(self, counts: list[list[float]], ratios: list[float], first: float, per_pos: list[float],
               k_min: int, decay: float) -> None:
        """Conditional shares per position: per_pos[i] over per_pos[i-1] (over `first` at i=0),
        both added to counts decayed by `decay`, for the positions i < k_min."""
        reached = first
        for i in range(min(k_min, len(per_pos), self.k_max)):
            c = counts[i]
            c[0] = decay * c[0] + per_pos[i]
            c[1] = decay * c[1] + reached
            if c[1] > 0:
                ratios[i] = c[0] / c[1]
            reached = per_pos[i]

    def predicted(self, batch: int, k: int) -> float:
        """Calibrated seconds of a step at any batch size (log-log between the nearest buckets),
        and the drafter's measured time at that batch size where it drafts."""
        bs = self.buckets
        lo = max([b for b in bs if b <= batch], default=bs[0])
        hi = min([b for b in bs if b >= batch], default=bs[-1])
        t_lo, t_hi = (self.cost(b, k, self.calibrated, lookup=False) for b in (lo, hi))
        lookup = 0.0 if k == OFF else self.drafter_seconds(batch, k)
        if lo == hi:
            return t_lo + lookup
        w = math.log(batch / lo) / math.log(hi / lo)
        return math.exp((1 - w) * math.log(t_lo) + w * math.log(t_hi)) + lookup

    def observe_steps(self, steps: list[tuple[int, int, float]]) -> None:
        """Refine step costs from one call's decode steps, (running batch, k or OFF, seconds) each.
        Start-up timing runs one sample per prompt at a fixed length; a real call runs groups of
        samples whose lengths spread, and pays per-step work the timing does not (output of n
        samples per prompt, finished requests). That shows up as an offset per step whatever k
        is, so it is estimated as one: per bucket, the mean of measured minus predicted over the
        steps in the bucket's range (earlier calls' counts decayed), added to every k's calibrated
        cost. A per-(bucket, k) correction would favour the k a call did not use, whose costs
        keep the timing's bias; a common offset moves every k alike and so does not. Given
        costs (fixed) stay as given."""
        if self.fixed:
            return
        bucket_of = self.bucket_of()
        per_bucket: dict[int, list[float]] = {}
        for n, k, seconds in steps:
            if n in bucket_of and (bucket_of[n], k) in self.calibrated:
                per_bucket.setdefault(bucket_of[n], []).append(seconds - self.predicted(n, k))
        for b, diffs in per_bucket.items():
            c = self.cost_counts.setdefault(b, [0.0, 0.0])
            c[0] = self.decay * c[0] + sum(diffs)
            c[1] = self.decay * c[1] + len(diffs)
            cells = [(b, k) for k in [OFF, *range(self.k_max + 1)] if (b, k) in self.calibrated]
            # a few fast tail steps must not make the cheapest cell (OFF) look free: measured steps
            # at most halve it, and every k moves by the same amount
            offset = max(c[0] / c[1], -0.5 * min(self.calibrated[x] for x in cells))
            for cell in cells:
                self.step_seconds[cell] = self.calibrated[cell] + offset

    def calls_k_min(self, plan: DraftPlan, batch_size: int) -> int:
        """Smallest positive k among the buckets a call starting at this batch size can pass."""
        ks = [k for lo, _, k in plan.schedule if lo <= batch_size and k > 0]
        return 0 if plan.off or not ks else min(ks)


def best_is_spec(rates: dict[int, float], planner: DraftLengthPlanner, bucket: int) -> bool:
    """Whether some k > 0 beats both k = 0 and OFF at this bucket."""
    return max(rates[k] for k in rates if k > 0) > max(rates[0], planner.tokens_per_second(bucket, OFF))


def load_step_costs(path: str, k_max: int) -> dict[tuple[int, int], float]:
    """speculation.auto_step_costs: {"<batch size>": [off, k=0, ..., k_max seconds], ...} ->
    (batch size, k or OFF) -> seconds; a ValueError naming the file and what is wrong."""
    where = f"speculation.auto_step_costs ({path})"
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: cannot read it as JSON: {exc}") from None
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{where}: must be a JSON object of batch sizes to step costs")
    out = {}
    for key, costs in table.items():
        if not str(key).isdigit() or int(key) < 1:
            raise ValueError(f"{where}: key {key!r} is not a batch size (a positive integer)")
        if not isinstance(costs, list) or len(costs) != k_max + 2 or not all(
                isinstance(c, (int, float)) and math.isfinite(c) and c > 0 for c in costs):
            raise ValueError(f"{where}: batch size {key}: want {k_max + 2} positive seconds (off, then k = 0 .. "
                             f"{k_max}: speculation.max_speculative_tokens), got {costs!r}")
        out.update({(int(key), k): float(c) for k, c in zip([OFF, *range(k_max + 1)], costs)})
    return out
