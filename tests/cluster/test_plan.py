"""Placement plans from config (pure Python), the paper experiments' placement, and --dry-run."""
import subprocess
import sys

import pytest

from conftest import ROOT, compose
from rlspec.config import ClusterConfig, ConfigError
from rlspec.checks import plan_of, validate
from rlspec.cluster.plan import DRAFT, GEN, LEARNER, LOGPROB, Slot, make_plan

PAPER = ["rl_zero_qwen3_8b", "rl_think_qwen3_8b", "qwen3_235b_a22b"]


@pytest.mark.parametrize("name", PAPER)
def test_paper_experiments_validate_with_aime_validation_and_eagle3_k3(name):
    cfg = compose([f"+experiment={name}"], plain=False)
    validate(cfg)  # hub IDs are not fetched: validation needs no network
    assert cfg.data.val.source == "HuggingFaceH4/aime_2024" and cfg.data.val.schema == "aime"
    assert cfg.data.train.source == "BytedTsinghua-SIA/DAPO-Math-17k"
    assert cfg.speculation.method == "eagle3" and cfg.speculation.num_speculative_tokens == 3
    plan = make_plan(cfg.cluster, cfg.generation.tensor_parallel_size, cfg.generation.expert_parallel)
    assert cfg.cluster.gpus_per_node == 4 and plan.gpus(GEN) == cfg.cluster.nodes * 4  # every GPU generates


def test_rl_zero_plan_on_8_nodes_x_4_gpus():
    cfg = compose(["+experiment=rl_zero_qwen3_8b"], plain=False)
    plan = make_plan(cfg.cluster, cfg.generation.tensor_parallel_size)
    assert plan.nodes == 8 and plan.slots_per_node == [4] * 8 and plan.mode == "colocated"
    assert {r: plan.roles[r].actors for r in plan.roles} == {GEN: 32, LOGPROB: 32, LEARNER: 32}
    assert all(len(s) == 1 for s in plan.roles[GEN].slots)  # TP 1
    # Engine e, learner rank e and log-prob rank e share GPU e % 4 of node e // 4.
    for e in range(32):
        want = [Slot(e // 4, e % 4)]
        assert plan.roles[GEN].slots[e] == plan.roles[LEARNER].slots[e] == plan.roles[LOGPROB].slots[e] == want
    assert plan.bundles(0) == [{"CPU": 16.0, "GPU": 1.0}] * 4
    assert plan.share(Slot(3, 2)) == {"num_cpus": 5.3333, "num_gpus": 0.3333}  # three tenants
    text = plan.describe()
    assert text.splitlines()[0] == "placement plan: 8 nodes x 4 GPUs, colocated, 32 GPUs used"
    assert "node 7: generator[28-31], logprob_worker[28-31], learner[28-31]" in text


def test_async_rl_think_generates_on_half_the_nodes_and_trains_on_the_other():
    cfg = compose(["+experiment=rl_think_qwen3_8b_async"], plain=False)
    validate(cfg)
    assert cfg.async_grpo.enabled and cfg.async_grpo.max_policy_lag == 1
    assert cfg.algo.off_policy_correction == "decoupled_ppo" and cfg.data.template == "rl_think"
    plan = make_plan(cfg.cluster, cfg.generation.tensor_parallel_size)
    assert plan.nodes == 16 and plan.mode == "disaggregated"
    assert {s.node for slots in plan.roles[GEN].slots for s in slots} == set(range(8))
    assert {s.node for slots in plan.roles[LEARNER].slots for s in slots} == set(range(8, 16))
    assert plan.roles[LOGPROB].slots == plan.roles[LEARNER].slots


def test_235b_engines_span_two_nodes_with_expert_parallel():
    cfg = compose(["+experiment=qwen3_235b_a22b"], plain=False)
    assert cfg.generation.tensor_parallel_size == 8 and cfg.generation.expert_parallel
    plan = make_plan(cfg.cluster, 8, True)
    assert plan.roles[GEN].actors == 64 and plan.roles[LEARNER].actors == 512
    assert plan.roles[GEN].slots[1] == [Slot(2, i) for i in range(4)] + [Slot(3, i) for i in range(4)]
    assert "TP 8 + EP = 8 GPUs" in plan.describe()


def test_disaggregated_gives_generation_its_own_gpus():
    plan = make_plan(ClusterConfig(nodes=4, gpus_per_node=4, placement="disaggregated", num_generators=4,
                                   learner_world_size=8, logprob_world_size=8), tensor_parallel_size=2)
    gen = {s for slots in plan.roles[GEN].slots for s in slots}
    train = {s for r in (LEARNER, LOGPROB) for slots in plan.roles[r].slots for s in slots}
    assert not gen & train and {s.node for s in gen} == {0, 1} and {s.node for s in train} == {2, 3}
    assert plan.roles[GEN].slots[1] == [Slot(0, 2), Slot(0, 3)]  # a TP-2 engine stays inside a node


def test_cpu_two_nodes_put_generation_and_training_on_different_nodes():
    plan = make_plan(ClusterConfig(nodes=2))
    assert plan.roles[GEN].slots == [[Slot(0, 0)]]
    assert plan.roles[LEARNER].slots == plan.roles[LOGPROB].slots == [[Slot(1, 0)]]
    assert plan.bundles(0) == plan.bundles(1) == [{"CPU": 1.0}]
    assert plan.share(Slot(1, 0)) == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert plan.share(Slot(0, 0)) == {"num_cpus": 1.0, "num_gpus": 0.0}


def test_online_draft_adaptation_trains_on_the_last_learner_ranks_gpu():
    """The DraftTrainer has a slot in the plan (on a GPU: a share of it, so its head trains there),
    the last learner rank's: rank 0 also sends the refit."""
    cfg = compose(["+experiment=rl_zero_qwen3_8b", "speculation.online.enabled=true"], plain=False)
    plan = plan_of(cfg)
    assert plan.roles[DRAFT].slots == [plan.roles[LEARNER].slots[-1]] == [[Slot(7, 3)]]
    assert plan.share(Slot(7, 3)) == {"num_cpus": 4.0, "num_gpus": 0.25}  # engine, log-prob, learner, draft
    assert "draft_trainer        1  1 GPU, shared                    1  7" in plan.describe()
    assert DRAFT not in plan_of(compose(["+experiment=rl_zero_qwen3_8b"], plain=False)).roles
    cpu = plan_of(compose(["speculation=eagle3", "speculation.online.enabled=true"]))
    assert cpu.roles[DRAFT].slots == cpu.roles[LEARNER].slots and cpu.slots_per_node == [2]


def test_default_cpu_plan_is_one_node_two_slots():
    plan = make_plan(compose().cluster)
    assert plan.slots_per_node == [2] and not plan.on_gpu


@pytest.mark.parametrize("overrides,key", [
    (["cluster.placement=spread"], "cluster.placement"),
    (["cluster.nodes=0"], "cluster.nodes"),
    (["cluster.num_generators=0"], "cluster.num_generators"),
    (["cluster.logprob_world_size=0"], "cluster.logprob_world_size"),
    (["cluster.refit=carrier_pigeon"], "cluster.refit"),
    (["generation.tensor_parallel_size=2"], "generation.tensor_parallel_size"),  # CPU: TP 1 only
    (["+experiment=rl_zero_qwen3_8b", "cluster.nodes=4"], "cluster.num_generators"),
    (["+experiment=rl_zero_qwen3_8b", "cluster.placement=disaggregated"], "cluster.num_generators"),
    (["+experiment=rl_zero_qwen3_8b", "cluster.num_generators=4", "cluster.placement=disaggregated"],
     "cluster.learner_world_size"),
    (["+experiment=rl_zero_qwen3_8b", "generation.tensor_parallel_size=3"], "generation.tensor_parallel_size"),
])
def test_bad_placement_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.") + ":"):
        validate(compose(overrides))


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlspec.train", "+experiment=rl_zero_qwen3_8b", "--dry-run",
                        f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert "placement plan: 8 nodes x 4 GPUs, colocated, 32 GPUs used" in p.stdout
    assert "generator           32  TP 1 = 1 GPU, shared" in p.stdout
    assert "model Qwen/Qwen3-8B-Base; speculation eagle3 k=3" in p.stdout
    assert not (tmp_path / "summary.json").exists()


def test_dry_run_of_a_plan_that_does_not_fit_names_the_key(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlspec.train", "+experiment=rl_zero_qwen3_8b", "cluster.nodes=2",
                        "cluster.dry_run=true", f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    assert "rlspec: error: cluster.num_generators: colocated placement needs 32 GPUs" in p.stderr


def test_a_wide_engine_shares_one_placement_group_over_its_nodes():
    plan = make_plan(compose(["+experiment=qwen3_235b_a22b"], plain=False).cluster, 8, True)
    units = plan.units()
    assert units == [[2 * u, 2 * u + 1] for u in range(64)]  # every engine: two whole GB200 nodes
    single = make_plan(ClusterConfig(nodes=4, gpus_per_node=4, placement="colocated", num_generators=8,
                                     learner_world_size=16, logprob_world_size=16), tensor_parallel_size=2)
    assert single.units() == [[0], [1], [2], [3]]


@pytest.mark.slow
def test_a_wide_engine_places_its_tp_workers_on_both_ray_nodes(tmp_path):
    """Two Ray nodes on loopback with 2 (declared) GPUs each, a TP-4 engine colocated with 4
    learner ranks: the engine's bundles span both nodes, a task in each bundle (as vLLM's Ray
    executor starts its TP workers) lands 2 per node, and each learner shares its GPU's node."""
    import json

    p = subprocess.run([sys.executable, str(ROOT / "tests" / "cluster" / "wide_engine_probe.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    a, b = r["nodes"]
    assert r["groups"] == 1 and r["bundle_indices"] == "0,1,2,3"
    assert sorted(r["workers"]) == [a, a, b, b]
    assert r["learners"] == r["workers"]  # learner rank i shares the GPU of the engine's worker i
    assert r["engine"] == r["workers"][0] and r["master_ip"]


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_refits_over_a_transport_its_placement_allows(name):
    """Every shipped experiment resolves to a refit transport its plan can run: rlspec's gloo group
    on CPU machines; on GPUs vLLM's nccl where every rank has a GPU of its own, vLLM's ipc where
    every receiver sits on a learner's GPU (the colocated paper runs)."""
    from rlspec.cluster.plan import receivers_off_learner_gpus, shared_weight_group_gpus
    from rlspec.checks import plan_of, resolve_auto

    cfg = compose([f"+experiment={name}"], plain=False)
    validate(cfg)
    cfg = resolve_auto(cfg)
    plan = plan_of(cfg)
    shared = shared_weight_group_gpus(plan, cfg.algo.recompute_logprobs)
    off = receivers_off_learner_gpus(plan, cfg.algo.recompute_logprobs)
    want = ("group" if not plan.on_gpu else "nccl" if not shared else "ipc" if not off else "object_store")
    assert cfg.cluster.refit == want
    if cfg.cluster.placement == "colocated" and cfg.cluster.gpus_per_node:
        assert cfg.cluster.refit == "ipc"
    validate(cfg)


def test_a_refit_transport_the_plan_cannot_run_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^cluster\.refit: nccl puts learner\[0\] and generator\[0\] in one "
                                          r"NCCL group on one GPU"):
        validate(compose(["+experiment=rl_zero_qwen3_8b", "cluster.refit=nccl"], plain=False))
    # disaggregated: engines on GPUs of their own; the log-prob workers share the learners' GPUs
    base = ["+experiment=rl_think_qwen3_8b_async"]
    validate(compose([*base, "cluster.refit=nccl"], plain=False))
    with pytest.raises(ConfigError, match=r"learner\[0\] and logprob_worker\[0\]"):
        validate(compose([*base, "cluster.refit=nccl", "algo.kl_coef=0.01"], plain=False))
    with pytest.raises(ConfigError, match=r"^cluster\.refit: ipc reaches receivers on the learners' GPUs only; "
                                          r"generator\[0\]"):
        validate(compose([*base, "cluster.refit=ipc"], plain=False))
    with pytest.raises(ConfigError, match=r"^cluster\.refit: ipc is vLLM's GPU transport; this plan has no GPUs"):
        validate(compose(["cluster.refit=ipc"], plain=False))
