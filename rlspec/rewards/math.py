"""Math answer reward: the final answer is taken from `\\boxed{...}` or an `Answer: ...` line and
checked against the ground truth with math-verify. Reward is 1.0 or 0.0 and never raises."""
from __future__ import annotations

import re
import threading

from math_verify import parse, verify

_ANSWER_RE = re.compile(r"answer\s*[:：]", re.IGNORECASE)
MAX_CHARS = 4000  # longer answers are cut before parsing: the parser is superlinear on garbage


def extract_answer(text: str) -> str | None:
    """The last `\\boxed{...}` if any, else the text after the last 'Answer:', else None."""
    if not isinstance(text, str):
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    last = None
    for last in _ANSWER_RE.finditer(text):
        pass
    if last is None:
        return None
    tail = text[last.end():].strip()
    ans = tail.splitlines()[0].strip() if tail else ""
    ans = ans.rstrip(".").strip().strip("$").strip()
    return ans or None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip() or None
    return None


def math_reward(response: str, ground_truth: str) -> float:
    """1.0 if the response's final answer equals `ground_truth` mathematically, else 0.0."""
    try:
        ans = extract_answer(response)
        if ans is None or ground_truth is None:
            return 0.0
        truth = str(ground_truth).strip()
        if ans == truth:
            return 1.0
        if len(ans) > MAX_CHARS or len(truth) > MAX_CHARS:
            return 0.0  # too long to parse safely, and not literally equal
        # math-verify's timeouts use SIGALRM, which only the main thread may set.
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        gold = parse(f"${truth}$", parsing_timeout=timeout)
        pred = parse(f"${ans}$", parsing_timeout=timeout)
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never take the run down on garbage text
        return 0.0
