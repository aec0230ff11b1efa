"""Per-token log-probs of given tokens under a causal LM, at the sampling temperature."""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V], targets [B, T] -> log p(target) [B, T] of softmax(logits / temperature)."""
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V] -> entropy [B, T] of softmax(logits / temperature)."""
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0, with_entropy: bool = False,
                      prompt_lengths: torch.Tensor | None = None):
    """input_ids [B, T+1] -> log-probs [B, T] of input_ids[:, 1:] (and entropy [B, T]).
    With prompt_lengths [B] the rows' prompts go through the model once each (shared_prompt_forward):
    the response positions get the same values, every other position 0."""
    if prompt_lengths is not None:
        logits, targets, place = shared_prompt_forward(model, input_ids, attention_mask, prompt_lengths)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        targets, place = input_ids[:, 1:], None
    lp = token_logprobs(logits, targets, temperature)
    lp = lp if place is None else place(lp)
    if not with_entropy:
        return lp
    with torch.no_grad():
        ent = token_entropy(logits, temperature)
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


def shared_prompt_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor):
    """A GRPO batch repeats each prompt once per sample of its group. Forward each distinct prompt
    once (left-padded, use_cache), give every row its prompt's keys and values (an index into the
    cache: gradients from all the group's rows add up on the one prompt pass, as they would over
    copies), then forward only the response tokens against that cache. Attention, positions and
    masks are those of the full rows, so the log-probs and gradients are the full forward's, up to
    floating-point summation order; the prompt's compute is paid once per group, not G times.

    input_ids, attention_mask [B, W] right-padded prompt + response; prompt_lengths [B].
    Returns (logits [B, R, V] predicting each response token, the response tokens [B, R], and
    place: [B, R] values -> the [B, W-1] grid of sequence_logprobs, 0 off the response)."""
    (B, W), dev = input_ids.shape, input_ids.device
    pl = prompt_lengths.to(device=dev, dtype=torch.long)
    rows: dict[tuple[int, ...], int] = {}
    lengths = pl.tolist()
    inv = torch.tensor([rows.setdefault(tuple(input_ids[i, : lengths[i]].tolist()), len(rows)) for i in range(B)],
                       device=dev)
    width = max(map(len, rows))
    ids_p = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
    mask_p = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
    for prompt, u in rows.items():  # left-padded, so every prompt's last token sits in the last column
        ids_p[u, width - len(prompt):] = torch.tensor(prompt, device=dev)
        mask_p[u, width - len(prompt):] = 1
    out = model(input_ids=ids_p, attention_mask=mask_p, position_ids=(mask_p.cumsum(1) - 1).clamp(min=0),
                use_cache=True)
    cache = out.past_key_values
    cache.batch_select_indices(inv)
    resp_len = attention_mask.sum(1) - pl
    R = max(int(resp_len.max()), 1)
    steps = torch.arange(R, device=dev)
    resp_mask = (steps < resp_len[:, None]).long()
    resp_ids = input_ids.gather(1, (pl[:, None] + steps).clamp(max=W - 1)) * resp_mask
    logits = out.logits[inv, -1:]  # the prompt's last position predicts the first response token
    if R > 1:
        rest = model(input_ids=resp_ids[:, :-1], attention_mask=torch.cat([mask_p[inv], resp_mask[:, :-1]], 1),
                     position_ids=pl[:, None] + steps[:-1], past_key_values=cache, use_cache=False).logits
        logits = torch.cat([logits, rest], 1)
    cols = pl[:, None] - 1 + steps  # response token j of row i is predicted at position pl_i - 1 + j

    def place(values: torch.Tensor) -> torch.Tensor:
        grid = torch.zeros(B, W - 1 + R, dtype=values.dtype, device=dev)  # room for padding's columns, cut off
        return grid.scatter(1, cols, values * resp_mask)[:, : W - 1]

    return logits, resp_ids, place
