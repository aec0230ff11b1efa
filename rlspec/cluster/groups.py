"""The placement plan (rlspec/cluster/plan.py) made real: one Ray placement group per node
(STRICT_PACK, one bundle per slot), or one over the nodes an engine wider than a node spans, and
the scheduling options of every actor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlspec.cluster.plan import GEN, PlacementPlan, Slot
from rlspec.refit.ports import endpoint


class PlacementError(RuntimeError):
    """Ray could not place the plan (too few nodes, GPUs or CPUs)."""


@dataclass
class Placed:
    pgs: list[Any]                          # Ray placement groups, one per plan unit
    where: dict[Slot, tuple[int, int]]      # plan slot -> (index into pgs, bundle index)

    def group(self, slot: Slot) -> Any:
        return self.pgs[self.where[slot][0]]

    def bundle(self, slot: Slot) -> int:
        return self.where[slot][1]


def create_placement_groups(plan: PlacementPlan, timeout_s: float) -> Placed:
    """Every unit of the plan (a node, or the nodes one wide engine spans) as a placement group,
    all placed within timeout_s. A wide engine's group asks for exactly its nodes' GPUs with PACK,
    so Ray fills whole nodes; the bundles follow the plan's slot order."""
    import ray
    from ray.util.placement_group import placement_group

    pgs, where, names = [], {}, []
    for unit in plan.units():
        bundles = []
        for n in unit:
            for i, b in enumerate(plan.bundles(n)):
                where[Slot(n, i)] = (len(pgs), len(bundles))
                bundles.append(b)
        name = f"rlspec-node{unit[0]}" if len(unit) == 1 else f"rlspec-nodes{unit[0]}-{unit[-1]}"
        pgs.append(placement_group(bundles, strategy="STRICT_PACK" if len(unit) == 1 else "PACK", name=name))
        names.append((name, unit, bundles))
    pending = {pg.ready(): u for u, pg in enumerate(pgs)}
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    missing = [pending[r] for r in pending if r not in ready]
    if missing:
        name, unit, bundles = names[missing[0]]
        for pg in pgs:
            ray.util.remove_placement_group(pg)
        nodes = f"plan node {unit[0]}, one Ray node" if len(unit) == 1 else \
            f"plan nodes {unit[0]}-{unit[-1]}, {len(unit)} Ray nodes for one engine"
        raise PlacementError(
            f"placement group {name} ({len(bundles)} x {bundles[0]}, {nodes}) not placed within {timeout_s:.0f}s: "
            f"{len(missing)} of {len(pgs)} groups unplaced; the Ray cluster has "
            f"{len([x for x in ray.nodes() if x['Alive']])} nodes and {ray.cluster_resources()} "
            "(check cluster.nodes, cluster.gpus_per_node, cluster.cpus_per_slot)")
    return Placed(pgs, where)


def actor_options(plan: PlacementPlan, placed: Placed, role: str, i: int) -> dict:
    """Ray options placing actor i of `role` in its first slot with its share of that slot; a
    tensor-parallel engine also names the bundles its vLLM workers take (on several nodes when
    the engine is wider than one)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    slots = plan.roles[role].slots[i]
    first = slots[0]
    share = plan.share(first)
    opts = dict(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placed.group(first), placement_group_bundle_index=placed.bundle(first),
        placement_group_capture_child_tasks=True), **share)
    env = {}
    if role == GEN and len(slots) > 1:
        # vLLM's Ray executor puts one TP worker in each of these bundles with this GPU share;
        # the engine actor itself only coordinates.
        assert len({placed.where[s][0] for s in slots}) == 1, "an engine's slots share one placement group"
        env = {"VLLM_RAY_BUNDLE_INDICES": ",".join(str(placed.bundle(s)) for s in slots),
               "VLLM_RAY_PER_WORKER_GPUS": str(share["num_gpus"])}
        opts["num_gpus"] = 0
    return {"options": opts, "env": env}


def slot_endpoint(placed: Placed, slot: Slot, timeout_s: float) -> tuple[str, int]:
    """(IP, free port) of the node the slot's bundle landed on, the port probed on that node (the
    host that will bind it), within timeout_s."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(endpoint).options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placed.group(slot), placement_group_bundle_index=placed.bundle(slot)))
    try:
        return ray.get(probe.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"no answer within {timeout_s:.0f}s (cluster.actor_timeout_s) from the node of "
                           f"placement slot {slot}, asked for a free port") from None


def slot_ip(placed: Placed, slot: Slot) -> str:
    """IP of the Ray node the slot's bundle landed on."""
    import ray
    from ray.util.placement_group import placement_group_table

    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return ip_of[placement_group_table(placed.group(slot))["bundles_to_node_id"][placed.bundle(slot)]]


def actor_nodes(handles: dict[str, Any]) -> dict[str, str]:
    """Actor name -> Ray node ID it runs on, as Ray reports it (asked inside each actor)."""
    import ray

    refs = {name: h.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
            for name, h in handles.items()}
    return dict(zip(refs, ray.get(list(refs.values()))))
