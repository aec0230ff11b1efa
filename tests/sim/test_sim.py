"""The simulator's cost-model limits, its calibration round trip, every scenario preset, and the
CLI's outputs. Pure Python: no Ray, vLLM or DeepSpeed."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, compose as compose_trainer
from rlspec.sim.calibrate import Measured, RunError, calibrate, cli, fit, load_run, sim_config_for_run
from rlspec.sim.config import EfficiencyConfig, SimConfigError, compose, validate
from rlspec.sim.cost import (compare, draft_cost_ratio, forward_seconds, implied_acceptance_rate,
                             infer_mean_response, logprob_seconds, refit_seconds, response_lengths, rollout,
                             step, textbook_speedup, tokens_per_verification, train_seconds, verification_seconds,
                             without_speculation)
from rlspec.messages import step_moments
from rlspec.sim.shapes import active_params, total_params

SCENARIOS = sorted(p.stem for p in (ROOT / "conf" / "sim" / "scenario").glob("*.yaml"))


def spec(cfg, **kw):
    return replace(cfg, spec=replace(cfg.spec, **kw))


def workload(cfg, **kw):
    return replace(cfg, workload=replace(cfg.workload, **kw))


@pytest.fixture(scope="module")
def base():
    return compose()  # Qwen3-8B + EAGLE-3 on 32 GB200


def test_shapes_match_published_parameter_counts(base):
    # Qwen3-8B: 8.19B parameters; Qwen3-235B-A22B: 235B total, 22B active (lm_head included).
    assert total_params(base.model.target) == pytest.approx(8.19e9, rel=0.005)
    moe = compose(["model=qwen3_235b_a22b"]).model.target
    assert total_params(moe) == pytest.approx(235e9, rel=0.01)
    assert active_params(moe) == pytest.approx(21.5e9, rel=0.03)


def test_k0_equals_no_speculation(base):
    for cfg in (base, compose(["+scenario=paper_235b_async"])):
        a, b = step(spec(cfg, k=0)), step(without_speculation(cfg))
        assert a.stage_seconds == b.stage_seconds and a.step_seconds == b.step_seconds
        assert compare(spec(cfg, k=0)).rollout_speedup == 1.0


def test_full_acceptance_emits_k_plus_1_tokens_per_verification(base):
    cfg = workload(spec(base, k=3, acceptance_per_pos=[1.0, 1.0, 1.0]), response_length_cv=0.0)
    assert tokens_per_verification(cfg.spec) == 4.0
    ro = rollout(cfg)
    # no tail (cv 0): every sequence needs exactly mean/(k+1) verifications
    assert ro.verifications == pytest.approx(cfg.workload.mean_response_tokens / 4)
    assert rollout(without_speculation(cfg)).verifications == pytest.approx(cfg.workload.mean_response_tokens)


def test_acceptance_extends_geometrically_past_measured_positions(base):
    s = spec(base, k=4, acceptance_per_pos=[0.8, 0.4]).spec
    assert tokens_per_verification(s) == pytest.approx(1 + 0.8 + 0.4 + 0.2 + 0.1)
    assert tokens_per_verification(spec(base, k=3, acceptance_per_pos=[], acceptance_rate=0.5).spec) == 1.875


def _short_context(cfg, seqs_per_gpu):
    gpus = cfg.cluster.num_gpus
    return workload(cfg, num_prompts_per_step=seqs_per_gpu * gpus // 8, num_generations_per_prompt=8,
                    prompt_tokens=64, max_new_tokens=512, mean_response_tokens=256, response_length_cv=0.0)


def test_compute_bound_large_batch_makes_long_k_lose(base):
    big = spec(_short_context(base, 2048), acceptance_per_pos=[], acceptance_rate=0.6)
    small = spec(_short_context(base, 2), acceptance_per_pos=[], acceptance_rate=0.6)
    big_k = [compare(spec(big, k=k)).rollout_speedup for k in (1, 3, 7)]
    small_k = [compare(spec(small, k=k)).rollout_speedup for k in (1, 3, 7)]
    assert big_k[2] < 1.0 < small_k[2]           # k=7 loses only when compute-bound
    assert big_k[2] < big_k[1] < big_k[0]         # and there every extra draft token costs
    assert small_k[0] < small_k[1]                # memory-bound: longer drafts still pay


def test_memory_bound_small_batch_recovers_the_textbook_speedup(base):
    cfg = spec(_short_context(base, 1), acceptance_per_pos=[], acceptance_rate=0.7, k=3)
    c = draft_cost_ratio(cfg.model.target, cfg.model.draft)
    # the first draft forward reads ~tau tokens, so allow a little more than the textbook cost
    assert compare(cfg).rollout_speedup == pytest.approx(textbook_speedup(0.7, 3, c), rel=0.03)


def test_moe_verification_reads_more_experts_than_a_decode_step(base):
    moe = compose(["model=qwen3_235b_a22b"])
    fwd = lambda cfg, q: forward_seconds(cfg.model.target, cfg.gpu, cfg.eff, 1, 1, q, 0)  # noqa: E731
    assert fwd(moe, 4) > 2.0 * fwd(moe, 1)       # 4 tokens visit ~3.7x the experts of one
    assert fwd(base, 4) < 1.01 * fwd(base, 1)    # a dense model streams the same weights


def test_long_tail_lowers_occupancy_and_the_step_waits_for_it(base):
    flat, tail = workload(base, response_length_cv=0.0), workload(base, response_length_cv=0.8)
    lengths = response_lengths(tail)
    assert sum(lengths) / len(lengths) == pytest.approx(tail.workload.mean_response_tokens, rel=1e-3)
    assert max(lengths) <= tail.workload.max_new_tokens
    ro_flat, ro_tail = rollout(flat), rollout(tail)
    assert ro_flat.mean_occupancy == pytest.approx(ro_flat.seqs_per_engine)
    assert ro_tail.mean_occupancy < 0.8 * ro_tail.seqs_per_engine
    assert ro_tail.seconds > 1.3 * ro_flat.seconds


def test_partial_rollouts_keep_the_batch_full_and_pay_only_with_a_tail(base):
    """The event simulation of partial rollouts: at over_provision 1 it is whole calls (every answer
    of the call generated, its occupancy draining like the analytic tail's); over-provisioned, the
    running batch stays fuller and a call takes less time when lengths have a tail; with equal
    lengths whole calls by simulation equal the analytic model."""
    tail = workload(base, response_length_cv=0.8)
    whole = rollout(workload(tail, partial_over_provision=1.0))
    part = rollout(workload(tail, partial_over_provision=2.0))
    analytic = rollout(tail)
    assert whole.seconds == pytest.approx(analytic.seconds, rel=0.25)  # seeded draws against quantiles
    assert whole.mean_occupancy < 0.8 * whole.seqs_per_engine
    assert part.mean_occupancy / part.seqs_per_engine > whole.mean_occupancy / whole.seqs_per_engine
    assert part.seconds < whole.seconds
    flat = workload(base, response_length_cv=0.0, partial_over_provision=1.0)
    assert rollout(flat).mean_occupancy == pytest.approx(rollout(flat).seqs_per_engine)
    assert rollout(flat).seconds == pytest.approx(rollout(workload(base, response_length_cv=0.0)).seconds, rel=1e-6)


def test_training_logprob_refit_from_flops_and_bytes(base):
    cfg = replace(base, eff=replace(base.eff, logprob_mfu=0.3, train_mfu=0.3, link=1.0))
    assert train_seconds(cfg) == pytest.approx(3 * logprob_seconds(cfg))
    assert refit_seconds(cfg) == pytest.approx(total_params(cfg.model.target) * 2 / cfg.gpu.nvlink_bandwidth)
    twice = replace(cfg, cluster=replace(cfg.cluster, num_gpus=64))
    assert train_seconds(twice) == pytest.approx(train_seconds(cfg) / 2)


def test_async_overlaps_and_lag2_skips_the_tail():
    cfg = compose(["+scenario=paper_235b_async"])
    s = step(cfg)
    gen_side = s.stage_seconds["generation"] + s.stage_seconds["refit"]
    train_side = s.stage_seconds["prep"] + s.stage_seconds["logprob"] + s.stage_seconds["train"]
    assert s.step_seconds == pytest.approx(max(gen_side, train_side))
    lag1 = replace(cfg, cluster=replace(cfg.cluster, policy_lag=1))
    assert rollout(cfg).seconds < rollout(lag1).seconds  # refilled slots never drain


def test_lag_l_keeps_l_batches_in_flight():
    """At lag L >= 2 each engine decodes L batches' sequences at once, so a batch takes 1/L of
    the verifications its own sequences need, each over L times the batch."""
    cfg = compose(["+scenario=paper_235b_async"])
    tau, lengths = tokens_per_verification(cfg.spec), response_lengths(cfg)
    for lag in (2, 3):
        ro = rollout(replace(cfg, cluster=replace(cfg.cluster, policy_lag=lag)))
        assert ro.seqs_per_engine == pytest.approx(len(lengths) / (cfg.cluster.gen_gpus // cfg.cluster.gen_tp))
        assert ro.mean_occupancy == pytest.approx(lag * ro.seqs_per_engine)
        assert ro.verifications == pytest.approx(sum(lengths) / len(lengths) / (tau * lag))
    # Decode is memory-bound here: a wider batch shares each expert read, so lag 3 is cheaper per batch.
    lag3 = replace(cfg, cluster=replace(cfg.cluster, policy_lag=3))
    assert rollout(lag3).seconds < rollout(cfg).seconds


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_composes_and_validates(name):
    cfg = compose([f"+scenario={name}"])
    assert cfg.paper["rollout_speedup"] > 1 and cfg.paper["step_speedup"] > 1
    c = compare(cfg)
    assert c.rollout_speedup > 1 and c.step_speedup > 1


@pytest.mark.parametrize("name,speedup,gen_s", [("paper_rl_zero_8b", 1.8, 100.0), ("paper_rl_think_8b", 1.54, 133.6)])
def test_8b_scenario_inputs_are_derived_as_documented_and_land_within_15pct(name, speedup, gen_s):
    cfg = compose([f"+scenario={name}"])
    c = draft_cost_ratio(cfg.model.target, cfg.model.draft)
    assert cfg.spec.acceptance_rate == pytest.approx(implied_acceptance_rate(speedup, 3, c), abs=1e-4)
    assert infer_mean_response(cfg, gen_s) == pytest.approx(cfg.workload.mean_response_tokens, abs=1)
    r = compare(cfg)
    assert r.baseline.stage_seconds["generation"] == pytest.approx(gen_s, rel=0.005)
    assert r.rollout_speedup == pytest.approx(cfg.paper["rollout_speedup"], rel=0.15)
    assert r.step_speedup == pytest.approx(cfg.paper["step_speedup"], rel=0.15)


def test_235b_scenarios_accept_three_tokens_per_verification():
    for name in ("paper_235b_sync", "paper_235b_async"):
        assert tokens_per_verification(compose([f"+scenario={name}"]).spec) == pytest.approx(3.0, abs=1e-3)


@pytest.mark.parametrize("override,key", [
    ("spec.method=medusa", "spec.method"),
    ("spec.acceptance_rate=1.0", "spec.acceptance_rate"),
    ("spec.acceptance_per_pos=[0.5,0.9]", "spec.acceptance_per_pos"),
    ("cluster.mode=async", "cluster.gen_gpus"),
    ("eff.train_mfu=1.5", "eff.train_mfu"),
    ("workload.mean_response_tokens=99999", "workload.mean_response_tokens"),
    ("model.draft=null", "model.draft"),
    ("workload.partial_over_provision=0.5", "workload.partial_over_provision"),
])
def test_validate_names_the_bad_key(override, key):
    with pytest.raises(SimConfigError, match=f"^{key}"):
        compose([override])


# ---------------------------------------------------------------------------------------------
# Calibration on a synthetic run: summary.json written by the simulator itself with known
# efficiencies, so the fit must recover them and predict a second run exactly.

# The engine's GEMM efficiency (decode_flops) is read off the decode steps' line, so the synthetic
# truth gives it a value of its own; runs without a step line borrow the log-prob or training MFU.
TRUE_EFF = EfficiencyConfig(forward_overhead_s=0.012, logprob_mfu=0.2, decode_flops=0.15, train_mfu=0.25,
                            refit_overhead_s=0.05, prep_s_per_sample=2e-4)


def _write_run(path: Path, overrides: list[str], response_length: float, per_pos: list[float],
               eff: EfficiencyConfig = TRUE_EFF, recompute: bool = True, steps: bool = True) -> Path:
    rcfg = compose_trainer(overrides)
    from omegaconf import OmegaConf
    path.mkdir(parents=True)
    (path / ".hydra").mkdir()
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(OmegaConf.to_container(OmegaConf.structured(rcfg))))
    rcfg_dict = yaml.safe_load((path / ".hydra" / "config.yaml").read_text())
    m = Measured({"logprob": float(recompute)}, 0.0, 0.0, response_length, per_pos, 1)
    from rlspec.sim.calibrate import load_gpu
    cfg = sim_config_for_run(rcfg_dict, m, load_gpu("cpu_2core"), 0.16, 10, eff)
    s = step(cfg)
    st = s.stage_seconds
    # decode steps as the Generator times them: a batch draining from 256 to 16 sequences
    ctx, tau = 10 + response_length / 2, tokens_per_verification(cfg.spec)
    decode = [(n, verification_seconds(cfg, n, ctx, tau)) for n in range(256, 15, -16)]
    rec = {"stage_seconds": {"data": 0.0, "prep": st["prep"], "generation": st["generation"],
                             "logprob": st["logprob"], "train": st["train"] + st["refit"]},
           "step_seconds": s.step_seconds, "generated_tokens": 0,
           "spec": {"acceptance_per_pos": per_pos} if per_pos else None,
           "decode_step_moments": step_moments(decode) if steps else None,
           "extra": {"refit_seconds": st["refit"], "response_length": response_length}}
    warmup = {**rec, "stage_seconds": {k: 3 * v for k, v in rec["stage_seconds"].items()}}  # dropped
    (path / "summary.json").write_text(json.dumps({"records": [warmup, rec, rec]}))
    return path


def test_calibrate_recovers_efficiencies_and_predicts_another_k_and_batch(tmp_path):
    fit_run = _write_run(tmp_path / "k3", ["speculation=draft_model", "speculation.num_speculative_tokens=3"],
                         28.0, [1.0, 0.97, 0.93])
    check = _write_run(tmp_path / "k1", ["speculation=draft_model", "speculation.num_speculative_tokens=1",
                                         "generation.num_prompts_per_step=16"], 27.5, [0.99])
    r = calibrate(str(fit_run), [str(check)], "cpu_2core", 0.16, 10)
    for key in ("forward_overhead_s", "logprob_mfu", "decode_flops", "train_mfu", "refit_overhead_s",
                "prep_s_per_sample"):
        assert r["eff"][key] == pytest.approx(getattr(TRUE_EFF, key), rel=1e-3), key
    for rows in (r["fit"], r["checks"][str(check)]):
        for stage, (meas, sim) in rows.items():
            assert sim == pytest.approx(meas, rel=1e-3), stage


def test_calibrate_without_a_step_line_or_recompute_borrows_the_training_mfu(tmp_path):
    """An older run (no decode_step_moments) of rlspec's default (no log-prob recompute): decode
    GEMMs are taken to run at the training pass's MFU, the one matmul efficiency it measured."""
    truth = replace(TRUE_EFF, decode_flops=TRUE_EFF.train_mfu)
    run = _write_run(tmp_path / "k3", ["speculation=draft_model", "speculation.num_speculative_tokens=3"],
                     28.0, [1.0, 0.97, 0.93], truth, recompute=False, steps=False)
    r = calibrate(str(run), [], "cpu_2core", 0.16, 10)
    for key in ("forward_overhead_s", "decode_flops", "train_mfu"):
        assert r["eff"][key] == pytest.approx(getattr(truth, key), rel=1e-3), key
    assert r["fit"]["logprob"] == [0.0, 0.0]


def test_calibrate_cli_reads_the_run_config_and_writes_its_report(tmp_path, capsys):
    fit_run = _write_run(tmp_path / "k3", ["speculation=draft_model", "speculation.num_speculative_tokens=3"],
                         28.0, [1.0, 0.97, 0.93])
    check = _write_run(tmp_path / "k1", ["speculation=draft_model", "speculation.num_speculative_tokens=1",
                                         "generation.num_prompts_per_step=16"], 27.5, [0.99])
    assert cli([str(fit_run), "--check", str(check), "--length-cv", "0.16", "--prompt-tokens", "10"]) == 0
    r = json.loads((fit_run / "sim_calibration.json").read_text())
    assert r["gpu"] == "cpu_2core"  # a CPU run (cluster.gpus_per_node=0) picks the CPU preset
    assert r["eff"]["train_mfu"] == pytest.approx(TRUE_EFF.train_mfu, rel=1e-3)
    assert f"check run {check}" in capsys.readouterr().out


def test_calibrate_names_what_a_run_dir_lacks(tmp_path):
    with pytest.raises(RunError, match="summary.json"):
        load_run(tmp_path)


def test_fit_switches_to_flops_efficiency_when_the_roofline_is_too_slow(base):
    cfg = workload(_short_context(base, 64), mean_response_tokens=64)
    fast = replace(cfg, eff=replace(cfg.eff, decode_flops=1.0))
    gen = step(fast).stage_seconds["generation"]
    m = Measured({"data": 0.0, "prep": 0.0, "generation": gen, "logprob": 1.0, "train": 2.0}, 0.0, 3.0, 64, [], 1)
    e = fit(cfg, m)
    assert e.forward_overhead_s == 0.0 and e.decode_flops == pytest.approx(1.0, rel=1e-3)  # no negative overhead


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_writes_sim_json_and_plots(tmp_path):
    out = tmp_path / "sim"
    p = subprocess.run([sys.executable, "-m", "rlspec.sim", "+scenario=paper_rl_think_8b", f"hydra.run.dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "rollout_speedup" in p.stdout and "1.54x" in p.stdout
    r = json.loads((out / "sim.json").read_text())
    assert r["rollout_speedup"] > 1 and r["step_speedup"] > 1
    for which in ("baseline", "speculative"):
        assert set(r["stage_seconds"][which]) == {"data", "prep", "generation", "logprob", "train", "refit"}
    assert r["stage_seconds"]["baseline"]["generation"] > r["stage_seconds"]["speculative"]["generation"]
    assert [row["k"] for row in r["sweeps"]["k"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (out / "speedup.png").stat().st_size > 10_000 and (out / "stages.png").stat().st_size > 10_000


def test_cli_bad_value_exits_2_naming_the_key(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlspec.sim", "cluster.gen_tp=0", f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "cluster.gen_tp" in p.stderr


def test_validate_rejects_async_without_a_generation_pool(base):
    with pytest.raises(SimConfigError, match="cluster.gen_gpus"):
        validate(replace(base, cluster=replace(base.cluster, mode="async", gen_gpus=0)))
