"""What a run is made of: its fixed parts (config, actors, data, log), built once, apart from its
mutable state (typed counters), which checkpoints carry."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from rlspec.cluster.launch import Actors
from rlspec.config import RLSpecConfig
from rlspec.data.loading import PromptSet
from rlspec.loops.preemption import StopRequest
from rlspec.loops.runlog import RunLog


@dataclass
class Run:
    """The fixed parts of a run."""
    cfg: RLSpecConfig
    actors: Actors
    tokenizer: object
    train: PromptSet
    val: PromptSet
    log: RunLog
    ckpt_root: str | None = None         # trainer.checkpoint_dir, resolved
    stop: StopRequest = field(default_factory=StopRequest)


@dataclass
class Counters:
    """The driver's mutable state besides the data position, RNGs and the log."""
    nonfinite_steps: int = 0          # updates skipped for a non-finite loss or gradient, in all
    nonfinite_in_row: int = 0         # ... in a row, up to the last step
    restarts: int = 0                 # restarts after an actor failure (not restored on resume)
    draft_head_version: int = 0       # the policy version at the head's last push (0: the initial head)
    draft_head_data_version: int = 0  # the newest policy version the pushed head trained on

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Counters":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
