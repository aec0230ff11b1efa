"""One real GRPO step through Ray + vLLM + DeepSpeed on the tiny assets."""
import pytest
import torch

from conftest import paths_of, resolved, sampling


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from rlspec.loops.runlog import RunLog
    from rlspec.loops.state import Run
    from rlspec.train import load_data
    from rlspec.models import load_tokenizer
    from rlspec.cluster.launch import launch_actors
    from rlspec.cluster.ray_cluster import RayCluster

    cfg = resolved(["generation.num_prompts_per_step=4", "generation.num_generations_per_prompt=4",
                   "trainer.micro_batch_size=8", "trainer.lr=1e-3", "data.train.num_rows=64",
                   "data.val.num_rows=8", "generation.max_new_tokens=40", "logging.wandb_mode=disabled",
                   "algo.recompute_logprobs=true"])  # the LogprobWorker is started and used
    tok = load_tokenizer(cfg.model.path, "model.path")
    train, val = load_data(cfg, tok)
    run_dir = tmp_path_factory.mktemp("run")
    with RayCluster(cfg):
        actors = launch_actors(cfg, paths_of(cfg))
        log = RunLog(str(run_dir), {}, 1, cfg.logging)
        yield Run(cfg, actors, tok, train, val, log)


def test_one_step_changes_every_parameter_and_refits_generator(stack):
    from transformers import AutoModelForCausalLM

    from rlspec.data.loading import PromptSampler
    from rlspec.cluster.calls import wait
    from rlspec.loops.state import Counters
    from rlspec.loops.step import train_step

    a = stack.actors
    before = wait(a.learners.full_weights(), a.timeout_s)[0]
    rec = train_step(stack, Counters(), PromptSampler(stack.train, seed=0), step=1)
    after = wait(a.learners.full_weights(), a.timeout_s)[0]
    assert rec.policy_version == 1 and rec.generated_tokens > 0
    assert set(before) == set(after)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, f"parameters not updated: {unchanged}"
    # float32 engine: vLLM's sampled-token log-probs match the recompute closely
    assert rec.logprob_mismatch < 1e-3
    assert all(v >= 0 for v in rec.stage_seconds.values())

    # The Generator now holds the learner's new weights: its greedy output equals a fresh
    # transformers forward of those weights.
    model = AutoModelForCausalLM.from_pretrained(stack.cfg.model.path, dtype=torch.float32)
    model.load_state_dict(after, strict=False)
    model.tie_weights()
    prompts = [p.token_ids for p in stack.val.prompts[:4]]
    ro = wait(a.generators.generate(prompts, sampling(1, 0.0, 24)), a.timeout_s)
    for p, got in zip(prompts, ro.response_ids):
        out = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                             eos_token_id=stack.tokenizer.eos_token_id, pad_token_id=stack.tokenizer.pad_token_id)
        assert got == out[0, len(p):].tolist()


def test_generator_refit_is_not_a_no_op(stack):
    """Pushing different weights changes the greedy output; pushing the old ones restores it."""
    from rlspec.cluster.calls import wait
    from rlspec.workers.generator import Generator

    a = stack.actors
    w = wait(a.learners.full_weights(), a.timeout_s)[0]
    prompts = [p.token_ids for p in stack.val.prompts[:4]]
    base = wait(a.generators.generate(prompts, sampling(1, 0.0, 16)), a.timeout_s).response_ids
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in w.items()}
    wait(a.generators.all(Generator.refit_tensors, noisy, 100), a.timeout_s)
    changed = wait(a.generators.generate(prompts, sampling(1, 0.0, 16)), a.timeout_s)
    wait(a.generators.all(Generator.refit_tensors, w, 101), a.timeout_s)
    restored = wait(a.generators.generate(prompts, sampling(1, 0.0, 16)), a.timeout_s)
    assert changed.response_ids != base and changed.policy_version == 100
    assert restored.response_ids == base


def test_dead_actor_is_reported_by_name(stack):
    import os
    import signal

    from rlspec.cluster.calls import ActorFailure, wait
    from rlspec.workers.logprob import LogprobWorker

    a = stack.actors
    os.kill(wait(a.logprobs.all(LogprobWorker.pid), timeout_s=60)[0], signal.SIGKILL)  # a crash, not a polite shutdown
    with pytest.raises(ActorFailure, match="logprob_worker died"):
        wait(a.logprobs.ping(), timeout_s=60)


def test_silent_actor_times_out_with_its_name(stack):
    import ray

    from rlspec.cluster.calls import ActorFailure, Call, wait

    @ray.remote(num_cpus=0)
    class Sleeper:
        def sleep(self, s):
            import time
            time.sleep(s)

    s = Sleeper.remote()
    with pytest.raises(ActorFailure, match=r"sleeper\.sleep did not answer within 2s"):
        wait(Call("sleeper", "sleep", s.sleep.remote(30)), timeout_s=2)
    ray.kill(s)
