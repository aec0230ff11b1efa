"""The host's record of the device history's ring (rlspec/speculation/history/device/store.py): its whole
sequences in ring order, each with its size, prompt-tail length and prompt, and per prompt its
sequences oldest first (inserts are planned here; the tensors stay on the device)."""
from __future__ import annotations

from collections import deque


END = -1      # a stored sequence's last token
EMPTY = -3    # an arena slot never written


class RingSequences:
    def __init__(self):
        self.seqs: dict[int, tuple[int, int, int]] = {}  # start -> (size, head, prompt salt), oldest first
        self.by_prompt: dict[int, deque] = {}             # prompt salt -> its sequences' starts, oldest first

    def add(self, start: int, size: int, head: int, salt: int) -> None:
        self.seqs[start] = (size, head, salt)
        self.by_prompt.setdefault(salt, deque()).append(start)

    def forget(self, start: int) -> tuple[int, int, int]:
        """A sequence leaves the record: its (start, size, head)."""
        n, h, salt = self.seqs.pop(start)
        starts = self.by_prompt[salt]
        starts.remove(start)
        if not starts:
            del self.by_prompt[salt]
        return start, n, h

    def starting_before(self, position: int) -> list[tuple[int, int, int]]:
        """The sequences starting before `position` (those a write from there overwrites), forgotten."""
        gone = []
        while self.seqs and next(iter(self.seqs)) < position:
            gone.append(self.forget(next(iter(self.seqs))))
        return gone

    def over_bound(self, max_per_prompt: int) -> list[tuple[int, int, int]]:
        """Each prompt's oldest sequences past max_per_prompt, forgotten."""
        over = [(salt, len(starts) - max_per_prompt) for salt, starts in self.by_prompt.items()
                if len(starts) > max_per_prompt]
        return [self.forget(self.by_prompt[salt][0]) for salt, n in over for _ in range(n)]

    def clear(self) -> None:
        self.seqs.clear()
        self.by_prompt.clear()
