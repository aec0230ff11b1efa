"""What a simulation prints and writes: a table, sim.json and PNG plots (speedup vs k, vs
acceptance, vs scale; stage shares sync vs async)."""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from omegaconf import OmegaConf

from rlspec.sim.config import SimConfig
from rlspec.sim.cost import STAGES, Comparison, StepEstimate, acceptance_per_pos, compare


def with_k(cfg: SimConfig, k: int) -> SimConfig:
    return replace(cfg, spec=replace(cfg.spec, k=k))


def with_acceptance(cfg: SimConfig, a: float) -> SimConfig:
    return replace(cfg, spec=replace(cfg.spec, acceptance_per_pos=[], acceptance_rate=a))


def with_scale(cfg: SimConfig, s: float) -> SimConfig:
    c = cfg.cluster
    tp = c.gen_tp
    gpus = max(tp, round(c.num_gpus * s / tp) * tp)
    gen = max(tp, round(c.gen_gpus * s / tp) * tp) if c.mode == "async" else 0
    return replace(cfg, cluster=replace(c, num_gpus=gpus, gen_gpus=min(gen, gpus - 1) if gen else 0))


def as_mode(cfg: SimConfig, mode: str) -> SimConfig:
    """The same cluster run sync, or async with its gen pool (half the GPUs if none is set)."""
    c = cfg.cluster
    if mode == "sync":
        return replace(cfg, cluster=replace(c, mode="sync", gen_gpus=0))
    gen = c.gen_gpus or max(c.gen_tp, c.num_gpus // 2 // c.gen_tp * c.gen_tp)
    return replace(cfg, cluster=replace(c, mode="async", gen_gpus=gen, policy_lag=max(c.policy_lag, 1)))


def _step_dict(e: StepEstimate) -> dict:
    return {"stage_seconds": e.stage_seconds, "step_seconds": e.step_seconds,
            "exposed_generation_seconds": e.exposed_generation, "rollout": asdict(e.rollout)}


def simulate(cfg: SimConfig) -> dict:
    """The scenario, its sweeps and the sync/async comparison, as one JSON-able dict."""
    cmp = compare(cfg)
    sw = cfg.sweep
    sweeps = {
        "k": [{"k": k, **_speedups(compare(with_k(cfg, k)))} for k in sw.k],
        "acceptance_rate": [{"acceptance_rate": a, **_speedups(compare(with_acceptance(cfg, a)))}
                            for a in sw.acceptance_rate],
        "scale": [{"num_gpus": with_scale(cfg, s).cluster.num_gpus, **_speedups(compare(with_scale(cfg, s)))}
                  for s in sw.scale],
        "mode": {m: {"baseline": _step_dict(c.baseline), "speculative": _step_dict(c.speculative)}
                 for m, c in ((m, compare(as_mode(cfg, m))) for m in ("sync", "async"))},
    }
    return {
        "rollout_speedup": cmp.rollout_speedup,
        "step_speedup": cmp.step_speedup,
        "tokens_per_verification": cmp.speculative.rollout.tokens_per_verification,
        "acceptance_per_pos": acceptance_per_pos(cfg.spec),
        "stage_seconds": {"baseline": cmp.baseline.stage_seconds, "speculative": cmp.speculative.stage_seconds},
        "step_seconds": {"baseline": cmp.baseline.step_seconds, "speculative": cmp.speculative.step_seconds},
        "exposed_generation_seconds": {"baseline": cmp.baseline.exposed_generation,
                                       "speculative": cmp.speculative.exposed_generation},
        "rollout": {"baseline": asdict(cmp.baseline.rollout), "speculative": asdict(cmp.speculative.rollout)},
        "warnings": sorted(set(cmp.baseline.rollout.warnings + cmp.speculative.rollout.warnings)),
        "paper": dict(cfg.paper),
        "sweeps": sweeps,
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
    }


def stage_shares(e: dict, mode: str) -> dict[str, float]:
    """Each stage's share of the step's wall time. Async stages overlap: the trainer's stages
    count in full and generation + refit only by what the step waits beyond them."""
    st, total = e["stage_seconds"], e["step_seconds"]
    if mode == "sync":
        return {k: v / total for k, v in st.items()}
    gen_side = st["generation"] + st["refit"]
    exposed = e["exposed_generation_seconds"]
    out = {k: st[k] / total for k in ("data", "prep", "logprob", "train")}
    out["generation"] = exposed * st["generation"] / gen_side / total if gen_side else 0.0
    out["refit"] = exposed * st["refit"] / gen_side / total if gen_side else 0.0
    return out


def _speedups(c: Comparison) -> dict:
    return {"rollout_speedup": c.rollout_speedup, "step_speedup": c.step_speedup,
            "tokens_per_verification": c.speculative.rollout.tokens_per_verification,
            "step_seconds": c.speculative.step_seconds, "baseline_step_seconds": c.baseline.step_seconds}


def table(r: dict) -> str:
    cfg = r["config"]
    c, s = cfg["cluster"], cfg["spec"]
    head = (f"{cfg['model']['target']['name']} on {c['num_gpus']} {cfg['gpu']['name']} ({c['mode']}"
            + (f", {c['gen_gpus']} generating, lag {c['policy_lag']}" if c["mode"] == "async" else "")
            + f"), {s['method']} k={s['k'] if s['method'] != 'none' else 0}, "
            + f"{r['tokens_per_verification']:.2f} tokens/verification")
    rows = [head, f"{'stage':<22}{'baseline s':>12}{'speculative s':>15}"]
    base, spec = r["stage_seconds"]["baseline"], r["stage_seconds"]["speculative"]
    for k in STAGES:
        rows.append(f"{k:<22}{base[k]:>12.2f}{spec[k]:>15.2f}")
    if c["mode"] == "async":
        ex = r["exposed_generation_seconds"]
        rows.append(f"{'exposed generation':<22}{ex['baseline']:>12.2f}{ex['speculative']:>15.2f}")
    rows.append(f"{'step':<22}{r['step_seconds']['baseline']:>12.2f}{r['step_seconds']['speculative']:>15.2f}")
    paper = r.get("paper") or {}
    rows.append(f"{'speedup':<22}{'simulator':>12}{'paper':>15}")
    for key in ("rollout_speedup", "step_speedup"):
        ref = f"{paper[key]:.2f}x" if key in paper else "-"
        rows.append(f"{key:<22}{r[key]:>11.2f}x{ref:>15}")
    for which in ("baseline", "speculative"):
        key = f"{which}_generation_seconds"
        if key in paper:
            sim = r["stage_seconds"][which]["generation"]
            rows.append(f"{which + ' generation':<22}{sim:>11.1f}s{paper[key]:>14.1f}s")
    rows += [f"warning: {w}" for w in r["warnings"]]
    return "\n".join(rows)


def write(r: dict, out_dir: str | Path, plot: bool) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim.json").write_text(json.dumps(r, indent=1) + "\n")
    return [out / "sim.json", *(plots(r, out) if plot else [])]


def plots(r: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw, paths = r["sweeps"], []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, label in ((axes[0], "k", "draft length k"),
                           (axes[1], "acceptance_rate", "per-token acceptance a"),
                           (axes[2], "num_gpus", "GPUs (global batch fixed)")):
        rows = sw["scale"] if key == "num_gpus" else sw[key]
        x = [row[key] for row in rows]
        ax.plot(x, [row["rollout_speedup"] for row in rows], "o-", label="rollout")
        ax.plot(x, [row["step_speedup"] for row in rows], "s-", label="step")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("speedup over no speculation")
        if key == "num_gpus":
            ax.set_xscale("log", base=2)
        ax.legend()
    fig.suptitle(r["config"]["model"]["target"]["name"])
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    modes = [(m, v) for m in ("sync", "async") for v in ("baseline", "speculative")]
    bars = [(f"{m}\n{v}", sw["mode"][m][v]) for m, v in modes]
    shares = [stage_shares(b[1], m) for b, (m, _) in zip(bars, modes)]
    bottom = [0.0] * len(bars)
    for stage in STAGES:
        h = [sh[stage] for sh in shares]
        ax.bar([b[0] for b in bars], h, bottom=bottom, label=stage)
        bottom = [x + y for x, y in zip(bottom, h)]
    for i, (_, b) in enumerate(bars):
        ax.text(i, 1.01, f"{b['step_seconds']:.0f} s", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("share of the step")
    ax.set_title("stage shares (async: generation and refit count only where exposed)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    paths.append(out / "stages.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
