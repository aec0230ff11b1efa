from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from conftest import ROOT, compose
from rlspec.config import ConfigError
from rlspec.checks import validate

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def test_default_is_chain_cpu():
    """`python -m rlspec.train` with no experiment runs chain_cpu: the reasoning-length task on its
    shipped policy, 240 problems revisited for 3 epochs, rollouts drafted from their own history."""
    from rlspec.train import compose_config

    cfg = compose_config([])
    assert Path(cfg.model.path) == ROOT / "rlspec" / "assets" / "chain" / "policy"
    assert cfg.data.train.source == "synthetic_chain" and cfg.data.train.num_rows == 240
    assert cfg.trainer.max_steps * cfg.generation.num_prompts_per_step == 3 * cfg.data.train.num_rows
    assert cfg.speculation.method == "history" and cfg.speculation.model is None
    validate(cfg)


def test_tiny_cpu_is_the_tests_baseline():
    cfg = compose(plain=False)
    assert Path(cfg.model.path) == ROOT / "rlspec" / "assets" / "tiny" / "policy"
    assert cfg.data.train.source == "synthetic"
    # speculative rollouts: the tiny draft, k=3 (the k sweep's fastest fixed k)
    assert cfg.speculation.method == "draft_model" and cfg.speculation.num_speculative_tokens == 3
    assert Path(cfg.speculation.model) == ROOT / "rlspec" / "assets" / "tiny" / "draft"
    validate(cfg)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name):
    cfg = compose([f"+experiment={name}"], plain=False)
    validate(cfg)


def test_every_group_option_composes():
    """Keys and types of every group file match the schema (validation is per experiment)."""
    for group in sorted(p for p in (ROOT / "conf").iterdir() if p.is_dir() and p.name not in ("experiment", "draft")):
        for opt in group.glob("*.yaml"):
            compose([f"{group.name}={opt.stem}"])
    # the draft group belongs to `python -m rlspec.draft.train` (conf/draft_train.yaml)
    from hydra import compose as hcompose, initialize_config_dir
    from omegaconf import OmegaConf

    import rlspec.draft.train  # noqa: F401 - registers draft_schema
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for opt in (ROOT / "conf" / "draft").glob("*.yaml"):
            cfg = OmegaConf.to_object(hcompose("draft_train", overrides=[f"draft={opt.stem}"]))
            assert cfg.draft.kind == opt.stem and cfg.model.path.endswith("tiny/policy")


def test_paper_experiments_select_paper_models():
    assert compose(["+experiment=rl_zero_qwen3_8b"]).model.path == "Qwen/Qwen3-8B-Base"
    think = compose(["+experiment=rl_think_qwen3_8b"])
    assert think.model.path == "Qwen/Qwen3-8B" and think.data.template == "rl_think"


def test_misspelled_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["trainer.max_stepz=3"])
    assert "max_stepz" in str(e.value.__cause__ or e.value)


def test_wrong_type_fails_naming_key():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["trainer.max_steps=many"])
    assert "max_steps" in str(e.value.__cause__ or e.value)


@pytest.mark.parametrize("override,key", [
    ("generation.num_generations_per_prompt=1", "generation.num_generations_per_prompt"),
    ("algo.advantage=ppo", "algo.advantage"),
    ("algo.loss_agg=mean", "algo.loss_agg"),
    ("algo.clip_low=1.5", "algo.clip_low"),
    ("trainer.micro_batch_size=7", "trainer.micro_batch_size"),
    ("data.template=chatml", "data.template"),
    ("data.on_bad_row=ignore", "data.on_bad_row"),
    ("generation.max_new_tokens=1000", "generation.max_new_tokens"),
    ("logging.wandb_mode=sometimes", "logging.wandb_mode"),
    ("generation.temperature=0", "generation.temperature"),
    ("async_grpo.max_policy_lag=-1", "async_grpo.max_policy_lag"),
    ("async_grpo.queue_capacity=0", "async_grpo.queue_capacity"),
    ("async_grpo.on_stale=reuse", "async_grpo.on_stale"),
    ("generation.partial.enabled=true generation.partial.over_provision=0.5", "generation.partial.over_provision"),
    ("generation.partial.enabled=true generation.partial.max_carry_versions=-1",
     "generation.partial.max_carry_versions"),
    ("generation.partial.enabled=true generation.partial.over_provision=64", "generation.partial.over_provision"),
    ("generation.partial.enabled=true generation.partial.max_carries=-1", "generation.partial.max_carries"),
    # partial calls never drop a stale batch (they are submitted within the lag): only regenerate holds
    ("generation.partial.enabled=true async_grpo.enabled=true async_grpo.on_stale=drop", "async_grpo.on_stale"),
    # tokens of older weights trained as if on-policy
    ("async_grpo.enabled=true async_grpo.max_policy_lag=1 algo.off_policy_correction=none",
     "algo.off_policy_correction"),
    ("generation.partial.enabled=true algo.off_policy_correction=none", "algo.off_policy_correction"),
    ("algo.off_policy_correction=vtrace", "algo.off_policy_correction"),
    ("algo.behaviour_weight_cap=0.5", "algo.behaviour_weight_cap"),
    ("algo.recompute_logprobs=false algo.kl_coef=0.1", "algo.recompute_logprobs"),
    ("cluster.generator_threads=0", "cluster.generator_threads"),
    ("cluster.generator_nice=20", "cluster.generator_nice"),
])
def test_invalid_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose(override.split()))


def test_async_on_colocated_gpus_is_refused():
    cfg = compose(["+experiment=rl_zero_qwen3_8b", "async_grpo.enabled=true"], plain=False)
    with pytest.raises(ConfigError, match="async_grpo.enabled: needs cluster.placement=disaggregated"):
        validate(cfg)


def test_sleep_mode_is_on_for_colocated_gpus_only():
    from rlspec.checks import resolve_auto

    def sleep(*overrides):
        return resolve_auto(compose(list(overrides), plain=False)).generation.sleep_mode

    assert sleep("+experiment=rl_zero_qwen3_8b") is True          # colocated GB200 nodes
    assert sleep("+experiment=rl_think_qwen3_8b_async") is False  # generation never waits
    assert sleep() is False                                       # the CPU default
    cfg = compose(["+experiment=rl_think_qwen3_8b_async", "generation.sleep_mode=true"], plain=False)
    with pytest.raises(ConfigError, match="^generation.sleep_mode: true, but async GRPO"):
        validate(cfg)


@pytest.mark.parametrize("override,key", [
    ("generation.top_p=0.9", "generation.top_p"),
    ("generation.top_k=20", "generation.top_k"),
    ("speculation=draft_model speculation.num_speculative_tokens=0", "speculation.num_speculative_tokens"),
    ("speculation=draft_model speculation.num_speculative_tokens=fast", "speculation.num_speculative_tokens"),
    ("speculation=draft_model speculation.auto_buckets=[]", "speculation.auto_buckets"),
    ("speculation=history speculation.auto_step_costs=/x.json", "speculation.auto_step_costs"),   # fixed k
    ("speculation=history generation.async_scheduling=true", "generation.async_scheduling"),   # a custom proposer
    ("speculation=ngram speculation.model=/x", "speculation.model"),
    ("speculation=draft_model speculation.model=null", "speculation.model"),
    ("speculation.method=medusa", "speculation.method"),
    ("speculation=draft_model speculation.draft_sample_method=typical", "speculation.draft_sample_method"),
    ("speculation=history speculation.history.drafter=gpu", "speculation.history.drafter"),
    ("speculation=history speculation.history.drafter=device speculation.history.device.max_tokens=10",
     "speculation.history.device.max_tokens"),
    # bounds against memory: 2^31 ring tokens are about 236 GB
    ("speculation=history speculation.history.drafter=device speculation.history.device.max_tokens=2147483648",
     "speculation.history.device.max_tokens"),
    ("speculation=history speculation.history.drafter=device speculation.history.device.lookup=hash",
     "speculation.history.device.lookup"),
    ("speculation=history speculation.history.drafter=device speculation.history.device.kernels=maybe",
     "speculation.history.device.kernels"),
    # a key the chosen drafter does not read (the other drafter's section) is refused, naming it
    ("speculation=history speculation.history.device.max_tokens=65536", "speculation.history.device.max_tokens"),
    ("speculation=history speculation.history.device.lookup=table", "speculation.history.device.lookup"),
    ("speculation=history speculation.history.drafter=device speculation.history.host.count_tokens=4096",
     "speculation.history.host.count_tokens"),
    ("speculation=history speculation.history.drafter=device speculation.history.host.max_tokens=4096",
     "speculation.history.host.max_tokens"),
    ("speculation=history speculation.history.host.global_keys=[3]", "speculation.history.host.global_keys"),
    ("speculation=history speculation.history.host.count_tokens=2147483648", "speculation.history.host.count_tokens"),
])
def test_invalid_speculation_and_sampling_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose(override.split()))


def test_suffix_with_auto_k_is_refused_naming_both_keys():
    """vLLM's suffix proposer asserts that it drafts its configured k; 'auto' changes k per batch."""
    with pytest.raises(ConfigError, match=r"^speculation\.num_speculative_tokens: 'auto' .*speculation\.method=suffix"):
        validate(compose(["speculation=suffix", "speculation.num_speculative_tokens=auto"]))
    validate(compose(["speculation=suffix", "speculation.num_speculative_tokens=3"]))


def _ckpt(path, **cfg):
    import json
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_draft_checks_against_the_target(tmp_path, tiny_policy):
    from rlspec.speculation.checks import check_draft

    cfg = compose(["speculation=draft_model"])
    check_draft(cfg.speculation, tiny_policy, cfg.speculation.model)  # the shipped pair fits
    eagle = compose(["speculation.method=eagle3", "speculation.model=/x"]).speculation
    head = _ckpt(tmp_path / "head", architectures=["LlamaForCausalLMEagle3"], hidden_size=128, target_hidden_size=512)
    with pytest.raises(ConfigError, match="expects target hidden size 512.*hidden_size=256"):
        check_draft(eagle, tiny_policy, head)
    with pytest.raises(ConfigError, match="mtp needs a target with MTP layers"):
        check_draft(compose(["speculation.method=mtp"]).speculation, tiny_policy, None)
    other = _ckpt(tmp_path / "other", vocab_size=99)
    with pytest.raises(ConfigError, match="share a tokenizer"):
        check_draft(cfg.speculation, tiny_policy, other)


def test_speculation_maps_to_vllm_config():
    from rlspec.speculation.vllm_config import vllm_speculative_config

    d = vllm_speculative_config(compose(["speculation=draft_model",
                                         "speculation.num_speculative_tokens=5"]).speculation, "/d")
    assert d == {"method": "draft_model", "num_speculative_tokens": 5, "model": "/d",
                 "draft_sample_method": "probabilistic"}
    n = vllm_speculative_config(compose(["speculation=ngram"]).speculation, None)
    assert n == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert vllm_speculative_config(compose().speculation, None) is None
    a = vllm_speculative_config(compose(["speculation=draft_model", "speculation.num_speculative_tokens=auto",
                                         "speculation.max_speculative_tokens=4"]).speculation, "/d")
    assert a["num_speculative_tokens"] == 4  # every k 4..1 named once: each a captured CUDA-graph shape
    assert a["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, 2, 3], [3, 3, 2], [4, 1 << 20, 1]]


def test_dtype_policy_resolves_per_platform_and_corrects_low_precision_sampling():
    """CPU runs keep float32 everywhere and need no correction; GPU experiments compute in
    bfloat16 (engine, learner and log-prob worker), run CUDA graphs, and correct the sampler /
    learner mismatch with truncated importance sampling unless async GRPO corrects the lag."""
    from rlspec.checks import resolve_auto

    cpu = resolve_auto(compose())
    assert (cpu.generation.dtype, cpu.trainer.dtype, cpu.algo.off_policy_correction) == ("float32", "float32", "none")
    assert cpu.generation.enforce_eager is True
    gpu = resolve_auto(compose(["+experiment=rl_zero_qwen3_8b"], plain=False))
    assert (gpu.generation.dtype, gpu.trainer.dtype, gpu.algo.off_policy_correction) == ("bfloat16", "bfloat16", "tis")
    assert gpu.generation.enforce_eager is False
    lagged = resolve_auto(compose(["+experiment=rl_zero_qwen3_8b", "async_grpo.enabled=true",
                                   "cluster.placement=disaggregated", "cluster.num_generators=16",
                                   "cluster.learner_world_size=16", "cluster.logprob_world_size=16",
                                   "trainer.micro_batch_size=2"], plain=False))
    assert lagged.algo.off_policy_correction == "behaviour_ppo"
    # partial rollouts resume answers with newer weights: their tokens mix versions
    carried = resolve_auto(compose(["generation.partial.enabled=true"]))
    assert carried.algo.off_policy_correction == "behaviour_ppo"
    on_policy = resolve_auto(compose(["generation.partial.enabled=true", "generation.partial.max_carry_versions=0"]))
    assert on_policy.algo.off_policy_correction == "none"
    with pytest.raises(ConfigError, match="^trainer.dtype:"):
        validate(compose(["trainer.dtype=float16"]))


@pytest.mark.parametrize("env,method,refused", [
    ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, "history", "VLLM_USE_V2_MODEL_RUNNER"),   # the host drafter: V1 only
    ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, "history_device", None),   # the device drafter has V2's speculator
    ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, "suffix", "VLLM_USE_V2_MODEL_RUNNER"),
    ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, "draft_model", None),   # V2 runs model drafters
    ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, "history", None),
    ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "none", "VLLM_ENABLE_V1_MULTIPROCESSING"),
    ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "history", None),
])
def test_engine_environment_that_would_break_an_engine_is_refused_naming_the_variable(env, method, refused,
                                                                                        monkeypatch):
    for k in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = compose({"suffix": ["speculation.method=suffix"],
                   "history_device": ["speculation=history", "speculation.history.drafter=device"]}.get(
        method, [f"speculation={method}"]))
    if refused is None:
        validate(cfg)
    else:
        with pytest.raises(ConfigError, match=f"^{refused}: is "):
            validate(cfg)
