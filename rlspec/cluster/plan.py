"""Placement plan: which node and which slot every actor runs on, computed from config alone.

A slot is one GPU (plus `cluster.cpus_per_slot` CPUs), or on CPU machines (`gpus_per_node=0`)
`cpus_per_slot` CPUs. Each node becomes one Ray placement group of its slots (STRICT_PACK), so
the plan is what Ray places; the nodes an engine wider than a node spans (tensor parallel over
several nodes) share one placement group (PACK over exactly those nodes' GPUs). Two modes:
- colocated: generation, log-prob and training share every slot; the synchronous loop runs one
  stage at a time, so each actor gets an equal share of its slot's resources;
- disaggregated: generation engines get slots of their own and log-prob workers share the rest
  with the learner ranks (what asynchronous GRPO needs: generation never waits for training).
With online draft adaptation a DraftTrainer shares the last learner rank's slot (rank 0 sends the
refit): it trains the head on that GPU while the learners train the policy.
Pure Python (no Ray, nothing else from rlspec): rlspec.checks.validate() and `--dry-run` use it before
anything starts; `c` is a ClusterConfig.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


class PlanError(ValueError):
    """The cluster config cannot be placed; the message starts with the dotted key
    (rlspec.checks.validate raises it as a ConfigError)."""

PLACEMENTS = ("colocated", "disaggregated")
GEN, LOGPROB, LEARNER, DRAFT = "generator", "logprob_worker", "learner", "draft_trainer"


@dataclass(frozen=True)
class Slot:
    node: int   # index of the node
    index: int  # the slot's index on that node


@dataclass
class RolePlan:
    name: str
    slots: list[list[Slot]]  # per actor, the slots it spans (a TP-n engine spans n)

    @property
    def actors(self) -> int:
        return len(self.slots)


@dataclass
class PlacementPlan:
    mode: str
    nodes: int
    gpus_per_node: int
    cpus_per_slot: int
    slots_per_node: list[int]
    roles: dict[str, RolePlan]
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    tenants: dict[Slot, list[str]] = field(default_factory=dict)  # slot -> actor names sharing it

    def __post_init__(self):
        for role in self.roles.values():
            for i, slots in enumerate(role.slots):
                for s in slots:
                    self.tenants.setdefault(s, []).append(f"{role.name}[{i}]")

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    def bundles(self, node: int) -> list[dict[str, float]]:
        """Ray bundles of one node's placement group."""
        one = {"CPU": float(self.cpus_per_slot), **({"GPU": 1.0} if self.on_gpu else {})}
        return [dict(one) for _ in range(self.slots_per_node[node])]

    def share(self, slot: Slot) -> dict[str, float]:
        """Resources one actor asks for in `slot`: an equal share of it among its tenants
        (rounded down to Ray's 1e-4 resource granularity so the shares always fit)."""
        k = len(self.tenants[slot])
        part = lambda total: math.floor(total / k * 1e4) / 1e4  # noqa: E731
        return {"num_cpus": part(self.cpus_per_slot), "num_gpus": part(1.0) if self.on_gpu else 0.0}

    def units(self) -> list[list[int]]:
        """Plan nodes that share one Ray placement group: a node alone, or every node an engine
        wider than a node spans (vLLM's Ray executor takes its TP workers' bundles from the one
        placement group its engine runs in). Nodes the plan leaves idle are left out."""
        parent = list(range(self.nodes))

        def root(n: int) -> int:
            while parent[n] != n:
                n = parent[n]
            return n

        for role in self.roles.values():
            for slots in role.slots:
                first, *rest = sorted({s.node for s in slots})
                for n in rest:
                    parent[root(n)] = root(first)
        groups: dict[int, list[int]] = {}
        for n in range(self.nodes):
            if self.slots_per_node[n]:
                groups.setdefault(root(n), []).append(n)
        return sorted(groups.values())

    def gpus(self, role: str) -> int:
        return len({s for slots in self.roles[role].slots for s in slots}) if self.on_gpu else 0

    def describe(self) -> str:
        """The plan as printed by `--dry-run`."""
        unit = f"{self.gpus_per_node} GPUs" if self.on_gpu else f"slots of {self.cpus_per_slot} CPU"
        total = sum(self.slots_per_node)
        head = (f"placement plan: {self.nodes} node{'s' * (self.nodes > 1)} x {unit}, {self.mode}, "
                f"{total} {'GPUs' if self.on_gpu else 'slots'} used")
        rows = [f"{'role':<15}{'actors':>7}  {'per actor':<28}{'GPUs' if self.on_gpu else 'slots':>6}  nodes"]
        for role in self.roles.values():
            used = {s for slots in role.slots for s in slots}
            nodes = sorted({s.node for s in used})
            tp = self.tensor_parallel_size if role.name == GEN else 1
            per = (f"TP {tp}" + (" + EP" if self.expert_parallel else "") + " = " if role.name == GEN else "") \
                + f"{tp} {'GPU' if self.on_gpu else 'slot'}{'s' * (tp > 1)}"
            if self._shares(role):
                per += ", shared"
            rows.append(f"{role.name:<15}{role.actors:>7}  {per:<28}{len(used):>6}  {_ranges(nodes)}")
        shown = min(self.nodes, 16)
        per_node = [f"node {n}: " + ", ".join(self._node_summary(n)) for n in range(shown)]
        if shown < self.nodes:
            per_node.append(f"... ({self.nodes - shown} more nodes, same pattern)")
        return "\n".join([head, *rows, *per_node])

    def _shares(self, role: RolePlan) -> bool:
        return any(len(self.tenants[s]) > 1 for slots in role.slots for s in slots)

    def _node_summary(self, node: int) -> list[str]:
        out = []
        for role in self.roles.values():
            idx = [i for i, slots in enumerate(role.slots) if any(s.node == node for s in slots)]
            if idx:
                out.append(f"{role.name}[{_ranges(idx)}]")
        return out or ["idle"]


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise PlanError(f"{key}: {msg}")


def make_plan(c, tensor_parallel_size: int = 1, expert_parallel: bool = False,
              draft_trainer: bool = False) -> PlacementPlan:
    """The placement of every actor (a DraftTrainer too when draft_trainer: online draft
    adaptation); raises PlanError naming the key that does not fit."""
    tp, E, W, L = tensor_parallel_size, c.num_generators, c.learner_world_size, c.logprob_world_size
    _check(c.placement in PLACEMENTS, "cluster.placement", f"{c.placement!r} not in {list(PLACEMENTS)}")
    _check(c.nodes >= 1, "cluster.nodes", "must be >= 1")
    _check(c.gpus_per_node >= 0, "cluster.gpus_per_node", "must be >= 0 (0: a CPU machine)")
    _check(c.cpus_per_slot >= 1, "cluster.cpus_per_slot", "must be >= 1")
    _check(E >= 1, "cluster.num_generators", "must be >= 1")
    _check(W >= 1, "cluster.learner_world_size", "must be >= 1")
    _check(L >= 1, "cluster.logprob_world_size", "must be >= 1")
    _check(tp >= 1, "generation.tensor_parallel_size", "must be >= 1")
    gpn = c.gpus_per_node
    if gpn == 0:
        _check(tp == 1, "generation.tensor_parallel_size",
               "must be 1 on CPU machines (cluster.gpus_per_node=0)")
    else:
        # An engine lives inside one node, or spans whole nodes (multi-node TP over NVLink/IB).
        _check(gpn % tp == 0 or tp % gpn == 0, "generation.tensor_parallel_size",
               f"{tp} must divide cluster.gpus_per_node={gpn} or be a multiple of it")
    gen_slots, train_slots = E * tp, max(W, L)
    needed = max(gen_slots, train_slots) if c.placement == "colocated" else gen_slots + train_slots
    if gpn:
        have = c.nodes * gpn
        if needed > have:
            fits = have if c.placement == "colocated" else have - 1  # disaggregated: training needs >= 1
            key = ("cluster.num_generators" if gen_slots > fits else
                   "cluster.learner_world_size" if W >= L else "cluster.logprob_world_size")
            raise PlanError(
                f"{key}: {c.placement} placement needs {needed} GPUs ({E} engines x TP {tp} = {gen_slots} for "
                f"generation, {train_slots} for {W} learner and {L} log-prob ranks), the cluster has {have} "
                f"(cluster.nodes={c.nodes} x cluster.gpus_per_node={gpn})")
        per_node = gpn
    else:
        per_node = math.ceil(needed / c.nodes)
    # Slots in order: node 0's, then node 1's, ...; generation first, training after (disaggregated)
    # or over the same slots (colocated). Engine starts are multiples of tp, so an engine never
    # straddles a node boundary unless it spans whole nodes.
    order = [Slot(n, i) for n in range(c.nodes) for i in range(per_node)]
    gen = [order[e * tp:(e + 1) * tp] for e in range(E)]
    base = 0 if c.placement == "colocated" else gen_slots
    if gpn == 0 and c.placement == "disaggregated" and c.nodes > 1 and gen_slots < per_node * c.nodes:
        # CPU nodes: start training on a fresh node when one is free, so the roles use every node.
        base = min(math.ceil(gen_slots / per_node) * per_node, len(order) - train_slots)
        base = max(base, gen_slots)
    learners = [[order[base + r]] for r in range(W)]
    logprob = [[order[base + r]] for r in range(L)]
    roles = {GEN: RolePlan(GEN, gen), LOGPROB: RolePlan(LOGPROB, logprob), LEARNER: RolePlan(LEARNER, learners)}
    if draft_trainer:
        roles[DRAFT] = RolePlan(DRAFT, [learners[-1]])
    slots_per_node = [per_node] * c.nodes
    if gpn == 0:  # CPU: only the slots the plan uses
        used = {s for r in roles.values() for slots in r.slots for s in slots}
        slots_per_node = [1 + max([s.index for s in used if s.node == n], default=-1) for n in range(c.nodes)]
    return PlacementPlan(c.placement, c.nodes, gpn, c.cpus_per_slot, slots_per_node, roles, tp, expert_parallel)


def weight_group_gpus(plan: PlacementPlan, logprob_workers: bool) -> dict[Slot, list[str]]:
    """GPU -> the ranks of the broadcast weight group on it: learner 0, every engine's workers (one
    per GPU the engine spans), and the log-prob workers when they run. Empty on CPU machines."""
    if not plan.on_gpu:
        return {}
    ranks = [(f"{LEARNER}[0]", plan.roles[LEARNER].slots[0][0])]
    ranks += [(f"{GEN}[{e}]", s) for e, slots in enumerate(plan.roles[GEN].slots) for s in slots]
    if logprob_workers:
        ranks += [(f"{LOGPROB}[{r}]", slots[0]) for r, slots in enumerate(plan.roles[LOGPROB].slots)]
    out: dict[Slot, list[str]] = {}
    for name, slot in ranks:
        out.setdefault(slot, []).append(name)
    return out


def shared_weight_group_gpus(plan: PlacementPlan, logprob_workers: bool) -> dict[Slot, list[str]]:
    """The GPUs holding two or more ranks of the weight group (NCCL refuses those groups)."""
    return {s: names for s, names in weight_group_gpus(plan, logprob_workers).items() if len(names) > 1}


def receivers_off_learner_gpus(plan: PlacementPlan, logprob_workers: bool) -> list[str]:
    """The weight receivers on a GPU no learner rank holds (CUDA IPC cannot reach them: every
    learner rank shares its own GPU's copy, and receivers open the copy on their GPU)."""
    learner = {slots[0] for slots in plan.roles[LEARNER].slots}
    out = [f"{GEN}[{e}]" for e, slots in enumerate(plan.roles[GEN].slots) if any(s not in learner for s in slots)]
    if logprob_workers:
        out += [f"{LOGPROB}[{r}]" for r, slots in enumerate(plan.roles[LOGPROB].slots) if slots[0] not in learner]
    return out


def refit_transport(plan: PlacementPlan, logprob_workers: bool) -> str:
    """cluster.refit=null: rlspec's gloo group on CPU machines; on GPUs vLLM's nccl when every rank
    of the group has a GPU of its own, vLLM's ipc when every receiver sits on a learner's GPU, and
    the object store for a plan that mixes the two."""
    if not plan.on_gpu:
        return "group"
    if not shared_weight_group_gpus(plan, logprob_workers):
        return "nccl"
    if not receivers_off_learner_gpus(plan, logprob_workers):
        return "ipc"
    return "object_store"
