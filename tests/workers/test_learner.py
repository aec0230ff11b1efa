"""Numerical faults in the Learner (a real DeepSpeed engine, no Ray): a non-finite loss or
gradient leaves weights, optimizer and scheduler untouched and is reported as skipped."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import child_env, report, rounding_bound, tiny_paths
from rlspec.config import AlgoConfig, GenerationConfig, ModelConfig, TrainerConfig
from rlspec.messages import MiniBatch, TrainBatch


def batch(nan_advantage: bool) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (4, 12), generator=g)
    mask = torch.zeros(4, 11)
    mask[:, 5:] = 1
    adv = torch.tensor([1.0, -1.0, 0.5, float("nan") if nan_advantage else -0.5])
    old = torch.full((4, 11), -3.0)
    return TrainBatch(ids, torch.ones_like(ids), mask, adv, old, old.clone(), None)


def learner_of(t: TrainerConfig, port: int):
    """A one-rank Learner (no Ray) on the tiny policy, 4 samples per step, no off-policy correction."""
    from rlspec.workers.learner import Learner

    return Learner(paths=tiny_paths(), model=ModelConfig(), algo=AlgoConfig(off_policy_correction="none"), trainer=t,
                   generation=GenerationConfig(num_prompts_per_step=1, num_generations_per_prompt=4), rank=0,
                   world_size=1, rendezvous=("127.0.0.1", port), threads=1)


def test_nonfinite_update_is_skipped_and_the_next_one_applies(zero_stage=1):
    """(One engine per process: DeepSpeed keeps its process groups, so one ZeRO stage here.)"""
    t = TrainerConfig(micro_batch_size=2, zero_stage=zero_stage, dtype="float32")
    learner = learner_of(t, 29600 + zero_stage)
    before = learner.full_weights()
    opt_steps = learner.engine.global_steps
    metrics, stats = learner.train_step([MiniBatch(batch(nan_advantage=True), 28.0, 4.0)])
    assert stats["skipped"] == 1.0 and math.isnan(metrics["loss"])
    after = learner.full_weights()
    assert all(torch.equal(before[k], after[k]) for k in before) and learner.engine.global_steps == opt_steps
    metrics, stats = learner.train_step([MiniBatch(batch(nan_advantage=False), 28.0, 4.0)])
    assert stats["skipped"] == 0.0 and math.isfinite(metrics["loss"])
    assert any(not torch.equal(before[k], v) for k, v in learner.full_weights().items())


def gradient_fault(zero_stage: int, dtype: str = "float32") -> None:
    """Finite inputs, a non-finite gradient (a backward hook turns one weight's gradient into NaN,
    as an overflow would): the engine refuses the update (weights, optimizer moments and the
    scheduler stay), the Learner reports it skipped, and the next clean step applies. In bfloat16
    DeepSpeed wraps the optimizer as it does on GPUs (it picks the wrapper from the dtypes, not the
    accelerator): FP16_UnfusedOptimizer in bf16 under ZeRO 0, bf16 ZeRO partitions above; the
    wrapper does the refusing."""
    t = TrainerConfig(micro_batch_size=2, zero_stage=zero_stage, warmup_steps=10, dtype=dtype)
    learner = learner_of(t, 29610 + 2 * zero_stage + (dtype == "bfloat16"))
    wrapper = type(learner.engine.optimizer).__name__
    assert wrapper == {(0, "float32"): "SkippingAdamW",
                       (0, "bfloat16"): "FP16_UnfusedOptimizer"}.get((zero_stage, dtype), wrapper)
    # moments exist now
    assert learner.train_step([MiniBatch(batch(nan_advantage=False), 28.0, 4.0)])[1]["skipped"] == 0.0
    before, lr = learner.full_weights(), learner.sched.get_last_lr()
    moments = [v.clone() for s in learner.engine.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v)] if zero_stage == 0 else []
    emb = learner.engine.module.lm.get_input_embeddings().weight
    hook = emb.register_hook(lambda g: torch.full_like(g, float("nan")))
    metrics, stats = learner.train_step([MiniBatch(batch(nan_advantage=False), 28.0, 4.0)])
    assert stats["skipped"] == 1.0 and not math.isfinite(stats["grad_norm"]), (metrics, stats)
    after = learner.full_weights()
    assert all(torch.equal(before[k], after[k]) for k in before) and learner.sched.get_last_lr() == lr
    now = [v for s in learner.engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert all(torch.equal(a, b) for a, b in zip(moments, now)) and len(moments) == (len(now) if zero_stage == 0 else 0)
    hook.remove()
    metrics, stats = learner.train_step([MiniBatch(batch(nan_advantage=False), 28.0, 4.0)])
    assert stats["skipped"] == 0.0 and math.isfinite(metrics["loss"]) and learner.sched.get_last_lr() != lr
    assert any(not torch.equal(before[k], v) for k, v in learner.full_weights().items())
    print("gradient fault skipped", flush=True)


@pytest.mark.parametrize("zero_stage,dtype", [(0, "float32"), (1, "float32"), (0, "bfloat16"), (1, "bfloat16")])
def test_nonfinite_gradient_is_skipped_by_the_engine(zero_stage, dtype):
    """In a fresh process per stage (DeepSpeed keeps its process groups)."""
    r = subprocess.run([sys.executable, "-c", ("from test_learner import gradient_fault; "
                                               f"gradient_fault({zero_stage}, {dtype!r})")],
                       cwd=Path(__file__).parent, env=child_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "gradient fault skipped" in r.stdout, r.stderr[-3000:]


def test_an_optimizer_wrapper_the_learner_is_not_checked_under_is_refused():
    """A torch optimizer DeepSpeed left unwrapped under ZeRO 0 (the learner's own step rules clip
    and skip there) is not one the reference matrix covers: refused by name, naming the keys."""
    from types import SimpleNamespace

    from rlspec.engines.deepspeed_engine import check_optimizer

    t = TrainerConfig(micro_batch_size=2, zero_stage=0, dtype="float32")
    engine = SimpleNamespace(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    with pytest.raises(ValueError, match=r"trainer.zero_stage=0, trainer.dtype=float32: .* in SGD, .*checked: "):
        check_optimizer(engine, t)


def rows(n: int = 8, seed: int = 1) -> TrainBatch:
    """n rows of 12 tokens, the last 7 the response, advantages of both signs, sampler log-probs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (n, 12), generator=g)
    mask = torch.zeros(n, 11)
    mask[:, 4:] = 1
    adv = torch.randn(n, generator=g)
    return TrainBatch(ids, torch.ones_like(ids), mask, adv, -3 * torch.rand(n, 11, generator=g) * mask)


# Two training paths compared agree to float rounding (conftest.rounding_bound: about 4e-4 for the
# tiny policy, where a machine shows about 5e-6). The updates compared are SGD's (lr x the clipped
# gradient: linear in it), with lr large enough that the weights' own rounding (2^-24 |w|) is small
# beside the update. Adam's first step is about lr x sign(g): a near-zero gradient whose sign flips
# with the summation order moves a weight by up to lr, so two Adam updates agree only to what one
# machine happened to give.
def policy_config() -> dict:
    import json

    return json.loads((Path(tiny_paths().model) / "config.json").read_text())


RELATIVE = rounding_bound(policy_config(), policy_config()["num_hidden_layers"], positions=12, tokens=16 * 11)
SGD_LR = 10.0  # one step moves the weights by lr x the clipped gradient (norm <= lr): far above u |w|


def relative_off(have: dict, want: dict, init: dict) -> float:
    """|have - want| over |want - init|, over every weight: how far one path's update is from the
    other's, relative to the update."""
    flat = lambda w: torch.cat([w[k].reshape(-1).double() for k in init])  # noqa: E731
    update = flat(want) - flat(init)
    assert float(update.abs().max()) > 0  # the step moved the weights
    return float((flat(have) - flat(want)).norm() / update.norm())


def initial_weights() -> dict:
    from rlspec.models import load_causal_lm

    return {k: v.detach() for k, v in load_causal_lm(tiny_paths().model).named_parameters()}


def test_adamw_is_configured_as_documented():
    """trainer.optimizer=adamw (what runs train with): AdamW, betas 0.9 / 0.999, eps 1e-8, the
    configured lr and weight decay; sgd: no momentum. The comparisons below run SGD."""
    from rlspec.engines.deepspeed_engine import OPTIMIZERS

    t = TrainerConfig(lr=3e-4, weight_decay=0.01)
    plain, skipping, kwargs = OPTIMIZERS["adamw"]
    opt = skipping([torch.nn.Parameter(torch.zeros(2))], 1.0, **kwargs(t))
    group = opt.param_groups[0]
    assert issubclass(plain, torch.optim.AdamW) and isinstance(opt, torch.optim.AdamW)
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (3e-4, 0.01, (0.9, 0.999), 1e-8)
    plain, skipping, kwargs = OPTIMIZERS["sgd"]
    assert isinstance(skipping([torch.nn.Parameter(torch.zeros(2))], 1.0, **kwargs(t)), torch.optim.SGD)
    assert kwargs(t)["momentum"] == 0.0


def reference_update(batch: TrainBatch, size: int, epochs: int, lr: float, clip: float,
                     device: str = "cpu") -> dict[str, torch.Tensor]:
    """The update by hand in plain torch: SGD steps over consecutive mini-batches of `size` rows,
    each with the PPO ratio against the initial weights' log-probs, clip-higher [0.8, 1.28] and
    dual clip 3, token mean over the mini-batch, gradients clipped to `clip`. Weights back on the
    host."""
    from rlspec.algo.logprobs import sequence_logprobs
    from rlspec.algo.losses import LossInputs, ppo_clip_loss
    from rlspec.models import load_causal_lm

    batch = batch.to(device)
    model = load_causal_lm(tiny_paths().model).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.0)
    with torch.no_grad():
        old = sequence_logprobs(model, batch.input_ids, batch.attention_mask) * batch.loss_mask
    for _ in range(epochs):
        for lo in range(0, len(batch), size):
            sl = slice(lo, lo + size)
            logp = sequence_logprobs(model, batch.input_ids[sl], batch.attention_mask[sl])
            x = LossInputs(logp=logp, old_logp=old[sl], advantages=batch.advantages[sl], mask=batch.loss_mask[sl])
            loss, _ = ppo_clip_loss(x, 0.2, 0.28, 0.0, "token_mean", float(batch.loss_mask[sl].sum()), float(size),
                                    clip_ratio_c=3.0)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
    return {k: v.detach().cpu() for k, v in model.named_parameters()}


def mini_batch_run(size: int, epochs: int, port: int) -> tuple[dict, dict, dict]:
    from rlspec.loops.step import mini_batches

    from rlspec.workers.learner import Learner

    t = TrainerConfig(micro_batch_size=2, zero_stage=0, dtype="float32", mini_batch_size=size, ppo_epochs=epochs,
                      lr=SGD_LR, optimizer="sgd")
    learner = Learner(paths=tiny_paths(), model=ModelConfig(), algo=AlgoConfig(off_policy_correction="none"),
                      trainer=t, generation=GenerationConfig(num_prompts_per_step=2, num_generations_per_prompt=4),
                      rank=0, world_size=1, rendezvous=("127.0.0.1", port), threads=1)
    b = rows()
    (parts,) = mini_batches(b, torch.ones(len(b)), size, 1)
    sums, stats = learner.train_step(parts, epochs)
    return learner.full_weights(), sums, stats


def mini_batches_match_the_reference() -> None:
    """Run in a fresh process (DeepSpeed keeps its process groups). The reference runs on the
    Learner's device; the two take their sums in other orders (the Learner trims each
    micro-batch to its longest row), so they agree to float rounding: RELATIVE. The ratio is past the clip
    (SGD_LR's steps are large), so the clipped branches are compared too."""
    from rlspec.models import local_device

    device = local_device()
    got, sums, stats = mini_batch_run(2, 1, 29640)
    want = reference_update(rows(), 2, 1, SGD_LR, 1.0, str(device))
    assert stats["optimizer_steps"] == 4 and stats["skipped"] == 0.0
    report(f"4 mini-batches on {device.type} against the hand-computed reference, update off by",
           relative_off(got, want, initial_weights()), RELATIVE)
    assert sums["clip_frac"] > 0, sums  # later mini-batches move the ratio past the clip
    print(f"4 mini-batches: clip_frac {sums['clip_frac']:.3f}", flush=True)


def test_four_mini_batches_match_a_hand_computed_reference():
    """8 rows, mini-batches of 2 (4 SGD steps, ZeRO 0): the Learner's weights equal a plain-torch
    loop taking the same four steps by hand; the ratio moves off 1, so clipping binds."""
    r = subprocess.run([sys.executable, "-c", "from test_learner import mini_batches_match_the_reference as f; f()"],
                       cwd=Path(__file__).parent, env=child_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "4 mini-batches:" in r.stdout, (r.stdout + r.stderr)[-3000:]
    print(r.stdout.strip())


def zero_stage_run(zero_stage: int, port: int, out: str) -> None:
    """One SGD step over rows(8) in 4 micro-batches of 2 under `zero_stage`; saves the weights
    after it and the step's stats."""
    t = TrainerConfig(micro_batch_size=2, zero_stage=zero_stage, dtype="float32", lr=SGD_LR, optimizer="sgd")
    learner = learner_of(t, port)
    b = rows()
    sums, stats = learner.train_step([MiniBatch(b, float(b.loss_mask.sum()), float(len(b)))])
    # ZeRO-3 records the order its forward fetches parameters in, and prefetches by it once the
    # record is complete: the root module's forward pre-hook (reset_step) closes each record
    offload = getattr(learner.engine.optimizer, "parameter_offload", None)
    trace = offload.get_param_coordinator().is_complete_trace() if offload is not None else None
    torch.save({"weights": learner.full_weights(), "stats": stats, "loss": sums["loss"], "trace": trace}, out)


def run_children(codes: list[str], timeout: float = 300) -> None:
    """Python snippets, each in its own process from tests/workers, all at once (ranks of one
    group rendezvous); each must exit 0."""
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parent, env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for code in codes]
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        finally:
            p.kill()
        assert p.returncode == 0, out[-3000:]


def test_every_micro_batch_adds_to_the_gradient_under_each_zero_stage(tmp_path):
    """The same 4-micro-batch step under ZeRO 0 and ZeRO 3, each in its own process: the loss,
    the gradient norm and the SGD update agree to float rounding. ZeRO-3 counts micro-batches in
    DeepSpeedEngine.forward: a learner that calls its module's parts around the engine instead
    (decoder, then the output layer by chunks) has each micro-batch's gradient replace the one
    before, and ZeRO-3 trains on the last micro-batch alone (its update then points elsewhere: off
    by far more than RELATIVE)."""
    run_children([f"from test_learner import zero_stage_run as f; f({stage}, {29660 + stage}, "
                  f"{str(tmp_path / str(stage))!r})" for stage in (0, 3)])
    z0, z3 = (torch.load(tmp_path / str(stage)) for stage in (0, 3))
    assert z0["stats"]["micro_batches"] == z3["stats"]["micro_batches"] == 4
    assert z3["trace"] is True  # ZeRO-3's parameter trace is complete: its prefetch runs
    report("ZeRO-3 against ZeRO 0 over 4 micro-batches, loss",
           abs(z3["loss"] - z0["loss"]) / abs(z0["loss"]), RELATIVE)
    report("... gradient norm", abs(z3["stats"]["grad_norm"] / z0["stats"]["grad_norm"] - 1), RELATIVE)
    report("... SGD update", relative_off(z3["weights"], z0["weights"], initial_weights()), RELATIVE)


def zero_gradient_rows_run(world: int, rank: int, zero_stage: int, skip: bool, port: int, out: str) -> None:
    """One learner rank's SGD step over rows(16) where only row 5 has an advantage (every other
    group agreed): with `skip`, the rows of zero gradient are left out (mini_batches' live rows)
    and every rank runs 1 micro-batch (one of them a padding row when there are 2), where training
    every row runs 16 / (world x 2). Saves the weights after the step, and this rank's sums."""
    from rlspec.algo.batching import gradient_rows
    from rlspec.loops.step import mini_batches
    from rlspec.workers.learner import Learner

    t = TrainerConfig(micro_batch_size=2, zero_stage=zero_stage, dtype="float32", lr=SGD_LR, optimizer="sgd")
    learner = Learner(paths=tiny_paths(), model=ModelConfig(), algo=AlgoConfig(off_policy_correction="none"),
                      trainer=t, generation=GenerationConfig(num_prompts_per_step=4, num_generations_per_prompt=4),
                      rank=rank, world_size=world, rendezvous=("127.0.0.1", port), threads=1)
    b = rows(16)
    b.advantages[torch.arange(16) != 5] = 0.0
    live = gradient_rows(b.advantages, torch.ones(16), "grpo", 0.0) if skip else None
    sums, stats = learner.train_step(mini_batches(b, torch.ones(16), None, world, live, 2)[rank])
    weights = learner.full_weights()  # a collective under ZeRO-3: every rank takes part
    torch.save({"weights": weights, "sums": dict(sums), "stats": stats}, f"{out}.{rank}")


def test_leaving_out_zero_gradient_rows_gives_the_same_update(tmp_path):
    """The same step four ways, each in its own processes: every row trained and the zero-gradient
    rows left out, on 1 rank (ZeRO 0) and on 2 ranks under ZeRO-3, where each rank runs 1
    micro-batch instead of 4 and one of them only a padding row (ZeRO-3 gathers parameters in
    every forward: a rank running fewer micro-batches than the other would hang). The loss over
    the ranks, the gradient norm and the SGD update agree to float rounding (RELATIVE): leaving
    out a row that carries gradient, or a denominator that counted only the rows trained, moves
    them by a whole row's share."""
    runs = {"all": (1, 0), "skip": (1, 0), "all_zero3": (2, 3), "skip_zero3": (2, 3)}
    codes = [f"from test_learner import zero_gradient_rows_run as f; "
             f"f({world}, {rank}, {stage}, {name.startswith('skip')}, {29650 + i}, {str(tmp_path / name)!r})"
             for i, (name, (world, stage)) in enumerate(runs.items()) for rank in range(world)]
    run_children(codes)
    got = {name: [torch.load(f"{tmp_path / name}.{r}") for r in range(world)] for name, (world, _) in runs.items()}
    init = initial_weights()
    for full, skip in (("all", "skip"), ("all_zero3", "skip_zero3")):
        want, have = got[full][0], got[skip][0]
        assert have["stats"]["micro_batches"] == 1 and want["stats"]["micro_batches"] == 8 // len(got[full])
        loss = [sum(r["sums"]["loss"] for r in got[name]) for name in (full, skip)]
        report(f"{skip} against {full}, loss", abs(loss[1] / loss[0] - 1), RELATIVE)
        report("... gradient norm", abs(have["stats"]["grad_norm"] / want["stats"]["grad_norm"] - 1), RELATIVE)
        report("... SGD update", relative_off(have["weights"], want["weights"], init), RELATIVE)
