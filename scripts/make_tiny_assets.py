"""Build the tiny assets the CPU runs use, reproducibly from a seed, fully offline.

Writes, in Hugging Face format (config.json, model.safetensors, tokenizer.json + chat template):
  <out>/policy : a small Qwen3-architecture policy pre-trained on a synthetic task's written
                 solutions, which forget a carry with probability --slip (so it starts partly right)
  <out>/draft  : a smaller Qwen3 draft model with the same tokenizer, trained on the same text
                 (the chain assets' is then fine-tuned on the policy's own answers by
                 rlspec.draft.train: docs/operations.md has the commands)
Both load through rlspec's normal model path (a local directory, exactly like a hub checkpoint).
Tasks: `addition` (rlspec/data/synthetic.py, short answers) and `chain` (rlspec/data/
synthetic_chain.py: every partial sum of a long-tailed chain written out, reasoning-length answers).

    python scripts/make_tiny_assets.py --out rlspec/assets/tiny
    python scripts/make_tiny_assets.py --task chain --out rlspec/assets/chain
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from rlspec.data.synthetic import make_split, sample_problem, solution, is_heldout
from rlspec.data.synthetic_chain import chain_solution, is_heldout_chain, make_chains, sample_chain
from rlspec.data.templates import RL_ZERO_TEMPLATE
from rlspec.rewards.math import math_reward

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [EOS, IM_START, IM_END, "<think>", "</think>"]
# A Qwen-style chat template (used by the RL-Think prompt template).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

SIZES = {
    "policy": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "draft": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64),
}


def corpus(rng: random.Random, n: int, args) -> list[str]:
    texts = []
    while len(texts) < n:
        if args.task == "chain":
            c = sample_chain(rng, args.min_digits, args.max_digits, args.max_terms, args.term_tail)
            if not is_heldout_chain(c):
                texts.append(RL_ZERO_TEMPLATE.format(prompt=c.question) + chain_solution(c, args.slip, rng) + EOS)
            continue
        p = sample_problem(rng, args.min_digits, args.max_digits)
        if not is_heldout(p):
            texts.append(RL_ZERO_TEMPLATE.format(prompt=p.question) + solution(p, args.slip, rng) + EOS)
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # Digits stay single tokens so arithmetic is column-aligned; bytes cover any text.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(kind: str, vocab: int, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, max_position_embeddings=512, rope_theta=10000.0,
                      tie_word_embeddings=True, rms_norm_eps=1e-6, eos_token_id=0,
                      pad_token_id=0, bos_token_id=None, **SIZES[kind])
    return Qwen3ForCausalLM(cfg)


def pretrain(model, tok, texts: list[str], steps: int, batch: int, lr: float, seed: int, bucket: int = 1) -> None:
    """AdamW with warm-up and cosine decay on random batches. bucket > 1: draw that many batches at
    once and cut them by length, so long-tailed texts pad little."""
    gen = torch.Generator().manual_seed(seed)
    enc = [tok(t)["input_ids"] for t in texts]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    t0 = time.time()
    queue: list[list[int]] = []
    for step in range(steps):
        if bucket == 1:
            idx = torch.randint(len(enc), (batch,), generator=gen).tolist()
        else:
            if not queue:
                drawn = sorted(torch.randint(len(enc), (batch * bucket,), generator=gen).tolist(),
                               key=lambda i: len(enc[i]))
                order = torch.randperm(bucket, generator=gen).tolist()
                queue = [drawn[b * batch:(b + 1) * batch] for b in order]
            idx = queue.pop()
        seqs = [enc[i] for i in idx]
        width = max(map(len, seqs))
        ids = torch.full((batch, width), tok.pad_token_id)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        warm = min(1.0, (step + 1) / 100)
        for g in opt.param_groups:
            g["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"  step {step:5d} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()


@torch.no_grad()
def greedy_accuracy(model, tok, n: int, args, seed: int) -> float:
    if args.task == "chain":
        problems = make_chains(seed, n, args.min_digits, args.max_digits, args.max_terms, args.term_tail, heldout=True)
    else:
        problems = make_split(seed, n, args.min_digits, args.max_digits, heldout=True)
    tok.padding_side = "left"
    right = 0.0
    for i in range(0, n, 50):
        part = problems[i:i + 50]
        enc = tok([RL_ZERO_TEMPLATE.format(prompt=p.question) for p in part], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        right += sum(math_reward(t, p.answer) for t, p in zip(texts, part))
    tok.padding_side = "right"
    return right / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["addition", "chain"], default="addition")
    ap.add_argument("--out", default="rlspec/assets/tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slip", type=float, default=0.7, help="chance a carry is forgotten in the pre-training text")
    ap.add_argument("--min-digits", type=int, default=None, help="digits of a number (addition 2, chain 1)")
    ap.add_argument("--max-digits", type=int, default=None, help="addition 3, chain 2")
    ap.add_argument("--max-terms", type=int, default=8, help="chain: most terms in a problem")
    ap.add_argument("--term-tail", type=float, default=1.5, help="chain: P(k terms) ~ k ** -tail")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="greedy check's limit (64; chain 320)")
    ap.add_argument("--texts", type=int, default=60000)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--policy-steps", type=int, default=2500)
    ap.add_argument("--draft-steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket", type=int, default=1, help="batches drawn at once and cut by length")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    chain = args.task == "chain"
    args.max_new_tokens = args.max_new_tokens or (320 if chain else 64)
    args.min_digits = args.min_digits or (1 if chain else 2)
    args.max_digits = args.max_digits or (2 if chain else 3)
    texts = corpus(rng, args.texts, args)
    tok = train_tokenizer(texts, args.vocab)
    out = Path(args.out)
    report = {"task": args.task, "seed": args.seed, "slip": args.slip, "vocab_size": len(tok)}
    if args.task == "chain":
        report.update(min_digits=args.min_digits, max_digits=args.max_digits, max_terms=args.max_terms,
                      term_tail=args.term_tail)
    for kind, steps, lr in (("policy", args.policy_steps, 2e-3), ("draft", args.draft_steps, 3e-3)):
        print(f"[{kind}] pre-training {steps} steps", flush=True)
        model = build_model(kind, len(tok), args.seed)
        pretrain(model, tok, texts, steps, args.batch, lr, args.seed + 1, args.bucket)
        acc = greedy_accuracy(model, tok, 200, args, args.seed + 2)
        print(f"[{kind}] {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
              f"greedy held-out accuracy {acc:.3f}", flush=True)
        report[kind] = {"params": sum(p.numel() for p in model.parameters()), "greedy_accuracy": acc}
        model.to(torch.bfloat16).save_pretrained(out / kind)
        tok.save_pretrained(out / kind)
    (out / "README.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
