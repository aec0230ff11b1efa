"""Generator: a vLLM engine producing G samples per prompt with behaviour log-probs."""
from __future__ import annotations

import logging
import time

import torch

from rlspec.config import GenerationConfig, SpeculationConfig
from rlspec.engines.vllm_engine import make_llm, reload_weights
from rlspec.messages import RolloutBatch


class Generator:
    def __init__(self, model_path: str, gen: GenerationConfig, spec: SpeculationConfig,
                 max_model_len: int, seed: int, threads: int, tokenizer: str | None = None):
        torch.set_num_threads(threads)
        self.gen = gen
        self.llm = make_llm(model_path, gen, max_model_len, seed, tokenizer)
        # Every in-place reload warns that rotary tables (not weights) were not loaded.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.policy_version = 0

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, max_tokens: int,
                 seed: int | None = None, top_p: float = 1.0, top_k: int = -1) -> RolloutBatch:
        """n samples per prompt, prompt-major: rows [i*n, (i+1)*n) belong to prompt i."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                max_tokens=max_tokens, logprobs=0, seed=seed, detokenize=False)
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
        return RolloutBatch(prompts, responses, logprobs, truncated, self.policy_version, seconds)

    def push_weights(self, weights: dict[str, torch.Tensor], version: int) -> float:
        """Refit the target policy's weights; returns seconds taken."""
        if self.tied_embeddings and "lm_head.weight" not in weights:
            # An in-place reload unties vLLM's lm_head from the embedding: without this the
            # engine keeps sampling from the old output layer.
            weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
        seconds = reload_weights(self.llm, weights.items())
        self.policy_version = version
        return seconds

    def ping(self) -> int:
        return self.policy_version
