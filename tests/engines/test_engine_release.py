"""VLLMEngine.close(): engines built one after another in one process, each released before the
next. On a GPU, vLLM ends every engine's CUDA-graph capture with `gc.unfreeze(); gc.collect()`
(Model Runner V2); an earlier engine still waiting for the collector is shut down right there, in
the middle of the new engine's start, and destroys the process-wide parallel groups the new one
has just made. The test forces that collect after each engine starts, before it generates."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
from conftest import child_env  # noqa: E402


def engines_released_one_after_another(n: int = 3) -> None:
    """n engines without speculation, each built, put through the collect a GPU start ends with,
    greedy-decoding the same prompts, then closed and dropped. Every engine gives the first one's
    tokens, and a closed engine is gone once its last reference is dropped and collected. Without
    close() the third engine's generate fails ("pipeline model parallel group is not initialized":
    the first engine's shutdown ran in the collect after the third one started)."""
    import gc
    import weakref

    from conftest import paths_of, resolved
    from rlspec.engines.vllm_engine import VLLMEngine
    from rlspec.messages import Sampling

    prompts = [[5, 17, 30, 41, 9], [8, 8, 12, 60]]
    outputs, cores = [], []
    cfg = resolved(["speculation=none"])
    paths = paths_of(cfg)
    for _ in range(n):
        engine = VLLMEngine(paths.model, paths.tokenizer, cfg.generation, cfg.model.max_model_len, 0)
        gc.unfreeze()
        gc.collect()
        outputs.append(engine.generate(prompts, Sampling(1, 0.0, 12), 0).response_ids)
        cores.append(weakref.ref(engine.llm.llm_engine))
        engine.close()
        engine.close()  # idempotent
        del engine
    gc.collect()
    assert all(o == outputs[0] for o in outputs), outputs
    assert [c() is None for c in cores] == [True] * n
    print(f"{n} engines released one after another, greedy outputs equal", flush=True)


@pytest.mark.slow
def test_engines_closed_one_after_another_survive_the_collect_a_gpu_start_runs():
    code = "from test_engine_release import engines_released_one_after_another as f; f()"
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=child_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "3 engines released" in r.stdout, (r.stdout + r.stderr)[-3000:]
