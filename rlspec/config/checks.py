"""Cross-field and value checks that read the settings alone (`check_values`): what types cannot
check, each error naming the offending key. The checks that need the placement plan, the memory
model or a registry are rlspec/checks.py's `validate`, which runs these first."""
from __future__ import annotations

from rlspec.config.schema import ASSETS, SPEC_METHODS, V1_ONLY_METHODS, ConfigError, RLSpecConfig
from rlspec.config.speculation import HistoryConfig


def require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def check_values(cfg: RLSpecConfig) -> None:
    """The settings' own checks; raises ConfigError naming the key."""
    _validate_data(cfg)
    _validate_algo(cfg)
    _validate_generation(cfg)
    _validate_speculation(cfg)
    _validate_run(cfg)
    _validate_environment(cfg)


def _validate_environment(cfg: RLSpecConfig, environ=None) -> None:
    """vLLM variables in the driver's environment (the actors inherit them) that would break an
    engine, named as the key."""
    import os

    problem = engine_environment_problem(vllm_method(cfg), os.environ if environ is None else environ)
    if problem is not None:
        raise ConfigError(f"{problem[0]}: {problem[1]}")


def _validate_data(cfg: RLSpecConfig) -> None:
    require(bool(cfg.model.path), "model.path", "must name a checkpoint directory or hub ID")
    require(cfg.model.max_model_len > 0, "model.max_model_len", "must be > 0")
    require(cfg.data.on_bad_row in ("skip", "error"), "data.on_bad_row", "must be 'skip' or 'error'")
    require(0 < cfg.data.max_prompt_tokens < cfg.model.max_model_len, "data.max_prompt_tokens",
            f"must be in (0, model.max_model_len={cfg.model.max_model_len})")
    for split in ("train", "val"):
        ds = getattr(cfg.data, split)
        require(ds.schema in ("auto", "plain", "dapo", "aime"), f"data.{split}.schema",
                "must be auto, plain, dapo or aime")
        require(ds.limit is None or ds.limit > 0, f"data.{split}.limit", "must be > 0 or null")
    s = cfg.data.synthetic
    require(1 <= s.min_digits <= s.max_digits, "data.synthetic.min_digits", "must be in [1, max_digits]")
    require(s.max_terms >= 2, "data.synthetic.max_terms", "must be >= 2")
    require(s.term_tail >= 0, "data.synthetic.term_tail", "must be >= 0")


def _validate_algo(cfg: RLSpecConfig) -> None:
    a, g, c = cfg.algo, cfg.generation, cfg.cluster
    require(0 <= a.clip_low < 1, "algo.clip_low", "must be in [0, 1)")
    require(a.clip_high >= 0, "algo.clip_high", "must be >= 0")
    require(a.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
    stale = (cfg.async_grpo.enabled and cfg.async_grpo.max_policy_lag >= 1) or (
        g.partial.enabled and g.partial.max_carry_versions >= 1)
    require(not (stale and a.off_policy_correction == "none"), "algo.off_policy_correction",
            "none, but tokens can be sampled by older weights (async_grpo.max_policy_lag >= 1 or "
            "generation.partial.max_carry_versions >= 1): choose decoupled_ppo, tis, behaviour_ppo or auto")
    require(a.recompute_logprobs is not False or a.kl_coef == 0, "algo.recompute_logprobs",
            "false, but the KL term (algo.kl_coef > 0) needs the reference policy's log-probs")
    require(a.recompute_logprobs is not False or not cfg.speculation.online.enabled, "algo.recompute_logprobs",
            "false, but speculation.online.enabled captures the draft's features in the log-prob recompute")
    require(a.behaviour_weight_cap >= 1.0, "algo.behaviour_weight_cap", "must be >= 1 (1 is on-policy)")
    require(a.clip_ratio_c is None or a.clip_ratio_c > 1.0, "algo.clip_ratio_c", "must be > 1 or null (off)")
    q = cfg.async_grpo
    require(q.max_policy_lag >= 0, "async_grpo.max_policy_lag", "must be >= 0")
    require(q.queue_capacity is None or q.queue_capacity >= 1, "async_grpo.queue_capacity", "must be >= 1 or null")
    require(q.on_stale in ("regenerate", "drop"), "async_grpo.on_stale", "must be regenerate or drop")
    require(not (q.enabled and c.placement == "colocated" and c.gpus_per_node > 0), "async_grpo.enabled",
            "needs cluster.placement=disaggregated: colocated roles share every GPU one stage at a time")
    require(not (q.enabled and g.sleep_mode), "generation.sleep_mode",
            "true, but async GRPO keeps the engines generating while the learner trains")
    require(a.dynamic_sampling_max_rounds >= 0, "algo.dynamic_sampling_max_rounds", "must be >= 0")


def _validate_generation(cfg: RLSpecConfig) -> None:
    g = cfg.generation
    sp = cfg.speculation
    sync_only = sp.method == "suffix" or (sp.method == "history" and sp.history.drafter == "host")
    require(not (g.async_scheduling and sync_only),
            "generation.async_scheduling", f"true, but vLLM schedules synchronously for speculation.method={sp.method}"
            f"{' with speculation.history.drafter=host (a custom proposer)' if sp.method == 'history' else ''}; "
            "leave it null or use speculation.history.drafter=device")
    require(g.num_prompts_per_step > 0, "generation.num_prompts_per_step", "must be > 0")
    require(g.num_generations_per_prompt >= 2, "generation.num_generations_per_prompt",
            "GRPO needs at least 2 samples per prompt")
    require(g.max_new_tokens > 0, "generation.max_new_tokens", "must be > 0")
    require(cfg.data.max_prompt_tokens + g.max_new_tokens <= cfg.model.max_model_len,
            "generation.max_new_tokens", f"data.max_prompt_tokens + max_new_tokens must fit "
            f"model.max_model_len={cfg.model.max_model_len}")
    require(g.temperature > 0, "generation.temperature", "must be > 0 for RL rollouts")
    require(g.val_temperature >= 0, "generation.val_temperature", "must be >= 0")
    # The log-prob recompute applies the temperature only; a truncated sampling distribution would
    # make every ratio off-policy without saying so.
    require(g.top_p == 1.0, "generation.top_p", "RL rollouts support top_p=1.0 only (the log-prob "
            "recompute does not truncate the distribution yet)")
    require(g.top_k == -1, "generation.top_k", "RL rollouts support top_k=-1 only (the log-prob "
            "recompute does not truncate the distribution yet)")
    require(g.dtype in (None, "float32", "bfloat16", "float16"), "generation.dtype",
            "must be float32, bfloat16, float16 or null (auto)")
    pr = g.partial
    if pr.enabled:
        require(1.0 <= pr.over_provision <= 8.0, "generation.partial.over_provision",
                "must be in [1, 8] (groups in flight over the groups a step trains; each holds its KV cache "
                "and its carried tokens)")
        require(not (cfg.async_grpo.enabled and cfg.async_grpo.on_stale != "regenerate"), "async_grpo.on_stale",
                f"{cfg.async_grpo.on_stale!r} with generation.partial.enabled: a partial call goes out only within "
                "the lag bound and an answer past max_carry_versions is started again (regenerate), never dropped")
        require(pr.max_carry_versions >= 0, "generation.partial.max_carry_versions", "must be >= 0")
        require(pr.max_carries >= 0, "generation.partial.max_carries", "must be >= 0")


def _validate_speculation(cfg: RLSpecConfig) -> None:
    sp = cfg.speculation
    require(sp.method in SPEC_METHODS, "speculation.method", f"{sp.method!r} not in {list(SPEC_METHODS)}")
    if sp.method != "none":
        k = sp.num_speculative_tokens
        require(k == "auto" or (isinstance(k, int) and k >= 1), "speculation.num_speculative_tokens",
                f"k must be an integer >= 1 or 'auto', got {k!r}")
        require(sp.max_speculative_tokens >= 1, "speculation.max_speculative_tokens", "must be >= 1")
        require(sp.auto_probe_every >= 1, "speculation.auto_probe_every", "must be >= 1")
        require(sp.auto_probe_max_cost >= 1.0, "speculation.auto_probe_max_cost", "must be >= 1")
        require(len(sp.auto_buckets) > 0 and min(sp.auto_buckets) >= 1, "speculation.auto_buckets",
                "must be a non-empty list of batch sizes >= 1")
        require(sp.auto_step_costs is None or sp.adaptive, "speculation.auto_step_costs",
                "applies to num_speculative_tokens=auto only")
        needs_model = sp.method in ("draft_model", "eagle3")
        require(needs_model == (sp.model is not None), "speculation.model",
                f"method {sp.method} {'needs a draft checkpoint' if needs_model else 'takes no draft checkpoint'}")
        require(sp.draft_sample_method in ("greedy", "probabilistic"), "speculation.draft_sample_method",
                "must be greedy or probabilistic")
        require(1 <= sp.prompt_lookup_min <= sp.prompt_lookup_max, "speculation.prompt_lookup_min",
                "must be in [1, prompt_lookup_max]")
    if sp.method == "suffix":
        import importlib.util

        require(importlib.util.find_spec("arctic_inference") is not None, "speculation.method",
                "suffix needs arctic-inference (vLLM's suffix decoding): `make suffix-install` installs it")
        # vLLM's suffix proposer asserts that every step drafts its configured k; 'auto' sets k per batch
        require(sp.num_speculative_tokens != "auto", "speculation.num_speculative_tokens",
                "'auto' does not work with speculation.method=suffix (vLLM's suffix proposer drafts its "
                "configured k at every step): give an integer k")
        require(sp.suffix.max_tree_depth >= 1, "speculation.suffix.max_tree_depth", "must be >= 1")
        require(0 < sp.suffix.min_token_prob <= 1, "speculation.suffix.min_token_prob", "must be in (0, 1]")
    h = sp.history
    require(h.max_match >= 1, "speculation.history.max_match", f"must be >= 1, got {h.max_match}")
    pkeys = list(h.prompt_keys)
    require(len(pkeys) >= 1 and all(1 <= m <= h.max_match for m in pkeys) and pkeys == sorted(set(pkeys), reverse=True),
            "speculation.history.prompt_keys",
            f"must be distinct key lengths in [1, speculation.history.max_match], longest first, got {pkeys}")
    require(0 < h.min_prob <= 1, "speculation.history.min_prob", f"must be in (0, 1], got {h.min_prob}")
    require(h.max_rollouts_per_prompt >= 1, "speculation.history.max_rollouts_per_prompt", "must be >= 1")
    require(h.max_candidates >= 1, "speculation.history.max_candidates", "must be >= 1")
    require(h.shadow_rows >= 0, "speculation.history.shadow_rows", f"must be >= 0, got {h.shadow_rows}")
    require(h.drafter in ("host", "device"), "speculation.history.drafter",
            f"must be host or device, got {h.drafter!r}")
    hs, H = h.host, "speculation.history.host"
    # the store's arena positions are int32: max_tokens response tokens with their prompt tails,
    # an insert's room and 1.5x to grow (rlspec/speculation/history/host/arena.py) stay under 2^31 positions
    require(1 <= hs.max_tokens <= 1 << 29, f"{H}.max_tokens",
            f"must be in [1, {1 << 29}] (the history store's positions are int32), got {hs.max_tokens}")
    require(hs.global_index in ("counts", "chains"), f"{H}.global_index",
            f"must be counts or chains, got {hs.global_index!r}")
    # bounds against memory: about 64 bytes a counted token, 110 a device-ring token (2^28: 16 and
    # 28 GiB), on the engine's device or its host
    require(1 << 10 <= hs.count_tokens <= 1 << 28, f"{H}.count_tokens",
            f"must be in [2^10, 2^28] (about 64 bytes each: 16 GiB at 2^28), got {hs.count_tokens}")
    keys = list(hs.global_keys)
    require(all(1 <= g <= h.max_match for g in keys) and keys == sorted(set(keys), reverse=True),
            f"{H}.global_keys",
            f"must be distinct key lengths in [1, speculation.history.max_match], longest first, got {keys}")
    require(0 <= hs.min_rollouts_per_prompt <= h.max_rollouts_per_prompt, f"{H}.min_rollouts_per_prompt",
            "must be in [0, speculation.history.max_rollouts_per_prompt]")
    require(1 << 10 <= h.device.max_tokens <= 1 << 28, "speculation.history.device.max_tokens",
            f"must be in [2^10, 2^28] (about 110 bytes each on the engine's device: 28 GiB at 2^28), "
            f"got {h.device.max_tokens}")
    require(h.device.lookup in ("scan", "table"), "speculation.history.device.lookup",
            f"must be scan or table, got {h.device.lookup!r}")
    require(str(h.device.kernels).lower() in ("auto", "true", "false"), "speculation.history.device.kernels",
            f"must be auto, true or false, got {h.device.kernels!r}")
    # a key the chosen drafter does not read is refused, not ignored: the other drafter's section,
    # and the host's chain keys under counts
    if sp.method == "history":
        other = "device" if h.drafter == "host" else "host"
        unread = [(other, key, f"speculation.history.drafter={h.drafter} does not read it")
                  for key in vars(getattr(h, other))]
        if hs.global_index == "counts":
            unread.append(("host", "global_keys", f"{H}.global_index=counts does not read it"))
        defaults = HistoryConfig()
        for section, key, why in unread:
            got, want = getattr(getattr(h, section), key), getattr(getattr(defaults, section), key)
            require(got == want, f"speculation.history.{section}.{key}", f"{why}: leave it at {want}, got {got}")
    o = sp.online
    if o.enabled:
        require(sp.method == "eagle3", "speculation.online.enabled",
                f"online draft adaptation trains EAGLE-3 heads; speculation.method is {sp.method!r}")
        for key in ("push_every", "steps_per_rl_step", "batch_size", "topk", "cache_mb", "max_positions"):
            require(getattr(o, key) >= 1, f"speculation.online.{key}", "must be >= 1")
        require(o.lr > 0, "speculation.online.lr", "must be > 0")
        require(o.micro_batch_size >= 0, "speculation.online.micro_batch_size", "must be >= 0 (0: the whole batch)")
        require(not cfg.async_grpo.enabled, "speculation.online.enabled",
                "runs with the synchronous loop for now (async_grpo.enabled=false)")


def _validate_run(cfg: RLSpecConfig) -> None:
    """Placement, cluster, trainer and logging."""
    g, t, c = cfg.generation, cfg.trainer, cfg.cluster
    shipped = sorted(d.name for d in ASSETS.iterdir() if (d / "policy").is_dir())
    require(cfg.assets in shipped, "assets", f"{cfg.assets!r} is not a shipped model family {shipped}")
    require(c.refit_bucket_mb >= 1, "cluster.refit_bucket_mb", "must be >= 1")
    require(c.threads_per_actor >= 1, "cluster.threads_per_actor", "must be >= 1")
    require(c.generator_threads is None or c.generator_threads >= 1, "cluster.generator_threads",
            "must be >= 1 or null")
    require(0 <= c.generator_nice <= 19, "cluster.generator_nice", "must be in [0, 19]")
    require(c.actor_timeout_s > 0, "cluster.actor_timeout_s", "must be > 0")
    require(t.max_steps >= 1, "trainer.max_steps", "must be >= 1")
    require(t.checkpoint_every >= 0, "trainer.checkpoint_every", "must be >= 0")
    require(t.checkpoint_keep >= 1, "trainer.checkpoint_keep", "must be >= 1")
    require(t.max_nonfinite_steps >= 0, "trainer.max_nonfinite_steps", "must be >= 0")
    require(bool(t.resume), "trainer.resume", "must be 'auto', 'never' or a checkpoint directory")
    require(c.max_restarts >= 0, "cluster.max_restarts", "must be >= 0")
    require(t.val_every >= 0, "trainer.val_every", "must be >= 0")
    require(t.lr > 0, "trainer.lr", "must be > 0")
    require(t.optimizer in ("adamw", "sgd"), "trainer.optimizer", "must be adamw or sgd")
    require(t.zero_stage in (0, 1, 2, 3), "trainer.zero_stage", "must be 0, 1, 2 or 3")
    require(t.logit_chunk_tokens >= 1, "trainer.logit_chunk_tokens", "must be >= 1")
    require(c.gpu_memory_gib is None or c.gpu_memory_gib > 0, "cluster.gpu_memory_gib", "must be > 0 or null")
    require(t.dtype in (None, "float32", "bfloat16"), "trainer.dtype", "must be float32, bfloat16 or null (auto)")
    samples = g.num_prompts_per_step * g.num_generations_per_prompt
    mini = t.mini_batch_size or samples
    require(t.mini_batch_size is None or (0 < mini and samples % mini == 0), "trainer.mini_batch_size",
            f"must divide the rollout batch of {samples} samples (or be null)")
    require(t.ppo_epochs >= 1, "trainer.ppo_epochs", "must be >= 1")
    per_rank = mini // c.learner_world_size
    require(mini % c.learner_world_size == 0, "cluster.learner_world_size",
            f"must divide the {mini} samples of each optimizer step")
    require(t.micro_batch_size > 0 and per_rank % t.micro_batch_size == 0, "trainer.micro_batch_size",
            f"must divide the {per_rank} samples each learner rank gets per optimizer step")
    require(cfg.logging.wandb_mode in ("offline", "online", "disabled"), "logging.wandb_mode",
            "must be offline, online or disabled")


def engine_environment_problem(method: str, environ) -> tuple[str, str] | None:
    """(variable, message) when the process environment would break an engine rlspec builds, else
    None. VLLM_ENABLE_V1_MULTIPROCESSING=1 moves the engine core into a process of its own, out of
    reach of rlspec's step timing, history drafter and CPU kernel fix; VLLM_USE_V2_MODEL_RUNNER=1
    forces Model Runner V2, which has no custom_class or suffix drafter (the engine would fail to
    start). Ray actors inherit VLLM_* variables on clusters, so the driver checks its own. method:
    vLLM's name (`vllm_method`: the host history drafter is custom_class, the device one ngram_gpu)."""
    mp = environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if mp is not None and mp.strip().lower() not in ("", "0", "false"):
        return "VLLM_ENABLE_V1_MULTIPROCESSING", (
            f"is {mp!r}: rlspec runs vLLM's engine core inside the Generator's process (it reads its scheduler and "
            "hosts the history drafter there); unset it or set it to 0")
    v2 = environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if method in V1_ONLY_METHODS and v2 is not None and v2.strip().lower() in ("1", "true"):
        return "VLLM_USE_V2_MODEL_RUNNER", (
            f"is {v2!r}, but speculation method {method} runs only on Model Runner V1 (vLLM 0.32's V2 has no "
            "custom_class or suffix drafter): unset it")
    return None


def vllm_method(cfg: RLSpecConfig) -> str:
    """The speculative method vLLM's engine is given (rlspec/speculation/vllm_config.py)."""
    sp = cfg.speculation
    if sp.method != "history":
        return sp.method
    return "ngram_gpu" if sp.history.drafter == "device" else "custom_class"
