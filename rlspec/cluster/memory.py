"""Per-GPU memory of every role of a run, from the model's shapes, the placement plan and the
trainer's settings: what `--dry-run` prints, and what validation checks when
cluster.gpu_memory_gib is set. Pure Python (no torch): it runs before anything starts.

Learner, per GPU: compute-dtype weights, gradients and the optimizer's fp32 state (master weights
when computing in bf16, and Adam's two moments), each sharded by its ZeRO stage over the learner
ranks; plus, while it trains, the activations autograd keeps for one micro-batch of the longest
rows (prompt + response limits) and the output layer's float32 chunk of logits.

Activations per token and decoder layer, in elements of the compute dtype: 8 x hidden +
4 x MLP width + 5 x query width + 5 x key/value width. Fitted on Qwen3 decoder layers measured
with saved-tensor hooks (scripts/memory_probe.py, run by scripts/bench_memory.py;
tests/cluster/test_memory.py measures a layer at Qwen3-8B's width against it); an MoE layer is
counted as a dense one whose MLP is its experts per token (not measured). Under gradient
checkpointing each layer keeps only its input (hidden) and one layer's full set lives while it is
recomputed.

Engine: the fraction of the GPU vLLM is given (generation.gpu_memory_utilization), which holds its
weights, KV cache and activations; under sleep mode an engine holds ENGINE_ASLEEP_GIB while
others work, and with CUDA graphs their memory pool too (vLLM does not offload it by default):
estimated as a forward pass's peak over the largest captured batch (vLLM captures up to
min(512, 2 x 256 sequences x (k + 1)) tokens), not yet measured on a GPU (scripts/gpu_vllm_check.py
reports what a sleeping engine keeps). Learner, under the `ipc` refit: each rank's IPC buffer,
as large as the engines' largest tensor (the embedding) or cluster.refit_bucket_mb if larger,
kept from one refit to the next (the receivers map it until their update finishes). Log-prob
worker: its weights (and the reference's), plus a forward's output-layer
chunk. Colocated roles share a GPU one stage at a time, so a GPU's peak is its largest stage.

DraftTrainer (online draft adaptation, on the last learner rank's GPU): the head in float32 with
its gradients and Adam's moments, the target's frozen embedding, and while it trains (beside the
learners) what one micro-batch keeps for backward, per row of T positions over S draft steps, in
bytes: T x (S x DRAFT_STEP_BYTES + 16 H + 2 n S (S - 1)) + (4 n S + 1) T^2, the T^2 term being the
head's attention probabilities. Fitted on the real head with saved-tensor hooks
(scripts/memory_probe.py: measure_draft_head; tests/cluster/test_memory.py checks it at another
width)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlspec.speculation import MAX_SIBLINGS, MAX_VOTERS
from rlspec.speculation.history.device.memory import (COUNT_WIDTH, live_bytes, store_bytes, workspace_bytes,
                                                       working_bytes)

GIB = 1 << 30
ENGINE_ASLEEP_GIB = 1.0      # allocator reserve an engine keeps while asleep
CONTEXT_GIB = 0.5            # a CUDA context: every process on a GPU holds one
ACT_ELEMENTS = (8, 4, 5, 5)  # per token and layer: x hidden, MLP width, query width, key/value width
# A forward pass without autograd (log-prob recompute): one layer's own peak per token, in the
# compute dtype, x hidden, x MLP width (measured on an H100: the MLP's gate and up outputs and their
# product); beside it the model's loop holds FORWARD_HELD hidden-sized tensors (the layer's input,
# the embeddings).
FORWARD_ELEMENTS = (2, 3)
FORWARD_HELD = 2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GRAPH_MAX_TOKENS = 512       # vLLM 0.32's largest CUDA-graph batch by default (1024 on Blackwell data centre GPUs)
GRAPH_MAX_SEQS = 256         # vLLM's default max_num_seqs on GPUs under 70 GiB
ENGINE_MAX_SEQS_LARGE = 1024  # vLLM 0.32's default max_num_seqs for the LLM class on GPUs of 70 GiB or more
# EAGLE-3 head training, bytes per position and draft step: x hidden, MLP width, draft vocabulary,
# query width (heads x head_dim), top-K soft labels
DRAFT_STEP_BYTES = (40, 16, 4, 16, 65)
SIM_MODELS = Path(__file__).resolve().parents[2] / "conf" / "sim" / "model"
# Hub IDs whose shapes ship with the simulator (conf/sim/model), so a dry run needs no download.
KNOWN_MODELS = {"Qwen/Qwen3-8B-Base": "qwen3_8b", "Qwen/Qwen3-8B": "qwen3_8b",
                "Qwen/Qwen3-1.7B": "qwen3_1p7b", "Qwen/Qwen3-1.7B-Base": "qwen3_1p7b",
                "Qwen/Qwen3-235B-A22B": "qwen3_235b_a22b", "Qwen/Qwen3-235B-A22B-Base": "qwen3_235b_a22b"}


def model_shape(path: str):
    """The target's ModelShape: from a local checkpoint's config.json, or a shipped shape for a
    known hub ID; None when neither is at hand."""
    from rlspec.sim.config import ModelShape
    from rlspec.sim.shapes import shape_from_hf_config

    if (Path(path).expanduser() / "config.json").is_file():
        return shape_from_hf_config(Path(path).expanduser(), 2)
    if path not in KNOWN_MODELS:
        return None
    from omegaconf import OmegaConf

    raw = OmegaConf.load(SIM_MODELS / f"{KNOWN_MODELS[path]}.yaml").target
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelShape), raw))


def activation_elements(m, checkpointing: bool) -> float:
    """Elements one token keeps for backward over the whole decoder."""
    a, b, c, d = ACT_ELEMENTS
    mlp = m.intermediate_size or m.experts_per_token * m.moe_intermediate_size
    layer = a * m.hidden_size + b * mlp + c * m.num_heads * m.head_dim + d * m.num_kv_heads * m.head_dim
    if checkpointing:  # each layer's input, and one layer's full set while it is recomputed
        return m.num_layers * m.hidden_size + layer
    return m.num_layers * layer


def draft_head_shape(cfg, m) -> dict:
    """The EAGLE-3 head's widths: its config.json when speculation.model is a local folder, else
    EAGLE-3's usual head for the target (its widths and vocabulary)."""
    import json

    d = Path(cfg.speculation.model or "").expanduser() / "config.json"
    h = json.loads(d.read_text()) if cfg.speculation.model and d.is_file() else {}
    return {"H": h.get("hidden_size", m.hidden_size), "Ht": h.get("target_hidden_size", m.hidden_size),
            "I": h.get("intermediate_size", m.intermediate_size or m.moe_intermediate_size),
            "n": h.get("num_attention_heads", m.num_heads), "kv": h.get("num_key_value_heads", m.num_kv_heads),
            "d": h.get("head_dim") or (h["hidden_size"] // h["num_attention_heads"] if h else m.head_dim),
            "Vd": h.get("draft_vocab_size") or h.get("vocab_size", m.vocab_size), "V": m.vocab_size,
            "aux": len(h.get("eagle_aux_hidden_state_layer_ids", [0, 0, 0]))}


def draft_activation_bytes(s: dict, tokens: int, steps: int, topk: int) -> float:
    """What one row of `tokens` positions keeps for backward in EAGLE-3 head training over `steps`
    draft steps (float32)."""
    a, b, c, e, f = DRAFT_STEP_BYTES
    H, n = s["H"], s["n"]
    per_step = a * H + b * s["I"] + c * s["Vd"] + e * n * s["d"] + f * topk
    return tokens * (steps * per_step + 16 * H + 2 * n * steps * (steps - 1)) + (4 * n * steps + 1) * tokens ** 2


def draft_trainer_memory(cfg, m) -> RoleMemory:
    s = draft_head_shape(cfg, m)
    H, n, kv, d = s["H"], s["n"], s["kv"], s["d"]
    params = s["aux"] * s["Ht"] * H + 2 * H * (n + 2 * kv) * d + n * d * H + 3 * H * s["I"] + s["Vd"] * H
    o, g = cfg.speculation.online, cfg.generation
    tokens = min(o.max_positions, cfg.data.max_prompt_tokens + g.max_new_tokens)
    rows = o.micro_batch_size or o.batch_size
    steps = cfg.speculation.k_max
    return RoleMemory("draft_trainer", weights=(4 * params + 4 * s["V"] * H) / GIB, gradients=4 * params / GIB,
                      optimizer=8 * params / GIB,
                      activations=rows * draft_activation_bytes(s, tokens, steps, o.topk) / GIB)


def forward_bytes(m, tokens: int, chunk_tokens: int, dtype_bytes: int) -> float:
    """Peak bytes of a log-prob pass without autograd over `tokens`: the larger of a decoder
    layer's (FORWARD_ELEMENTS) and the output layer's (the final hidden states held twice, and per
    chunk its float32 logits with logsumexp's float32 temporary beside them)."""
    mlp = m.intermediate_size or m.experts_per_token * m.moe_intermediate_size
    h, i = FORWARD_ELEMENTS
    layer = tokens * dtype_bytes * ((h + FORWARD_HELD) * m.hidden_size + i * mlp)
    head = 2 * tokens * m.hidden_size * dtype_bytes + min(chunk_tokens, tokens) * m.vocab_size * 2 * 4
    return max(layer, head)


def cuda_graph_pool_gib(cfg, m) -> float:
    """What an engine's CUDA graphs keep while it sleeps: a forward pass's peak over the largest
    captured batch (0 without graphs)."""
    g = cfg.generation
    if g.enforce_eager:
        return 0.0
    k = cfg.speculation.k_max if cfg.speculation.method != "none" else 0
    tokens = min(GRAPH_MAX_TOKENS, 2 * GRAPH_MAX_SEQS * (k + 1))
    return forward_bytes(m, tokens, tokens, DTYPE_BYTES[g.dtype]) / g.tensor_parallel_size / GIB


def device_drafter_gib(cfg) -> tuple[float, float]:
    """The device history drafter's memory per engine rank (speculation.history.drafter=device),
    resident and working: its store and the call's rows (running and finished), allocated with the runner
    (plain torch tensors: they stay while the engine sleeps, vLLM's sleep frees its own pool), and
    a step's working tensors at the engine's largest batch (rlspec/speculation/history/device/memory.py).
    Both inside the engine's share, taken from its KV cache (vLLM profiles a step:
    device.proposer.profile_step)."""
    s = cfg.speculation
    if s.method != "history" or s.history.drafter != "device":
        return 0.0, 0.0
    h, L = s.history, cfg.model.max_model_len
    rows = ENGINE_MAX_SEQS_LARGE if (cfg.cluster.gpu_memory_gib or 0) >= 70 else GRAPH_MAX_SEQS
    levels, table = len(h.prompt_keys), h.device.lookup == "table"
    kernels = str(h.device.kernels).lower() != "false"   # (auto: a GPU's)
    resident = store_bytes(h.device.max_tokens, levels, h.max_candidates, h.global_source, COUNT_WIDTH) + \
        live_bytes(rows, L, levels, table) + \
        (workspace_bytes(rows, s.k_max, levels, h.max_match, MAX_SIBLINGS) if kernels else 0)
    if kernels and table:   # a step in the kernels with the table allocates nothing more
        return resident / GIB, 0.0
    return resident / GIB, working_bytes(rows, L, s.k_max, levels, h.max_candidates, h.max_match, MAX_SIBLINGS,
                                         MAX_VOTERS, h.global_source, COUNT_WIDTH) / GIB


def ipc_buffer_gib(cfg, m) -> float:
    """A learner rank's IPC refit buffer (`ipc` transport only): the engines' largest tensor, the
    embedding, or cluster.refit_bucket_mb if larger (rlspec/refit/engine.py's trainer_init_info)."""
    if cfg.cluster.refit != "ipc":
        return 0.0
    return max(cfg.cluster.refit_bucket_mb << 20,
               m.vocab_size * m.hidden_size * DTYPE_BYTES[cfg.generation.dtype]) / GIB


@dataclass
class RoleMemory:
    """GiB per GPU, by part."""
    role: str
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0   # while it computes (training: for backward; engines: in their fraction)
    engine: float = 0.0        # vLLM's fraction of the GPU (weights, KV cache, activations) less the drafter's
    drafter: float = 0.0       # inside vLLM's fraction: the device history drafter's store and working tensors
    buffers: float = 0.0       # held between stages: a learner's IPC refit buffer, an engine's graph pool asleep

    @property
    def resident(self) -> float:
        return self.weights + self.gradients + self.optimizer + (0.0 if self.engine else self.buffers)

    @property
    def total(self) -> float:
        return self.resident + self.activations + self.engine + self.drafter


@dataclass
class GPUMemory:
    roles: list[RoleMemory]
    stages: dict[str, float]      # GiB on the busiest GPU at each stage it runs
    capacity: float | None        # GiB (cluster.gpu_memory_gib)
    shape: str
    checkpointing: bool = False   # trainer.gradient_checkpointing

    @property
    def peak(self) -> tuple[str, float]:
        return max(self.stages.items(), key=lambda kv: kv[1])

    def describe(self) -> str:
        head = (f"{'per GPU, GiB':<16}{'weights':>9}{'grads':>8}{'optim':>8}{'activ.':>8}{'KV etc':>8}{'drafter':>9}"
                f"{'buffers':>9}{'total':>8}")
        rows = [f"memory ({self.shape}, from its shapes; rlspec/cluster/memory.py)", head]
        for r in self.roles:
            rows.append(f"{r.role:<16}{r.weights:>9.1f}{r.gradients:>8.1f}{r.optimizer:>8.1f}{r.activations:>8.1f}"
                        f"{r.engine:>8.1f}{r.drafter:>9.1f}{r.buffers:>9.1f}{r.total:>8.1f}")
        rows.append("(drafter: the device history drafter's store and a step's working tensors, inside the engine's "
                    "share; buffers: a learner's IPC refit buffer; an engine's CUDA-graph pool, kept while it sleeps "
                    "and inside its share while awake)")
        stage, peak = self.peak
        cap = f" of {self.capacity:.0f} GiB ({'fits' if peak <= self.capacity else 'DOES NOT FIT'})" \
            if self.capacity else " (cluster.gpu_memory_gib not set: not checked)"
        rows.append("busiest GPU by stage: " + ", ".join(f"{s} {v:.1f}" for s, v in self.stages.items())
                    + f"; peak {peak:.1f} GiB in {stage}{cap}")
        return "\n".join(rows)


def gpu_memory(cfg, plan) -> GPUMemory | None:
    """The run's per-GPU memory (cfg resolved: rlspec.checks.resolve_auto); None on CPU machines or when
    the model's shapes are not at hand."""
    from rlspec.config.resolve import fp32_grad_accumulation
    from rlspec.sim.shapes import total_params

    c, t, g = cfg.cluster, cfg.trainer, cfg.generation
    m = model_shape(cfg.model.path)
    if not plan.on_gpu or m is None:
        return None
    P = total_params(m)
    tb = DTYPE_BYTES[t.dtype]
    W, z = c.learner_world_size, t.zero_stage
    shard = lambda stage_from: W if z >= stage_from else 1  # noqa: E731
    tokens = t.micro_batch_size * (cfg.data.max_prompt_tokens + g.max_new_tokens)
    # fp32 logits and their grad, the head's output
    chunk = min(t.logit_chunk_tokens, tokens) * m.vocab_size * (2 * 4 + tb)
    # an fp32 gradient accumulation buffer besides the bf16 gradients: BF16_Optimizer's is whole
    # under ZeRO-1, ZeRO-2's is its partition
    accum = 4 * P / shard(2) if fp32_grad_accumulation(t) else 0.0
    learner = RoleMemory("learner", weights=tb * P / shard(3) / GIB, gradients=(tb * P / shard(2) + accum) / GIB,
                         optimizer=(12 if tb < 4 else 8) * P / shard(1) / GIB,
                         activations=(tokens * tb * activation_elements(m, t.gradient_checkpointing) + chunk) / GIB,
                         buffers=ipc_buffer_gib(cfg, m))
    copies = 1 + (cfg.algo.kl_coef > 0)  # the policy, and the KL reference
    logprob = RoleMemory("logprob_worker", weights=copies * tb * P / GIB,
                         activations=forward_bytes(m, tokens, t.logit_chunk_tokens, tb) / GIB) \
        if cfg.algo.recompute_logprobs else None
    cap = c.gpu_memory_gib
    engine_gib = g.gpu_memory_utilization * cap if cap else 0.0
    # the engine's weights (sharded over its TP ranks) sit inside its fraction; the rest is KV cache
    engine_weights = DTYPE_BYTES[g.dtype] * P / g.tensor_parallel_size / GIB
    drafter_resident, drafter_working = device_drafter_gib(cfg)
    drafter = drafter_resident + drafter_working
    engine = RoleMemory(f"generator (TP {g.tensor_parallel_size})", weights=engine_weights, drafter=drafter,
                        engine=engine_gib - engine_weights - drafter, buffers=cuda_graph_pool_gib(cfg, m))
    draft = draft_trainer_memory(cfg, m) if cfg.speculation.online.enabled else None
    roles = [r for r in (engine, learner, logprob, draft) if r is not None]
    asleep = ENGINE_ASLEEP_GIB + engine.buffers + drafter_resident if g.sleep_mode else engine_gib
    # the DraftTrainer's GPU (a learner's) holds its state throughout and trains beside the learner
    shared_resident = (logprob.resident if logprob else 0.0) + (draft.resident + CONTEXT_GIB if draft else 0.0)
    head_act = draft.activations if draft else 0.0
    if c.placement == "colocated":
        ctx = CONTEXT_GIB * (2 + bool(logprob))
        stages = {"generation": learner.resident + shared_resident + engine_gib + ctx,
                  "train": learner.resident + shared_resident + asleep + learner.activations + head_act + ctx}
        if logprob:
            stages["logprob"] = learner.resident + shared_resident + asleep + logprob.activations + ctx
    else:  # engines on GPUs of their own; log-prob workers share the learners'
        ctx = CONTEXT_GIB * (1 + bool(logprob))
        stages = {"generation": engine_gib + CONTEXT_GIB,
                  "train": learner.resident + shared_resident + learner.activations + head_act + ctx}
        if logprob:
            stages["logprob"] = learner.resident + shared_resident + logprob.activations + ctx
    return GPUMemory(roles, stages, cap, f"{m.name}, {P / 1e9:.2f}B parameters", t.gradient_checkpointing)


def check_fits(mem: GPUMemory) -> tuple[str, str] | None:
    """(config key, message) when the busiest GPU overflows cluster.gpu_memory_gib, or an engine's
    weights leave no room for its KV cache; else None."""
    if mem is None or not mem.capacity:
        return None
    engine = mem.roles[0]
    if engine.engine <= 0:
        drafter = f" and the device history drafter {engine.drafter:.1f} GiB" if engine.drafter else ""
        return "generation.gpu_memory_utilization", (
            f"an engine's weights take {engine.weights:.0f} GiB per GPU{drafter}, its whole share of the GPU "
            f"({engine.total:.0f} GiB): no room for a KV cache (raise it, or generation.tensor_parallel_size"
            + (", or lower speculation.history.device.max_tokens" if engine.drafter else "") + ")")
    stage, peak = mem.peak
    if peak <= mem.capacity:
        return None
    draft = next((r for r in mem.roles if r.role == "draft_trainer"), None)
    learner = next((r for r in mem.roles if r.role == "learner"), None)
    if learner is not None and learner.resident > mem.capacity:
        return "cluster.learner_world_size", (
            f"a learner's weights, gradients, optimizer state and buffers alone take {learner.resident:.0f} GiB per "
            f"GPU, cluster.gpu_memory_gib is {mem.capacity:.0f} (more learner ranks under ZeRO shard them, or a "
            f"smaller model)")
    key = "generation.gpu_memory_utilization" if stage == "generation" else \
        "trainer.micro_batch_size" if stage == "train" else "cluster.logprob_world_size"
    if stage == "train" and draft and peak - draft.activations <= mem.capacity:
        return "speculation.online.micro_batch_size", (
            f"the train stage needs {peak:.0f} GiB on the DraftTrainer's GPU, {draft.activations:.0f} of them "
            f"the head's activations; cluster.gpu_memory_gib is {mem.capacity:.0f} (fewer rows per head "
            f"micro-batch, or speculation.online.max_positions, cut them)")
    return key, (f"the {stage} stage needs {peak:.0f} GiB on its busiest GPU, cluster.gpu_memory_gib is "
                 f"{mem.capacity:.0f}" + (" (trainer.gradient_checkpointing would cut the activations)"
                                          if stage == "train" and not mem.checkpointing else ""))
