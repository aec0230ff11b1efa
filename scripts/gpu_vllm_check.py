"""vLLM's engine on one GPU, checked in one command: what no CPU can stand in for. `make gpu-kit`
packs what it needs for a GPU machine that has PyTorch but no package index; the default test
suite runs it on CPU where only that machine's packages and the kit are importable
(tests/scripts/test_gpu_kit_shadow.py), so it cannot rot.

    python scripts/gpu_vllm_check.py --out gpu_vllm_check.json

In-process engines (no Ray), one after another, each a Generator over the shipped chain policy with
its draft model, EAGLE-3 head or rollout history; on a GPU bfloat16, CUDA graphs and sleep mode
(the platform's defaults), on CPU float32, eager, no sleep. Checks, most valuable first, so that a
run cut off by --budget-s still says most:
1. runner: the model runner and async scheduling vLLM picks for none, eagle3, draft_model, ngram,
   history and history_device (history drafted on the engine's device, in vLLM's ngram_gpu slot,
   with its live table: Model Runner V2 and the drafter's Triton kernels on a GPU), against
   rlspec's rule (speculation.vllm_config.gpu_model_runner; V1 on CPU), and each engine built
   reports the same;
2. greedy: with speculation (eagle3, history, history_device, draft_model, ngram under `auto`),
   token for token the rollouts of the engine without; EAGLE-3's again after its engine slept and
   woke (sleep level 1, no draft refit: on a GPU), with the same accepted draft tokens;
3. refit: after sleep and wake, target and draft weights refit through vLLM's weight-transfer API
   from device tensors; greedy rollouts and accepted draft tokens then equal those of a fresh
   engine built on the new weights;
4. sampled: speculation keeps the distribution (EAGLE-3, and history drafted on the device, at
   temperature 1; chi-square per prompt and position, Bonferroni level 0.01, power stated at the
   observed distributions);
5. acceptance > 0 at every draft position; under `auto` every k of the schedule ran (its
   calibration times each k at each batch size, under CUDA graphs on a GPU);
6. tokens/s with and without speculation at batch 1, 8 and 64 (reported; eagle3, and both history
   drafters on answers they have seen), and on a GPU the memory a sleeping engine keeps against
   the memory model's figure.
They run in this order: the runner check, the engine without speculation, then an engine a method
(--methods) with its greedy check, a sampled test right after EAGLE-3's and history_device's, the
refit after the draft model's. Before the first, vLLM's compiled parts the kit carries are loaded explicitly
(`compiled_parts` in the JSON; vLLM itself only warns when one fails). A pass/fail table, exit 1
if a check failed (a check not reached is 'not run'). The JSON is rewritten after every check; at
--stop-s a watchdog marks the running check 'interrupted', writes the JSON and exits (status 3), so
a call's time limit never takes what already ran.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpu_check import Checks
from gpu_probe import compiled_parts, origins

ROOT = Path(__file__).resolve().parents[1]

METHODS = ("none", "eagle3", "draft_model", "ngram", "history", "history_device")
# A method is a speculation group, or one of these: the group and the overrides that make it
# (the device drafter with its live table: on a GPU every Triton kernel of its step runs)
VARIANTS = {"history_device": ("history", ["speculation.history.drafter=device",
                                           "speculation.history.device.lookup=table"])}
SAMPLED_PROMPTS = 3
SAMPLED_TOKENS = 6
SHIFT = 0.05  # the power is stated against moving this much probability between a position's two commonest tokens


OVERRIDES: list[str] = []  # --set: Hydra overrides every engine takes


def config(method: str, on_gpu: bool, extra: list[str] = ()):
    from rlspec.checks import resolve_auto
    from rlspec.train import compose_config

    group, variant = VARIANTS.get(method, (method, []))
    overrides = ["+experiment=chain_cpu", f"speculation={group}", "speculation.num_speculative_tokens=3", *variant,
                 *extra, *OVERRIDES]
    if on_gpu:  # one GPU; bfloat16, CUDA graphs and sleep mode by the platform's defaults
        overrides += ["cluster.gpus_per_node=1", "cluster.placement=colocated", "generation.gpu_memory_utilization=0.2"]
    return resolve_auto(compose_config(overrides))


def generator(cfg, paths=None):
    from rlspec.train import resolve_paths
    from rlspec.workers.generator import Generator

    return Generator(paths=paths or resolve_paths(cfg), model=cfg.model, generation=cfg.generation,
                     speculation=cfg.speculation, seed=0, threads=2)


def release(gen) -> None:
    """Shut an engine down before the next starts (one GPU, one process: Generator.shutdown)."""
    import torch

    gen.shutdown()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stated_power(a: list[int], b: list[int], alpha: float) -> float:
    """Power of the two-sample chi-square test at level alpha to detect SHIFT of probability moved
    between the two commonest tokens of the pooled sample (noncentral chi-square, df = columns - 1)."""
    from collections import Counter

    from scipy.stats import chi2, ncx2

    n = min(len(a), len(b))
    pooled = Counter(a) + Counter(b)
    common = [c / (len(a) + len(b)) for _, c in pooled.most_common()]
    if len(common) < 2:
        return 1.0
    df = max(1, sum(1 for c in pooled.values() if c >= 10))  # columns the test keeps, minus one (merged rest)
    lam = n / 2 * SHIFT ** 2 * (1 / common[0] + 1 / common[1])
    return float(ncx2.sf(chi2.isf(alpha, df), df, lam))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_vllm_check.json"))
    ap.add_argument("--samples", type=int, default=2000, help="samples per prompt and side for the two-sample test")
    ap.add_argument("--methods", default="eagle3,history,history_device,draft_model,ngram",
                    help="speculation methods whose engines are built (in this order)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no check after this many seconds")
    ap.add_argument("--stop-s", type=float, default=None,
                    help="after this many seconds mark the running check interrupted, write the JSON and exit 3")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Hydra overrides for every engine (e.g. generation.attention_backend=TRITON_ATTN)")
    a = ap.parse_args()
    OVERRIDES[:] = a.set
    t_all = time.perf_counter()  # --budget-s and --stop-s count from here, before the imports

    import torch

    from rlspec.data.loading import load_split
    from rlspec.engines.vllm_engine import runner_of, vllm_config_of
    from rlspec.messages import Sampling
    from rlspec.models import load_tokenizer
    from rlspec.speculation.lossless import two_sample_p
    from rlspec.speculation.vllm_config import gpu_model_runner, vllm_speculative_config
    from rlspec.train import resolve_paths

    on_gpu = torch.cuda.is_available()
    checks = Checks()
    methods = [m for m in a.methods.split(",") if m]
    base_cfg = config("none", on_gpu)
    paths = resolve_paths(base_cfg)
    tok = load_tokenizer(paths.tokenizer, "model.path")
    val = [p.token_ids for p in load_split(base_cfg.data, "val", tok).prompts]
    held_out, max_new = val[:16], 96
    greedy = Sampling(1, 0.0, max_new, rollout=False)
    platform = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__,
                "engine_dtype": base_cfg.generation.dtype, "cuda_graphs": not base_cfg.generation.enforce_eager,
                "sleep_mode": base_cfg.generation.sleep_mode, "overrides": a.set}
    try:
        import vllm
        platform["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001 - reported as the runner check's failure
        pass
    platform["origins"] = origins()  # the kit's site folders ahead of the machine's
    try:
        platform["compiled_parts"] = compiled_parts()
    except Exception as e:  # noqa: BLE001 - vLLM not importable: the runner check fails and says why
        platform["compiled_parts"] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(platform), flush=True)
    state: dict = {"engines": {}, "running": None}
    write(a.out, checks, platform, state, t_all, complete=False)

    def within_budget() -> bool:
        return time.perf_counter() - t_all < a.budget_s

    def run(name, fn):
        if not within_budget():
            checks.rows.append({"check": name, "passed": False, "not_run": True, "seconds": 0.0})
            print(f"NOT RUN  {name} (--budget-s {a.budget_s:.0f} spent)", flush=True)
            return {}
        state["running"] = (name, time.perf_counter())
        if a.stop_s is not None and "watchdog" not in state:  # armed as the first check starts
            state["watchdog"] = watchdog(a.stop_s, a.out, checks, platform, state, t_all)
        figures = checks.run(name, fn)
        state["running"] = None
        write(a.out, checks, platform, state, t_all, complete=False)
        return figures

    def runners():
        got = {}
        for m in METHODS:
            cfg = config(m, on_gpu)
            p = resolve_paths(cfg)
            info = runner_of(vllm_config_of(p.model, cfg.generation, cfg.model.max_model_len, 0, p.tokenizer,
                                            vllm_speculative_config(cfg.speculation, p.draft)))
            got[m] = {**info, "expected": gpu_model_runner(cfg.speculation) if on_gpu else "V1"}
        return all(r["model_runner"] == r["expected"] for r in got.values()), got

    run("runner: vLLM's choice per method matches rlspec's rule", runners)

    def baseline():
        gen = generator(base_cfg)
        state["greedy"] = gen.generate(held_out, greedy).response_ids
        state["engines"]["none"] = gen.runner_info()
        if on_gpu:
            free_before = torch.cuda.mem_get_info()[0]
        ids = held_out[:SAMPLED_PROMPTS]
        state["sampled"] = gen.generate(ids, Sampling(a.samples, 1.0, SAMPLED_TOKENS, seed=2, rollout=False))
        state["speed_none"] = speeds(gen)
        figures = {"runner": state["engines"]["none"], "tokens": sum(map(len, state["greedy"]))}
        if on_gpu:  # the engine sleeps between calls: what it keeps then, against the memory model
            figures["asleep_gib"] = (free_before - torch.cuda.mem_get_info()[0]) / 2**30
        release(gen)
        return True, figures

    def speeds(gen, rollout: bool = False) -> dict:
        """Tokens/s at batch 1, 8 and 64, each shape timed on its second call (history: training
        calls, so the second drafts from the first's answers)."""
        out = {}
        for b in (1, 8, 64):
            prompts = [val[i % len(val)] for i in range(b)]
            s = Sampling(1, 1.0, 128, seed=5, rollout=rollout)
            gen.generate(prompts, s)  # warm-up at this shape
            ro = gen.generate(prompts, s)
            out[b] = ro.num_tokens / ro.seconds
        return out

    run("baseline engine (no speculation) starts and generates", baseline)
    if "greedy" not in state:
        return finish(a.out, checks, platform, state, t_all)

    def spec_engine(method: str):
        extra = ["speculation.num_speculative_tokens=auto", "speculation.max_speculative_tokens=3"] \
            if method == "ngram" else []
        if method == "eagle3":
            extra = ["speculation.draft_sample_method=probabilistic"]
        cfg = config(method, on_gpu, extra)
        gen = generator(cfg)
        info = gen.runner_info()
        state["engines"][method] = info
        figures = {"runner": info}
        if method.startswith("history"):  # history to draft from: a sampled training call on the same prompts
            gen.generate(held_out, Sampling(4, 1.0, max_new, seed=1))
        ro = gen.generate(held_out, Sampling(1, 0.0, max_new))  # a training call: history drafts in it
        equal = ro.response_ids == state["greedy"]
        figures.update(acceptance_length=ro.spec.acceptance_length, accepted_per_pos=ro.spec.accepted_per_pos)
        ok = equal and info["model_runner"] == (gpu_model_runner(cfg.speculation) if on_gpu else "V1")
        if method == "ngram":  # under `auto`: its calibration ran OFF and every k of the schedule
            ks = sorted({k for _, k in gen.adaptive.planner.calibrated})
            figures["calibrated_k"] = ks
            ok = ok and ks == [-1, 0, 1, 2, 3]
        else:  # (n-gram drafts only where an answer repeats itself, and `auto` may switch it off)
            ok = ok and all(x > 0 for x in ro.spec.accepted_per_pos)
        if method == "draft_model":
            state["refit_engine"] = (gen, cfg)
        if method == "eagle3":  # the Generator slept (level 1) and woke again since that call: no draft refit
            again = gen.generate(held_out, Sampling(1, 0.0, max_new))
            figures["after_sleep_wake"] = {"sleep_mode": bool(cfg.generation.sleep_mode),
                                           "accepted": [ro.spec.accepted_tokens, again.spec.accepted_tokens]}
            ok = ok and again.response_ids == state["greedy"] and again.spec.accepted_tokens == ro.spec.accepted_tokens
            ids = held_out[:SAMPLED_PROMPTS]
            got = gen.generate(ids, Sampling(a.samples, 1.0, SAMPLED_TOKENS, seed=1, rollout=False))
            state["spec_sampled"] = got
            figures["speed"] = {"speculation": speeds(gen), "none": state["speed_none"]}
        if method == "history_device":  # a training call (history drafts in it) on prompts it has answered
            ids = held_out[:SAMPLED_PROMPTS]
            state["spec_sampled"] = gen.generate(ids, Sampling(a.samples, 1.0, SAMPLED_TOKENS, seed=1))
        if method.startswith("history"):  # the host drafter against the device drafter, each beside none
            figures["speed"] = {"speculation": speeds(gen, rollout=True), "none": state["speed_none"]}
        if method != "draft_model":
            release(gen)
        figures["greedy_equal"] = equal
        return ok, figures

    def refit():
        gen, cfg = state.pop("refit_engine")
        g = torch.Generator().manual_seed(3)
        device = "cuda" if on_gpu else "cpu"
        new_target = perturbed(paths.model, g)
        new_draft = perturbed(resolve_paths(cfg).draft, g)
        dtype = getattr(torch, cfg.generation.dtype)
        gen.refit_tensors({k: v.to(device, dtype) for k, v in new_target.items()}, 1)
        gen.refit_tensors({k: v.to(device, dtype) for k, v in new_draft.items()}, 1, draft=True)
        got = gen.generate(held_out, Sampling(1, 0.0, max_new))
        release(gen)
        with tempfile.TemporaryDirectory() as d:
            fresh_paths = type(paths)(save_like(paths.model, new_target, f"{d}/policy"), paths.tokenizer,
                                      save_like(resolve_paths(cfg).draft, new_draft, f"{d}/draft"))
            fresh = generator(cfg, fresh_paths)
            want = fresh.generate(held_out, Sampling(1, 0.0, max_new))
            release(fresh)
        changed = got.response_ids != state["greedy"]
        same = got.response_ids == want.response_ids and got.spec.accepted_tokens == want.spec.accepted_tokens
        return same and changed, {"outputs_changed": changed, "accepted": [got.spec.accepted_tokens,
                                                                           want.spec.accepted_tokens]}

    def sampled():
        got, ref = state["spec_sampled"], state["sampled"]
        n = a.samples
        pad = lambda ro: [r + [-1] * (SAMPLED_TOKENS - len(r)) for r in ro.response_ids]  # noqa: E731
        g, r = pad(got), pad(ref)
        pairs = [([x[pos] for x in g[i * n:(i + 1) * n]], [x[pos] for x in r[i * n:(i + 1) * n]])
                 for i in range(SAMPLED_PROMPTS) for pos in range(SAMPLED_TOKENS)]
        level = 0.01 / len(pairs)
        pvals = [two_sample_p(x, y) for x, y in pairs]
        power = sorted(stated_power(x, y, level) for x, y in pairs)
        return min(pvals) >= level and got.spec.accepted_tokens > 0, {
            "tests": len(pvals), "min_p": min(pvals), "bonferroni_level": level, "samples_per_side": n,
            "accepted_draft_tokens": got.spec.accepted_tokens,
            "median_power_to_detect_shift": power[len(power) // 2], "shift": SHIFT}

    for method in methods:
        run(f"greedy: {method} equals no speculation, token for token", lambda m=method: spec_engine(m))
        if "spec_sampled" in state:  # the sampled test right after its engine: it outranks the later engines
            run(f"sampled: {method} speculation keeps the distribution", sampled)
            del state["spec_sampled"]
        if "refit_engine" in state:  # before another engine starts: a second live engine in the process
            run("refit: sleep, wake, target + draft refit equal a fresh engine", refit)  # broke its draft refit
            if "refit_engine" in state:
                release(state.pop("refit_engine")[0])
    return finish(a.out, checks, platform, state, t_all)


def perturbed(model_dir: str, g) -> dict:
    """A checkpoint's weights, each moved by noise at 30% of its own spread (float32, on the host);
    a tied output layer stays the embedding."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            v = v.float()
            out[k] = v + 0.3 * v.std().clamp_min(1e-3) * torch.randn(v.shape, generator=g)
    if json.loads((Path(model_dir) / "config.json").read_text()).get("tie_word_embeddings") and "lm_head.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def save_like(model_dir: str, weights: dict, out_dir: str) -> str:
    """A copy of a checkpoint folder with these weights (in its own dtype)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    for f in Path(out_dir).glob("*.safetensors"):
        dtype = next(iter(load_file(str(f)).values())).dtype
        keys = list(load_file(str(f)))
        save_file({k: weights[k].to(dtype).contiguous() for k in keys}, str(f), metadata={"format": "pt"})
    return out_dir


def write(out: Path, checks: Checks, platform: dict, state: dict, t0: float, complete: bool) -> None:
    """The JSON of what ran so far (replaced whole: a kill mid-write leaves the previous one)."""
    rows = list(checks.rows)
    if state.get("running") is not None:
        name, started = state["running"]
        rows.append({"check": name, "passed": False, "interrupted": True, "seconds": time.perf_counter() - started})
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"platform": platform, "complete": complete,
                               "passed": complete and all(r["passed"] for r in rows), "checks": rows,
                               "engines": state["engines"], "wall_seconds": time.perf_counter() - t0},
                              indent=1, default=str) + "\n")
    os.replace(tmp, out)


def watchdog(stop_s: float, out: Path, checks: Checks, platform: dict, state: dict, t0: float) -> threading.Timer:
    """At stop_s: the running check marked interrupted in the JSON, every thread's stack printed (where
    it hung), exit 3. faulthandler's own timer ends the process 20 s later if this thread never runs."""
    def stop():
        write(out, checks, platform, state, t0, complete=False)
        print(f"\nSTOPPED at --stop-s {stop_s:.0f}: {state['running'][0] if state['running'] else 'between checks'}"
              f"; wrote {out}", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    remaining = max(stop_s - (time.perf_counter() - t0), 0.0)
    timer = threading.Timer(remaining, stop)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(remaining + 20, exit=True)
    return timer


def finish(out: Path, checks: Checks, platform: dict, state: dict, t0: float) -> int:
    passed = all(r["passed"] for r in checks.rows)
    print("\n" + checks.table() + f"\n{'all passed' if passed else 'FAILED'} in {time.perf_counter() - t0:.0f} s",
          flush=True)
    if state.get("watchdog") is not None:
        state["watchdog"].cancel()
        faulthandler.cancel_dump_traceback_later()
    write(out, checks, platform, state, t0, complete=True)
    print(f"wrote {out}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
