"""Cross-field and value checks (`validate`): what types cannot check, each error naming the
offending key."""
from __future__ import annotations

import copy

from rlspec.cluster.plan import receivers_off_learner_gpus, shared_weight_group_gpus
from rlspec.config.resolve import plan_of, recompute_logprobs, resolve_auto
from rlspec.config.schema import ASSETS, SPEC_METHODS, V1_ONLY_METHODS, ConfigError, RLSpecConfig
from rlspec.refit import TRANSPORTS


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")



def validate(cfg: RLSpecConfig) -> None:
    """Cross-field and value checks; raises ConfigError naming the key."""
    _validate_data(cfg)
    _validate_algo(cfg)
    _validate_generation(cfg)
    _validate_speculation(cfg)
    _validate_run(cfg)
    _validate_memory(cfg)
    _validate_environment(cfg)


def _validate_environment(cfg: RLSpecConfig, environ=None) -> None:
    """vLLM variables in the driver's environment (the actors inherit them) that would break an
    engine, named as the key."""
    import os

    problem = engine_environment_problem(cfg.speculation.method, os.environ if environ is None else environ)
    if problem is not None:
        raise ConfigError(f"{problem[0]}: {problem[1]}")


def _validate_memory(cfg: RLSpecConfig) -> None:
    """With cluster.gpu_memory_gib set, the busiest GPU must hold its roles (rlspec/cluster/memory.py)."""
    if not (cfg.cluster.gpu_memory_gib and cfg.cluster.gpus_per_node):
        return
    from rlspec.cluster.memory import check_fits, gpu_memory

    resolved = resolve_auto(copy.deepcopy(cfg))
    problem = check_fits(gpu_memory(resolved, plan_of(resolved)))
    if problem is not None:
        raise ConfigError(f"{problem[0]}: {problem[1]}")


def _validate_data(cfg: RLSpecConfig) -> None:
    from rlspec.data.templates import TEMPLATES
    from rlspec.rewards import REWARDS

    _check(bool(cfg.model.path), "model.path", "must name a checkpoint directory or hub ID")
    _check(cfg.model.max_model_len > 0, "model.max_model_len", "must be > 0")
    _check(cfg.data.template in TEMPLATES, "data.template", f"{cfg.data.template!r} not in {sorted(TEMPLATES)}")
    _check(cfg.data.reward in REWARDS, "data.reward", f"{cfg.data.reward!r} not in {sorted(REWARDS)}")
    _check(cfg.data.on_bad_row in ("skip", "error"), "data.on_bad_row", "must be 'skip' or 'error'")
    _check(0 < cfg.data.max_prompt_tokens < cfg.model.max_model_len, "data.max_prompt_tokens",
           f"must be in (0, model.max_model_len={cfg.model.max_model_len})")
    for split in ("train", "val"):
        ds = getattr(cfg.data, split)
        _check(ds.schema in ("auto", "plain", "dapo", "aime"), f"data.{split}.schema",
               "must be auto, plain, dapo or aime")
        _check(ds.limit is None or ds.limit > 0, f"data.{split}.limit", "must be > 0 or null")
    s = cfg.data.synthetic
    _check(1 <= s.min_digits <= s.max_digits, "data.synthetic.min_digits", "must be in [1, max_digits]")
    _check(s.max_terms >= 2, "data.synthetic.max_terms", "must be >= 2")
    _check(s.term_tail >= 0, "data.synthetic.term_tail", "must be >= 0")


def _validate_algo(cfg: RLSpecConfig) -> None:
    from rlspec.algo import ADVANTAGES, CORRECTIONS, LOSS_AGGREGATIONS, LOSSES

    a, g, c = cfg.algo, cfg.generation, cfg.cluster
    _check(a.advantage in ADVANTAGES, "algo.advantage", f"{a.advantage!r} not in {sorted(ADVANTAGES)}")
    _check(a.loss in LOSSES, "algo.loss", f"{a.loss!r} not in {sorted(LOSSES)}")
    _check(a.loss_agg in LOSS_AGGREGATIONS, "algo.loss_agg", f"{a.loss_agg!r} not in {sorted(LOSS_AGGREGATIONS)}")
    _check(0 <= a.clip_low < 1, "algo.clip_low", "must be in [0, 1)")
    _check(a.clip_high >= 0, "algo.clip_high", "must be >= 0")
    _check(a.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
    _check(a.off_policy_correction in ("auto", *CORRECTIONS), "algo.off_policy_correction",
           f"{a.off_policy_correction!r} not in {['auto', *CORRECTIONS]}")
    stale = (cfg.async_grpo.enabled and cfg.async_grpo.max_policy_lag >= 1) or (
        g.partial.enabled and g.partial.max_carry_versions >= 1)
    _check(not (stale and a.off_policy_correction == "none"), "algo.off_policy_correction",
           "none, but tokens can be sampled by older weights (async_grpo.max_policy_lag >= 1 or "
           "generation.partial.max_carry_versions >= 1): choose decoupled_ppo, tis, behaviour_ppo or auto")
    _check(a.recompute_logprobs is not False or a.kl_coef == 0, "algo.recompute_logprobs",
           "false, but the KL term (algo.kl_coef > 0) needs the reference policy's log-probs")
    _check(a.recompute_logprobs is not False or not cfg.speculation.online.enabled, "algo.recompute_logprobs",
           "false, but speculation.online.enabled captures the draft's features in the log-prob recompute")
    _check(a.behaviour_weight_cap >= 1.0, "algo.behaviour_weight_cap", "must be >= 1 (1 is on-policy)")
    _check(a.clip_ratio_c is None or a.clip_ratio_c > 1.0, "algo.clip_ratio_c", "must be > 1 or null (off)")
    q = cfg.async_grpo
    _check(q.max_policy_lag >= 0, "async_grpo.max_policy_lag", "must be >= 0")
    _check(q.queue_capacity is None or q.queue_capacity >= 1, "async_grpo.queue_capacity", "must be >= 1 or null")
    _check(q.on_stale in ("regenerate", "drop"), "async_grpo.on_stale", "must be regenerate or drop")
    _check(not (q.enabled and c.placement == "colocated" and c.gpus_per_node > 0), "async_grpo.enabled",
           "needs cluster.placement=disaggregated: colocated roles share every GPU one stage at a time")
    _check(not (q.enabled and g.sleep_mode), "generation.sleep_mode",
           "true, but async GRPO keeps the engines generating while the learner trains")
    _check(a.dynamic_sampling_max_rounds >= 0, "algo.dynamic_sampling_max_rounds", "must be >= 0")


def _validate_generation(cfg: RLSpecConfig) -> None:
    g = cfg.generation
    sp = cfg.speculation
    sync_only = sp.method == "suffix" or (sp.method == "history" and sp.history.drafter == "host")
    _check(not (g.async_scheduling and sync_only),
           "generation.async_scheduling", f"true, but vLLM schedules synchronously for speculation.method={sp.method}"
           f"{' with speculation.history.drafter=host (a custom proposer)' if sp.method == 'history' else ''}; "
           "leave it null or use speculation.history.drafter=device")
    _check(g.num_prompts_per_step > 0, "generation.num_prompts_per_step", "must be > 0")
    _check(g.num_generations_per_prompt >= 2, "generation.num_generations_per_prompt",
           "GRPO needs at least 2 samples per prompt")
    _check(g.max_new_tokens > 0, "generation.max_new_tokens", "must be > 0")
    _check(cfg.data.max_prompt_tokens + g.max_new_tokens <= cfg.model.max_model_len,
           "generation.max_new_tokens", f"data.max_prompt_tokens + max_new_tokens must fit "
           f"model.max_model_len={cfg.model.max_model_len}")
    _check(g.temperature > 0, "generation.temperature", "must be > 0 for RL rollouts")
    _check(g.val_temperature >= 0, "generation.val_temperature", "must be >= 0")
    # The log-prob recompute applies the temperature only; a truncated sampling distribution would
    # make every ratio off-policy without saying so.
    _check(g.top_p == 1.0, "generation.top_p", "RL rollouts support top_p=1.0 only (the log-prob "
           "recompute does not truncate the distribution yet)")
    _check(g.top_k == -1, "generation.top_k", "RL rollouts support top_k=-1 only (the log-prob "
           "recompute does not truncate the distribution yet)")
    _check(g.dtype in (None, "float32", "bfloat16", "float16"), "generation.dtype",
           "must be float32, bfloat16, float16 or null (auto)")
    pr = g.partial
    if pr.enabled:
        _check(1.0 <= pr.over_provision <= 8.0, "generation.partial.over_provision",
               "must be in [1, 8] (groups in flight over the groups a step trains; each holds its KV cache "
               "and its carried tokens)")
        _check(not (cfg.async_grpo.enabled and cfg.async_grpo.on_stale != "regenerate"), "async_grpo.on_stale",
               f"{cfg.async_grpo.on_stale!r} with generation.partial.enabled: a partial call goes out only within "
               "the lag bound and an answer past max_carry_versions is started again (regenerate), never dropped")
        _check(pr.max_carry_versions >= 0, "generation.partial.max_carry_versions", "must be >= 0")
        _check(pr.max_carries >= 0, "generation.partial.max_carries", "must be >= 0")


def _validate_speculation(cfg: RLSpecConfig) -> None:
    sp = cfg.speculation
    _check(sp.method in SPEC_METHODS, "speculation.method", f"{sp.method!r} not in {list(SPEC_METHODS)}")
    if sp.method != "none":
        k = sp.num_speculative_tokens
        _check(k == "auto" or (isinstance(k, int) and k >= 1), "speculation.num_speculative_tokens",
               f"k must be an integer >= 1 or 'auto', got {k!r}")
        _check(sp.max_speculative_tokens >= 1, "speculation.max_speculative_tokens", "must be >= 1")
        _check(sp.auto_probe_every >= 1, "speculation.auto_probe_every", "must be >= 1")
        _check(sp.auto_probe_max_cost >= 1.0, "speculation.auto_probe_max_cost", "must be >= 1")
        _check(len(sp.auto_buckets) > 0 and min(sp.auto_buckets) >= 1, "speculation.auto_buckets",
               "must be a non-empty list of batch sizes >= 1")
        _check(sp.auto_step_costs is None or sp.adaptive, "speculation.auto_step_costs",
               "applies to num_speculative_tokens=auto only")
        needs_model = sp.method in ("draft_model", "eagle3")
        _check(needs_model == (sp.model is not None), "speculation.model",
               f"method {sp.method} {'needs a draft checkpoint' if needs_model else 'takes no draft checkpoint'}")
        _check(sp.draft_sample_method in ("greedy", "probabilistic"), "speculation.draft_sample_method",
               "must be greedy or probabilistic")
        _check(1 <= sp.prompt_lookup_min <= sp.prompt_lookup_max, "speculation.prompt_lookup_min",
               "must be in [1, prompt_lookup_max]")
    if sp.method == "suffix":
        import importlib.util

        _check(importlib.util.find_spec("arctic_inference") is not None, "speculation.method",
               "suffix needs arctic-inference (vLLM's suffix decoding): `make suffix-install` installs it")
        # vLLM's suffix proposer asserts that every step drafts its configured k; 'auto' sets k per batch
        _check(sp.num_speculative_tokens != "auto", "speculation.num_speculative_tokens",
               "'auto' does not work with speculation.method=suffix (vLLM's suffix proposer drafts its "
               "configured k at every step): give an integer k")
        _check(sp.suffix.max_tree_depth >= 1, "speculation.suffix.max_tree_depth", "must be >= 1")
        _check(0 < sp.suffix.min_token_prob <= 1, "speculation.suffix.min_token_prob", "must be in (0, 1]")
    h = sp.history
    _check(h.max_match >= 1, "speculation.history.max_match", f"must be >= 1, got {h.max_match}")
    pkeys = list(h.prompt_keys)
    _check(len(pkeys) >= 1 and all(1 <= m <= h.max_match for m in pkeys) and pkeys == sorted(set(pkeys), reverse=True),
           "speculation.history.prompt_keys",
           f"must be distinct key lengths in [1, speculation.history.max_match], longest first, got {pkeys}")
    _check(0 < h.min_prob <= 1, "speculation.history.min_prob", f"must be in (0, 1], got {h.min_prob}")
    for key in ("max_rollouts_per_prompt", "max_tokens"):
        _check(getattr(h, key) >= 1, f"speculation.history.{key}", "must be >= 1")
    # the store's arena positions are int32: max_tokens response tokens with their prompt tails,
    # an insert's room and 1.5x to grow (rlspec/speculation/arena.py) stay under 2^31 positions
    _check(h.max_tokens <= 1 << 29, "speculation.history.max_tokens",
           f"must be <= {1 << 29} (the history store's positions are int32), got {h.max_tokens}")
    _check(h.max_candidates >= 1, "speculation.history.max_candidates", "must be >= 1")
    _check(h.global_index in ("counts", "chains"), "speculation.history.global_index",
           f"must be counts or chains, got {h.global_index!r}")
    # bounds against memory: about 64 bytes a counted token, 110 a device-ring token (2^28: 16 and
    # 28 GiB), on the engine's device or its host
    _check(1 << 10 <= h.count_tokens <= 1 << 28, "speculation.history.count_tokens",
           f"must be in [2^10, 2^28] (about 64 bytes each: 16 GiB at 2^28), got {h.count_tokens}")
    keys = list(h.global_keys)
    _check(all(1 <= g <= h.max_match for g in keys) and keys == sorted(set(keys), reverse=True),
           "speculation.history.global_keys",
           f"must be distinct key lengths in [1, speculation.history.max_match], longest first, got {keys}")
    _check(0 <= h.min_rollouts_per_prompt <= h.max_rollouts_per_prompt, "speculation.history.min_rollouts_per_prompt",
           "must be in [0, speculation.history.max_rollouts_per_prompt]")
    _check(h.shadow_rows >= 0, "speculation.history.shadow_rows", f"must be >= 0, got {h.shadow_rows}")
    _check(h.drafter in ("host", "device"), "speculation.history.drafter", f"must be host or device, got {h.drafter!r}")
    _check(1 << 10 <= h.device_max_tokens <= 1 << 28, "speculation.history.device_max_tokens",
           f"must be in [2^10, 2^28] (about 110 bytes each on the engine's device: 28 GiB at 2^28), "
           f"got {h.device_max_tokens}")
    o = sp.online
    if o.enabled:
        _check(sp.method == "eagle3", "speculation.online.enabled",
               f"online draft adaptation trains EAGLE-3 heads; speculation.method is {sp.method!r}")
        for key in ("push_every", "steps_per_rl_step", "batch_size", "topk", "cache_mb", "max_positions"):
            _check(getattr(o, key) >= 1, f"speculation.online.{key}", "must be >= 1")
        _check(o.lr > 0, "speculation.online.lr", "must be > 0")
        _check(o.micro_batch_size >= 0, "speculation.online.micro_batch_size", "must be >= 0 (0: the whole batch)")
        _check(not cfg.async_grpo.enabled, "speculation.online.enabled",
               "runs with the synchronous loop for now (async_grpo.enabled=false)")


def _validate_run(cfg: RLSpecConfig) -> None:
    """Placement, cluster, trainer and logging."""
    g, t, c = cfg.generation, cfg.trainer, cfg.cluster
    plan_of(cfg)  # raises naming the key that does not fit
    shipped = sorted(d.name for d in ASSETS.iterdir() if (d / "policy").is_dir())
    _check(cfg.assets in shipped, "assets", f"{cfg.assets!r} is not a shipped model family {shipped}")
    _check(c.refit in (None, *TRANSPORTS), "cluster.refit", f"must be one of {', '.join(TRANSPORTS)} or null (auto)")
    plan = plan_of(cfg)
    if c.refit in ("nccl", "ipc"):
        _check(plan.on_gpu, "cluster.refit", f"{c.refit} is vLLM's GPU transport; this plan has no GPUs "
               "(cluster.gpus_per_node=0): use group, or null to choose")
    if c.refit in ("nccl", "group"):
        shared = shared_weight_group_gpus(plan, recompute_logprobs(cfg))
        slot, names = next(iter(shared.items()), (None, []))
        _check(not shared, "cluster.refit", f"{c.refit} puts {' and '.join(names)} in one NCCL group on one GPU "
               f"(node {getattr(slot, 'node', 0)}, GPU {getattr(slot, 'index', 0)}; {len(shared)} such GPUs), "
               "which NCCL refuses; use ipc or object_store, or null to choose")
    if c.refit == "ipc":
        off = receivers_off_learner_gpus(plan, recompute_logprobs(cfg))
        _check(not off, "cluster.refit", f"ipc reaches receivers on the learners' GPUs only; {', '.join(off)} "
               "sit elsewhere: use nccl or object_store, or null to choose")
    _check(c.refit_bucket_mb >= 1, "cluster.refit_bucket_mb", "must be >= 1")
    _check(c.threads_per_actor >= 1, "cluster.threads_per_actor", "must be >= 1")
    _check(c.generator_threads is None or c.generator_threads >= 1, "cluster.generator_threads", "must be >= 1 or null")
    _check(0 <= c.generator_nice <= 19, "cluster.generator_nice", "must be in [0, 19]")
    _check(c.actor_timeout_s > 0, "cluster.actor_timeout_s", "must be > 0")
    _check(t.max_steps >= 1, "trainer.max_steps", "must be >= 1")
    _check(t.checkpoint_every >= 0, "trainer.checkpoint_every", "must be >= 0")
    _check(t.checkpoint_keep >= 1, "trainer.checkpoint_keep", "must be >= 1")
    _check(t.max_nonfinite_steps >= 0, "trainer.max_nonfinite_steps", "must be >= 0")
    _check(bool(t.resume), "trainer.resume", "must be 'auto', 'never' or a checkpoint directory")
    _check(c.max_restarts >= 0, "cluster.max_restarts", "must be >= 0")
    _check(t.val_every >= 0, "trainer.val_every", "must be >= 0")
    _check(t.lr > 0, "trainer.lr", "must be > 0")
    _check(t.optimizer in ("adamw", "sgd"), "trainer.optimizer", "must be adamw or sgd")
    _check(t.zero_stage in (0, 1, 2, 3), "trainer.zero_stage", "must be 0, 1, 2 or 3")
    _check(t.logit_chunk_tokens >= 1, "trainer.logit_chunk_tokens", "must be >= 1")
    _check(c.gpu_memory_gib is None or c.gpu_memory_gib > 0, "cluster.gpu_memory_gib", "must be > 0 or null")
    _check(t.dtype in (None, "float32", "bfloat16"), "trainer.dtype", "must be float32, bfloat16 or null (auto)")
    samples = g.num_prompts_per_step * g.num_generations_per_prompt
    mini = t.mini_batch_size or samples
    _check(t.mini_batch_size is None or (0 < mini and samples % mini == 0), "trainer.mini_batch_size",
           f"must divide the rollout batch of {samples} samples (or be null)")
    _check(t.ppo_epochs >= 1, "trainer.ppo_epochs", "must be >= 1")
    per_rank = mini // c.learner_world_size
    _check(mini % c.learner_world_size == 0, "cluster.learner_world_size",
           f"must divide the {mini} samples of each optimizer step")
    _check(t.micro_batch_size > 0 and per_rank % t.micro_batch_size == 0, "trainer.micro_batch_size",
           f"must divide the {per_rank} samples each learner rank gets per optimizer step")
    _check(cfg.logging.wandb_mode in ("offline", "online", "disabled"), "logging.wandb_mode",
           "must be offline, online or disabled")


def engine_environment_problem(method: str, environ) -> tuple[str, str] | None:
    """(variable, message) when the process environment would break an engine rlspec builds, else
    None. VLLM_ENABLE_V1_MULTIPROCESSING=1 moves the engine core into a process of its own, out of
    reach of rlspec's step timing, history drafter and CPU kernel fix; VLLM_USE_V2_MODEL_RUNNER=1
    forces Model Runner V2, which has no custom_class or suffix drafter (the engine would fail to
    start). Ray actors inherit VLLM_* variables on clusters, so the driver checks its own."""
    mp = environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if mp is not None and mp.strip().lower() not in ("", "0", "false"):
        return "VLLM_ENABLE_V1_MULTIPROCESSING", (
            f"is {mp!r}: rlspec runs vLLM's engine core inside the Generator's process (it reads its scheduler and "
            "hosts the history drafter there); unset it or set it to 0")
    v2 = environ.get("VLLM_USE_V2_MODEL_RUNNER")
    runs_v1_only = method in V1_ONLY_METHODS or method == "history"  # rlspec's name or vLLM's
    if runs_v1_only and v2 is not None and v2.strip().lower() in ("1", "true"):
        return "VLLM_USE_V2_MODEL_RUNNER", (
            f"is {v2!r}, but speculation method {method} runs only on Model Runner V1 (vLLM 0.32's V2 has no "
            "custom_class or suffix drafter): unset it")
    return None
