"""Every learner configuration the validator accepts trains GRPO's update: a covering set of cells
(every pair of two settings' values in at least one cell), each two RL steps through the real
Learner (DeepSpeed over gloo, one process per rank), compared with the plain-torch reference
(reference_step.py) in what is exact up to rounding: each step's loss, gradient norm and SGD
update of the (master) weights.

The pairs no cell holds are the ones validation refuses: a test composes each and checks that the
error names a key of one of its two settings.

Each RL step is compared from the same weights: the reference's step i starts from the Learner's
(master) weights after step i - 1, so one step's rounding is not amplified by the next. The
tolerance is `bound`: conftest.rounding_bound over the tiny policy and the batch's tokens, plus
bf16's unit for each value stored in bf16 on the longest path in a bf16 cell, times the optimizer
steps of the RL step. The loss is compared relative to the size of its terms (|A| x ratio, and
kl_coef x the k3 bound), the gradient norm and the update relative to themselves.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections import OrderedDict
from itertools import combinations
from pathlib import Path

import pytest
import torch

from conftest import child_env, compose, report, rounding_bound, tiny_paths
from rlspec.algo.losses import K3_MAX

PROMPTS, G = 6, 4
ROWS = PROMPTS * G
# fp32 cells: steps that move the ratios off 1 within a step, and a sampler off the policy by about
# 0.3 nats a token: a fifth to a third of the tokens are clipped
# bf16 cells: a bf16 log-prob moves by up to about 0.1 wherever a batch is cut differently, which
# moves a token across a clip boundary where its ratio lies that close to it: the clipped surrogate
# is not continuous there, and no rounding bound holds across it. bf16 cells run where no ratio
# comes near a boundary, with sampler log-probs from the bf16 policy (the clipped branches are the
# fp32 cells' to check).
LR = {"float32": 0.3, "bfloat16": 0.003}
SAMPLER_NOISE = {"float32": 0.3, "bfloat16": 0.03}

# setting -> values; a cell takes one value of each
SETTINGS = OrderedDict(
    zero_stage=[0, 1, 2, 3],
    world=[1, 2],
    micro_per_step=[1, 3],           # micro-batches each rank runs per optimizer step
    mini_batches=[1, 2],             # optimizer steps per pass over the batch
    ppo_epochs=[1, 2],
    skip_rows=[True, False],         # trainer.skip_zero_gradient_rows
    loss_agg=["token_mean", "seq_mean"],
    correction=["none", "tis", "behaviour_ppo"],
    kl_coef=[0.0, 0.01],
    clip=["higher_dual", "symmetric"],  # clip_high 0.28 and dual clip 3, or 0.2 / 0.2 and none
    recompute=[False, True],         # algo.recompute_logprobs: the proximal log-probs from a recompute
    shared_prompts=[True, False],    # trainer.shared_prompt_forward
    checkpointing=[False, True],     # trainer.gradient_checkpointing
    dtype=["float32", "bfloat16"],   # trainer.dtype: bf16 compute, fp32 master weights
)
# the config key each setting is (in validation errors)
KEYS = dict(zero_stage="trainer.zero_stage", world="cluster.learner_world_size",
            micro_per_step="trainer.micro_batch_size", mini_batches="trainer.mini_batch_size",
            ppo_epochs="trainer.ppo_epochs", skip_rows="trainer.skip_zero_gradient_rows", loss_agg="algo.loss_agg",
            correction="algo.off_policy_correction", kl_coef="algo.kl_coef", clip="algo.clip_high",
            recompute="algo.recompute_logprobs", shared_prompts="trainer.shared_prompt_forward",
            checkpointing="trainer.gradient_checkpointing", dtype="trainer.dtype")


# interactions of three settings that faults have hidden in, each in a cell of its own
REQUIRED = [
    dict(zero_stage=3, world=2, micro_per_step=3),                      # ZeRO-3 counts micro-batches in forward
    dict(zero_stage=1, world=2, micro_per_step=3, dtype="bfloat16"),    # BF16_Optimizer's backward prologue
]


def sizes(cell: dict) -> tuple[int, int]:
    """(mini_batch_size, micro_batch_size) of a cell."""
    mini = ROWS // cell["mini_batches"]
    return mini, mini // (cell["world"] * cell["micro_per_step"])


def apply(cfg, cell: dict):
    """The composed config with a cell's settings (the Learner's sections and the batch's shape)."""
    cfg = copy.deepcopy(cfg)
    mini, micro = sizes(cell)
    cfg.generation.num_prompts_per_step, cfg.generation.num_generations_per_prompt = PROMPTS, G
    cfg.cluster.learner_world_size = cell["world"]
    t = cfg.trainer
    t.zero_stage, t.dtype, t.optimizer, t.lr, t.grad_clip, t.warmup_steps = (cell["zero_stage"], cell["dtype"], "sgd",
                                                                              LR[cell["dtype"]], 1.0, 0)
    t.micro_batch_size, t.mini_batch_size = micro, (None if cell["mini_batches"] == 1 else mini)
    t.ppo_epochs, t.skip_zero_gradient_rows = cell["ppo_epochs"], cell["skip_rows"]
    t.shared_prompt_forward, t.gradient_checkpointing = cell["shared_prompts"], cell["checkpointing"]
    a = cfg.algo
    a.loss, a.loss_agg, a.off_policy_correction, a.kl_coef = ("grpo", cell["loss_agg"], cell["correction"],
                                                              cell["kl_coef"])
    a.clip_low, a.clip_high, a.clip_ratio_c = (0.2, 0.28, 3.0) if cell["clip"] == "higher_dual" else (0.2, 0.2, None)
    a.behaviour_weight_cap = 2.0
    a.recompute_logprobs = cell["recompute"]
    return cfg


_BASE = None


def refusal(cell: dict) -> str | None:
    """Validation's error for a cell, or None where it is accepted."""
    from rlspec.config import ConfigError
    from rlspec.checks import validate

    global _BASE
    if _BASE is None:
        _BASE = compose()
    try:
        validate(apply(_BASE, cell))
    except ConfigError as e:
        return str(e)
    return None


def cells() -> list[dict]:
    """The covering set: allpairspy's pairwise cells over SETTINGS, the validator as the filter,
    completed with a cell for each accepted pair it left out, and one for each REQUIRED
    interaction (deterministic; kept in reference_matrix_cells.json, which a test checks is what
    this makes)."""
    from allpairspy import AllPairs

    names = list(SETTINGS)

    def accepted(values: list) -> bool:
        return len(values) < len(names) or refusal(dict(zip(names, values))) is None

    rows = [dict(zip(names, row)) for row in AllPairs(list(SETTINGS.values()), filter_func=accepted)]
    # the filter can leave a pair out that some cell would take: add the first cell that does
    for a, b in combinations(names, 2):
        for x in SETTINGS[a]:
            for y in SETTINGS[b]:
                if not any(c[a] == x and c[b] == y for c in rows):
                    take = next((c | {a: x, b: y} for c in rows if refusal(c | {a: x, b: y}) is None), None)
                    if take is not None:
                        rows.append(take)
    for need in REQUIRED:
        rows.append(next(c | need for c in rows if refusal(c | need) is None))
    return rows


CELLS_FILE = Path(__file__).with_name("reference_matrix_cells.json")
CELLS = json.loads(CELLS_FILE.read_text()) if CELLS_FILE.exists() else []


# -- the batches and one cell's run -------------------------------------------------------------------
def make_batches(path: Path, dtype: str) -> None:
    """Two RL steps' batches: 6 prompts x 4 answers of varied lengths (right-padded), GRPO
    advantages (two groups all agreeing: zero advantage), one sample of weight 0, sampler log-probs
    and reference log-probs near the initial policy's (computed in the cell's dtype)."""
    from rlspec.algo import compute_advantages
    from rlspec.messages import TrainBatch
    from rlspec.models import load_causal_lm
    from rlspec.algo.logprobs import sequence_logprobs

    model = load_causal_lm(tiny_paths().model).to(getattr(torch, dtype))
    noise = SAMPLER_NOISE[dtype]
    out = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(5, 200, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(PROMPTS)]
        seqs, plens = [], []
        for p in prompts:
            for _ in range(G):
                seqs.append(p + torch.randint(5, 200, (int(torch.randint(3, 11, (1,), generator=g)),),
                                              generator=g).tolist())
                plens.append(len(p))
        width = max(map(len, seqs))
        ids = torch.zeros(ROWS, width, dtype=torch.long)
        att = torch.zeros(ROWS, width, dtype=torch.long)
        mask = torch.zeros(ROWS, width - 1)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], att[i, : len(s)] = torch.tensor(s), 1
            mask[i, plens[i] - 1: len(s) - 1] = 1.0
        rewards = (torch.rand(PROMPTS, G, generator=g) > 0.5).float()
        rewards[1], rewards[4] = 1.0, 0.0  # groups that agree: advantage 0
        adv = compute_advantages("grpo", rewards).flatten()
        weight = torch.ones(ROWS)
        weight[9] = 0.0  # an overlong sample: kept for shape, no loss
        mask = mask * weight[:, None]
        with torch.no_grad():
            lp = sequence_logprobs(model, ids, att) * (mask != 0)
        behav = (lp + noise * torch.randn(lp.shape, generator=g)) * (mask != 0)
        ref = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * (mask != 0)
        out.append((TrainBatch(ids, att, mask, adv.float(), behav, None, ref, prompt_lengths=torch.tensor(plens)),
                    weight))
    torch.save(out, path)


def cell_run(cell: dict, rank: int, port: int, batches: str, out: str) -> None:
    """One rank of a cell: the Learner built from the cell's config, two RL steps as the training
    loop gives them (loops.step.mini_batches with the rows of zero gradient left out or not, the
    recompute's log-probs from this learner's weights before each step). Saves each step's partial
    sums, stats and the weights after it."""
    from rlspec.algo.batching import gradient_rows
    from rlspec.checks import resolve_auto
    from rlspec.loops.step import mini_batches
    from rlspec.workers.learner import Learner

    cfg = resolve_auto(apply(compose(), cell))
    t, a = cfg.trainer, cfg.algo
    learner = Learner(paths=tiny_paths(), model=cfg.model, algo=a, trainer=t, generation=cfg.generation, rank=rank,
                      world_size=cell["world"], rendezvous=("127.0.0.1", port), threads=1)
    start = master_weights(learner)
    steps = []
    for batch, weight in torch.load(batches, weights_only=False):
        if a.recompute_logprobs:
            batch.old_logprobs = learner._logprobs(batch)
        if a.kl_coef == 0:
            batch.ref_logprobs = None
        live = gradient_rows(batch.advantages, weight, a.loss, a.kl_coef) if t.skip_zero_gradient_rows else None
        parts = mini_batches(batch, weight, t.mini_batch_size, cell["world"], live, t.micro_batch_size)[rank]
        sums, stats = learner.train_step(parts, t.ppo_epochs)
        steps.append({"sums": sums, "stats": stats, "weights": master_weights(learner)})
    torch.save({"start": start, "steps": steps}, f"{out}.{rank}")


def master_weights(learner) -> dict:
    """The weights the optimizer steps, by name, on every rank (a collective: every rank calls): the
    parameters themselves in fp32 without ZeRO-3's partitions; else DeepSpeed's public accessor of
    the fp32 (master) copy, which the FP16_UnfusedOptimizer wrapper of bf16 ZeRO 0 lacks: its fp32
    groups are read instead."""
    from deepspeed.utils import safe_get_full_fp32_param

    t, named = learner.trainer, list(learner.engine.module.lm.named_parameters())
    if t.dtype == "float32" and t.zero_stage < 3:
        return {n: p.detach().clone() for n, p in named}
    if t.zero_stage == 0:
        opt = learner.engine.optimizer
        master = {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lps, hps)}
        return {n: master[id(p)].detach().clone() for n, p in named}
    return {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in named}


def reference_of(cell: dict, data: list, starts: list[dict]) -> list[dict]:
    """The reference's RL steps over `data` (make_batches'), step i from the weights `starts[i]`
    (the Learner's before it): each step is compared from the same weights, so one step's rounding
    is not carried into the next."""
    from reference_step import ReferencePolicy
    from rlspec.checks import resolve_auto
    from rlspec.models import load_causal_lm

    cfg = resolve_auto(apply(compose(), cell))
    model = load_causal_lm(tiny_paths().model)
    if cfg.trainer.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = ReferencePolicy(model, cfg.trainer)
    steps = []
    for (batch, weight), start in zip(copy.deepcopy(data), starts):
        policy.load(start)
        if cfg.algo.recompute_logprobs:
            with torch.no_grad():
                batch.old_logprobs = policy.logprobs(batch, cfg.generation.temperature)
        if cfg.algo.kl_coef == 0:
            batch.ref_logprobs = None
        steps.append(policy.step(batch, weight, cfg.algo, cfg.generation.temperature) | {"weights": policy.weights()})
    return steps


def relative_off(have: dict, want: dict, start: dict) -> float:
    """|have - want| over the reference's update |want - start| (all weights as one vector)."""
    flat = lambda w: torch.cat([w[k].reshape(-1).double() for k in want])  # noqa: E731
    update = flat(want) - flat(start)
    assert float(update.abs().max()) > 0  # the step moved the weights
    return float((flat(have) - flat(want)).norm() / update.norm())


BF16_EPS = 2.0 ** -8  # bf16's unit of rounding (8 bits of significand)


def bound(cell: dict, steps: float) -> float:
    """The tolerance of one RL step of `steps` optimizer steps: conftest.rounding_bound for one
    float32 computation, times the steps (each step's rounding is carried into the next). bf16 adds
    a bf16 rounding for each value a layer stores in bf16 on the longest path (its norm, q/k/v,
    attention, output, residual, norm, gate, up, product, down and residual: 11 a layer; the
    embedding, final norm and logits: 3) and for each micro-batch's gradient, summed across micro-
    batches and ranks: differently cut batches may round those values differently."""
    config = json.loads((Path(tiny_paths().model) / "config.json").read_text())
    layers = config["num_hidden_layers"]
    b = rounding_bound(config, layers, positions=16, tokens=ROWS * 15)
    if cell["dtype"] == "bfloat16":
        b += (11 * layers + 3 + cell["micro_per_step"] * cell["world"]) * BF16_EPS
    return b * steps


def run_cell(cell: dict, tmp_path: Path, port: int) -> None:
    batches = tmp_path / "batches.pt"
    make_batches(batches, cell["dtype"])
    codes = [f"from test_reference_matrix import cell_run; cell_run({cell!r}, {rank}, {port}, "
             f"{str(batches)!r}, {str(tmp_path / 'cell')!r})" for rank in range(cell["world"])]
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parent, env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for code in codes]
    for p in procs:
        try:
            out, _ = p.communicate(timeout=300)
        finally:
            p.kill()
        assert p.returncode == 0, out[-3000:]
    ranks = [torch.load(f"{tmp_path / 'cell'}.{r}", weights_only=False) for r in range(cell["world"])]
    have = ranks[0]["steps"]
    starts = [ranks[0]["start"]] + [step["weights"] for step in have[:-1]]
    data = torch.load(batches, weights_only=False)
    want_steps = reference_of(cell, data, starts)
    for i, want in enumerate(want_steps):
        loss, clip, dual = (sum(r["steps"][i]["sums"].get(k, 0.0) for r in ranks)
                            for k in ("loss", "clip_frac", "dual_clip_frac"))
        stats = have[i]["stats"]
        assert stats["skipped"] == 0.0 and stats["optimizer_steps"] == want["optimizer_steps"], (stats, want)
        tol = bound(cell, want["optimizer_steps"])
        print(f"step {i + 1}: tokens clipped {clip:.3f}, dual-clipped {dual:.3f}", flush=True)
        # the size of the loss's terms, |A| x ratio and kl_coef x k3 (a mean of terms of both signs
        # may cancel to near 0, so the loss is compared relative to its terms, not to itself)
        scale = (float(data[i][0].advantages.abs().max()) * max(1.0, want["ratio_max"])
                 + cell["kl_coef"] * K3_MAX)
        report(f"step {i + 1} loss against the reference (relative to its terms' size)",
               abs(loss - want["loss"]) / scale, tol)
        report(f"step {i + 1} gradient norm", abs(stats["grad_norm"] / want["grad_norm"] - 1), tol)
        report(f"step {i + 1} weights, off the reference's update by",
               relative_off(have[i]["weights"], want["weights"], starts[i]), tol)


def cell_id(cell: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in cell.items())


# slow tier: the covering set's 16 cells take 5 minutes; the default suite keeps test_learner's references
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CELLS)), ids=[f"cell{i}" for i in range(len(CELLS))])
def test_a_cell_trains_the_reference_update(index, tmp_path):
    cell = CELLS[index]
    print(cell_id(cell), flush=True)
    run_cell(cell, tmp_path, 29700 + index)


def test_the_cells_cover_every_pair_and_the_pairs_left_out_are_refused():
    """The committed cells are what cells() makes now (regenerate: python
    tests/workers/test_reference_matrix.py). Every pair of two settings' values is in some cell, or
    a config holding it (the other settings at their first value) is refused naming one of the two
    settings' keys."""
    assert cells() == CELLS, "the settings changed: regenerate reference_matrix_cells.json"
    names = list(SETTINGS)
    seen = {(a, cell[a], b, cell[b]) for cell in CELLS for a, b in combinations(names, 2)}
    missing = [(a, x, b, y) for a, b in combinations(names, 2) for x in SETTINGS[a] for y in SETTINGS[b]
               if (a, x, b, y) not in seen]
    for a, x, b, y in missing:
        cell = {n: v[0] for n, v in SETTINGS.items()} | {a: x, b: y}
        err = refusal(cell)
        assert err is not None, f"{a}={x} with {b}={y} is accepted but in no cell"
        assert err.split(":")[0] in (KEYS[a], KEYS[b]), (a, x, b, y, err)
    print(f"{len(CELLS)} cells; pairs refused by validation: {len(missing)}", flush=True)


if __name__ == "__main__":
    CELLS_FILE.write_text(json.dumps(cells(), indent=0) + "\n")
    print(f"{len(json.loads(CELLS_FILE.read_text()))} cells written to {CELLS_FILE}")
