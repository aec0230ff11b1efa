"""Prompt datasets: rlspec's synthetic generator, local files, saved datasets or hub IDs, each row
normalised to {'prompt': str, 'answer': str} and tokenised through the prompt template.

Malformed rows are skipped and counted (`on_bad_row=skip`) or stop the run naming the source and
row (`on_bad_row=error`); they never reach a worker.
"""
from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from rlspec.config import DataConfig, DatasetConfig, SyntheticConfig
from rlspec.data.synthetic import make_rows
from rlspec.data.synthetic_chain import make_chain_rows
from rlspec.data.synthetic_code import make_code_rows
from rlspec.data.templates import apply_template


class DataError(ValueError):
    """A dataset cannot be loaded, or a row is malformed under on_bad_row=error."""


class BadRow(ValueError):
    """A malformed row; `reason` is a short category for the skip counts."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class Prompt:
    text: str                 # the question as the dataset has it
    answer: str               # ground truth for the reward
    token_ids: list[int]      # templated prompt, tokenised
    row: int                  # row number in the source (1-based)


@dataclass
class PromptSet:
    source: str
    prompts: list[Prompt]
    skipped: Counter = field(default_factory=Counter)  # reason -> count

    def __len__(self) -> int:
        return len(self.prompts)


def _read_rows(ds: DatasetConfig, synth: SyntheticConfig, key: str) -> Iterator[tuple[int, Any]]:
    """(1-based row number, raw row) pairs. A row that is not even parseable is yielded as an
    Exception so the caller applies the bad-row policy to it like any other malformed row."""
    if ds.source == "synthetic":
        rows = make_rows(ds.seed, ds.num_rows, synth.min_digits, synth.max_digits,
                         heldout=ds.split != "train")
        yield from enumerate(rows, start=1)
        return
    if ds.source == "synthetic_chain":
        rows = make_chain_rows(ds.seed, ds.num_rows, synth.min_digits, synth.max_digits, synth.max_terms,
                               synth.term_tail, heldout=ds.split != "train")
        yield from enumerate(rows, start=1)
        return
    if ds.source == "synthetic_code":
        yield from enumerate(make_code_rows(ds.seed, ds.num_rows), start=1)
        return
    path = Path(ds.source).expanduser()
    if path.suffix == ".jsonl" and path.is_file():
        with path.open(encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line, parse_int=_parse_int)
                except ValueError as e:  # JSONDecodeError, or a number Python refuses to parse
                    yield i, BadRow("invalid_json", f"invalid JSON ({getattr(e, 'msg', e)})")
        return
    import datasets

    try:
        if path.is_file():
            fmt = {".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
            if fmt is None:
                raise DataError(f"{key}.source={ds.source!r}: unsupported file type {path.suffix!r} "
                                "(use .jsonl, .json, .parquet or .csv)")
            data = datasets.load_dataset(fmt, data_files=str(path), split="train")
        elif path.is_dir() and any((path / f).exists()
                                   for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                data = data[ds.split]
        elif path.exists() or ds.source.startswith((".", "/", "~")):
            raise DataError(f"{key}.source={ds.source!r}: not a dataset file or saved dataset directory")
        else:
            data = datasets.load_dataset(ds.source, split=ds.split)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one clear message
        raise DataError(f"{key}.source={ds.source!r} (split {ds.split!r}) could not be loaded: "
                        f"{type(e).__name__}: {e}") from e
    yield from enumerate(data, start=1)


_SURROGATE = re.compile("[\ud800-\udfff]")  # lone surrogates: no tokenizer can encode them


def _parse_int(digits: str) -> int | str:
    """JSON integers past Python's int/str digit limit stay as their digit string (an answer
    like 10^5000 written out is still a valid ground truth)."""
    return int(digits) if len(digits) < 4000 else digits


def _answer_text(answer: str | int | float) -> str:
    if isinstance(answer, float) and not math.isfinite(answer):
        raise BadRow("answer_not_finite", f"answer is {answer}")
    if isinstance(answer, int) and abs(answer).bit_length() > 13_000:  # ~3900 digits: str() may refuse
        sign, answer, parts = "-" if answer < 0 else "", abs(answer), []
        while answer:
            answer, r = divmod(answer, 10**1000)
            parts.append(f"{r:01000d}")
        return sign + "".join(reversed(parts)).lstrip("0")
    return str(answer).strip()


def normalise_row(raw: Any, schema: str) -> tuple[str, str]:
    """Raw row -> (prompt, answer). Raises BadRow for a malformed row."""
    if isinstance(raw, BadRow):
        raise raw
    if not isinstance(raw, dict):
        raise BadRow("not_an_object", f"row is a {type(raw).__name__}, not an object")
    if schema == "auto":
        if "reward_model" in raw:
            schema = "dapo"
        elif "prompt" in raw:
            schema = "plain"
        else:
            schema = "aime"
    if schema == "dapo":
        msgs = raw.get("prompt")
        if isinstance(msgs, list):
            user = [m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
            prompt = user[-1] if user else None
        else:
            prompt = msgs
        rm = raw.get("reward_model")
        answer = rm.get("ground_truth") if isinstance(rm, dict) else None
    elif schema == "plain":
        prompt, answer = raw.get("prompt"), raw.get("answer")
    else:  # aime
        prompt = raw.get("problem", raw.get("question"))
        answer = raw.get("answer")
    if prompt is None:
        raise BadRow("missing_prompt", "missing prompt field")
    if not isinstance(prompt, str):
        raise BadRow("prompt_not_string", f"prompt is a {type(prompt).__name__}, not a string")
    if not prompt.strip():
        raise BadRow("empty_prompt", "empty prompt")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise BadRow("missing_answer", "missing answer field")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise BadRow("answer_not_scalar", f"answer is a {type(answer).__name__}, not a string or number")
    if _SURROGATE.search(prompt):
        raise BadRow("invalid_unicode", "prompt holds lone surrogate code points")
    answer = _answer_text(answer)
    if not answer:
        raise BadRow("missing_answer", "missing answer field")
    return prompt, answer


def load_split(data: DataConfig, split: str, tokenizer) -> PromptSet:
    """data.train or data.val ('train' / 'val') through the data section's template, prompt
    length limit and bad-row policy."""
    return load_prompts(getattr(data, split), data.synthetic, key=f"data.{split}", tokenizer=tokenizer,
                        template=data.template, max_prompt_tokens=data.max_prompt_tokens,
                        on_bad_row=data.on_bad_row)


def load_prompts(ds: DatasetConfig, synth: SyntheticConfig, *, key: str, tokenizer, template: str,
                 max_prompt_tokens: int, on_bad_row: str) -> PromptSet:
    """Load, normalise, template and tokenise one dataset. `key` is its config key (data.train)."""
    out = PromptSet(source=ds.source, prompts=[])
    for row, raw in _read_rows(ds, synth, key):
        try:
            prompt, answer = normalise_row(raw, ds.schema)
            ids = tokenizer(apply_template(template, prompt, tokenizer), add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_tokens:
                raise BadRow("prompt_too_long", f"prompt has {len(ids)} tokens, more than "
                             f"data.max_prompt_tokens={max_prompt_tokens}")
        except BadRow as e:
            if on_bad_row == "error":
                raise DataError(f"{ds.source}, row {row}: {e} ({key}, data.on_bad_row=error)") from None
            out.skipped[e.reason] += 1
            continue
        out.prompts.append(Prompt(prompt, answer, ids, row))
        if ds.limit is not None and len(out.prompts) >= ds.limit:
            break
    if not out.prompts:
        raise DataError(f"{key}.source={ds.source!r}: no usable rows (skipped: {dict(out.skipped)})")
    return out


class PromptSampler:
    """Endless seeded epochs over a PromptSet; its position is plain state (epoch, cursor)."""

    def __init__(self, prompts: PromptSet, seed: int, shuffle: bool = True):
        self.prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "size": len(self.prompts)}

    def load_state(self, state: dict) -> None:
        if state.get("partial"):
            raise ValueError("the checkpoint carries unfinished groups of partial rollouts: resume it with "
                             "generation.partial.enabled=true, as it was saved")
        if state["size"] != len(self.prompts) or state["seed"] != self.seed:
            raise ValueError(f"checkpointed data position is for {state['size']} prompts and seed {state['seed']}, "
                             f"this run has {len(self.prompts)} prompts and seed {self.seed}")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)

    def next_batch(self, n: int) -> list[Prompt]:
        batch = []
        while len(batch) < n:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.prompts.prompts[self._order[self.cursor]])
            self.cursor += 1
        return batch
