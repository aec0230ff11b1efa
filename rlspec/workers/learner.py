"""Learner: one DeepSpeed rank running the GRPO update over micro-batches."""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import replace

import torch

from rlspec.algo import behaviour_weights, merge_weight_sums, policy_loss, ratio_reference, weight_sums
from rlspec.algo.batching import micro_batches
from rlspec.algo.logprobs import LogprobModel, prompt_cache_supported, prompt_plan
from rlspec.algo.losses import LossInputs
from rlspec.config import AlgoConfig, GenerationConfig, ModelConfig, TrainerConfig
from rlspec.engines.deepspeed_engine import init_distributed, make_engine
from rlspec.messages import MiniBatch, TrainBatch
from rlspec.models import ModelPaths, load_causal_lm, local_device, release_cached_memory
from rlspec.refit.ports import endpoint


def finite_inputs(batch: TrainBatch) -> bool:
    """Advantages and the log-probs the loss uses are finite (a NaN there poisons every gradient)."""
    resp = batch.loss_mask != 0
    parts = [batch.advantages, batch.behaviour_logprobs[resp]]
    parts += [lp[resp] for lp in (batch.old_logprobs, batch.ref_logprobs) if lp is not None]
    return all(bool(torch.isfinite(p).all()) for p in parts)


class Learner:
    def __init__(self, *, paths: ModelPaths, model: ModelConfig, algo: AlgoConfig, trainer: TrainerConfig,
                 generation: GenerationConfig, rank: int, world_size: int, rendezvous: tuple[str, int],
                 threads: int, device: str | None = None, timeout_s: float = 1800.0):
        """algo: resolved (rlspec.checks.resolve_auto). rendezvous: (address, port) of DeepSpeed's group.
        device: where this rank computes (None: the one its placement gives it). timeout_s: how
        long DeepSpeed's collectives (its rendezvous included) may wait."""
        if algo.off_policy_correction == "auto":
            raise ValueError("algo.off_policy_correction is 'auto': resolve_auto(cfg) before building a Learner")
        paths.check_visible("Learner")
        torch.set_num_threads(threads)
        torch.manual_seed(trainer.seed)
        init_distributed(rank, world_size, *rendezvous, timeout_s=timeout_s)
        self.algo, self.trainer, self.temperature = algo, trainer, generation.temperature
        self.correction = algo.off_policy_correction
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device else local_device()
        module = load_causal_lm(paths.model, trust_remote_code=model.trust_remote_code).to(self.device)
        module.config.use_cache = False
        if trainer.gradient_checkpointing:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.shared_prompts = (trainer.shared_prompt_forward and prompt_cache_supported(module)
                               and not trainer.gradient_checkpointing)
        # DeepSpeed's batch is one optimizer step's: a mini-batch
        samples_per_step = (trainer.mini_batch_size
                            or generation.num_prompts_per_step * generation.num_generations_per_prompt)
        # the engine runs log-probs as its module's forward: DeepSpeed's forward and hooks run for
        # every micro-batch (engine.module.lm is the causal LM)
        self.engine, self.sched = make_engine(LogprobModel(module), trainer, samples_per_step, world_size)
        self.policy_version = 0
        self.sender = None  # join_refit: its end of the refit (refit.sender.RefitSender)

    def train_step(self, parts: list[MiniBatch], epochs: int = 1) -> tuple[dict, dict]:
        """epochs x len(parts) optimizer steps, one per mini-batch of this rank's shard, in order.
        Each part carries its global mini-batch's loss-carrying token and sequence counts (all
        ranks), the loss's denominators. Returns (partial sums that add up over ranks to the mean
        of the steps' losses and metrics, rank stats)."""
        t0 = time.perf_counter()
        # Planned on the host (which rows, how wide, which share a prompt); each micro-batch moves
        # to the device as it is taken, and results leave as Python floats.
        ok = torch.tensor([float(all(finite_inputs(p.batch) for p in parts))], device=self.device)
        if self.world_size > 1:  # every rank must skip together, or the collectives would hang
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)  # NCCL: device tensors
        if not ok.item():
            # Skipped before the engine sees it: weights, optimizer, scheduler and DeepSpeed's
            # step counters stay exactly as they were.
            self.policy_version += 1
            return {"loss": float("nan")}, {"skipped": 1.0, "grad_norm": float("nan"), "optimizer_steps": 0.0,
                                            "lr": float(self.sched.get_last_lr()[0]), "micro_batches": 0.0,
                                            "seconds": time.perf_counter() - t0}
        steps = epochs * len(parts)
        if steps > 1:
            # Every step's ratio is taken against the weights before the first one: without a
            # recompute, this rank's own no-grad pass over its rows now.
            parts = [replace(p, batch=replace(p.batch, old_logprobs=self._logprobs(p.batch, p.micro_batches)))
                     if p.batch.old_logprobs is None else p for p in parts]
        self.engine.train()
        sums, norms, applied, micro = defaultdict(float), [], True, 0
        for epoch in range(epochs):
            for p in parts:
                step_sums, n = self._optimizer_step(p, steps, first_epoch=epoch == 0)
                for k, v in step_sums.items():
                    sums[k] += v
                micro += n
                norms.append(float(self.engine.get_global_grad_norm() or 0.0))
                applied = applied and self.engine.was_step_applied()
        # ZeRO 1-3 refuse a non-finite gradient themselves (the step is not applied); without ZeRO,
        # the Skipping optimizer does. Should an update with a non-finite gradient still have gone in under
        # stage 0 (an optimizer wrapper that ignores `overflow`), the weights are lost: end the run.
        finite = all(map(math.isfinite, norms)) and math.isfinite(sums["loss"])
        skipped = not applied or not finite
        if self.trainer.zero_stage == 0 and applied and not finite:
            raise FloatingPointError("non-finite gradient under ZeRO stage 0 and the update was applied; "
                                     "resume from the last checkpoint")
        stats = {"skipped": float(skipped), "grad_norm": sum(norms) / len(norms), "optimizer_steps": float(steps),
                 "lr": float(self.sched.get_last_lr()[0]), "micro_batches": float(micro),
                 "seconds": time.perf_counter() - t0}
        self.policy_version += 1
        release_cached_memory(self.device)
        return dict(sums), stats

    @torch.no_grad()
    def _logprobs(self, batch: TrainBatch, count: int = 0) -> torch.Tensor:
        """[N, T] this rank's current log-probs of the batch's tokens, on the host, in `count`
        micro-batches (0: as many as the rows need), as many forward passes as every other rank's."""
        out = torch.zeros(batch.loss_mask.shape)
        for idx, width in micro_batches(batch.attention_mask, self.trainer.micro_batch_size, count or None):
            mb = batch.rows(idx, width).to(self.device)
            out[idx, : width - 1] = self.engine(mb.input_ids, mb.attention_mask, self.temperature,
                                                chunk_tokens=self.trainer.logit_chunk_tokens).cpu()
        return out * (batch.loss_mask != 0)

    def _optimizer_step(self, part: MiniBatch, steps: int, first_epoch: bool) -> tuple[dict, int]:
        """Forward and backward of one mini-batch's micro-batches; DeepSpeed steps the optimizer at
        the last (its gradient accumulation covers exactly one mini-batch). Partial sums of the
        step's loss and metrics, each divided by `steps` (so the run reports their mean over the
        steps), and how many micro-batches ran."""
        batch, num_tokens, num_seqs = part.batch, part.num_tokens, part.num_seqs
        sums = defaultdict(float)
        chunks = micro_batches(batch.attention_mask, self.trainer.micro_batch_size, part.micro_batches or None)
        # Where rows with zero gradient were left out, the metrics are means over the rows trained
        # (the loss's denominators stay the whole mini-batch's: the loss and gradient are unchanged).
        trained_tokens = num_tokens if part.trained_tokens is None else part.trained_tokens
        trained_seqs = num_seqs if part.trained_seqs is None else part.trained_seqs
        rescale = (num_seqs / max(trained_seqs, 1.0) if self.algo.loss_agg == "seq_mean"
                   else num_tokens / max(trained_tokens, 1.0))
        for i, (idx, width) in enumerate(chunks):
            # the step's micro-batch count varies, so the boundary is set by hand, not counted
            self.engine.set_gradient_accumulation_boundary(i == len(chunks) - 1)
            host = batch.rows(idx, width)
            mb = host.to(self.device)
            shared = self.shared_prompts and host.prompt_lengths is not None
            plan = prompt_plan(host.input_ids, host.attention_mask, host.prompt_lengths) if shared else None
            logp, ent = self.engine(mb.input_ids, mb.attention_mask, self.temperature, with_entropy=True, plan=plan,
                                    chunk_tokens=self.trainer.logit_chunk_tokens)
            # The proximal policy is the weights before the batch's first update: with one step per
            # batch the weights do not move between micro-batches, so without a recompute it is
            # this forward pass, detached (ratio 1, as in PPO's first epoch); with several, the
            # recompute or train_step's own pass. The ratio is taken against it (behaviour_ppo:
            # against the sampler's log-probs), and the behaviour weight corrects for the older
            # weights that sampled the tokens (none, behaviour_ppo: the mask, weight 1).
            prox = logp.detach() if mb.old_logprobs is None else mb.old_logprobs
            behav, cap = mb.behaviour_logprobs, self.algo.behaviour_weight_cap
            old = ratio_reference(prox, behav, self.correction)
            weight, mask = behaviour_weights(prox, behav, mb.loss_mask, self.correction, cap)
            if first_epoch:  # sampler vs learner (before any update) log-probs, as the loop reports them
                resp, learner_lp = mb.loss_mask != 0, logp.detach() if steps == 1 else prox
                sums["mismatch_sum"] += float((behav - learner_lp).abs().masked_fill(~resp, 0.0).sum())
                sums["mismatch_tokens"] += float(resp.sum())
                # pi_prox / pi_behav, reported whatever the correction
                sums.update(merge_weight_sums(sums, weight_sums(prox, behav, mb.loss_mask, cap)))
            x = LossInputs(logp=logp, old_logp=old, advantages=mb.advantages, mask=mask, ref_logp=mb.ref_logprobs,
                           weight=weight)
            loss, metrics = policy_loss(self.algo.loss, x, clip_low=self.algo.clip_low,
                                        clip_high=self.algo.clip_high, kl_coef=self.algo.kl_coef,
                                        agg=self.algo.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                                        clip_ratio_c=self.algo.clip_ratio_c)
            # The denominators are the mini-batch's, so micro-batch losses add up to its loss;
            # DeepSpeed averages gradients over ranks, hence the world-size factor.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            self.engine.step()
            sums["loss"] += loss.item() / steps
            for k, v in metrics.items():
                sums[k] += float(v) * (1.0 if k == "pg_loss" else rescale) / steps
            sums["entropy"] += float((ent * x.mask.float()).sum() / max(trained_tokens, 1.0)) / steps
        return sums, len(chunks)

    def save_checkpoint(self, path: str) -> None:
        """DeepSpeed state (weights, optimizer, scheduler, this rank's partitions) + RNG, into path/learner."""
        cuda_rng = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None
        self.engine.save_checkpoint(path, tag="learner", save_latest=False,
                                    client_state={"torch_rng": torch.get_rng_state(), "cuda_rng": cuda_rng,
                                                  "policy_version": self.policy_version})

    def load_checkpoint(self, path: str) -> int:
        _, client = self.engine.load_checkpoint(path, tag="learner", load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
        torch.set_rng_state(client["torch_rng"])
        if client.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(client["cuda_rng"])
        self.policy_version = client["policy_version"]
        return self.policy_version

    def full_weights(self, dtype: str = "float32", tied_head: bool = True) -> dict[str, torch.Tensor]:
        """Hugging Face-named full weights (gathered under ZeRO-3) on CPU in `dtype` (the
        engines' for a refit: a tied output layer as lm_head.weight too); empty off rank 0."""
        source = self._source(dtype, 256 << 20, tied_head)
        if self.rank != 0:
            for _ in source:  # the gathers are collectives
                pass
            return {}
        return {n: t.to("cpu").clone() for n, t in source}

    def save_pretrained(self, path: str, tokenizer_dir: str | None = None) -> None:
        """Write the current policy in Hugging Face format (rank 0)."""
        weights = self.full_weights(tied_head=False)
        if self.rank != 0:
            return
        self.engine.module.lm.save_pretrained(path, state_dict=weights)
        if tokenizer_dir:
            from transformers import AutoTokenizer
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)

    # -- the refit (rlspec/refit/): rank 0 drives vLLM's weight-transfer API ----------------------
    def _source(self, dtype: str, bucket_bytes: int, tied_head: bool = True):
        """This rank's weights as vLLM's WeightSource (imported here: a driver imports this class
        without vLLM)."""
        from rlspec.refit.source import LearnerSource
        return LearnerSource(self.engine.module.lm, self.trainer.zero_stage == 3, getattr(torch, dtype), bucket_bytes,
                             tied_head)

    def refit_endpoint(self) -> tuple[str, int]:
        """Where the refit group meets (rank 0's node, a free port)."""
        return endpoint()

    def join_refit(self, transport: str, receivers: list, address: str, port: int, world_size: int,
                   dtype: str, bucket_bytes: int, timeout_s: float) -> int:
        """Every rank builds its end of `transport` (nccl, ipc or group) over this learner's weights
        in the engines' `dtype`; rank 0 rendezvouses with the receivers ((name, actor, first rank))."""
        from rlspec.refit.sender import RefitSender

        source = self._source(dtype, bucket_bytes)
        self.sender = RefitSender(transport, source, receivers, self.rank, address, port, world_size, bucket_bytes,
                                  "nccl" if self.device.type == "cuda" else "gloo", timeout_s)
        return self.rank

    def refit(self, version: int) -> float:
        """One refit round: rank 0 sends, the other ranks take part in the gathers (ZeRO-3) and,
        under ipc, in the handle exchange; seconds taken."""
        return self.sender.send(version)

    def ping(self) -> int:
        return self.policy_version
