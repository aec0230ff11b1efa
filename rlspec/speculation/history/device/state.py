"""The device history's checkpoint (rlspec/speculation/history/device/store.py): its whole sequences, which
load into a store of any settings (inserted afresh), and the ring as it is held (written tokens,
bucket entries, fills, count table, sequence starts), which loads exactly into a store of the same
settings: buckets keep their newest entries and the count table its highest counts insert by
insert, so inserting the sequences again builds another store once a bucket overflows."""
from __future__ import annotations

import numpy as np
import torch

from rlspec.speculation.history.device.ring import EMPTY, END

class RingCheckpoint:
    """DeviceHistory's state_dict and load_state_dict (a base class: the store's own attributes)."""

    def state_dict(self) -> dict:
        """The ring's whole sequences, oldest first, on the host, in the host store's layout
        (history/state.py: per sequence its prompt's salt, its response's length and its stored
        length, [prompt tail | response | END]; the sequences concatenated: arena), and the ring as
        held (exact)."""
        seqs = list(self._ring.seqs.items())
        at = self._positions([(a, n) for a, (n, _, _) in seqs])
        stored = np.array([n for _, (n, _, _) in seqs], np.int64)
        return {"format": "device", "salt": np.array([salt for _, (_, _, salt) in seqs], np.int64).view(np.uint64),
                "tokens": stored - 1 - np.array([h for _, (_, h, _) in seqs], np.int64), "stored": stored,
                "arena": self.tok[at].cpu().numpy().astype(np.int32), "exact": self._held()}

    def _settings(self) -> str:
        """What decides the ring's layout and contents (a held state loads only into its like)."""
        c = self.counts
        return repr((self.capacity, self.n_buckets, self.width, self.prompt_keys, self.max_match,
                     self.max_per_prompt, None if c is None else (c.keys, c.width, c.buckets)))

    def _held(self) -> dict:
        """The ring as it is: its written tokens (blanked answers included), bucket entries, fills,
        count table and sequence starts. Buckets keep their newest entries and the count table its
        highest counts insert by insert, so re-inserting the sequences in one go builds another
        store once a bucket overflows: an exact resume loads these."""
        used = self.stored()
        at = torch.nonzero(self.table.view(-1) != -1)[:, 0]
        fat = torch.nonzero(self.fill)[:, 0]
        return {"settings": self._settings(), "written": self._written,
                "starts": np.array(list(self._ring.seqs), np.int64),
                "tok": self.tok[:used].cpu().numpy(), "pid": self.pid[:used].cpu().numpy(),
                "table_at": at.cpu().numpy(), "table": self.table.view(-1)[at].cpu().numpy(),
                "fill_at": fat.cpu().numpy(), "fill": self.fill[fat].cpu().numpy(),
                "counts": None if self.counts is None else self.counts.held()}

    def _load_held(self, held: dict, salts, sizes, heads) -> None:
        dev, used = self.device, len(held["tok"])
        self.tok[:used] = torch.from_numpy(np.asarray(held["tok"], np.int32)).to(dev)
        self.pid[:used] = torch.from_numpy(np.asarray(held["pid"], np.int64)).to(dev)
        self.table.view(-1)[torch.from_numpy(np.asarray(held["table_at"], np.int64)).to(dev)] = \
            torch.from_numpy(np.asarray(held["table"], np.int64)).to(dev)
        self.fill[torch.from_numpy(np.asarray(held["fill_at"], np.int64)).to(dev)] = \
            torch.from_numpy(np.asarray(held["fill"], np.int64)).to(dev)
        self._written = int(held["written"])
        self.written.fill_(self._written)
        for a, n, h, salt in zip(np.asarray(held["starts"]).tolist(), sizes.tolist(), heads.tolist(), salts.tolist()):
            self._ring.add(a, n, h, salt)
        if self.counts is not None:
            self.counts.load_held(held["counts"])

    def load_state_dict(self, state: dict) -> None:
        """A saved ring (state_dict): as it was held where this store has its settings (the same
        drafts after a resume); else (other settings, several engines' states merged by
        history.state.merge_states) its sequences inserted afresh: past capacity, the newest stay."""
        tokens = np.asarray(state["arena"], np.int32)
        sizes = np.asarray(state["stored"], np.int64)
        salts = np.asarray(state["salt"], np.uint64).view(np.int64)
        lengths = np.asarray(state["tokens"], np.int64)
        if len(sizes) != len(salts) or len(lengths) != len(sizes):
            raise ValueError("device history state: sequences and tokens do not agree")
        heads = sizes - 1 - lengths
        if int(sizes.sum()) != len(tokens) or \
                (len(sizes) and (not np.all(tokens[np.cumsum(sizes) - 1] == END) or heads.min() < 0)):
            raise ValueError("device history state: sequences and tokens do not agree")
        self.tok = torch.full_like(self.tok, EMPTY)
        self.pid, self.table, self.fill = torch.zeros_like(self.pid), torch.full_like(self.table, -1), \
            torch.zeros_like(self.fill)
        self._written = 0
        self.written.fill_(0)
        self._ring.clear()
        if self.counts is not None:
            self.counts.clear()
        held = state.get("exact")
        if held is not None and held["settings"] == self._settings() and len(held["starts"]) == len(sizes):
            self._load_held(held, salts, sizes, heads)
        elif len(sizes):
            bodies = np.split(tokens.astype(np.int64), np.cumsum(sizes)[:-1])
            self._insert(torch.from_numpy(salts).to(self.device), bodies, heads.tolist())
