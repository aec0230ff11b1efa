"""Run by tests/cluster/test_plan.py in a process of its own: a Ray cluster of two nodes on loopback
(ray.cluster_utils, 2 GPUs declared on each, none needed), the placement groups of a plan whose
one engine is tensor-parallel over both nodes, and probes standing in for the actors: the engine
actor, and in each bundle the engine names (VLLM_RAY_BUNDLE_INDICES) a task as vLLM's Ray executor
would place a TP worker. Prints one JSON line: the Ray node of each."""
import json

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlspec.config import ClusterConfig
from rlspec.cluster.plan import GEN, LEARNER, make_plan
from rlspec.cluster.groups import actor_options, create_placement_groups, slot_ip


def node_id(*_):
    return ray.get_runtime_context().get_node_id()


@ray.remote
class Engine:
    def where(self):
        return node_id()

    def workers(self, indices: str, gpus: float):
        """What vLLM's Ray executor does: one worker in each named bundle of the engine's group."""
        pg = get_current_placement_group()
        task = ray.remote(node_id)
        return ray.get([task.options(num_cpus=0, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=int(b))).remote() for b in indices.split(",")])


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=2)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    # colocated: the TP-4 engine and 4 learner ranks share the 4 GPUs of both nodes
    c = ClusterConfig(nodes=2, gpus_per_node=2, cpus_per_slot=1, placement="colocated", num_generators=1,
                      learner_world_size=4, logprob_world_size=1)
    plan = make_plan(c, tensor_parallel_size=4)
    placed = create_placement_groups(plan, 60)
    opts = actor_options(plan, placed, GEN, 0)
    engine = Engine.options(**opts["options"]).remote()
    env = opts["env"]
    learners = [ray.remote(node_id).options(**actor_options(plan, placed, LEARNER, r)["options"]).remote()
                for r in range(plan.roles[LEARNER].actors)]
    print(json.dumps({
        "groups": len(placed.pgs), "bundle_indices": env["VLLM_RAY_BUNDLE_INDICES"],
        "engine": ray.get(engine.where.remote(), timeout=60),
        "workers": ray.get(engine.workers.remote(env["VLLM_RAY_BUNDLE_INDICES"],
                                                 float(env["VLLM_RAY_PER_WORKER_GPUS"])), timeout=60),
        "learners": ray.get(learners, timeout=60),
        "master_ip": slot_ip(placed, plan.roles[LEARNER].slots[0][0]),
        "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}), flush=True)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
