"""Generators of tensor-parallel size 1 and 2 on this CPU, placed as a run places them (rlspec's plan
and placement groups on a Ray cluster declaring 2 GPUs, none needed), the TP=2 engines' workers
through vLLM's Ray executor (tests/helpers/ray_on_cpu.py). Run as a child process: argv, the
speculation methods to run at TP=2 (draft_model, eagle3, ngram, history, history_device, and
under async scheduling history_device_async, eagle3_async, draft_model_async); TP=1 on Model Runner
V1 without speculation is the reference. With VLLM_USE_V2_MODEL_RUNNER=1 and TRITON_INTERPRET=1 in
the environment the TP=2 engines run Model Runner V2 (tests/helpers/ray_on_cpu.py). Each
engine answers a greedy call on 4 held-out prompts (recorded as history); history engines answer
it again (drafting from the first call's answers); the reference and the device drafter's engines
then take a refit of perturbed weights and answer once more. Prints, as JSON, per engine: the
runner, each call's answers, each rank's drafter counters, and what each rank holds (the drafter's
settings and store, the refit weight) and the Ray node it ran on."""
import json
import os
import sys

import numpy as np
import torch

# a store size and the shadow rows, each drafter's own size key
SETTINGS = ["speculation.history.device.max_tokens=65536", "speculation.history.shadow_rows=7"]
METHODS = {"none": ["speculation=none"], "draft_model": ["speculation=draft_model"],
           "eagle3": ["speculation=eagle3"], "ngram": ["speculation=ngram"],
           "history": ["speculation=history", "speculation.history.host.max_tokens=65536",
                       "speculation.history.shadow_rows=7"],
           "history_device": ["speculation=history", "speculation.history.drafter=device", *SETTINGS],
           "history_device_async": ["speculation=history", "speculation.history.drafter=device", *SETTINGS,
                                    "generation.async_scheduling=true"],
           "eagle3_async": ["speculation=eagle3", "generation.async_scheduling=true"],
           "draft_model_async": ["speculation=draft_model", "generation.async_scheduling=true"]}
REFIT = "model.norm.weight"   # replicated on every rank: read back whole on each
# Ray nodes on loopback (TP_NODES in the environment): with 2, each TP=2 engine has a rank on each
NODES = int(os.environ.get("TP_NODES", "1"))


def perturbed(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in m.named_parameters()}


def ranks_hold(gen) -> dict:
    """Per rank: the refit weight, the history drafter's settings (the device drafter's as its store
    holds them) and the device drafter's store (where it drafts)."""
    from rlspec.speculation.history.device import proposer as device_proposer
    from rlspec.speculation.history.host.proposer import HistoryProposer

    def read(worker):
        import ray

        node = ray.get_runtime_context().get_node_id()
        model = worker.model_runner.model
        weight = dict(model.named_parameters())[REFIT].detach().clone()
        runner = worker.model_runner   # Model Runner V1's drafter, V2's speculator
        p = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
        if getattr(p, "drafting", None) and p.history is not None:
            return weight, (p.history.capacity, p.shadow_rows), device_proposer.state_dict(worker), node
        if isinstance(p, HistoryProposer):
            return weight, (p.cfg.host.max_tokens, p.cfg.shadow_rows), None, node
        return weight, None, None, node
    return gen.engine.llm.collective_rpc(read)


def run(method: str, tp: int, prompts, weights) -> dict:
    import ray

    from conftest import paths_of, resolved
    from rlspec.cluster.groups import actor_options, create_placement_groups
    from rlspec.cluster.plan import GEN, make_plan
    from rlspec.config import ClusterConfig
    from rlspec.messages import Sampling
    from rlspec.workers.generator import Generator

    cfg = resolved(METHODS[method])
    cfg.generation.tensor_parallel_size = tp
    plan = make_plan(ClusterConfig(nodes=NODES, gpus_per_node=2 // NODES, cpus_per_slot=1, placement="colocated",
                                   num_generators=1, learner_world_size=1, logprob_world_size=1), tp)
    placed = create_placement_groups(plan, 120)
    o = actor_options(plan, placed, GEN, 0)
    # the reference is Model Runner V1 whatever the others run
    env = {**o["env"], **({"VLLM_USE_V2_MODEL_RUNNER": "0"} if method == "none" else {})}
    gen = ray.remote(Generator).options(**o["options"], **({"runtime_env": {"env_vars": env}} if env else {})
                                        ).remote(paths=paths_of(cfg), model=cfg.model, generation=cfg.generation,
                                                 speculation=cfg.speculation, seed=0, threads=1)
    out = {"method": method, "tp": tp, "bundles": o["env"].get("VLLM_RAY_BUNDLE_INDICES"),
           "runner": ray.get(gen.runner_info.remote(), timeout=600), "calls": [], "history_by_rank": []}
    calls = 3 if method in ("none", "history_device", "history_device_async") else 2 if method == "history" else 1
    for call in range(calls):
        if call == 2:
            ray.get(gen.refit_tensors.remote(weights, 1), timeout=300)
        ro = ray.get(gen.generate.remote(prompts, Sampling(1, 0.0, 16, seed=0)), timeout=600)
        out["calls"].append({"answers": ro.response_ids, "accepted": ro.spec.accepted_tokens if ro.spec else 0})
        out["history_by_rank"].append(ray.get(gen.__ray_call__.remote(lambda g: g.history_by_rank), timeout=60))
    held = ray.get(gen.__ray_call__.remote(ranks_hold), timeout=120)
    out["refit_on_rank"] = [bool(torch.equal(h[0], weights[REFIT])) for h in held] if calls == 3 else None
    out["settings_by_rank"] = [h[1] for h in held]
    out["node_by_rank"] = [h[3] for h in held]
    states = [h[2] for h in held]
    out["stores_equal"] = all(_equal(states[0], s) for s in states[1:])
    ray.kill(gen)
    for pg in placed.pgs:
        ray.util.remove_placement_group(pg)
    return out


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def main() -> None:
    import ray

    from conftest import ROOT, heldout_prompts
    from helpers.ray_on_cpu import init_ray
    from rlspec.models import load_tokenizer

    cluster = init_ray(gpus=2 // NODES, nodes=NODES)
    policy = str(ROOT / "rlspec" / "assets" / "tiny" / "policy")
    prompts = heldout_prompts(load_tokenizer(policy, "model.path"), 4)
    weights = perturbed(policy)
    engines = [run("none", 1, prompts, weights)] + [run(m, 2, prompts, weights) for m in sys.argv[1:]]
    print(json.dumps(engines))
    if cluster is not None:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
