"""An EAGLE-3 head in plain torch, trainable, in the checkpoint format vLLM serves
(rlspec.draft.heads documents the format; vLLM's model_executor/models/llama_eagle3.py runs it).

The forward pass is vLLM's, step for step: at draft position t the first step sees
(embed(x_{t+1}), fc(concat(h_low, h_mid, h_high)_t)) at rope position t and predicts x_{t+2};
draft step j >= 1 at the same anchor sees (embed(x_{t+1+j}), its own pre-norm output of step j-1)
at rope position t+j. Training follows EAGLE-3's training-time test: all k steps are unrolled
over every anchor at once, and step j's query attends to step 0's keys at positions <= t plus the
keys steps 1..j wrote at its own anchor, which is exactly the KV cache vLLM's drafter holds then.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rlspec.draft.heads import _copy_tokenizer, _write


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding of x [B, heads, T, d] at integer positions [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)   # [d/2]
    ang = positions.float()[..., None] * inv                                                # [B, T, d/2]
    cos, sin = ang.cos().repeat(1, 1, 2)[:, None], ang.sin().repeat(1, 1, 2)[:, None]       # [B, 1, T, d]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rope_theta(config: dict) -> float:
    """RoPE base as heads ship it: `rope_parameters.rope_theta` (transformers >= 4.56) or a
    top-level `rope_theta` (older configs, the public heads)."""
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ValueError("EAGLE-3 head config has no rope_theta (rope_parameters.rope_theta or rope_theta)")
    return float(theta)


class Eagle3Head(nn.Module):
    """One-layer EAGLE-3 head. `embed` is the target's [V, H] input embedding, shared and frozen
    (vLLM shares it too: the checkpoint has no embed_tokens). With a draft vocabulary smaller than
    the target's (`draft_vocab_size` Vd < V, as public heads ship), lm_head has Vd rows and the
    buffers d2t [Vd] (target id = draft id + d2t) and t2d [V] (membership) map between them."""

    def __init__(self, config: dict, embed: torch.Tensor):
        super().__init__()
        if config.get("num_hidden_layers", 1) != 1:
            raise ValueError("training supports one-layer EAGLE-3 heads (num_hidden_layers=1)")
        V = config["vocab_size"]
        Vd = config.get("draft_vocab_size") or V
        if Vd > V:
            raise ValueError(f"draft_vocab_size {Vd} exceeds the target vocabulary {V}")
        if "eagle_aux_hidden_state_layer_ids" not in config:
            raise ValueError("EAGLE-3 head config has no eagle_aux_hidden_state_layer_ids "
                             "(from_checkpoint fills EAGLE-3's default from the target's depth)")
        self.config = config
        H, Ht, inter = (config["hidden_size"], config.get("target_hidden_size", config["hidden_size"]),
                        config["intermediate_size"])
        self.n, self.kv = config["num_attention_heads"], config["num_key_value_heads"]
        self.d = config.get("head_dim") or H // self.n
        self.theta = rope_theta(config)
        eps = config.get("rms_norm_eps", 1e-6)
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)  # [V, H]
        self.fc = nn.Linear(len(config["eagle_aux_hidden_state_layer_ids"]) * Ht, H, bias=False)
        self.hidden_norm, self.input_layernorm, self.post_attention_layernorm, self.norm = (
            RMSNorm(H, eps) for _ in range(4))
        self.q_proj = nn.Linear(2 * H, self.n * self.d, bias=False)
        self.k_proj = nn.Linear(2 * H, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * H, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.n * self.d, H, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(H, inter, bias=False), nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.reduced = Vd < V
        if self.reduced:  # identity maps until a checkpoint gives them
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[:Vd] = True
            self.register_buffer("t2d", t2d)

    def draft_of_target(self) -> torch.Tensor | None:
        """[V] draft id of each target token, -1 where the draft vocabulary lacks it (None: the
        full vocabulary)."""
        if not self.reduced:
            return None
        out = torch.full(self.t2d.shape, -1, dtype=torch.long, device=self.d2t.device)
        Vd = self.d2t.numel()
        out[torch.arange(Vd, device=self.d2t.device) + self.d2t] = torch.arange(Vd, device=self.d2t.device)
        return out

    # -- checkpoint format (names as rlspec.draft.heads writes them) --------------------------
    NAMES = {"fc": "fc", "hidden_norm": "midlayer.hidden_norm", "input_layernorm": "midlayer.input_layernorm",
             "post_attention_layernorm": "midlayer.post_attention_layernorm", "norm": "norm", "lm_head": "lm_head",
             **{p: f"midlayer.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
             **{p: f"midlayer.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}}

    MAPS = ("d2t", "t2d")  # the vocabulary maps: checkpoint names without ".weight", never cast

    def vllm_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Weights under vLLM's checkpoint names (the names a draft refit takes)."""
        dt = dtype or getattr(torch, self.config.get("dtype", "float32"))
        out = {}
        for k, v in self.state_dict().items():
            if k in self.MAPS:
                out[k] = v.detach().contiguous()
            else:
                out[f"{self.NAMES[k.split('.')[0]]}.weight"] = v.detach().to(dt).contiguous()
        return out

    def load_vllm_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        inverse = {f"{v}.weight": f"{k}.weight" for k, v in self.NAMES.items()}
        inverse |= {m: m for m in self.MAPS if self.reduced}
        unknown = sorted(set(weights) - set(inverse))
        if unknown:
            raise ValueError(f"unexpected EAGLE-3 weights {unknown[:5]}")
        self.load_state_dict({inverse[k]: (v if k in self.MAPS else v.float()) for k, v in weights.items()},
                             strict=True)

    @staticmethod
    def read_config(head_dir: str | Path, num_target_layers: int | None = None) -> dict:
        """The head's config.json, with EAGLE-3's default auxiliary layers for a target of
        `num_target_layers` where the config names none (public heads often do not)."""
        from rlspec.draft.heads import eagle3_aux_layer_ids

        config = json.loads((Path(head_dir) / "config.json").read_text())
        if "eagle_aux_hidden_state_layer_ids" not in config and num_target_layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(eagle3_aux_layer_ids(num_target_layers))
        return config

    @staticmethod
    def read_weights(head_dir: str | Path) -> dict[str, torch.Tensor]:
        """model.safetensors, else PyTorch's pytorch_model.bin (as public heads ship)."""
        d = Path(head_dir)
        if (d / "model.safetensors").exists():
            from safetensors.torch import load_file
            return load_file(str(d / "model.safetensors"))
        if (d / "pytorch_model.bin").exists():
            return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        raise FileNotFoundError(f"{d}: no model.safetensors or pytorch_model.bin")

    @classmethod
    def from_checkpoint(cls, head_dir: str | Path, embed: torch.Tensor,
                        num_target_layers: int | None = None) -> "Eagle3Head":
        head = cls(cls.read_config(head_dir, num_target_layers), embed)
        head.load_vllm_state_dict(cls.read_weights(head_dir))
        return head

    def save(self, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> str:
        out = Path(out_dir)
        _write(out, self.config, {k: v.cpu() for k, v in self.vllm_state_dict().items()})
        if tokenizer_dir is not None:
            _copy_tokenizer(tokenizer_dir, out)
        return str(out)

    # -- forward ---------------------------------------------------------------------------------
    def _qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Layer input for one draft step. tokens/positions [B, T], hidden [B, T, H] ->
        (q [B, n, T, d], k, v [B, kv, T, d], residual [B, T, H])."""
        x = torch.cat([self.input_layernorm(self.embed[tokens]), self.hidden_norm(hidden)], -1)  # [B, T, 2H]
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv, self.d).transpose(1, 2)
        return rope(q, positions, self.theta), rope(k, positions, self.theta), v, hidden

    def _finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [B, n, T, d] -> (logits [B, T, V], pre-norm output [B, T, H]), vLLM's fused
        add+norm order: h = o(attn) + residual; out = mlp(norm(h)) + h."""
        B, _, T, _ = attn.shape
        h = self.o_proj(attn.transpose(1, 2).reshape(B, T, self.n * self.d)) + residual
        m = self.post_attention_layernorm(h)
        pre = self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m)) + h
        return self.lm_head(self.norm(pre)), pre

    def unrolled(self, tokens: torch.Tensor, aux_hidden: torch.Tensor, valid: torch.Tensor,
                 steps: int, start: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training-time test over every anchor. tokens [B, T] (the full sequence), aux_hidden
        [B, T, 3*Ht] (the target's low/mid/high hidden states), valid [B, T] bool (not padding),
        start [B]: each row's first position (a window of a longer rollout; default 0).
        Returns `steps` logits tensors [B, T, V]: entry j at anchor t predicts x_{t+2+j} (only
        anchors with t+1+j < T are meaningful; the caller masks the rest)."""
        B, T = tokens.shape
        rep = self.n // self.kv
        pos0 = torch.arange(T, device=tokens.device).expand(B, T)
        if start is not None:
            pos0 = pos0 + start[:, None]
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()[None, None] & valid[:, None, None, :]
        scale = self.d ** -0.5
        hidden = self.fc(aux_hidden.float())                                                   # [B, T, H]
        ks, vs, out = [], [], []
        for j in range(steps):
            # the token fed at step j is x_{t+1+j}; past the end it is padding (masked out later)
            tok = F.pad(tokens[:, 1 + j:], (0, 1 + j), value=0)
            q, k, v, res = self._qkv(tok, hidden, pos0 + j)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)                    # [B, n, T, d]
            ks.append(k), vs.append(v)
            s0 = (q @ ks[0].transpose(-1, -2)) * scale                                          # [B, n, T, T]
            s0 = s0.masked_fill(~causal, float("-inf"))
            diag = [(q * ki).sum(-1, keepdim=True) * scale for ki in ks[1:]]                     # [B, n, T, 1] each
            p = torch.softmax(torch.cat([s0, *diag], -1), -1)
            attn = p[..., :T] @ vs[0] + sum(p[..., T + i: T + i + 1] * vi for i, vi in enumerate(vs[1:]))
            logits, hidden = self._finish(attn, res)
            out.append(logits)
        return out


def _in_draft_vocab(target_ids: torch.Tensor, draft_of_target: torch.Tensor | None):
    """(the target's top-K ids as draft ids, 0 where absent; [B, T, K] bool: in the draft vocabulary)."""
    if draft_of_target is None:
        return target_ids, torch.ones_like(target_ids, dtype=torch.bool)
    ids = draft_of_target[target_ids]                                                           # -1: absent
    return ids.clamp(min=0), ids >= 0


def _step_mask(shift: int, loss_from: torch.Tensor, length: torch.Tensor, in_vocab: torch.Tensor) -> torch.Tensor:
    """[B, T]: the anchors whose draft step (shift - 1) counts: loss_from <= t + shift <= length - 2,
    with some of the target's top-K in the draft vocabulary there."""
    u = torch.arange(in_vocab.shape[1], device=in_vocab.device)[None] + shift
    mask = (u >= loss_from[:, None]) & (u <= length[:, None] - 2)
    return mask & F.pad(in_vocab[:, shift:].any(-1), (0, shift))


def ttt_counts(target_ids: torch.Tensor, loss_from: torch.Tensor, length: torch.Tensor, steps: int,
               draft_of_target: torch.Tensor | None = None) -> list[float]:
    """Positions counted at each draft step over a whole batch: ttt_loss's denominators when the
    batch is split into micro-batches (their losses then add up to the whole batch's)."""
    _, in_vocab = _in_draft_vocab(target_ids, draft_of_target)
    return [float(_step_mask(1 + j, loss_from, length, in_vocab).sum()) for j in range(steps)]


def ttt_loss(step_logits: list[torch.Tensor], target_ids: torch.Tensor, target_logp: torch.Tensor,
             loss_from: torch.Tensor, length: torch.Tensor, decay: float = 0.8,
             temperature: float = 1.0, draft_of_target: torch.Tensor | None = None,
             denominators: list[float] | None = None) -> tuple[torch.Tensor, dict]:
    """EAGLE-3's objective: cross-entropy of each draft step against the target's next-token
    distribution (top-k, renormalised), step j weighted by decay**j. The draft's logits are taken
    at `temperature`, as vLLM samples drafts (target_logp must be at that temperature too).

    target_ids/target_logp [B, T, K]: the target's top-K next-token ids and log-probs at every
    position u (predicting x_{u+1}); loss_from [B]: first position u whose prediction counts (the
    last prompt position: drafts only ever propose response tokens); length [B]: sequence lengths.
    Step j at anchor t uses u = t+1+j, counted when loss_from <= u <= length-2.
    Also returns, per step, the acceptance proxy sum_v min(p(v), q(v)) (the probability a draft
    sampled from q survives rejection sampling against p) and top-1 agreement, masked means.
    draft_of_target [V] (a head with a smaller draft vocabulary): the target's top-K restricted to
    the draft vocabulary and renormalised, as EAGLE-3 trains such heads; positions where none of
    it is in the draft vocabulary do not count.
    denominators (ttt_counts of the whole batch): this is one micro-batch of it; each step's sums
    (loss and statistics) are divided by the whole batch's count, so micro-batches add up."""
    p_full = target_logp.softmax(-1)                                                             # renormalised top-K
    target_ids, in_vocab = _in_draft_vocab(target_ids, draft_of_target)
    if draft_of_target is not None:
        p_full = p_full * in_vocab
        p_full = p_full / p_full.sum(-1, keepdim=True).clamp(min=1e-12)
    total, stats = 0.0, {"loss": [], "accept": [], "top1": []}
    for j, logits in enumerate(step_logits):
        shift = 1 + j
        mask = _step_mask(shift, loss_from, length, in_vocab)                                    # [B, T]
        denom = mask.sum() if denominators is None else denominators[j]
        if not denom:
            break
        ids = F.pad(target_ids[:, shift:], (0, 0, 0, shift))                                     # [B, T, K] at u=t+1+j
        p = F.pad(p_full[:, shift:], (0, 0, 0, shift))
        logq = (logits.float() / max(temperature, 1e-6)).log_softmax(-1)
        ce = -(p * logq.gather(-1, ids)).sum(-1)                                                 # [B, T]
        loss_j = (ce * mask).sum() / denom
        total = total + decay ** j * loss_j
        with torch.no_grad():
            q_top = logq.gather(-1, ids).exp()
            acc = torch.minimum(p, q_top).sum(-1)
            top1 = ((logits.argmax(-1) == ids[..., 0]) & F.pad(in_vocab[:, shift:, 0], (0, shift))).float()
            stats["loss"].append(loss_j.item())
            stats["accept"].append(((acc * mask).sum() / denom).item())
            stats["top1"].append(((top1 * mask).sum() / denom).item())
    return total, stats


def acceptance_length_proxy(accept_per_step: list[float]) -> float:
    """1 + sum_j prod_{i<=j} a_i: tokens per verification if step acceptances were independent."""
    out, run = 1.0, 1.0
    for a in accept_per_step:
        run *= a
        out += run
    return out


def head_step(opt: torch.optim.Optimizer, loss: torch.Tensor, grad_clip: float) -> float:
    """One optimizer step of a draft (head or model) on `loss`, gradients clipped to `grad_clip`;
    the gradient norm before clipping. Offline and online draft training share it."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    return apply_grads(opt, grad_clip)


def apply_grads(opt: torch.optim.Optimizer, grad_clip: float) -> float:
    """The optimizer step on the gradients accumulated so far, clipped to `grad_clip`; their norm
    before clipping."""
    params = [p for g in opt.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    return float(norm)
