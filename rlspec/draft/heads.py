"""Randomly initialised speculative heads in the checkpoint formats vLLM loads: an EAGLE-3 head for
a target (`{"method": "eagle3", "model": head_dir}`) and a copy of a Qwen3 target with one MTP layer
(`{"method": "mtp"}`, the copy is the engine's model). Why: online draft training starts
from these; rollouts must load and verify them losslessly before any training. Reproducible from
`seed`; tokenizer files are copied from the target so each directory stands alone."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def _config(d: str | Path) -> dict:
    return json.loads((Path(d) / "config.json").read_text())


def _copy_tokenizer(src: str | Path, dst: Path, extra: tuple[str, ...] = ()) -> None:
    for name in TOKENIZER_FILES + extra:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, dst / name)


def _write(out: Path, config: dict, weights: dict[str, torch.Tensor]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return str(out)


def eagle3_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """Target layers whose outputs feed an EAGLE-3 head (low, mid, high). vLLM's default is
    (2, L//2, L-3) (used when those are distinct, e.g. Qwen3-8B: 2, 18, 33); tiny targets get
    (1, L//2, L-1). Id i is the residual stream after i decoder layers, before the final norm:
    Hugging Face `output_hidden_states=True` -> `hidden_states[i]` (index 0 = embeddings)."""
    L = num_target_layers
    for ids in ((2, L // 2, L - 3), (1, L // 2, L - 1)):
        if len(set(ids)) == 3 and all(0 < i < L for i in ids):
            return ids
    raise ValueError(f"an EAGLE-3 head needs a target with >= 4 decoder layers, got {L}")


def init_eagle3_head(target_dir: str, out_dir: str, seed: int = 0, num_layers: int = 1,
                     draft_vocab: list[int] | None = None) -> str:
    """Write a random EAGLE-3 head for `target_dir` to `out_dir` (architecture
    `LlamaForCausalLMEagle3`, vLLM's model_executor/models/llama_eagle3.py); returns `out_dir`.

    Which hidden states vLLM feeds it: config `eagle_aux_hidden_state_layer_ids` (see
    `eagle3_aux_layer_ids`; 4-layer tiny policy: [1, 2, 3]), each the target's pre-norm residual
    stream (hidden + residual) after that many layers, concatenated in ascending id order into
    [T, 3*Ht]. At draft position t the head sees (embed(x_{t+1}), fc(h_t)) and predicts x_{t+2};
    later draft steps feed back the head's own pre-norm output instead of fc(h).
    Weights (H = hidden = target hidden, I = intermediate, n/kv heads of size d, V target vocab,
    Vd = len(draft_vocab) or V; no embed_tokens: vLLM shares the target's [V, H] embedding):
      fc.weight                                       [H, 3*H]   over concat(low, mid, high)
      midlayer.hidden_norm.weight, .input_layernorm.weight, .post_attention_layernorm.weight [H]
      midlayer.self_attn.{q,k,v}_proj.weight          [n*d | kv*d | kv*d, 2*H]  over concat(norm(embed), norm(h))
      midlayer.self_attn.o_proj.weight                [H, n*d]
      midlayer.mlp.{gate,up}_proj.weight [I, H]; midlayer.mlp.down_proj.weight [H, I]
      norm.weight [H]; lm_head.weight [Vd, H]
      d2t [Vd] int64 (target_id = draft_id + d2t[draft_id]), t2d [V] bool: only when Vd < V
    Extra layers (num_layers > 1) are `layers.{i}.*`, same names, q/k/v over [*, H] instead of 2*H.
    """
    tc = _config(target_dir)
    H, V, L = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"]
    n, kv = tc["num_attention_heads"], tc.get("num_key_value_heads", tc["num_attention_heads"])
    d = tc.get("head_dim") or H // n
    inter = tc["intermediate_size"]
    vocab = sorted(set(draft_vocab)) if draft_vocab is not None else list(range(V))
    if not vocab or vocab[0] < 0 or vocab[-1] >= V:
        raise ValueError(f"draft_vocab must be target token ids in [0, {V})")
    Vd, aux = len(vocab), eagle3_aux_layer_ids(L)
    dtype = tc.get("dtype") or tc.get("torch_dtype") or "bfloat16"  # weights stored in the target's dtype
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "target_hidden_size": H, "intermediate_size": inter,
        "num_hidden_layers": num_layers, "num_attention_heads": n, "num_key_value_heads": kv, "head_dim": d,
        "hidden_act": "silu", "rms_norm_eps": tc.get("rms_norm_eps", 1e-6), "attention_bias": False,
        "mlp_bias": False, "vocab_size": V, "draft_vocab_size": Vd,
        "max_position_embeddings": tc.get("max_position_embeddings", 4096),
        "rope_parameters": tc.get("rope_parameters") or {"rope_type": "default",
                                                          "rope_theta": tc.get("rope_theta", 10000.0)},
        "tie_word_embeddings": False, "initializer_range": tc.get("initializer_range", 0.02),
        "eagle_aux_hidden_state_layer_ids": list(aux), "dtype": dtype,
        "bos_token_id": tc.get("bos_token_id"), "eos_token_id": tc.get("eos_token_id"),
        "pad_token_id": tc.get("pad_token_id"),
    }
    g = torch.Generator().manual_seed(seed)
    std, dt = config["initializer_range"], getattr(torch, dtype)

    def rand(*shape: int) -> torch.Tensor:  # drawn in float32, stored in the target's dtype
        return (torch.randn(*shape, generator=g) * std).to(dt)

    def ones(k: int) -> torch.Tensor:
        return torch.ones(k, dtype=dt)

    w: dict[str, torch.Tensor] = {"fc.weight": rand(H, 3 * H)}                      # [H, 3*Ht]
    for i in range(num_layers):
        p, inp = ("midlayer." if i == 0 else f"layers.{i}."), (2 * H if i == 0 else H)
        w |= {p + "hidden_norm.weight": ones(H), p + "input_layernorm.weight": ones(H),
              p + "post_attention_layernorm.weight": ones(H),
              p + "self_attn.q_proj.weight": rand(n * d, inp),                       # [n*d, 2H]
              p + "self_attn.k_proj.weight": rand(kv * d, inp),                      # [kv*d, 2H]
              p + "self_attn.v_proj.weight": rand(kv * d, inp),                      # [kv*d, 2H]
              p + "self_attn.o_proj.weight": rand(H, n * d),
              p + "mlp.gate_proj.weight": rand(inter, H), p + "mlp.up_proj.weight": rand(inter, H),
              p + "mlp.down_proj.weight": rand(H, inter)}
    w |= {"norm.weight": ones(H), "lm_head.weight": rand(Vd, H)}              # [Vd, H]
    if Vd < V:
        ids = torch.tensor(vocab, dtype=torch.long)
        w["d2t"] = ids - torch.arange(Vd)                                           # [Vd] offsets
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d                                                              # [V] membership
    out = Path(out_dir)
    _write(out, config, w)
    _copy_tokenizer(target_dir, out)
    return str(out)


def init_mtp_target(target_dir: str, out_dir: str, seed: int = 0) -> str:
    """Write `target_dir` (a Qwen3ForCausalLM) re-expressed as GLM-4.5 (`Glm4MoeForCausalLM`) plus
    one random MTP layer; vLLM's `mtp` method serves it (models/glm4_moe_mtp.py). Returns `out_dir`.

    vLLM 0.32 has no MTP for Qwen3 dense models (MTP exists for MiMo = Qwen2 without q/k-norm,
    Qwen3-Next/3.5 = gated attention + hybrid layers, DeepSeek, GLM, ...). GLM-4.5's dense layer is
    Qwen3's exactly with `use_qk_norm`, no bias, `partial_rotary_factor: 1.0` (same RMSNorm, neox
    rope, attention, SiLU MLP kernels in vLLM). vLLM's GLM model insists on at least one MoE layer,
    so the last layer's MLP becomes an MoE whose shared expert is the original MLP and whose routed
    experts are all-zero (they add exact zeros). The tied embedding is written as `lm_head` too.
    Main-model names are the target's, except model.layers.{L-1}.mlp.{gate,up,down}_proj ->
    .mlp.shared_experts.*, plus .mlp.gate.weight [E, H] (fp32), .mlp.gate.e_score_correction_bias [E],
    .mlp.experts.{e}.{gate,up,down}_proj.weight (zeros). MTP layer, under model.layers.{L}.:
      enorm.weight, hnorm.weight [H]; eh_proj.weight [H, 2H] over concat(enorm(embed(x_{t+1})), hnorm(h_t));
      shared_head.norm.weight [H]; shared_head.head.weight [V, H] (copy of lm_head);
      a full decoder layer (self_attn.*, q/k_norm, norms, MoE mlp.*) with random weights,
    where h_t is the main model's final-normed hidden state at t; the MTP layer predicts x_{t+2}.
    """
    tc = _config(target_dir)
    if tc.get("architectures") != ["Qwen3ForCausalLM"]:
        raise ValueError(f"init_mtp_target converts Qwen3ForCausalLM targets, got {tc.get('architectures')}")
    H, V, L, inter = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"], tc["intermediate_size"]
    n, kv = tc["num_attention_heads"], tc.get("num_key_value_heads", tc["num_attention_heads"])
    d = tc.get("head_dim") or H // n
    E = 2  # routed experts per MoE layer (zeros in the main model; must be >= top-k = 1)
    rope = dict(tc.get("rope_parameters") or {"rope_type": "default", "rope_theta": tc.get("rope_theta", 1e6)})
    rope["partial_rotary_factor"] = 1.0  # GLM defaults to 0.5; Qwen3 rotates the whole head
    config = {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "hidden_size": H, "intermediate_size": inter, "num_hidden_layers": L, "num_attention_heads": n,
        "num_key_value_heads": kv, "head_dim": d, "hidden_act": "silu",
        "rms_norm_eps": tc.get("rms_norm_eps", 1e-6), "vocab_size": V,
        "max_position_embeddings": tc.get("max_position_embeddings", 4096), "rope_parameters": rope,
        "partial_rotary_factor": 1.0, "attention_bias": False, "use_qk_norm": True,
        "tie_word_embeddings": False, "initializer_range": tc.get("initializer_range", 0.02),
        "first_k_dense_replace": L - 1, "n_routed_experts": E, "n_shared_experts": 1,
        "moe_intermediate_size": inter, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "num_nextn_predict_layers": 1, "num_mtp_layers": 1, "dtype": tc.get("dtype", "bfloat16"),
        "bos_token_id": tc.get("bos_token_id"), "eos_token_id": tc.get("eos_token_id"),
        "pad_token_id": tc.get("pad_token_id"),
    }
    src = load_file(str(Path(target_dir) / "model.safetensors"))
    dt = src["model.embed_tokens.weight"].dtype
    w = {k: v for k, v in src.items() if k != "lm_head.weight"}
    w["lm_head.weight"] = src.get("lm_head.weight", src["model.embed_tokens.weight"]).clone()  # [V, H]

    def moe(p: str, shared: dict[str, torch.Tensor], routed) -> dict[str, torch.Tensor]:
        out = {f"{p}mlp.shared_experts.{k}": v for k, v in shared.items()}
        out |= {f"{p}mlp.gate.weight": routed(E, H).float(),                            # [E, H] router, fp32
                f"{p}mlp.gate.e_score_correction_bias": torch.zeros(E)}
        for e in range(E):
            out |= {f"{p}mlp.experts.{e}.gate_proj.weight": routed(inter, H),        # [I, H]
                    f"{p}mlp.experts.{e}.up_proj.weight": routed(inter, H),          # [I, H]
                    f"{p}mlp.experts.{e}.down_proj.weight": routed(H, inter)}        # [H, I]
        return out

    last = f"model.layers.{L - 1}."
    mlp = {m: w.pop(f"{last}mlp.{m}.weight") for m in ("gate_proj", "up_proj", "down_proj")}
    w |= moe(last, {f"{m}.weight": t for m, t in mlp.items()}, lambda *s: torch.zeros(*s, dtype=dt))

    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * config["initializer_range"]).to(dt)

    def ones(k: int) -> torch.Tensor:
        return torch.ones(k, dtype=dt)

    p = f"model.layers.{L}."
    w |= {p + "enorm.weight": ones(H), p + "hnorm.weight": ones(H), p + "eh_proj.weight": rand(H, 2 * H),
          p + "shared_head.norm.weight": ones(H), p + "shared_head.head.weight": w["lm_head.weight"].clone(),
          p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
          p + "self_attn.q_proj.weight": rand(n * d, H), p + "self_attn.k_proj.weight": rand(kv * d, H),
          p + "self_attn.v_proj.weight": rand(kv * d, H), p + "self_attn.o_proj.weight": rand(H, n * d),
          p + "self_attn.q_norm.weight": ones(d), p + "self_attn.k_norm.weight": ones(d)}
    w |= moe(p, {"gate_proj.weight": rand(inter, H), "up_proj.weight": rand(inter, H),
                 "down_proj.weight": rand(H, inter)}, rand)
    out = Path(out_dir)
    _write(out, config, w)
    _copy_tokenizer(target_dir, out, extra=("generation_config.json",))
    return str(out)


def to_public_format(head_dir: str, out_dir: str, layer_ids: bool = True) -> str:
    """The EAGLE-3 head at head_dir rewritten as public heads ship (the Qwen3-8B one rlspec's paper
    experiments name): weights in pytorch_model.bin, RoPE's base as a top-level `rope_theta`, and
    with layer_ids=False no `eagle_aux_hidden_state_layer_ids` (EAGLE-3's default layers: which
    vLLM and rlspec both take only for targets of >= 6 layers). Returns out_dir."""
    import shutil

    from safetensors.torch import load_file

    src, out = Path(head_dir), Path(out_dir)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model.safetensors", "*.png", "train_log.json"))
    cfg = _config(src)
    cfg["rope_theta"] = (cfg.pop("rope_parameters", None) or {}).get("rope_theta", cfg.get("rope_theta"))
    if not layer_ids:
        cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.save(load_file(str(src / "model.safetensors")), out / "pytorch_model.bin")
    return str(out)


def main() -> None:
    """python -m rlspec.draft.heads {eagle3,mtp} TARGET_DIR OUT_DIR [--seed N]
    python -m rlspec.draft.heads public HEAD_DIR OUT_DIR [--no-layer-ids]"""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("kind", choices=("eagle3", "mtp", "public"))
    ap.add_argument("target_dir", help="the target (eagle3, mtp) or the head to rewrite (public)")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-layer-ids", action="store_true", help="public: leave the layer ids to EAGLE-3's default")
    args = ap.parse_args()
    if args.kind == "public":
        print(to_public_format(args.target_dir, args.out_dir, layer_ids=not args.no_layer_ids))
        return
    build = init_eagle3_head if args.kind == "eagle3" else init_mtp_target
    print(build(args.target_dir, args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
