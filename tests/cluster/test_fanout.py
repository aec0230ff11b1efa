"""Several Generator engines and LogprobWorkers behind one interface, two ZeRO-3 learner ranks,
colocated placement, weights refit over the gloo broadcast group: one real GRPO step."""
import pytest
import torch

from conftest import paths_of, resolved, sampling
from rlspec.messages import RolloutBatch, SpecStats
from rlspec.cluster import fanout


def test_split_is_contiguous_and_balanced():
    assert fanout.split(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert fanout.split(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]


def test_merge_rollouts_keeps_prompt_order_and_sums_speculation():
    a = RolloutBatch([[1]], [[5, 6]], [[-0.1, -0.2]], [False], 3, 2.0, SpecStats(2, 6, 3, [2, 1, 0]))
    b = RolloutBatch([[2]], [[7]], [[-0.3]], [True], 3, 5.0, SpecStats(1, 3, 3, [1, 1, 1]))
    m = fanout.merge_rollouts([a, b])
    assert m.prompt_ids == [[1], [2]] and m.response_ids == [[5, 6], [7]] and m.truncated == [False, True]
    assert m.seconds == 5.0 and m.spec == SpecStats(3, 9, 6, [3, 2, 1]) and m.policy_version == 3


def test_history_routing_keeps_each_prompt_on_one_engine_and_rows_in_prompt_order():
    prompts = [[i, i + 1, 7] for i in range(40)]
    routes = fanout.by_prompt(prompts, 3)
    assert sorted(i for r in routes for i in r) == list(range(40)) and all(routes)
    # the same prompt goes to the same engine whatever else is in the call, and in which order
    again = fanout.by_prompt(prompts[::-1][:10], 3)
    engine_of = {tuple(prompts[i]): e for e, r in enumerate(routes) for i in r}
    assert all(engine_of[tuple(prompts[::-1][i])] == e for e, r in enumerate(again) for i in r)
    # engines answer their groups (2 answers each, tagged by prompt) in their own order; a call that
    # returns every group puts them back in the call's order
    parts = [RolloutBatch([prompts[i] for i in r for _ in range(2)], [[i, j] for i in r for j in range(2)],
                          [[0.0, 0.0]] * 2 * len(r), [False] * 2 * len(r), 1, 1.0 + e, history={"rows": len(r)},
                          tags=list(r), carry=[], partial={"new_tokens": 4 * len(r)}) for e, r in enumerate(routes)]
    m = fanout.merge_groups(parts, list(range(40)))
    assert m.response_ids == [[i, j] for i in range(40) for j in range(2)]
    assert m.prompt_ids == [p for p in prompts for _ in range(2)] and m.tags == list(range(40))
    assert m.seconds == 3.0 and m.history == {"rows": 40} and m.partial == {"new_tokens": 160}


def test_needed_groups_are_shared_in_proportion_and_partial_calls_merge():
    from rlspec.messages import Answer, Group

    assert fanout.shares(4, [3, 3]) == [2, 2] and fanout.shares(5, [4, 2]) == [3, 2]
    assert fanout.shares(3, [1, 5]) == [1, 2] and fanout.shares(None, [2, 2]) == [None, None]
    assert sum(fanout.shares(7, [5, 3, 4])) == 7

    def part(tag, version, carried):
        done = Answer([9], [-0.5], [version], done=True)
        ro = RolloutBatch([[tag]], [[9]], [[-0.5]], [False], version, 1.0 + tag, token_versions=[[version]],
                          tags=[tag], carry=[Group([tag + 10], [Answer([1], [-1.0], [version])], None, tag + 10)]
                          if carried else [], partial={"carried_groups": int(carried), "new_tokens": 1})
        return ro, done

    (a, _), (b, _) = part(0, 2, True), part(1, 3, False)
    m = fanout.merge_groups([a, b])
    assert m.tags == [0, 1] and [g.tag for g in m.carry] == [10] and m.policy_version == 2
    assert m.token_versions == [[2], [3]] and m.partial == {"carried_groups": 1, "new_tokens": 2}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from rlspec.loops.runlog import RunLog
    from rlspec.models import load_tokenizer
    from rlspec.loops.state import Run
    from rlspec.train import load_data
    from rlspec.cluster.launch import launch_actors
    from rlspec.cluster.ray_cluster import RayCluster

    cfg = resolved(["generation.num_prompts_per_step=4", "generation.num_generations_per_prompt=4",
                   "trainer.micro_batch_size=4", "trainer.lr=1e-3", "data.train.num_rows=64",
                   "data.val.num_rows=8", "generation.max_new_tokens=32", "logging.wandb_mode=disabled",
                   "cluster.placement=colocated", "cluster.num_generators=2", "cluster.logprob_world_size=2",
                   "cluster.learner_world_size=2", "trainer.zero_stage=3", "cluster.refit_bucket_mb=1",
                   "algo.recompute_logprobs=true"])  # the log-prob fan-out runs every step
    tok = load_tokenizer(cfg.model.path, "model.path")
    train, val = load_data(cfg, tok)
    with RayCluster(cfg):
        actors = launch_actors(cfg, paths_of(cfg))
        yield Run(cfg, actors, tok, train, val, RunLog(str(tmp_path_factory.mktemp("run")), {}, 1, cfg.logging))


def test_prompts_spread_over_engines_and_broadcast_refit_reaches_all(stack):
    from transformers import AutoModelForCausalLM

    from rlspec.data.loading import PromptSampler
    from rlspec.cluster.calls import wait
    from rlspec.loops.state import Counters
    from rlspec.loops.step import train_step
    from rlspec.workers.generator import Generator

    a = stack.actors
    assert len(a.generators) == 2 and len(a.logprobs) == 2 and len(a.learners) == 2
    assert len(set(a.nodes.values())) == 1  # colocated on the one local node
    prompts = [p.token_ids for p in stack.val.prompts[:6]]
    whole = wait(a.generators.generate(prompts, sampling(1, 0.0, 16)), a.timeout_s)
    # Engine 0 got prompts 0-2, engine 1 prompts 3-5; greedy output is the same either way.
    per_engine = [wait(a.generators.one(e, Generator.generate, prompts[3 * e:3 * e + 3], sampling(1, 0.0, 16)),
                       a.timeout_s) for e in range(len(a.generators))]
    assert whole.response_ids == per_engine[0].response_ids + per_engine[1].response_ids

    rec = train_step(stack, Counters(), PromptSampler(stack.train, seed=0), step=1)
    assert rec.policy_version == 1 and rec.extra["refit_seconds"] > 0
    assert abs(rec.extra["train/ratio_mean"] - 1.0) < 1e-3 and rec.logprob_mismatch < 1e-3
    # Both engines and both log-prob workers now hold the learners' ZeRO-3 weights.
    after = wait(a.learners.full_weights(), a.timeout_s)[0]
    model = AutoModelForCausalLM.from_pretrained(stack.cfg.model.path, dtype=torch.float32)
    model.load_state_dict(after, strict=False)
    model.tie_weights()
    for e in range(len(a.generators)):
        ro = wait(a.generators.one(e, Generator.generate, prompts[:2], sampling(1, 0.0, 16)), a.timeout_s)
        assert ro.policy_version == 1
        for p, got in zip(prompts[:2], ro.response_ids):
            out = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=stack.tokenizer.eos_token_id, pad_token_id=stack.tokenizer.pad_token_id)
            assert got == out[0, len(p):].tolist(), f"generator[{e}] not refit"
    assert wait(a.logprobs.ping(), a.timeout_s)[0] == 1


def test_a_partial_call_over_two_engines_returns_the_groups_needed(stack):
    """Partial rollouts over both engines: 6 groups, 3 needed (2 on one engine, 1 on the other);
    the merged call returns 3 complete groups and carries the other 3, every group once."""
    from rlspec.cluster.calls import wait
    from rlspec.messages import Answer, Group

    a = stack.actors
    groups = [Group(p.token_ids, [Answer() for _ in range(2)], 100 + i, i) for i, p in enumerate(stack.val.prompts[:6])]
    ro = wait(a.generators.generate_groups(groups, sampling(2, 1.0, 16, seed=3), 3, 2), a.timeout_s)
    assert len(ro.tags) == 3 and sorted(ro.tags + [g.tag for g in ro.carry]) == list(range(6))
    assert len(ro.response_ids) == 6 and ro.partial["carried_groups"] == 3
    assert {len([t for t in ro.tags if t < 3]), len([t for t in ro.tags if t >= 3])} == {1, 2}
