"""Online draft adaptation (speculation.online): the feature cache's bound, the configuration
checks, and, through the real stack, that training the draft leaves the policy's updates
bit-for-bit unchanged while the draft trains and its pushes reach the Generator."""
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TEST_EXPERIMENT, compose, logprob_worker, report, rounding_bound, tiny_paths

SMALL = [TEST_EXPERIMENT, "speculation=eagle3", "trainer.max_steps=3", "trainer.val_every=0",
         "generation.num_prompts_per_step=4",
         "generation.num_generations_per_prompt=4", "trainer.micro_batch_size=8", "data.train.num_rows=64",
         "data.val.num_rows=16", "generation.max_new_tokens=40", "logging.wandb_mode=disabled",
         "logging.plot=false", "logging.progress_bar=false"]


def test_feature_cache_bound_holds_and_evicts_oldest_first():
    from rlspec.draft.cache import FeatureCache

    cache = FeatureCache(max_bytes=200_000)
    rng = random.Random(0)
    for version in range(30):
        B, T = 4, rng.randint(20, 60)
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[0, T // 2:] = False  # padding is dropped, not stored
        cache.add_batch(torch.randint(0, 100, (B, T)), mask, torch.randn(B, T, 96), torch.randint(0, 100, (B, T, 8)),
                        torch.randn(B, T, 8), [5] * B, version)
        assert cache.bytes <= cache.max_bytes
        assert cache.bytes == sum(s.nbytes for s in cache.items)
    assert cache.evicted > 0 and len(cache) > 0
    versions = [s.policy_version for s in cache.items]
    assert versions == sorted(versions) and versions[-1] == 29  # the newest are kept
    assert all(s.aux_hidden.dtype == torch.bfloat16 and s.topk_logp.dtype == torch.float16 for s in cache.items)
    with pytest.raises(ValueError, match="more than the cache bound"):
        FeatureCache(100).add_batch(torch.zeros(1, 50, dtype=torch.long), torch.ones(1, 50, dtype=torch.bool),
                                    torch.zeros(1, 50, 96), torch.zeros(1, 50, 8, dtype=torch.long),
                                    torch.zeros(1, 50, 8), [1], 0)


def test_a_long_rollout_keeps_a_window_that_reaches_its_response():
    """A 1,000-position rollout (response from 900) in a cache of 100 positions keeps 100
    consecutive positions, the same values at the same places, covering response positions."""
    from rlspec.draft.cache import FeatureCache

    T, A, K = 1000, 16, 4
    ids = torch.arange(T)[None] % 250
    aux, tid, tlp = torch.randn(1, T, A), torch.randint(0, 250, (1, T, K)), torch.randn(1, T, K)
    for seed in range(5):
        cache = FeatureCache(1 << 30, max_positions=100, seed=seed)
        cache.add_batch(ids, torch.ones(1, T, dtype=torch.bool), aux, tid, tlp, [900], 0)
        (s,) = cache.items
        assert len(s.ids) == 100 and cache.cropped == 1 and s.start + 100 > 901 and s.start + 100 <= T
        assert torch.equal(s.ids, ids[0, s.start: s.start + 100].int())
        assert torch.equal(s.aux_hidden, aux[0, s.start: s.start + 100].bfloat16())
        assert s.loss_from == max(900 - s.start, 0)
    # the byte bound cuts too: a quarter of the cache
    cache = FeatureCache(100 * (4 + 2 * A + 6 * K))
    cache.add_batch(ids, torch.ones(1, T, dtype=torch.bool), aux, tid, tlp, [900], 0)
    assert len(cache.items[0].ids) == 25 and cache.bytes <= cache.max_bytes


def test_a_window_trains_at_its_own_positions():
    """The head over a window [s, T) at positions s.. computes what it computes over the whole
    rollout with the keys before s masked: the same rotary positions, the same context."""
    import tempfile

    from rlspec.draft.eagle3 import Eagle3Head
    from rlspec.draft.heads import init_eagle3_head

    with tempfile.TemporaryDirectory() as d:
        head_dir = init_eagle3_head(str(ROOT / "rlspec" / "assets" / "tiny" / "policy"), d, seed=5)
        cfg = json.loads((ROOT / "rlspec" / "assets" / "tiny" / "policy" / "config.json").read_text())
        embed = torch.randn(cfg["vocab_size"], cfg["hidden_size"])
        head = Eagle3Head.from_checkpoint(head_dir, embed).eval()
    T, s = 24, 9
    tokens = torch.randint(0, cfg["vocab_size"], (1, T))
    aux = torch.randn(1, T, 3 * cfg["hidden_size"])
    valid = torch.ones(1, T, dtype=torch.bool)
    with torch.no_grad():
        masked = valid.clone()
        masked[:, :s] = False
        full = head.unrolled(tokens, aux, masked, 3)
        window = head.unrolled(tokens[:, s:], aux[:, s:], valid[:, s:], 3, torch.tensor([s]))
    for j, (f, w) in enumerate(zip(full, window)):
        n = T - s - 1 - j  # anchors whose step-j input is still inside the sequence
        torch.testing.assert_close(w[:, :n], f[:, s: s + n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides,key", [
    (["speculation=draft_model", "speculation.online.enabled=true"], "speculation.online.enabled"),
    (["speculation=eagle3", "speculation.online.enabled=true", "algo.recompute_logprobs=false"],
     "algo.recompute_logprobs"),
    (["speculation=eagle3", "speculation.online.enabled=true", "speculation.online.cache_mb=0"],
     "speculation.online.cache_mb"),
])
def test_online_config_errors_name_the_key(overrides, key):
    from rlspec.config import ConfigError
    from rlspec.checks import validate

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose(overrides))


def test_online_turns_the_recompute_on():
    from rlspec.config import recompute_logprobs

    assert not recompute_logprobs(compose(["speculation=eagle3"]))
    # the off-policy correction needs no recompute: the learner's forward pass is the proximal policy
    assert not recompute_logprobs(compose(["speculation=eagle3", "async_grpo.enabled=true"]))
    assert recompute_logprobs(compose(["speculation=eagle3", "speculation.online.enabled=true"]))


def _run(tmp_path, name, extra):
    out = tmp_path / name
    p = subprocess.run([sys.executable, "-m", "rlspec.train", *SMALL, "algo.recompute_logprobs=true", *extra,
                        f"hydra.run.dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return (json.loads((out / "summary.json").read_text())["records"],
            load_file(str(out / "final" / "model.safetensors")))


@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores
def test_online_adaptation_leaves_the_policy_updates_bit_identical(tmp_path):
    """Same seeds, same config (the log-prob recompute on in both), online adaptation off vs on:
    the learner's losses, gradient norms and final weights match to the last bit, while the draft
    trains every step from a cache held under a 1 MB bound (evicting). The head is pushed only
    after the last step here: a pushed head changes which tokens the sampler draws (not their
    distribution: tests/speculation/test_lossless.py), so bit-identical rollouts need the same head in both."""
    off, w_off = _run(tmp_path, "off", [])
    on, w_on = _run(tmp_path, "on", ["speculation.online.enabled=true", "speculation.online.push_every=3",
                                     "speculation.online.cache_mb=1", "speculation.online.steps_per_rl_step=2"])
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    assert [r["extra"]["train/grad_norm"] for r in on] == [r["extra"]["train/grad_norm"] for r in off]
    assert [r["generated_tokens"] for r in on] == [r["generated_tokens"] for r in off]
    assert w_on.keys() == w_off.keys() and all(torch.equal(w_on[k], w_off[k]) for k in w_off)
    d = [r["extra"] for r in on]
    assert [x["draft/optimizer_steps"] for x in d] == [2.0, 4.0, 6.0]
    assert all(x["draft/cache_mb"] <= 1.0 for x in d) and d[-1]["draft/cache_evicted"] > 0
    assert [x["draft/pushed"] for x in d] == [0.0, 0.0, 1.0]
    assert [x["draft/staleness"] for x in d] == [0.0, 1.0, 2.0]  # rollouts of versions 0..2, head of version 0
    assert all(d[i]["draft/loss"] > 0 for i in range(3))
    assert not any(k.startswith("draft/") for k in off[0]["extra"])


def _captured_batch(seed: int):
    """A LogprobWorker (plain class, no Ray) with capture on, over a batch of random rollouts."""
    from rlspec.algo.batching import build_train_batch
    from rlspec.messages import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 282, (int(n),), generator=g).tolist() for n in torch.randint(5, 12, (6,), generator=g)]
    responses = [torch.randint(1, 282, (int(n),), generator=g).tolist()
                 for n in torch.randint(3, 20, (6,), generator=g)]
    ro = RolloutBatch(prompts, responses, [[0.0] * len(r) for r in responses], [False] * 6, policy_version=seed)
    batch = build_train_batch(ro, torch.zeros(6), torch.ones(6), 0)
    w = logprob_worker(4, capture={"layer_ids": [1, 2, 3], "topk": 8})
    plain = w._run(w.policy, batch)
    captured, _ = w.compute_logprobs(batch)
    return plain, captured, w.take_features(), w, prompts, batch


def test_capture_keeps_logprobs_and_the_draft_state_round_trips(tmp_path):
    from rlspec.config import GenerationConfig, OnlineDraftConfig, SpeculationConfig
    from rlspec.workers.draft_trainer import DraftTrainer

    plain, captured, feats, worker, prompts, batch = _captured_batch(0)
    assert torch.equal(plain, captured)  # the capturing forward pass changes no log-prob bit
    assert len(feats) == 2 and feats[0]["aux_hidden"].shape[-1] == 3 * 256 and worker.take_features() == []
    from rlspec.algo.batching import micro_batches
    first = micro_batches(batch.attention_mask, 4)[0][0]  # micro-batches of 4, longest rows first
    assert feats[0]["loss_from"] == [len(prompts[i]) for i in first]
    cfg = OnlineDraftConfig(enabled=True, batch_size=4)
    spec = SpeculationConfig(method="eagle3", num_speculative_tokens=3, online=cfg)
    a = DraftTrainer(paths=tiny_paths("eagle3"), speculation=spec, generation=GenerationConfig(dtype="float32"), seed=0,
                     threads=1)
    assert a.update(2, feats)["optimizer_steps"] == 2
    a.save(str(tmp_path / "draft.pt"))
    b = DraftTrainer(paths=tiny_paths("eagle3"), speculation=spec, generation=GenerationConfig(dtype="float32"), seed=5,
                     threads=1)
    b.load(str(tmp_path / "draft.pt"))
    assert all(torch.equal(a.weights()[k], v) for k, v in b.weights().items())
    b.add(feats)  # the same cache content and RNG: the next steps are the same steps
    assert a.train(2)["loss"] == b.train(2)["loss"]


def test_micro_batched_head_steps_equal_the_whole_batch_step():
    """speculation.online.micro_batch_size: gradients accumulated over micro-batches (each padded to
    its own longest row, each step's loss over the whole batch's count) give the whole batch's
    loss, acceptance proxy and optimizer step, to float rounding (conftest.rounding_bound: the
    head's fc over 3 target layers, its decoder layer unrolled over k=3 steps). The step compared is
    SGD's (linear in the gradient): the head trains with AdamW, whose first step (about lr x sign(g))
    turns rounding in a near-zero gradient into a step of up to lr."""
    from rlspec.config import GenerationConfig, OnlineDraftConfig, SpeculationConfig
    from rlspec.workers.draft_trainer import DraftTrainer

    feats = _captured_batch(0)[2]
    head = json.loads((Path(tiny_paths("eagle3").draft) / "config.json").read_text())
    tokens = sum(int(f["mask"].sum()) for f in feats)
    bound = rounding_bound(head, 3, positions=32, tokens=tokens, extra=3 * head["target_hidden_size"])
    out = {}
    for mb in (0, 3):
        spec = SpeculationConfig(method="eagle3", num_speculative_tokens=3,
                                 online=OnlineDraftConfig(enabled=True, batch_size=8, micro_batch_size=mb))
        t = DraftTrainer(paths=tiny_paths("eagle3"), speculation=spec, generation=GenerationConfig(dtype="float32"),
                         seed=0, threads=1)
        t.opt = torch.optim.SGD(t.head.parameters(), lr=10.0)
        before = {k: v.clone() for k, v in t.weights().items()}  # (on the CPU these are the live tensors)
        out[mb] = t.update(1, feats), {k: v.clone() for k, v in t.weights().items()}
    (whole, w0), (micro, w3) = out[0], out[3]
    flat = lambda w: torch.cat([w[k].reshape(-1).double() for k in before])  # noqa: E731
    update = flat(w0) - flat(before)
    assert float(update.abs().max()) > 0  # the step moved the head
    report("micro-batched head step against the whole batch's, loss", abs(micro["loss"] / whole["loss"] - 1), bound)
    report("... acceptance proxy", abs(micro["accept_proxy"] / whole["accept_proxy"] - 1), bound)
    report("... SGD update", float((flat(w3) - flat(w0)).norm() / update.norm()), bound)
    assert whole["optimizer_steps"] == micro["optimizer_steps"] == 1
