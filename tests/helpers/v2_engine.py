"""A Generator on Model Runner V2 on this CPU (vLLM's CPU V2 runner, its Triton kernels in Triton's
interpreter: tests/helpers/v2_on_cpu.py's enable), run as a child process with argv[1] V1 or V2 and
the rest `python -m rlspec.train` overrides: two greedy calls of 24 tokens on held-out prompts,
the first call's answers recorded as history. Prints the runner vLLM chose, each call's answers
and its drafter counters, as JSON. With `--sample N` after the runner: one call at temperature 1
instead, N samples of up to SAMPLE_TOKENS tokens for each of test_lossless.PROMPTS, the engine seeded
with SEED (`--sample N SEED`)."""
import json
import os
import sys

SAMPLE_TOKENS = 4


def main() -> None:
    runner, overrides = sys.argv[1], sys.argv[2:]
    samples, seed = None, 0
    if overrides[:1] == ["--sample"]:
        samples, seed, overrides = int(overrides[1]), int(overrides[2]), overrides[3:]
    if runner == "V2":
        from helpers.v2_on_cpu import enable

        enable()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "V2" else "0"
    from conftest import heldout_prompts, paths_of, resolved

    from rlspec.messages import Sampling
    from rlspec.models import load_tokenizer
    from rlspec.workers.generator import Generator

    cfg = resolved(overrides)
    paths = paths_of(cfg)
    gen = Generator(paths=paths, model=cfg.model, generation=cfg.generation, speculation=cfg.speculation,
                    seed=seed, threads=2)
    tok = load_tokenizer(paths.model, "model.path")
    out = {"runner": gen.runner_info(), "calls": []}
    if samples is not None:
        from speculation.test_lossless import PROMPTS

        ro = gen.generate([tok(p)["input_ids"] for p in PROMPTS], Sampling(samples, 1.0, SAMPLE_TOKENS))
        out["samples"] = ro.response_ids
        out["accepted"] = ro.spec.accepted_tokens if ro.spec else 0
        print(json.dumps(out))
        return
    prompts = heldout_prompts(tok, 4)
    for _ in range(2):
        ro = gen.generate(prompts, Sampling(1, 0.0, 24, seed=0))
        out["calls"].append({"answers": ro.response_ids, "history": ro.history,
                             "accepted": ro.spec.accepted_tokens if ro.spec else 0})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
