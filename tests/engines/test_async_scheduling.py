"""vLLM's async scheduling (the next step scheduled while this one runs), which vLLM turns on on
GPUs and its CPU platform turns off: generation.async_scheduling=true keeps it on for rlspec's
engines here, so the GPU's scheduling path runs on this CPU through the CPU runner's own
placeholders."""
import pytest

pytest.importorskip("vllm")


def _calls(gen, prompts, n=2):
    import ray

    from conftest import sampling

    return [ray.get(gen.generate.remote(prompts, sampling(1, 0.0, 32)), timeout=600) for _ in range(n)]


@pytest.mark.slow  # four engines
def test_async_scheduling_on_cpu_is_exact_with_the_device_drafter(ray_session, tokenizer):
    """Greedy: engines scheduling asynchronously (their runners say so), without speculation and
    with the device drafter, answer as a synchronous one without speculation; the device drafter's
    second call drafts from the first's answers, and it accepts from each source what the
    synchronous engine's device drafter does."""
    import ray

    from conftest import heldout_prompts, start_generator

    prompts = heldout_prompts(tokenizer, 8)
    out = {}
    device = ["speculation=history", "speculation.history.drafter=device"]
    async_on = ["generation.async_scheduling=true"]
    engines = (("sync", []), ("async", async_on), ("sync_device", device), ("async_device", [*async_on, *device]))
    for name, over in engines:
        gen = start_generator(over)
        info = ray.get(gen.runner_info.remote(), timeout=600)   # the first call waits for the engine
        assert (info["model_runner"], info["async_scheduling"], info["executor"], info["tensor_parallel_size"]) == \
               ("V1", name.startswith("async"), "uni", 1), info
        out[name] = _calls(gen, prompts)
        ray.kill(gen)
    want = out["sync"][0].response_ids
    for name, calls in out.items():
        assert [c.response_ids for c in calls] == [want, want], name
    first, second = out["async_device"]
    print(f"async, device drafter: accepted {first.spec.accepted_tokens} then {second.spec.accepted_tokens}; "
          f"{second.history}")
    # the same tokens accepted from each source as the synchronous engine's drafter (async schedules
    # one more step a request, so rows and drafted tokens differ)
    for sync, asyn in zip(out["sync_device"], out["async_device"]):
        assert sync.spec.accepted_tokens == asyn.spec.accepted_tokens
        assert {k: v for k, v in sync.history.items() if k.startswith("accepted_")} == \
               {k: v for k, v in asyn.history.items() if k.startswith("accepted_")}
    assert second.history["accepted_history"] > 0 and second.spec.accepted_tokens > first.spec.accepted_tokens
