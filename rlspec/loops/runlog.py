"""Step timing and run reporting: progress bar, wandb (rlspec/tracking), summary.json, stage table and plot."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from rlspec.config import LoggingConfig
from rlspec.messages import StepRecord
from rlspec.tracking import open_wandb, progress_bar

STAGES = ("data", "prep", "generation", "logprob", "train")


class StageTimer:
    """Accumulates wall seconds per stage; a stage may be entered several times in one step."""

    def __init__(self):
        self.seconds = {s: 0.0 for s in STAGES}

    @contextmanager
    def __call__(self, stage: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - t0


class RunLog:
    def __init__(self, run_dir: str, cfg_dict: dict, total_steps: int, log: LoggingConfig):
        self.run_dir = Path(run_dir)
        self.records: list[StepRecord] = []
        # (step, accuracy, unix time the validation started, its seconds)
        self.val: list[tuple] = []
        self.notes: dict = {}
        self.t0 = time.perf_counter()
        self.bar = progress_bar(log, total_steps, "grpo")
        self.wandb = open_wandb(log, self.run_dir, cfg_dict)

    def step(self, rec: StepRecord) -> None:
        self.records.append(rec)
        self.write_summary()  # after every step, so a crash loses at most the step in flight
        if self.bar is not None:
            self.bar.update(1)
            post = dict(reward=f"{rec.reward_mean:.3f}", gen_s=f"{rec.stage_seconds['generation']:.1f}",
                        tok_s=f"{rec.tokens_per_second:.0f}")
            if rec.acceptance_length is not None:
                post["acc_len"] = f"{rec.acceptance_length:.2f}"
            self.bar.set_postfix(**post, refresh=False)
        if self.wandb is not None:
            flat = {k: v for k, v in asdict(rec).items() if isinstance(v, (int, float))}
            flat.update({f"stage/{k}_s": v for k, v in rec.stage_seconds.items()})
            flat.update({f"stage/{k}_share": v / rec.step_seconds for k, v in rec.stage_seconds.items()})
            flat.update(rec.extra)
            flat.update({f"importance_weight/{k}": v for k, v in rec.importance_weight.items()})
            if rec.spec is not None:
                flat.update({f"spec/accept_pos{i}": v for i, v in enumerate(rec.spec["acceptance_per_pos"])})
                flat.update({f"spec/{k}": v for k, v in rec.spec.items() if not isinstance(v, list)})
            self.wandb.log(flat, step=rec.step)

    def validation(self, step: int, accuracy: float, n: int, started_at: float | None = None,
                   seconds: float | None = None) -> None:
        self.val.append((step, accuracy, started_at, seconds))
        self.write_summary()
        self.write(f"validation @ step {step}: held-out accuracy {accuracy:.3f} on {n} problems")
        if self.wandb is not None:
            self.wandb.log({"val/accuracy": accuracy}, step=step)

    def save_rollouts(self, step: int, prompt_ids: list[list[int]], response_ids: list[list[int]],
                      rewards: list[float], group: int) -> None:
        """One line of rollouts.jsonl: the step's groups (prompt, responses, rewards)."""
        groups = [{"prompt": prompt_ids[i], "responses": response_ids[i: i + group], "rewards": rewards[i: i + group]}
                  for i in range(0, len(prompt_ids), group)]
        with open(self.run_dir / "rollouts.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "groups": groups}) + "\n")

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def summary(self) -> dict:
        n = max(len(self.records), 1)
        stage = {s: sum(r.stage_seconds[s] for r in self.records) / n for s in STAGES}
        gen_tokens = sum(r.generated_tokens for r in self.records)
        spec = [r.spec for r in self.records if r.spec]
        drafts = sum(x["drafts"] for x in spec)
        # engine time (the stage time is what the learner waited: less under async GRPO)
        gen_secs = sum(r.engine_seconds or r.stage_seconds["generation"] for r in self.records)
        return {
            "steps": len(self.records),
            "wall_seconds": time.perf_counter() - self.t0,
            "val_accuracy": [v[1] for v in self.val],
            "val_steps": [v[0] for v in self.val],
            # when each validation started (unix seconds) and how long it took: benchmarks take
            # the time spent validating out of time-to-accuracy
            "val_started_at": [v[2] if len(v) > 2 else None for v in self.val],
            "val_seconds": [v[3] if len(v) > 3 else None for v in self.val],
            "stage_seconds": stage,
            "stage_share": {s: v / max(sum(stage.values()), 1e-9) for s, v in stage.items()},
            "step_seconds": sum(r.step_seconds for r in self.records) / n,
            "tokens_per_second": gen_tokens / max(gen_secs, 1e-9),
            "engine_seconds": gen_secs / n,
            "exposed_generation_seconds": sum(r.exposed_generation_seconds for r in self.records) / n,
            "policy_lag_max": max((r.policy_lag_max for r in self.records), default=0),
            # tokens per verification over the whole run (None without speculation)
            "acceptance_length": 1 + sum(x["accepted_tokens"] for x in spec) / drafts if drafts else None,
            **self.notes,
            "records": [{**asdict(r), **{f"{k}_seconds": v for k, v in r.stage_seconds.items()}}
                        for r in self.records],
        }

    def write_summary(self) -> dict:
        s = self.summary()
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(s, indent=1) + "\n")
        tmp.replace(self.run_dir / "summary.json")
        return s

    def finish(self, plot: bool) -> dict:
        if self.bar is not None:
            self.bar.close()
        s = self.write_summary()
        print(stage_table(s), flush=True)
        if plot and self.records:
            plot_run(s, self.run_dir / "reward_and_stages.png")
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in s.items() if isinstance(v, (int, float))})
            self.wandb.finish()
        return s


def stage_table(s: dict) -> str:
    rows = [f"{'stage':<12}{'s/step':>9}{'share':>8}"]
    for k in STAGES:
        rows.append(f"{k:<12}{s['stage_seconds'][k]:>9.2f}{100 * s['stage_share'][k]:>7.1f}%")
    rows.append(f"{'step':<12}{s['step_seconds']:>9.2f}")
    rows.append(f"generation {s['tokens_per_second']:.0f} tokens/s over {s['steps']} steps, "
                f"wall {s['wall_seconds']:.0f}s")
    if s.get("engine_seconds"):
        rows.append(f"rollouts: engine {s['engine_seconds']:.2f} s/step, learner waited "
                    f"{s['exposed_generation_seconds']:.2f} s/step, largest policy lag {s['policy_lag_max']}")
    if s.get("acceptance_length"):
        rows.append(f"speculation: {s['acceptance_length']:.2f} tokens per verification")
    if s["val_accuracy"]:
        v = s["val_accuracy"]
        rows.append(f"held-out accuracy {v[0]:.3f} -> {v[-1]:.3f} ({100 * (v[-1] - v[0]):+.1f} points)")
    return "\n".join(rows)


def plot_run(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = s["records"]
    steps = [r["step"] for r in recs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(steps, [r["reward_mean"] for r in recs], label="train reward")
    if s["val_accuracy"]:
        a.plot(s["val_steps"], s["val_accuracy"], "o-", label="held-out accuracy")
    a.set_xlabel("step")
    a.set_ylim(0, 1)
    a.legend()
    a.set_title("reward")
    bottom = [0.0] * len(recs)
    for k in STAGES:
        share = [r["stage_seconds"][k] / r["step_seconds"] for r in recs]
        b.bar(steps, share, bottom=bottom, label=k, width=1.0)
        bottom = [x + y for x, y in zip(bottom, share)]
    b.set_xlabel("step")
    b.set_ylabel("share of step")
    b.set_title("stage shares")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
