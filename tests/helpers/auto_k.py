"""`speculation.num_speculative_tokens=auto` with a history drafter, through a Generator actor: what
the host and the device drafters' tests check alike."""
import json


def gpu_like_step_costs(path, k_max: int = 8) -> str:
    """Step costs as a GPU's look (a step without drafting 1 s, verifying k more tokens 3% each, k
    up to k_max), at every batch size, written to `path` for speculation.auto_step_costs: 'auto' then
    plans from them and its measured acceptance only, whatever the load on this machine."""
    costs = [1.0, 1.02] + [1.02 + 0.03 * k for k in range(1, k_max + 1)]
    path.write_text(json.dumps({str(b): costs for b in (1, 16, 256)}))
    return str(path)


def auto_calls_keep_to_their_schedule(actor, generate, want, calls: int = 2, k_max: int = 3) -> list[float]:
    """`calls` greedy calls (generate(actor) -> RolloutBatch) equal `want` token for token; none
    drafts past the largest k of its schedule (nothing when it ran without), and vLLM verifies at
    most that k a draft. Returns the planner's measured fill: per position, the share of rows
    drafting it among those that drafted the one before, each in (0, 1]."""
    import ray

    from rlspec.speculation.history.stats import per_pos

    for _ in range(calls):
        ro = generate(actor)
        assert ro.response_ids == want
        schedule = ray.get(actor.__ray_call__.remote(lambda g: g.adaptive.draft_schedule()), timeout=60)
        k_call = max((k for _, _, k in schedule), default=0)
        assert per_pos(ro.history, "drafts_ge", k_max)[k_call:] == [0] * (k_max - k_call), (schedule, ro.history)
        assert ro.spec.draft_tokens <= k_call * ro.spec.drafts, (schedule, ro.spec)
    fill, counts = ray.get(actor.__ray_call__.remote(lambda g: (g.adaptive.planner.fill,
                                                                g.adaptive.planner.fill_counts)), timeout=60)
    measured = [f for f, c in zip(fill, counts) if c[1] > 0]
    assert measured and all(0 < f <= 1 for f in measured), (fill, counts)
    return measured
