"""A first run on one GPU (`make gpu-check`): the tiny policy and its tiny draft through rlspec's
real stack, each property a user needs before a cluster run checked and timed, a pass/fail table
printed and the figures written as JSON. Runs on CPU too (the default test suite runs it there,
so it keeps working); on a GPU the roles are colocated on it, with bfloat16, CUDA graphs and vLLM
sleep mode.

    python scripts/gpu_check.py --out gpu_check.json

Checks:
1. the stack starts (engine with the draft, learner, refit) in the platform's settings;
2. greedy rollouts with speculation equal those without, token for token;
3. sampled rollouts with speculation keep the policy's distribution (two-sample chi-square per
   prompt and position, Bonferroni level 0.01);
4. one GRPO step refits the engine (policy version 1), and the sampler / learner log-prob
   mismatch of its tokens is small (bfloat16 on a GPU, float32 here);
5. a draft refit takes effect (a scrambled draft accepts less) and restoring it restores the
   acceptance exactly;
6. rollout tokens/s with and without speculation (reported, no bar to pass).
Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Compute 9", "Compute 47", "Q: 7*8\nA:"]


def overrides(on_gpu: bool) -> list[str]:
    base = ["+experiment=tiny_cpu", "speculation=draft_model", "speculation.num_speculative_tokens=3",
            "generation.num_prompts_per_step=8",
            "generation.num_generations_per_prompt=4", "generation.max_new_tokens=48", "trainer.micro_batch_size=8",
            "trainer.save_final=false", "logging.wandb_mode=disabled", "logging.progress_bar=false",
            "data.train.num_rows=256",
            "data.val.num_rows=32"]
    if on_gpu:  # one GPU, every role on it; bfloat16, CUDA graphs and sleep mode by the platform's defaults
        base += ["cluster.gpus_per_node=1", "cluster.placement=colocated", "generation.gpu_memory_utilization=0.25"]
    return base


class Checks:
    def __init__(self):
        self.rows: list[dict] = []

    def run(self, name: str, fn):
        t0 = time.perf_counter()
        try:
            ok, figures = fn()
        except Exception as e:  # noqa: BLE001 - a failed check is reported, the others still run
            ok, figures = False, {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        self.rows.append({"check": name, "passed": bool(ok), "seconds": time.perf_counter() - t0, **figures})
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {json.dumps(figures)}", flush=True)
        return figures

    def table(self) -> str:
        out = [f"{'check':<66}{'result':>8}{'seconds':>9}"]
        out += [f"{r['check']:<66}{'not run' if r.get('not_run') else 'pass' if r['passed'] else 'FAIL':>8}"
                f"{r['seconds']:>9.1f}" for r in self.rows]
        return "\n".join(out)


class Stack:
    """What the checks share: the run's config and data, the launched actors, and a reference
    engine without speculation outside the placement plan."""

    def __init__(self, cfg, paths, tok, train_set, val_set, samples: int, run_dir: Path, on_gpu: bool):
        self.cfg, self.paths, self.tok, self.train_set, self.val_set = cfg, paths, tok, train_set, val_set
        self.samples, self.run_dir, self.on_gpu = samples, run_dir, on_gpu
        self.held_out = [p.token_ids for p in val_set.prompts[:16]]
        self.actors = self.plain = None

    def wait(self, call):
        from rlspec.cluster.calls import wait

        return wait(call, self.actors.timeout_s)

    def plain_generate(self, prompts, sampling):
        import ray

        return ray.get(self.plain.generate.remote(prompts, sampling), timeout=self.actors.timeout_s)


def start(s: Stack):
    import ray

    from rlspec.cluster.launch import launch_actors
    from rlspec.workers.generator import Generator

    t0 = time.perf_counter()
    s.actors = launch_actors(s.cfg, s.paths)
    plain_spec = type(s.cfg.speculation)(method="none")
    # the reference engine stays outside the plan (whose bundle holds the GPU): an actor that asks
    # for no GPU sees every GPU of its node
    s.plain = ray.remote(Generator).options(num_cpus=0).remote(
        paths=s.paths, model=s.cfg.model, generation=s.cfg.generation, speculation=plain_spec, seed=0, threads=2)
    ray.get(s.plain.ping.remote(), timeout=s.cfg.cluster.actor_timeout_s)
    return True, {"seconds_to_start": time.perf_counter() - t0}


def greedy_equal(s: Stack):
    from rlspec.messages import Sampling

    spec = s.wait(s.actors.generators.generate(s.held_out, Sampling(1, 0.0, 48)))
    base = s.plain_generate(s.held_out, Sampling(1, 0.0, 48))
    return spec.response_ids == base.response_ids, {"prompts": len(s.held_out), "tokens": spec.num_tokens,
                                                    "acceptance_length": spec.spec.acceptance_length}


def distribution(s: Stack):
    from rlspec.messages import Sampling
    from rlspec.speculation.lossless import two_sample_p

    ids = [s.tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    n = s.samples
    got = s.wait(s.actors.generators.generate(ids, Sampling(n, 1.0, 6, seed=1)))
    ref = s.plain_generate(ids, Sampling(n, 1.0, 6, seed=2))
    pad = lambda ro: [r + [-1] * (6 - len(r)) for r in ro.response_ids]  # noqa: E731
    g, r = pad(got), pad(ref)
    pvals = [two_sample_p([x[pos] for x in g[i * n:(i + 1) * n]], [x[pos] for x in r[i * n:(i + 1) * n]])
             for i in range(len(ids)) for pos in range(6)]
    level = 0.01 / len(pvals)
    return min(pvals) >= level and got.spec.accepted_tokens > 0, {
        "tests": len(pvals), "min_p": min(pvals), "bonferroni_level": level,
        "accepted_draft_tokens": got.spec.accepted_tokens}


def grpo_step(s: Stack):
    from rlspec.data.loading import PromptSampler
    from rlspec.loops.runlog import RunLog
    from rlspec.loops.state import Counters, Run
    from rlspec.loops.step import train_step

    log = RunLog(str(s.run_dir), {}, 1, s.cfg.logging)
    run = Run(s.cfg, s.actors, s.tok, s.train_set, s.val_set, log)
    rec = train_step(run, Counters(), PromptSampler(s.train_set, seed=0), step=1)
    version = s.wait(s.actors.generators.ping())[0]
    bound = 0.05 if s.on_gpu else 1e-3
    return version == 1 and rec.logprob_mismatch < bound, {
        "policy_version": version, "logprob_mismatch": rec.logprob_mismatch, "mismatch_bound": bound,
        "importance_weight": rec.importance_weight, "refit_seconds": rec.extra["refit_seconds"],
        "step_seconds": rec.step_seconds}


def draft_refit(s: Stack):
    import torch

    from rlspec.messages import Sampling
    from rlspec.models import load_causal_lm
    from rlspec.workers.generator import Generator

    gen = s.actors.generators
    draft = {k: v.to(getattr(torch, s.cfg.generation.dtype)) for k, v in
             load_causal_lm(s.paths.draft).named_parameters()}
    g = torch.Generator().manual_seed(3)
    scrambled = {k: v + torch.randn(v.shape, generator=g).to(v.dtype) for k, v in draft.items()}
    before = s.wait(gen.generate(s.held_out, Sampling(1, 0.0, 48))).spec
    s.wait(gen.all(Generator.refit_tensors, scrambled, 2, True))
    bad = s.wait(gen.generate(s.held_out, Sampling(1, 0.0, 48))).spec
    s.wait(gen.all(Generator.refit_tensors, draft, 3, True))
    back = s.wait(gen.generate(s.held_out, Sampling(1, 0.0, 48))).spec
    ok = bad.acceptance_rate < 0.5 * before.acceptance_rate and back.accepted_tokens == before.accepted_tokens
    return ok, {"acceptance_rate": before.acceptance_rate, "scrambled": bad.acceptance_rate,
                "restored": back.acceptance_rate}


def speed(s: Stack):
    from rlspec.messages import Sampling

    prompts = [p.token_ids for p in s.train_set.prompts[:32]]
    sampling = Sampling(4, 1.0, 64, seed=5)
    rates = {}
    for name, call in (("speculation", lambda: s.wait(s.actors.generators.generate(prompts, sampling))),
                       ("none", lambda: s.plain_generate(prompts, sampling))):
        call()  # warm-up at this shape
        ro = call()
        rates[name] = ro.num_tokens / ro.seconds
    return True, {"tokens_per_second": rates, "speedup": rates["speculation"] / rates["none"],
                  "batch": "32 prompts x 4 samples x 64 tokens"}


CHECKS = [("greedy: speculation equals no speculation", greedy_equal),
          ("sampled: speculation keeps the distribution", distribution),
          ("GRPO step, refit, sampler/learner mismatch", grpo_step),
          ("draft refit takes effect and restores", draft_refit),
          ("rollout speed with and without speculation", speed)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--samples", type=int, default=1000, help="samples per prompt for the two-sample test")
    a = ap.parse_args()

    import torch

    from rlspec.cluster.ray_cluster import RayCluster
    from rlspec.checks import resolve_auto, validate
    from rlspec.models import load_tokenizer
    from rlspec.train import compose_config, load_data, resolve_paths

    on_gpu = torch.cuda.is_available()
    cfg = compose_config(overrides(on_gpu))
    validate(cfg)
    cfg = resolve_auto(cfg)
    checks, t_all = Checks(), time.perf_counter()
    platform = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "engine_dtype": cfg.generation.dtype,
                "learner_dtype": cfg.trainer.dtype, "cuda_graphs": not cfg.generation.enforce_eager,
                "sleep_mode": cfg.generation.sleep_mode, "refit": cfg.cluster.refit}
    print(json.dumps(platform), flush=True)
    paths = resolve_paths(cfg)
    tok = load_tokenizer(paths.tokenizer, "model.path")
    train_set, val_set = load_data(cfg, tok)
    stack = Stack(cfg, paths, tok, train_set, val_set, a.samples, a.out.resolve().parent, on_gpu)
    with RayCluster(cfg):
        checks.run("stack starts (engine + draft, learner, refit)", lambda: start(stack))
        if stack.actors is not None:
            for name, check in CHECKS:
                checks.run(name, lambda: check(stack))
    return finish(a.out, checks, platform, t_all)


def finish(out: Path, checks: Checks, platform: dict, t0: float) -> int:
    passed = all(r["passed"] for r in checks.rows) and len(checks.rows) == 6
    print("\n" + checks.table() + f"\n{'all passed' if passed else 'FAILED'} in {time.perf_counter() - t0:.0f} s",
          flush=True)
    out.write_text(json.dumps({"platform": platform, "passed": passed, "checks": checks.rows,
                               "wall_seconds": time.perf_counter() - t0}, indent=1) + "\n")
    print(f"wrote {out}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
