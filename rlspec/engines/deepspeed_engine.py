"""DeepSpeed engine set-up for the learner: ZeRO stage from config, gloo on CPU, NCCL on GPU."""
from __future__ import annotations

import datetime
import math
import os

import torch

from rlspec.config import TrainerConfig, fp32_grad_accumulation


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     timeout_s: float = 1800.0) -> None:
    os.environ.update(RANK=str(rank),
                      LOCAL_RANK="0" if not torch.cuda.is_available() else os.environ.get("LOCAL_RANK", "0"),
                      WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    import logging

    import deepspeed
    import deepspeed.ops

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

    # The shared-memory comm op JIT-compiles on first use (tens of seconds) and gloo serves CPU runs well.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               auto_mpi_discovery=False, verbose=False,
                               timeout=datetime.timedelta(seconds=timeout_s))


def ds_config(t: TrainerConfig, samples_per_step: int, world_size: int) -> dict:
    gas = samples_per_step // (t.micro_batch_size * world_size)
    cfg = {
        "train_batch_size": samples_per_step,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": t.grad_clip if t.zero_stage else 0.0,  # stage 0: the Skipping optimizer clips
        "zero_optimization": {"stage": t.zero_stage},
        "zero_allow_untested_optimizer": True,  # a client torch AdamW: no fused-op JIT build
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if t.dtype is None:
        raise ValueError("trainer.dtype is unresolved: resolve_auto(cfg) first")
    if t.dtype == "bfloat16":  # bf16 compute, fp32 master weights and optimizer state
        cfg["bf16"] = {"enabled": True}
        if fp32_grad_accumulation(t):
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


class _Skipping:
    """For ZeRO stage 0, over a torch optimizer: clips (DeepSpeed's clipping is off then) and
    refuses a non-finite gradient: no parameter, moment or step count moves, and `overflow` is set,
    which DeepSpeed's engine reads to report the step as not applied and to hold the scheduler back.
    It also leaves the pre-clip norm where the engine picks it up (`_global_grad_norm`), which
    DeepSpeed does not compute without ZeRO. ZeRO 1-3 do all of this in their own optimizer."""

    overflow = False

    def __init__(self, params, grad_clip: float, **kw):
        super().__init__(params, **kw)
        self.grad_clip = grad_clip

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else float("inf"))
        self._global_grad_norm = float(norm)
        self.overflow = not math.isfinite(self._global_grad_norm)
        return None if self.overflow else super().step(closure)


class SkippingAdamW(_Skipping, torch.optim.AdamW):
    pass


class SkippingSGD(_Skipping, torch.optim.SGD):
    pass


# trainer.optimizer -> (torch optimizer under ZeRO 1-3, its stage-0 form, keyword arguments of it)
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, SkippingAdamW, lambda t: dict(lr=t.lr, weight_decay=t.weight_decay,
                                                               betas=(0.9, 0.999), eps=1e-8)),
    "sgd": (torch.optim.SGD, SkippingSGD, lambda t: dict(lr=t.lr, weight_decay=t.weight_decay, momentum=0.0)),
}


# The optimizer wrappers DeepSpeed picks for rlspec's settings (trainer.zero_stage, trainer.dtype):
# the learner's Skipping optimizers under ZeRO 0 in fp32, FP16_UnfusedOptimizer under ZeRO 0 in
# bf16, BF16_Optimizer under ZeRO-1 in bf16 (fp32 gradient accumulation), ZeRO-1/2's and ZeRO-3's
# optimizers. The learner runs each micro-batch through the engine's forward, which sets up each
# wrapper's backward; any other wrapper is refused rather than trusted.
CHECKED_OPTIMIZERS = ("SkippingAdamW", "SkippingSGD", "FP16_UnfusedOptimizer", "BF16_Optimizer",
                      "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")


def check_optimizer(engine, t: TrainerConfig) -> None:
    name = type(engine.optimizer).__name__
    if name not in CHECKED_OPTIMIZERS:
        raise ValueError(f"trainer.zero_stage={t.zero_stage}, trainer.dtype={t.dtype}: DeepSpeed wraps the optimizer "
                         f"in {name}, under which the learner's micro-batches are not checked "
                         f"(checked: {', '.join(CHECKED_OPTIMIZERS)})")


def make_engine(model: torch.nn.Module, t: TrainerConfig, samples_per_step: int, world_size: int,
                extra: dict | None = None):
    """(engine, scheduler): the optimizer (trainer.optimizer) as a client optimizer (no fused-op JIT
    build), linear warmup; refused unless DeepSpeed's wrapper of it is one the learner is checked
    under. extra: more DeepSpeed config (tests)."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    plain, skipping, kwargs = OPTIMIZERS[t.optimizer]
    opt = skipping(params, t.grad_clip, **kwargs(t)) if t.zero_stage == 0 else plain(params, **kwargs(t))
    warm = max(t.warmup_steps, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    engine, _, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                               config={**ds_config(t, samples_per_step, world_size), **(extra or {})})
    check_optimizer(engine, t)
    return engine, sched
