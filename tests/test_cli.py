"""The real entry point, end to end, in a subprocess."""
import json
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TEST_EXPERIMENT
from helpers.cli import SMALL, kill_actor_of


def test_two_step_run_writes_summary_plot_and_final_policy(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlspec.train", *SMALL, f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["steps"] == 2 and len(s["val_accuracy"]) == 3  # before step 1, after steps 1 and 2
    assert set(s["stage_seconds"]) == {"data", "prep", "generation", "logprob", "train"}
    assert s["tokens_per_second"] > 0 and s["wall_seconds"] > 0
    for r in s["records"]:
        assert {"step", "loss", "reward_mean", "policy_version", "generation_seconds"} <= set(r)
        e = r["extra"]
        assert 1 <= e["response_length_p50"] <= e["response_length_p90"] <= e["response_length_max"]
        assert e["response_length_max"] <= 40 and e["response_length_max"] >= e["response_length"]
    assert [r["policy_version"] for r in s["records"]] == [1, 2]
    # the learner's metrics average over the rows it trained (zero-gradient rows left out)
    assert s["train_metrics_over"] == "rows_trained" and all("train/rows_skipped" in r["extra"] for r in s["records"])
    # the engine's model runner as vLLM chose it: the CPU build runs V1, eager, without async scheduling
    assert s["engines"] == [{"model_runner": "V1", "async_scheduling": False, "cuda_graphs": False,
                             "speculation": "draft_model", "executor": "uni", "tensor_parallel_size": 1}]
    assert "engines: 1 on Model Runner V1, async scheduling off, CUDA graphs off" in p.stdout + p.stderr
    assert (tmp_path / "reward_and_stages.png").stat().st_size > 0
    assert "held-out accuracy" in p.stdout and "generation" in p.stdout
    assert list((tmp_path / "wandb").glob("offline-run-*"))

    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    AutoTokenizer.from_pretrained(tmp_path / "final")


@pytest.mark.slow  # CI time; tests/loops/test_queue.py ends an async run on a dead generator, by name
def test_killed_generator_ends_run_naming_it(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "rlspec.train", *SMALL, "trainer.max_steps=50",
                             "logging.progress_bar=false", f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        for line in proc.stdout:
            if "validation @ step 0" in line or time.time() > deadline:
                break
        kill_actor_of(proc.pid, "ray::Generator")
        t0 = time.time()
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    assert "actor failure: generator died" in err
    assert time.time() - t0 < 120


@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores
def test_dapo_with_kl_on_two_zero3_learner_ranks(tmp_path):
    """DAPO (dynamic sampling, overlong filter) + k3 KL + two DeepSpeed ranks under ZeRO-3."""
    p = subprocess.run([sys.executable, "-m", "rlspec.train", *SMALL, "trainer.max_steps=3", "trainer.val_every=0",
                        "algo=dapo", "algo.kl_coef=0.01", "cluster.learner_world_size=2", "trainer.zero_stage=3",
                        "logging.wandb_mode=disabled", f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = json.loads((tmp_path / "summary.json").read_text())["records"]
    for r in recs:
        # On-policy: the LogprobWorker's refit weights equal the learner's, so the ratio is 1.
        assert abs(r["extra"]["train/ratio_mean"] - 1.0) < 1e-3
        assert r["extra"]["sampling_rounds"] >= 1
    assert recs[0]["extra"]["train/kl"] == pytest.approx(0.0, abs=1e-9)  # policy == reference
    assert recs[-1]["extra"]["train/kl"] > 0.0


@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores
def test_speculative_run_records_acceptance_per_step(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlspec.train", *SMALL, "trainer.val_every=0", "speculation=draft_model",
                        "logging.wandb_mode=disabled", f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    for r in s["records"]:
        sp = r["spec"]
        assert sp["drafts"] > 0 and 0 < sp["accepted_tokens"] <= sp["drafted_tokens"] == 3 * sp["drafts"]
        assert r["acceptance_length"] == pytest.approx(1 + sp["accepted_tokens"] / sp["drafts"])
        assert len(sp["acceptance_per_pos"]) == 3 and all(0 <= a <= 1 for a in sp["acceptance_per_pos"])
    assert 1 < s["acceptance_length"] <= 4 and "tokens per verification" in p.stdout


@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores
def test_skipped_recompute_trains_like_the_recompute(tmp_path):
    """Every batch gets exactly one optimizer step, so by default the learner's own detached forward
    pass stands in for the LogprobWorker's recompute as the proximal policy: same loss and gradient.
    Run asynchronously with lag 1: step 1 is on-policy, and step s > 1 trains on rollouts sampled by
    the weights before step s-1's update, so its decoupled-PPO behaviour weights pi_prox / pi_behav
    are taken from that forward pass (here step 1 has no update, every group agreeing, so step 3 is
    the first off-policy one). decoupled_ppo is named: it is the correction that takes both the
    ratio and the weight from the proximal policy. Both train with SGD (linear in the gradient),
    so the two paths' weights stay within float rounding of each other from step to step; Adam's
    first step (about lr x sign(g)) would turn rounding in near-zero gradients into steps of up to
    lr, and the later steps' losses would agree only to what one machine happened to give."""
    recs = {}
    for name, extra in (("skip", []), ("recompute", ["algo.recompute_logprobs=true"])):
        p = subprocess.run([sys.executable, "-m", "rlspec.train", *SMALL, "trainer.val_every=0", *extra,
                            "trainer.optimizer=sgd", "trainer.lr=0.1",
                            "trainer.max_steps=3", "async_grpo.enabled=true",
                            "algo.off_policy_correction=decoupled_ppo",
                            "trainer.save_final=false", "logging.plot=false",
                            "logging.wandb_mode=disabled", f"hydra.run.dir={tmp_path / name}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        recs[name] = json.loads((tmp_path / name / "summary.json").read_text())["records"]
    skip, full = recs["skip"], recs["recompute"]
    assert [r["policy_lag_max"] for r in skip] == [r["policy_lag_max"] for r in full] == [0, 1, 1]
    assert all(r["stage_seconds"]["logprob"] == 0.0 for r in skip)
    assert all(r["stage_seconds"]["logprob"] > 0.0 for r in full)
    # the recompute's log-probs come from the LogprobWorker's refit copy of the same weights: the
    # ratio against them is 1 only if that refit is exact (the skip path's ratio is 1 by construction)
    # (a step whose every group agreed trains no row, and reports no ratio)
    trained = [r for r in full if r["extra"]["train/rows_skipped"] < 1]
    assert len(trained) >= 2 and all(r["extra"]["train/ratio_mean"] == pytest.approx(1.0, abs=1e-3) for r in trained)
    assert skip[0]["logprob_mismatch"] < 1e-3
    # the same rollouts (sampled by the same weights), the same loss, gradient and behaviour weights
    # up to float rounding
    for a, b in zip(skip, full):
        assert a["generated_tokens"] == b["generated_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["extra"]["train/grad_norm"] == pytest.approx(b["extra"]["train/grad_norm"], rel=1e-4)
        assert a["importance_weight"] == pytest.approx(b["importance_weight"], rel=1e-4)
    assert skip[2]["importance_weight"]["max"] > 1.001  # the lagged batch is off-policy


# slow tier: a whole CLI run; the learner's skip of one non-finite update stays in the default suite
@pytest.mark.slow
def test_nonfinite_updates_in_a_row_stop_with_exit_4_and_a_checkpoint(tmp_path):
    """A policy with one NaN weight (finite inputs, NaN log-probs): every update is skipped; one
    more than trainer.max_nonfinite_steps in a row writes a complete checkpoint and exits 4."""
    import shutil

    from safetensors.torch import load_file, save_file

    policy = tmp_path / "policy"
    shutil.copytree(ROOT / "rlspec" / "assets" / "tiny" / "policy", policy)
    w = load_file(policy / "model.safetensors")
    w["model.layers.3.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(w, policy / "model.safetensors", metadata={"format": "pt"})
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "rlspec.train", TEST_EXPERIMENT, f"model.path={policy}",
                        "trainer.max_steps=6",
                        "trainer.max_nonfinite_steps=1", "trainer.val_every=0", "trainer.checkpoint_every=0",
                        "generation.num_prompts_per_step=4", "generation.num_generations_per_prompt=4",
                        "trainer.micro_batch_size=8", "data.val.num_rows=16", "generation.max_new_tokens=16",
                        "logging.wandb_mode=disabled", "logging.plot=false", f"hydra.run.dir={run}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 4, p.stderr[-3000:]
    assert "2 non-finite updates in a row (more than trainer.max_nonfinite_steps=1)" in p.stderr
    from rlspec.loops import checkpoint

    ck = checkpoint.latest(run / "checkpoints")
    assert ck is not None and ck.name == "step_00000002" and (ck / "COMPLETE").exists()
    assert checkpoint.read_driver_state(ck).step == 2
    s = json.loads((run / "summary.json").read_text())
    assert s["nonfinite_steps"] == 2 and [r["extra"]["train/skipped"] for r in s["records"]] == [1.0, 1.0]
