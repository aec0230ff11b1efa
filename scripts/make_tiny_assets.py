"""Build the tiny assets the CPU default runs on, reproducibly from a seed, fully offline.

Writes, in Hugging Face format (config.json, model.safetensors, tokenizer.json + chat template):
  <out>/policy : a small Qwen3-architecture policy pre-trained on synthetic addition whose written
                 solutions forget a carry with probability --slip (so it starts partly right)
  <out>/draft  : a smaller Qwen3 draft model with the same tokenizer, trained on the same text
Both load through rlspec's normal model path (a local directory, exactly like a hub checkpoint).

    python scripts/make_tiny_assets.py --out rlspec/assets/tiny
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


def corpus(rng: random.Random, n: int, slip: float, min_digits: int, max_digits: int) -> list[str]:
    texts = []
    while len(texts) < n:
        p = sample_problem(rng, min_digits, max_digits)
        if is_heldout(p):
            continue
        texts.append(RL_ZERO_TEMPLATE.format(prompt=p.question) + solution(p, slip, rng) + EOS)
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


def pretrain(model, tok, texts: list[str], steps: int, batch: int, lr: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    enc = [tok(t)["input_ids"] for t in texts]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    t0 = time.time()
    for step in range(steps):
        idx = torch.randint(len(enc), (batch,), generator=gen).tolist()
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
def greedy_accuracy(model, tok, n: int, min_digits: int, max_digits: int, seed: int) -> float:
    problems = make_split(seed, n, min_digits, max_digits, heldout=True)
    tok.padding_side = "left"
    prompts = [RL_ZERO_TEMPLATE.format(prompt=p.question) for p in problems]
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    tok.padding_side = "right"
    return sum(math_reward(t, p.answer) for t, p in zip(texts, problems)) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="rlspec/assets/tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slip", type=float, default=0.7, help="chance a carry is forgotten in the pre-training text")
    ap.add_argument("--min-digits", type=int, default=2)
    ap.add_argument("--max-digits", type=int, default=3)
    ap.add_argument("--texts", type=int, default=60000)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--policy-steps", type=int, default=2500)
    ap.add_argument("--draft-steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    texts = corpus(rng, args.texts, args.slip, args.min_digits, args.max_digits)
    tok = train_tokenizer(texts, args.vocab)
    out = Path(args.out)
    report = {"seed": args.seed, "slip": args.slip, "vocab_size": len(tok)}
    for kind, steps, lr in (("policy", args.policy_steps, 2e-3), ("draft", args.draft_steps, 3e-3)):
        print(f"[{kind}] pre-training {steps} steps", flush=True)
        model = build_model(kind, len(tok), args.seed)
        pretrain(model, tok, texts, steps, args.batch, lr, args.seed + 1)
        acc = greedy_accuracy(model, tok, 200, args.min_digits, args.max_digits, args.seed + 2)
        print(f"[{kind}] {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
              f"greedy held-out accuracy {acc:.3f}", flush=True)
        report[kind] = {"params": sum(p.numel() for p in model.parameters()), "greedy_accuracy": acc}
        model.to(torch.bfloat16).save_pretrained(out / kind)
        tok.save_pretrained(out / kind)
    (out / "README.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
