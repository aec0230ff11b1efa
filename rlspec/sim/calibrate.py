"""Calibrate the simulator on a real run, and check it against other runs.

    python -m rlspec.sim calibrate RUN_DIR [--check RUN_DIR ...] [--gpu PRESET] [--length-cv X]

Reads RUN_DIR/summary.json (per-step stage seconds, response length, per-position acceptance,
refit seconds) and RUN_DIR/.hydra/config.yaml (checkpoints, batch, k), rebuilds the SimConfig
that run had (shapes from the checkpoints' config.json, hardware from a conf/sim/gpu preset), and
fits one efficiency per stage to the run's steady state (the median over steps after the first,
which pays one-time start-up costs):

    engine decode steps (seconds vs running sequences, a least-squares line over every step the
               run timed) -> eff.decode_flops, from the line's slope: the cost of one more sequence
    logprob    -> eff.logprob_mfu (also the engine's eff.decode_flops when the run has no step line)
    generation -> eff.forward_overhead_s (eff.decode_flops when the roofline alone is too slow)
    train (minus refit) -> eff.train_mfu (and decode_flops without a line or a log-prob stage)
    refit -> eff.refit_overhead_s         data + prep -> eff.prep_s_per_sample

Each --check run is then simulated with its own config and the fitted efficiencies (never fitted
on) and compared with what it measured. Writes RUN_DIR/sim_calibration.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from omegaconf import OmegaConf

from rlspec.sim.config import (CONF_DIR, EfficiencyConfig, GPUSpec, ModelPair, SimClusterConfig, SimConfig,
                               SimSpeculationConfig, WorkloadConfig, validate)
from rlspec.sim.cost import step, tokens_per_verification, verification_seconds
from rlspec.sim.shapes import shape_from_hf_config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CHECKED = ("prep", "generation", "logprob", "train", "step")


class RunError(ValueError):
    """A run directory lacks what calibration needs; the message names the file."""


@dataclass
class Measured:
    """A run's steady-state figures (medians over steps after the first)."""
    stage_seconds: dict[str, float]   # data, prep, generation, logprob, train (train includes refit)
    refit_seconds: float
    step_seconds: float
    response_length: float
    acceptance_per_pos: list[float]
    steps_used: int
    # Engine decode step seconds = intercept + slope x running sequences, fitted over the steady
    # steps' decode_step_moments (None: the run did not record them, or too few batch sizes).
    step_line: tuple[float, float] | None = None
    step_batch_range: tuple[float, float] = (0.0, 0.0)  # mean -/+ one std of the running sequences


def load_run(run_dir: str | Path) -> tuple[dict, dict, Measured]:
    """(run config, summary, steady-state measurements) of a run directory."""
    from rlspec.config import register_resolvers

    register_resolvers()  # the run config names shipped assets as ${asset:...}

    run = Path(run_dir)
    for f in ("summary.json", ".hydra/config.yaml"):
        if not (run / f).is_file():
            raise RunError(f"{run / f}: missing (is {run} an rlspec.train run directory?)")
    summary = json.loads((run / "summary.json").read_text())
    recs = summary.get("records") or []
    if not recs:
        raise RunError(f"{run / 'summary.json'}: no step records")
    rcfg = OmegaConf.to_container(OmegaConf.load(run / ".hydra/config.yaml"), resolve=True)
    steady = recs[1:] if len(recs) > 1 else recs
    med = lambda xs: statistics.median(xs)  # noqa: E731
    stages = {k: med([r["stage_seconds"][k] for r in steady]) for k in steady[0]["stage_seconds"]}
    per_pos = [r["spec"]["acceptance_per_pos"] for r in steady if r.get("spec")]
    pos = [statistics.mean(col) for col in zip(*per_pos)] if per_pos else []
    measured = Measured(stages, med([r["extra"].get("refit_seconds", 0.0) for r in steady]),
                        med([r["step_seconds"] for r in steady]),
                        med([r["extra"].get("response_length", r["generated_tokens"] / _samples(rcfg))
                             for r in steady]), pos, len(steady), *step_line(steady))
    return rcfg, summary, measured


def step_line(records: list[dict]) -> tuple[tuple[float, float] | None, tuple[float, float]]:
    """Least-squares line through the records' engine decode steps (seconds vs running batch)."""
    moments = [r["decode_step_moments"] for r in records if r.get("decode_step_moments")]
    if not moments:
        return None, (0.0, 0.0)
    c, sn, snn, st, snt = (sum(col) for col in zip(*moments))
    var = snn / c - (sn / c) ** 2
    if c < 3 or var <= 1.0:  # one batch size: no slope to read
        return None, (0.0, 0.0)
    slope = (snt / c - sn / c * st / c) / var
    mean, std = sn / c, var ** 0.5
    return (st / c - slope * mean, slope), (max(1.0, mean - std), mean + std)


def _samples(rcfg: dict) -> int:
    g = rcfg["generation"]
    return g["num_prompts_per_step"] * g["num_generations_per_prompt"]


def load_gpu(name: str) -> GPUSpec:
    path = CONF_DIR / "gpu" / f"{name}.yaml"
    if not path.is_file():
        raise RunError(f"--gpu {name}: no {path}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GPUSpec), OmegaConf.load(path)))


def prompt_tokens(rcfg: dict) -> float:
    """Mean templated prompt length of the run's training prompts (first 1000), tokenised as the
    trainer does. Local and synthetic sources only; pass --prompt-tokens for hub datasets."""
    from rlspec.config import DataConfig, DatasetConfig, SyntheticConfig
    from rlspec.data.loading import load_split
    from rlspec.models import load_tokenizer

    d = rcfg["data"]
    ds = DatasetConfig(**{**d["train"], "num_rows": min(d["train"]["num_rows"], 1000),
                          "limit": min(d["train"]["limit"] or 1000, 1000)})
    tok = load_tokenizer(rcfg["model"]["tokenizer"] or rcfg["model"]["path"], "model.path")
    data = DataConfig(train=ds, synthetic=SyntheticConfig(**d["synthetic"]), template=d["template"],
                      max_prompt_tokens=d["max_prompt_tokens"], on_bad_row="skip")
    ps = load_split(data, "train", tok)
    return statistics.mean(len(p.token_ids) for p in ps.prompts)


def sim_config_for_run(rcfg: dict, m: Measured, gpu: GPUSpec, length_cv: float, prompt_len: float,
                       eff: EfficiencyConfig | None = None) -> SimConfig:
    """The SimConfig of a run: its shapes, batch, k and measured acceptance on one device (the
    synchronous loop runs one stage at a time, each actor using the whole machine)."""
    from rlspec.config import default_dtype

    g, sp = rcfg["generation"], rcfg["speculation"]
    # .hydra/config.yaml holds the run's config as composed: null is the platform's default dtype
    bpp = DTYPE_BYTES[g["dtype"] or default_dtype(rcfg["cluster"]["gpus_per_node"] > 0)]
    target = shape_from_hf_config(rcfg["model"]["path"], bpp, "target")
    method = sp["method"]
    draft = None
    if method in ("draft_model", "eagle3"):
        draft = shape_from_hf_config(sp["model"], bpp, "draft")
    elif method == "mtp":  # the target's own MTP layer: one decoder layer plus an fc over 2 x hidden
        draft = replace(target, name="mtp", num_layers=1, has_embedding=False,
                        extra_params=2 * target.hidden_size ** 2)
    elif method == "suffix":
        method = "ngram"
    k = sp["num_speculative_tokens"] if method != "none" else 0
    cfg = SimConfig(
        gpu=gpu, model=ModelPair(target, draft),
        workload=WorkloadConfig(
            num_prompts_per_step=g["num_prompts_per_step"], num_generations_per_prompt=g["num_generations_per_prompt"],
            prompt_tokens=round(prompt_len), max_new_tokens=g["max_new_tokens"],
            mean_response_tokens=min(m.response_length, g["max_new_tokens"]), response_length_cv=length_cv,
            padded=True, kl_reference=rcfg["algo"]["kl_coef"] > 0,
            recompute_logprobs=m.stage_seconds.get("logprob", 0.0) > 0),
        spec=SimSpeculationConfig(method=method, k=k, acceptance_per_pos=m.acceptance_per_pos[:k]),
        cluster=SimClusterConfig(num_gpus=1, mode="sync", gen_tp=1),
        eff=eff or EfficiencyConfig(), plot=False)
    validate(cfg)
    return cfg


def _bisect(f, lo: float, hi: float, target: float, increasing: bool) -> float:
    for _ in range(80):
        mid = (lo + hi) / 2
        below = f(mid) < target
        lo, hi = (mid, hi) if below == increasing else (lo, mid)
    return (lo + hi) / 2


def fit(cfg: SimConfig, m: Measured) -> EfficiencyConfig:
    """One efficiency per stage so the simulated steady-state step matches `m`. The generation
    stage alone cannot separate the engine's compute efficiency from its per-forward overhead:
    the efficiency comes from the slope of the run's engine-step line (step seconds vs running
    sequences), or without one from the log-prob pass's MFU (the same model's matmuls on the same
    machine; an upper bound for skinny decode GEMMs), or the training pass's when the run skipped
    the recompute; the overhead is then fitted to the stage."""
    s0 = step(cfg).stage_seconds
    train_only = max(m.stage_seconds["train"] - m.refit_seconds, 1e-9)  # the trainer times refit inside train
    train_mfu = cfg.eff.train_mfu * s0["train"] / train_only
    if m.stage_seconds.get("logprob", 0.0) > 0:
        logprob_mfu = cfg.eff.logprob_mfu * s0["logprob"] / m.stage_seconds["logprob"]
    else:  # no recompute stage: nothing to fit, and decode borrows the training pass's MFU
        logprob_mfu = train_mfu
    e = replace(cfg.eff, logprob_mfu=logprob_mfu, decode_flops=min(1.0, logprob_mfu))
    with_eff = lambda **kw: replace(cfg, eff=replace(e, **kw))  # noqa: E731
    if m.step_line is not None and m.step_line[1] > 0:
        # The engine's own cost per extra sequence: the simulated verification's slope over the
        # batch sizes the run's decode steps covered, matched by the GEMM efficiency.
        lo, hi = m.step_batch_range
        ctx = cfg.workload.prompt_tokens + m.response_length / 2
        tau = tokens_per_verification(cfg.spec)
        slope = lambda c: (verification_seconds(c, hi, ctx, tau)  # noqa: E731
                           - verification_seconds(c, lo, ctx, tau)) / (hi - lo)
        if slope(with_eff(decode_flops=1.0)) < m.step_line[1]:  # compute-bound: the slope sets it
            e = replace(e, decode_flops=_bisect(lambda x: slope(with_eff(decode_flops=x)), 1e-4, 1.0,
                                                m.step_line[1], increasing=False))
    gen = lambda c: step(c).stage_seconds["generation"]  # noqa: E731
    target = m.stage_seconds["generation"]
    if gen(with_eff(forward_overhead_s=0.0)) <= target:
        e = replace(e, forward_overhead_s=_bisect(lambda o: gen(with_eff(forward_overhead_s=o)), 0.0, 10.0,
                                                   target, increasing=True))
    else:  # the roofline alone is slower than measured: decode beats that efficiency
        e = replace(e, forward_overhead_s=0.0, decode_flops=_bisect(
            lambda x: gen(with_eff(forward_overhead_s=0.0, decode_flops=x)), 1e-4, 1.0, target, increasing=False))
    refit_wire = step(replace(cfg, eff=e)).stage_seconds["refit"] - e.refit_overhead_s
    n = cfg.workload.num_prompts_per_step * cfg.workload.num_generations_per_prompt
    return replace(e, train_mfu=train_mfu,
                   refit_overhead_s=max(0.0, m.refit_seconds - refit_wire),
                   prep_s_per_sample=(m.stage_seconds["prep"] + m.stage_seconds.get("data", 0.0)) / n)


def compare_run(cfg: SimConfig, m: Measured) -> dict[str, tuple[float, float]]:
    """{stage: (measured, simulated)}; the trainer times the refit inside its train stage."""
    s = step(cfg)
    sim = dict(s.stage_seconds)
    sim["train"] += sim.pop("refit")
    sim["prep"] += sim.pop("data")
    meas = dict(m.stage_seconds)
    meas["prep"] += meas.pop("data", 0.0)
    return {k: (meas[k], sim[k]) for k in CHECKED[:-1]} | {"step": (m.step_seconds, s.step_seconds)}


def _rel(meas: float, sim: float) -> float:
    return (sim - meas) / meas if meas else 0.0


def report(name: str, rows: dict[str, tuple[float, float]]) -> str:
    out = [f"{name}", f"  {'stage':<12}{'measured s':>12}{'simulated s':>13}{'error':>9}"]
    for k, (meas, sim) in rows.items():
        out.append(f"  {k:<12}{meas:>12.3f}{sim:>13.3f}{100 * _rel(meas, sim):>8.1f}%")
    return "\n".join(out)


def calibrate(run_dir: str, checks: list[str], gpu_name: str, length_cv: float,
              prompt_len: float | None) -> dict:
    gpu = load_gpu(gpu_name)
    rcfg, _, m = load_run(run_dir)
    cfg = sim_config_for_run(rcfg, m, gpu, length_cv, prompt_len or prompt_tokens(rcfg))
    eff = fit(cfg, m)
    fitted = replace(cfg, eff=eff)
    result = {"run": str(run_dir), "gpu": gpu_name, "length_cv": length_cv, "eff": asdict(eff),
              "fit": {k: list(v) for k, v in compare_run(fitted, m).items()}, "checks": {}}
    for other in checks:
        ocfg, _, om = load_run(other)
        pred = sim_config_for_run(ocfg, om, gpu, length_cv, prompt_len or prompt_tokens(ocfg), eff)
        result["checks"][str(other)] = {k: list(v) for k, v in compare_run(pred, om).items()}
    return result


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlspec.sim calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--check", nargs="*", default=[], help="runs to predict with the fitted efficiencies")
    ap.add_argument("--gpu", default=None, help="conf/sim/gpu preset (default: cpu_2core for CPU runs)")
    ap.add_argument("--length-cv", type=float, default=WorkloadConfig.response_length_cv,
                    help="std/mean of the run's response lengths (summary.json records only the mean)")
    ap.add_argument("--prompt-tokens", type=float, default=None,
                    help="mean prompt length (default: tokenise the run's training prompts)")
    a = ap.parse_args(argv)
    try:
        rcfg, _, _ = load_run(a.run_dir)
        gpu = a.gpu or ("cpu_2core" if rcfg["cluster"]["gpus_per_node"] == 0 else None)
        if gpu is None:
            raise RunError("--gpu: a GPU run needs its preset named (e.g. --gpu h200)")
        r = calibrate(a.run_dir, a.check, gpu, a.length_cv, a.prompt_tokens)
    except (RunError, ValueError, KeyError) as e:
        print(f"rlspec.sim calibrate: error: {e}", flush=True)
        return 2
    print("fitted efficiencies: " + ", ".join(f"{k}={v:.4g}" for k, v in r["eff"].items()))
    print(report(f"fit run {r['run']} (error after fitting)", {k: tuple(v) for k, v in r["fit"].items()}))
    for run, rows in r["checks"].items():
        print(report(f"check run {run} (predicted, not fitted)", {k: tuple(v) for k, v in rows.items()}))
    out = Path(a.run_dir) / "sim_calibration.json"
    out.write_text(json.dumps(r, indent=1) + "\n")
    print(f"wrote {out}")
    return 0
