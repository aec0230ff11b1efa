"""The per-GPU memory model: its activation term against real layers measured here, the paper
experiment's table on a GB200, and validation refusing what does not fit, naming the key."""
import pytest

from conftest import compose
from memory_probe import measure_draft_head, measure_layer
from rlspec.cluster.memory import ACT_ELEMENTS, check_fits, draft_activation_bytes, gpu_memory
from rlspec.config import ConfigError
from rlspec.checks import plan_of, resolve_auto, validate

QWEN3_8B_LAYER = dict(hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128)


def elements(hidden, intermediate, heads, kv_heads, head_dim):
    a, b, c, d = ACT_ELEMENTS
    return a * hidden + b * intermediate + c * heads * head_dim + d * kv_heads * head_dim


def test_activation_model_matches_a_real_qwen3_8b_layer():
    """A Qwen3-8B decoder layer (bf16, 64 tokens) keeps about 211 KiB per token for backward;
    the model's 8h + 4i + 5q + 5kv elements land within 2%. Checkpointed, it keeps nothing but
    its input (counted by the layer before)."""
    measured = measure_layer(**QWEN3_8B_LAYER)
    predicted = 2 * elements(**QWEN3_8B_LAYER)
    print(f"Qwen3-8B layer: measured {measured / 1024:.1f} KiB per token, model {predicted / 1024:.1f} KiB")
    assert abs(predicted / measured - 1) < 0.02
    assert measure_layer(**QWEN3_8B_LAYER, tokens=16, checkpointing=True) < 0.01 * measured


def test_rl_zero_on_gb200_fits_and_its_terms_are_the_sharded_state():
    cfg = resolve_auto(compose(["+experiment=rl_zero_qwen3_8b"], plain=False))
    mem = gpu_memory(cfg, plan_of(cfg))
    learner = next(r for r in mem.roles if r.role == "learner")
    P, W = 8.19e9, cfg.cluster.learner_world_size
    assert learner.optimizer == pytest.approx(12 * P / W / 2**30, rel=0.01)   # fp32 master + Adam, ZeRO-3
    assert learner.weights == pytest.approx(2 * P / W / 2**30, rel=0.01)
    stage, peak = mem.peak
    assert check_fits(mem) is None and peak <= cfg.cluster.gpu_memory_gib
    print(mem.describe())


@pytest.mark.parametrize("overrides,key", [
    (["trainer.gradient_checkpointing=false"], "trainer.micro_batch_size"),
    (["generation.gpu_memory_utilization=0.98"], "generation.gpu_memory_utilization"),
    (["generation.gpu_memory_utilization=0.05"], "generation.gpu_memory_utilization"),
    # a head step over 32 rows of 4096 positions: the attention alone is 385 x 4096^2 bytes a row
    (["speculation.online.enabled=true"], "speculation.online.micro_batch_size"),
])
def test_a_run_that_does_not_fit_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.") + ":"):
        validate(compose(["+experiment=rl_zero_qwen3_8b", *overrides], plain=False))


@pytest.mark.parametrize("width", [
    dict(hidden=384, intermediate=1024, heads=6, kv_heads=2, head_dim=64, draft_vocab=1500, tokens=96, steps=3),
    dict(hidden=512, intermediate=1536, heads=8, kv_heads=4, head_dim=32, draft_vocab=3000, tokens=80, steps=2),
])
def test_draft_head_activation_model_matches_the_real_head(width):
    """EAGLE-3 head training (Eagle3Head.unrolled + ttt_loss) measured with saved-tensor hooks at
    widths other than the ones DRAFT_STEP_BYTES was fitted on: within 2%."""
    measured = measure_draft_head(**width)
    w = width
    shape = dict(H=w["hidden"], I=w["intermediate"], n=w["heads"], kv=w["kv_heads"], d=w["head_dim"],
                 Vd=w["draft_vocab"])
    predicted = draft_activation_bytes(shape, w["tokens"], w["steps"], 20)
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)


def test_online_draft_adaptation_fits_a_gb200_in_micro_batches_of_one_row():
    cfg = resolve_auto(compose(["+experiment=rl_zero_qwen3_8b", "speculation.online.enabled=true",
                                "speculation.online.micro_batch_size=1"], plain=False))
    validate(cfg)
    mem = gpu_memory(cfg, plan_of(cfg))
    draft = next(r for r in mem.roles if r.role == "draft_trainer")
    assert 10 < draft.activations < 30 and check_fits(mem) is None  # one row of 4096 positions, k=3
    print(mem.describe())


def test_cpu_runs_and_unknown_models_are_not_checked():
    assert gpu_memory(resolve_auto(compose()), plan_of(compose())) is None
    validate(compose(["+experiment=rl_zero_qwen3_8b", "model.path=someorg/unknown-model"], plain=False))


def test_ipc_buffer_and_a_sleeping_engines_graph_pool_are_counted():
    """Colocated 8B (refit over CUDA IPC, sleep mode, CUDA graphs): each learner GPU keeps an IPC
    buffer as large as the bfloat16 embedding (refit.engine.trainer_init_info sizes it so; the
    receivers map it until their update finishes), and a sleeping engine keeps its CUDA-graph pool
    through the train stage. Over nccl there is no buffer; an eager engine has no pool."""
    cfg = resolve_auto(compose(["+experiment=rl_zero_qwen3_8b"], plain=False))
    assert cfg.cluster.refit == "ipc" and cfg.generation.sleep_mode and not cfg.generation.enforce_eager
    mem = gpu_memory(cfg, plan_of(cfg))
    learner, engine = next(r for r in mem.roles if r.role == "learner"), mem.roles[0]
    assert learner.buffers == pytest.approx(151936 * 4096 * 2 / 2**30, rel=1e-6)
    assert learner.resident == pytest.approx(learner.weights + learner.gradients + learner.optimizer + learner.buffers)
    assert 0.1 < engine.buffers < 2.0 and engine.total == pytest.approx(engine.weights + engine.engine)
    eager_cfg = resolve_auto(compose(["+experiment=rl_zero_qwen3_8b", "generation.enforce_eager=true"], plain=False))
    eager = gpu_memory(eager_cfg, plan_of(eager_cfg))
    assert eager.roles[0].buffers == 0.0
    assert mem.stages["train"] - eager.stages["train"] == pytest.approx(engine.buffers)  # the pool, kept asleep
    nccl_cfg = resolve_auto(compose(["+experiment=rl_zero_qwen3_8b", "cluster.refit=nccl"], plain=False))
    assert next(r for r in gpu_memory(nccl_cfg, plan_of(nccl_cfg)).roles if r.role == "learner").buffers == 0.0
    print(mem.describe())


def test_the_one_gpu_experiment_fits_an_80gb_gpu_and_a_24gb_one_is_refused():
    """+experiment=rl_think_qwen3_1p7b_1gpu: every role colocated on one GPU under sleep mode fits
    79 GiB; on 22 GiB (a 24 GB card) the learner's state alone does not fit, and validation says so
    naming the key."""
    cfg = resolve_auto(compose(["+experiment=rl_think_qwen3_1p7b_1gpu"], plain=False))
    validate(cfg)
    mem = gpu_memory(cfg, plan_of(cfg))
    stage, peak = mem.peak
    assert cfg.generation.sleep_mode and cfg.cluster.refit == "ipc" and 40 < peak <= 79
    print(mem.describe())
    with pytest.raises(ConfigError, match=r"^cluster\.learner_world_size: a learner's weights"):
        validate(compose(["+experiment=rl_think_qwen3_1p7b_1gpu", "cluster.gpu_memory_gib=22"], plain=False))
