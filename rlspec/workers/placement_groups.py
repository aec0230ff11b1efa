"""The placement plan (rlspec/placement.py) made real: one Ray placement group per node
(STRICT_PACK, one bundle per slot) and the scheduling options of every actor."""
from __future__ import annotations

from typing import Any

from rlspec.placement import GEN, PlacementPlan


class PlacementError(RuntimeError):
    """Ray could not place the plan (too few nodes, GPUs or CPUs)."""


def create_placement_groups(plan: PlacementPlan, timeout_s: float) -> list[Any]:
    """Placement groups per node of the plan (None for a node the plan leaves idle), all placed."""
    import ray
    from ray.util.placement_group import placement_group

    pgs = [placement_group(plan.bundles(n), strategy="STRICT_PACK", name=f"rlspec-node{n}")
           if plan.slots_per_node[n] else None for n in range(plan.nodes)]
    pending = {pg.ready(): n for n, pg in enumerate(pgs) if pg is not None}
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    missing = [pending[r] for r in pending if r not in ready]
    if missing:
        n = missing[0]
        for pg in pgs:
            if pg is not None:
                ray.util.remove_placement_group(pg)
        raise PlacementError(
            f"placement group of plan node {n} ({plan.slots_per_node[n]} x {plan.bundles(n)[0]}, one Ray node) "
            f"not placed within {timeout_s:.0f}s: {len(missing)} of {len(pending)} nodes unplaced; the Ray cluster "
            f"has {len([x for x in ray.nodes() if x['Alive']])} nodes and {ray.cluster_resources()} "
            "(check cluster.nodes, cluster.gpus_per_node, cluster.cpus_per_slot)")
    return pgs


def actor_options(plan: PlacementPlan, pgs: list[Any], role: str, i: int) -> dict:
    """Ray options placing actor i of `role` in its first slot with its share of that slot; a
    tensor-parallel engine also names the bundles its vLLM workers take."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    slots = plan.roles[role].slots[i]
    first = slots[0]
    if len({s.node for s in slots}) > 1:
        raise PlacementError(f"{role}[{i}] spans nodes {sorted({s.node for s in slots})}: engines wider than a "
                             "node (generation.tensor_parallel_size > cluster.gpus_per_node) are planned but not "
                             "launched yet")
    share = plan.share(first)
    opts = dict(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pgs[first.node], placement_group_bundle_index=first.index,
        placement_group_capture_child_tasks=True), **share)
    env = {}
    if role == GEN and len(slots) > 1:
        # vLLM's Ray executor puts one TP worker in each of these bundles with this GPU share;
        # the engine actor itself only coordinates.
        env = {"VLLM_RAY_BUNDLE_INDICES": ",".join(str(s.index) for s in slots),
               "VLLM_RAY_PER_WORKER_GPUS": str(share["num_gpus"])}
        opts["num_gpus"] = 0
    return {"options": opts, "env": env}


def node_ips(plan: PlacementPlan, pgs: list[Any]) -> dict[int, str]:
    """Plan node -> IP of the Ray node its placement group landed on."""
    import ray
    from ray.util.placement_group import placement_group_table

    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return {n: ip_of[placement_group_table(pg)["bundles_to_node_id"][0]] for n, pg in enumerate(pgs) if pg is not None}


def actor_nodes(handles: dict[str, Any]) -> dict[str, str]:
    """Actor name -> Ray node ID it runs on, as Ray reports it (asked inside each actor)."""
    import ray

    refs = {name: h.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
            for name, h in handles.items()}
    return dict(zip(refs, ray.get(list(refs.values()))))
