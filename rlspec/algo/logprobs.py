"""Per-token log-probs of given tokens under a causal LM, at the sampling temperature."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V], targets [B, T] -> log p(target) [B, T] of softmax(logits / temperature)."""
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V] -> entropy [B, T] of softmax(logits / temperature)."""
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# Config fields through which a model post-processes its output layer's logits (soft-capping,
# scaling): such a model's logits are not head(hidden), so its log-probs come from its own forward.
LOGIT_MODIFIERS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def split_head(model):
    """(decoder, output layer) of a causal LM whose logits are exactly output_layer(decoder
    hidden states), else None. `model` may be a DeepSpeed engine (its .module is read)."""
    m = getattr(model, "module", model)
    cfg = getattr(m, "config", None)
    if cfg is None or not (hasattr(m, "get_decoder") and hasattr(m, "get_output_embeddings")):
        return None
    head = m.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or any(getattr(cfg, k, None) not in (None, 1, 1.0)
                                                    for k in LOGIT_MODIFIERS):
        return None
    return m.get_decoder(), head


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float,
                  chunk_tokens: int, with_entropy: bool = False):
    """log p(targets) [B, T] (and entropy [B, T]) from hidden states [B, T, H] through the output
    layer, about `chunk_tokens` positions of the micro-batch at a time, in float32. With autograd
    on, each chunk's logits are recomputed in backward (activation checkpointing), so neither the
    [B, T, V] logits nor a float32 copy of them is ever held."""
    B, T, _ = hidden.shape
    step = max(1, chunk_tokens // max(B, 1))

    def chunk(h: torch.Tensor, t: torch.Tensor):
        logits = head(h).float().div_(temperature)                     # [B, c, V]; in place: one fp32 copy
        lse = torch.logsumexp(logits, dim=-1)                         # [B, c]
        lp = logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - lse
        if not with_entropy:
            return lp, None
        with torch.no_grad():
            return lp, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)

    parts = [torch.utils.checkpoint.checkpoint(chunk, hidden[:, s:s + step], targets[:, s:s + step],
                                               use_reentrant=False)
             if torch.is_grad_enabled() else chunk(hidden[:, s:s + step], targets[:, s:s + step])
             for s in range(0, T, step)]
    lp = torch.cat([p[0] for p in parts], 1)
    return (lp, torch.cat([p[1] for p in parts], 1)) if with_entropy else lp


def output_logprobs(model, out, targets: torch.Tensor, temperature: float, chunk_tokens: int) -> torch.Tensor:
    """log p(targets) [B, T] from a forward pass `out` run with output_hidden_states=True over
    inputs one longer than targets, computed as sequence_logprobs computes them (bit for bit)."""
    split = split_head(model)
    if split is not None:
        return head_logprobs(out.hidden_states[-1][:, :-1], split[1], targets, temperature, chunk_tokens)
    return token_logprobs(out.logits[:, :-1], targets, temperature)


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0, with_entropy: bool = False,
                      prompt_lengths: torch.Tensor | None = None, plan: "PromptPlan | None" = None,
                      chunk_tokens: int = 4096):
    """input_ids [B, T+1] -> log-probs [B, T] of input_ids[:, 1:] (and entropy [B, T]).
    With prompt_lengths [B] (or their `plan`, made on the host from the same rows) the rows'
    prompts go through the model once each (shared_prompt_forward): the response positions get
    the same values, every other position 0. Where the model allows (split_head), the output layer
    runs chunk_tokens positions at a time (head_logprobs); otherwise the model's own logits are
    used."""
    if plan is None and prompt_lengths is not None:
        plan = prompt_plan(input_ids.cpu(), attention_mask.cpu(), prompt_lengths.cpu())
    split = split_head(model)
    if plan is not None:
        out, targets, place = shared_prompt_forward(model, input_ids, attention_mask, plan, split)
    elif split is not None:
        out = split[0](input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state[:, :-1]
        targets, place = input_ids[:, 1:], None
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        targets, place = input_ids[:, 1:], None
    if split is not None:  # `out` is hidden states
        res = head_logprobs(out, split[1], targets, temperature, chunk_tokens, with_entropy)
        lp, ent = res if with_entropy else (res, None)
    else:  # `out` is logits
        lp = token_logprobs(out, targets, temperature)
        if with_entropy:
            with torch.no_grad():
                ent = token_entropy(out, temperature)
    lp = lp if place is None else place(lp)
    if not with_entropy:
        return lp
    return lp, (ent if place is None else place(ent))


def prompt_cache_supported(model) -> bool:
    """Whether shared_prompt_forward may run on this model: every layer's KV cache is a plain
    full-attention one (sliding-window and recurrent layers would drop or fold the prompt)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    config = getattr(getattr(model, "module", model), "config", None)
    try:
        return config is not None and all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)
    except Exception:  # a config the cache cannot be built from
        return False


@dataclass(frozen=True)
class PromptPlan:
    """Which rows share a prompt, worked out on the host (no device reads in the forward)."""
    prompts: list[tuple[int, ...]]   # the distinct prompts, in first-seen order
    inv: list[int]                   # [B] each row's prompt index
    lengths: list[int]               # [B] prompt lengths
    response_width: int              # R: the longest response (at least 1)


def prompt_plan(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor) -> PromptPlan:
    """The plan of host rows [B, W] (right-padded prompt + response) with prompt lengths [B]."""
    lengths = prompt_lengths.tolist()
    rows: dict[tuple[int, ...], int] = {}
    inv = [rows.setdefault(tuple(input_ids[i, : lengths[i]].tolist()), len(rows)) for i in range(len(lengths))]
    resp = (attention_mask.sum(1) - prompt_lengths).tolist()
    return PromptPlan(list(rows), inv, lengths, max(max(resp, default=0), 1))


def shared_prompt_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, plan: PromptPlan,
                          split=None):
    """A GRPO batch repeats each prompt once per sample of its group. Forward each distinct prompt
    once (left-padded, use_cache), give every row its prompt's keys and values (an index into the
    cache: gradients from all the group's rows add up on the one prompt pass, as they would over
    copies), then forward only the response tokens against that cache. Attention, positions and
    masks are those of the full rows, so the log-probs and gradients are the full forward's, up to
    floating-point summation order; the prompt's compute is paid once per group, not G times.

    input_ids, attention_mask [B, W] right-padded prompt + response, on the model's device; plan:
    prompt_plan() of the same rows on the host; split: split_head(model), to return hidden states
    instead of logits. Returns (logits [B, R, V], or hidden states [B, R, H], predicting each
    response token, the response tokens [B, R], and place: [B, R] values -> the [B, W-1] grid of
    sequence_logprobs, 0 off the response)."""
    (B, W), dev = input_ids.shape, input_ids.device
    width, R = max(map(len, plan.prompts)), plan.response_width
    ids_p = torch.zeros(len(plan.prompts), width, dtype=torch.long)
    mask_p = torch.zeros(len(plan.prompts), width, dtype=torch.long)
    for u, prompt in enumerate(plan.prompts):  # left-padded, so every prompt's last token sits in the last column
        ids_p[u, width - len(prompt):] = torch.tensor(prompt)
        mask_p[u, width - len(prompt):] = 1
    ids_p, mask_p = ids_p.to(dev), mask_p.to(dev)
    inv, pl = torch.tensor(plan.inv, device=dev), torch.tensor(plan.lengths, device=dev)
    forward, field = (split[0], "last_hidden_state") if split is not None else (model, "logits")
    out = forward(input_ids=ids_p, attention_mask=mask_p, position_ids=(mask_p.cumsum(1) - 1).clamp(min=0),
                  use_cache=True)
    cache = out.past_key_values
    cache.batch_select_indices(inv)
    resp_len = attention_mask.sum(1) - pl
    steps = torch.arange(R, device=dev)
    resp_mask = (steps < resp_len[:, None]).long()
    resp_ids = input_ids.gather(1, (pl[:, None] + steps).clamp(max=W - 1)) * resp_mask
    logits = getattr(out, field)[inv, -1:]  # the prompt's last position predicts the first response token
    if R > 1:
        rest = forward(input_ids=resp_ids[:, :-1], attention_mask=torch.cat([mask_p[inv], resp_mask[:, :-1]], 1),
                       position_ids=pl[:, None] + steps[:-1], past_key_values=cache, use_cache=False)
        logits = torch.cat([logits, getattr(rest, field)], 1)
    cols = pl[:, None] - 1 + steps  # response token j of row i is predicted at position pl_i - 1 + j

    def place(values: torch.Tensor) -> torch.Tensor:
        grid = torch.zeros(B, W - 1 + R, dtype=values.dtype, device=dev)  # room for padding's columns, cut off
        return grid.scatter(1, cols, values * resp_mask)[:, : W - 1]

    return logits, resp_ids, place


class LogprobModel(torch.nn.Module):
    """A causal LM whose forward is sequence_logprobs: the module a learner's DeepSpeed engine
    wraps, so each micro-batch goes through DeepSpeedEngine.forward and every hook it sets (ZeRO's
    backward-seen flag, ZeRO-3's step reset and parameter trace, the output hooks whose backward
    prologue opens the optimizer's backward: BF16_Optimizer clears its bf16 gradients there)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                with_entropy: bool = False, plan: "PromptPlan | None" = None, chunk_tokens: int = 4096):
        return sequence_logprobs(self.lm, input_ids, attention_mask, temperature, with_entropy=with_entropy, plan=plan,
                                 chunk_tokens=chunk_tokens)
