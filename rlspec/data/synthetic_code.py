"""Synthetic code-generation tasks for the code reward: small stdin -> stdout programs, each with
three test cases drawn from a seeded generator. Rows use the plain schema; the answer is the JSON
list of cases that rlspec.rewards.code checks against."""
from __future__ import annotations

import json
import random

# (task statement, input generator, reference solution on the input text)
TASKS = [
    ("reads two integers a and b from one line of standard input and prints a+b",
     lambda r: f"{r.randint(-999, 999)} {r.randint(-999, 999)}", lambda s: str(sum(map(int, s.split())))),
    ("reads a line of integers separated by spaces and prints the largest",
     lambda r: " ".join(str(r.randint(-99, 99)) for _ in range(r.randint(1, 8))),
     lambda s: str(max(map(int, s.split())))),
    ("reads a word and prints it reversed",
     lambda r: "".join(r.choice("abcdefghij") for _ in range(r.randint(1, 10))), lambda s: s[::-1]),
    ("reads a word and prints how many vowels (a, e, i, o, u) it has",
     lambda r: "".join(r.choice("abcdeiou") for _ in range(r.randint(1, 12))),
     lambda s: str(sum(c in "aeiou" for c in s))),
    ("reads an integer n (0 <= n <= 12) and prints n factorial",
     lambda r: str(r.randint(0, 12)), lambda s: str(__import__("math").factorial(int(s)))),
]


def make_code_rows(seed: int, n: int, cases_per_task: int = 3) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        statement, make_input, solve = rng.choice(TASKS)
        inputs = [make_input(rng) for _ in range(cases_per_task)]
        cases = [{"stdin": x + "\n", "stdout": solve(x) + "\n"} for x in inputs]
        rows.append({"prompt": f"Write a Python program that {statement}. Reply in a ```python block.",
                     "answer": json.dumps(cases)})
    return rows
