"""Code-generation reward: the response's last fenced Python block (else the whole response) runs
against the task's test cases in the sandbox (rlspec/rewards/sandbox.py); the reward is the
fraction of cases whose stdout matches, so it lies in [0, 1] and never raises.

Ground truth is a JSON list of cases, `[{"stdin": "1 2\\n", "stdout": "3\\n"}, ...]`: the program
sees only the inputs; outputs are compared here, outside the sandbox."""
from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

from rlspec.rewards.sandbox import Limits, run_python

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
MAX_SOURCE_CHARS = 20_000


def extract_code(text: str) -> str | None:
    if not isinstance(text, str) or not text.strip():
        return None
    blocks = _FENCE.findall(text)
    code = blocks[-1] if blocks else text
    return code if code.strip() and len(code) <= MAX_SOURCE_CHARS else None


def parse_cases(truth: str) -> list[tuple[str, str]]:
    """[(stdin, expected stdout)]; [] when the ground truth is not a list of cases."""
    try:
        cases = json.loads(truth)
    except (TypeError, ValueError):
        return []
    if not isinstance(cases, list):
        return []
    return [(c["stdin"], c["stdout"]) for c in cases
            if isinstance(c, dict) and isinstance(c.get("stdin"), str) and isinstance(c.get("stdout"), str)]


def _same_output(got: str, want: str) -> bool:
    norm = lambda s: [ln.rstrip() for ln in s.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)


def code_reward(response: str, ground_truth: str, limits: Limits | None = None) -> float:
    try:
        code, cases = extract_code(response), parse_cases(ground_truth)
        if code is None or not cases:
            return 0.0
        result = run_python(code, [c[0] for c in cases], limits)
        passed = sum(out is not None and _same_output(out, want) for out, (_, want) in zip(result.outputs, cases))
        return passed / len(cases)
    except Exception:  # noqa: BLE001 - a reward must never take the run down
        return 0.0


def code_rewards(responses: list[str], truths: list[str], limits: Limits | None = None) -> list[float]:
    """Scores of a batch, one sandbox process per response, os.cpu_count() at a time."""
    with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 1)) as pool:
        return list(pool.map(lambda rt: code_reward(rt[0], rt[1], limits), zip(responses, truths)))
