"""Synthetic reasoning-length math: sums of a chain of numbers, solved by writing out every
partial sum column by column before the answer.

    Compute 47+385+9.
    47+385: 7+5=12, 4+8+1=13, 0+3+1=4, so 432. 432+9: 2+9=11, 3+0+1=4, 4+0=4, so 441. Answer: 441

The number of terms has a long tail (P(k terms) proportional to k ** -term_tail for k = 2 ..
max_terms), so most answers are short and a few are many times longer: the shape of reasoning
traces, where a handful of long rollouts keep the engine busy at a small batch. As in the addition
task, the tiny policy is pre-trained on working that sometimes forgets a carry; one slip anywhere
in the chain makes the answer wrong, so long problems are harder and RL has room on every length.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from rlspec.data.synthetic import column_addition


@dataclass(frozen=True)
class Chain:
    terms: tuple[int, ...]

    @property
    def question(self) -> str:
        return "Compute " + "+".join(map(str, self.terms)) + "."

    @property
    def answer(self) -> str:
        return str(sum(self.terms))


def term_weights(max_terms: int, tail: float) -> list[float]:
    """P(k terms) for k = 2 .. max_terms, proportional to k ** -tail."""
    w = [k ** -tail for k in range(2, max_terms + 1)]
    return [x / sum(w) for x in w]


def sample_chain(rng: random.Random, min_digits: int, max_digits: int, max_terms: int, tail: float) -> Chain:
    k = rng.choices(range(2, max_terms + 1), weights=term_weights(max_terms, tail))[0]

    def number() -> int:
        d = rng.randint(min_digits, max_digits)
        return rng.randint(10 ** (d - 1), 10**d - 1)

    return Chain(tuple(number() for _ in range(k)))


def chain_solution(c: Chain, slip_prob: float = 0.0, rng: random.Random | None = None) -> str:
    """Every partial sum written column by column ('a+b: columns, so s.'), then 'Answer: N'; a
    slipped carry carries its wrong partial sum on to the end."""
    total, steps = c.terms[0], []
    for t in c.terms[1:]:
        parts, s = column_addition(total, t, slip_prob, rng)
        steps.append(f"{total}+{t}: " + ", ".join(parts) + f", so {s}.")
        total = s
    return " ".join(steps) + f" Answer: {total}"


def is_heldout_chain(c: Chain) -> bool:
    """A fixed hash split: one problem in ten is held out from pre-training and RL training."""
    h = 0
    for t in c.terms:
        h = (h * 1_000_003 + t) % 2**61
    return h * 2_654_435_761 % 2**32 % 10 == 0


def make_chains(seed: int, n: int, min_digits: int, max_digits: int, max_terms: int, tail: float,
                heldout: bool) -> list[Chain]:
    """`n` distinct problems drawn with `seed` from the held-out or the training side of the split."""
    rng = random.Random(seed)
    seen: set[Chain] = set()
    out: list[Chain] = []
    while len(out) < n:
        c = sample_chain(rng, min_digits, max_digits, max_terms, tail)
        if c not in seen and is_heldout_chain(c) == heldout:
            seen.add(c)
            out.append(c)
    return out


def make_chain_rows(seed: int, n: int, min_digits: int, max_digits: int, max_terms: int, tail: float,
                    heldout: bool) -> list[dict]:
    """Rows in rlspec's plain schema: {'prompt', 'answer'}."""
    return [{"prompt": c.question, "answer": c.answer}
            for c in make_chains(seed, n, min_digits, max_digits, max_terms, tail, heldout)]
