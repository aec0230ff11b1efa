"""Synthetic verifiable math: multi-digit addition with a written column-by-column solution.

The tiny policy is pre-trained on solutions in which a carry is sometimes forgotten (a "slip"),
so it starts with a systematic, learnable bug: greedy decoding copies the slip on most problems
that need a carry, while sampling still finds the correct carry some of the time. That gives
GRPO a real signal (groups with mixed rewards) and a measurable rise in held-out accuracy.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"Compute {self.a}+{self.b}."

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def sample_problem(rng: random.Random, min_digits: int, max_digits: int) -> Problem:
    def number() -> int:
        d = rng.randint(min_digits, max_digits)
        return rng.randint(10 ** (d - 1), 10**d - 1)

    return Problem(number(), number())


def column_addition(a: int, b: int, slip_prob: float = 0.0, rng: random.Random | None = None) -> tuple[list[str], int]:
    """a + b written column by column, right to left: (the columns' equations, the sum they state).

    With probability `slip_prob` per column that has a carry in, the carry is forgotten; the later
    columns stay consistent with the slip, so the stated sum is then wrong.
    """
    xs, ys = str(a)[::-1], str(b)[::-1]
    width = max(len(xs), len(ys))
    carry, parts, digits = 0, [], []
    for i in range(width):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        if carry and rng is not None and rng.random() < slip_prob:
            carry = 0
        s = x + y + carry
        parts.append(f"{x}+{y}+1={s}" if carry else f"{x}+{y}={s}")
        digits.append(s % 10)
        carry = s // 10
    if carry:
        digits.append(1)
    return parts, int("".join(str(d) for d in reversed(digits)))


def solution(p: Problem, slip_prob: float = 0.0, rng: random.Random | None = None) -> str:
    """Column-by-column solution ending in 'Answer: N' (column_addition's slips included)."""
    parts, stated = column_addition(p.a, p.b, slip_prob, rng)
    return ", ".join(parts) + f". Answer: {stated}"


def is_heldout(p: Problem) -> bool:
    """A fixed hash split: one problem in ten is held out from pre-training and RL training."""
    return ((p.a * 1_000_003 + p.b) * 2_654_435_761) % 2**32 % 10 == 0


def make_split(seed: int, n: int, min_digits: int, max_digits: int, heldout: bool) -> list[Problem]:
    """`n` distinct problems drawn with `seed` from the held-out or the training side of the split."""
    rng = random.Random(seed)
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < n:
        p = sample_problem(rng, min_digits, max_digits)
        if p not in seen and is_heldout(p) == heldout:
            seen.add(p)
            out.append(p)
    return out


def make_rows(seed: int, n: int, min_digits: int, max_digits: int, heldout: bool) -> list[dict]:
    """Rows in rlspec's plain schema: {'prompt', 'answer'}."""
    return [{"prompt": p.question, "answer": p.answer}
            for p in make_split(seed, n, min_digits, max_digits, heldout)]
