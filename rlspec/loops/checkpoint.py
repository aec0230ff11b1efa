"""Checkpoints: one directory per step under trainer.checkpoint_dir, written atomically.

    checkpoints/
      step_00000004/        learner/ (DeepSpeed: weights, optimizer, scheduler, per rank),
                            reference.pt (KL reference policy, when on), draft.pt (online-
                            trained draft head and its optimizer, when on), history_E.pt
                            (speculation=history: engine E's store), driver.pt (data-loader
                            position, driver RNGs, run log, counters), queued.pt (async: the
                            results of the calls out at the save), config.json, COMPLETE
      step_00000008/
      latest                "step_00000008", written last

Every part is written into `.tmp-step_N-<pid>/`, fsynced, and the directory renamed into place;
only then is `latest` replaced (write, fsync, rename, fsync of the directory). A driver killed at
any moment leaves the previous checkpoint and pointer intact; a half-written temp directory is
never read and is removed by the next save. The oldest complete directories beyond
trainer.checkpoint_keep are deleted after the pointer moves.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlspec.cluster.calls import wait
from rlspec.cluster.launch import Actors
from rlspec.config import ConfigError
from rlspec.loops.runlog import RunLog
from rlspec.loops.state import Counters
from rlspec.messages import StepRecord

LATEST = "latest"
COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class DriverState:
    """Everything the driver itself owns at the end of a step."""
    step: int                      # last finished step; the policy version equals it
    sampler: dict                  # PromptSampler.state()
    rng: dict                      # python / numpy / torch states of the driver process
    records: list[dict]            # RunLog step records so far (summary.json continues)
    val: list[tuple[int, float]]   # RunLog validations so far
    counters: dict = field(default_factory=dict)  # restarts, non-finite steps, ...


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(root: str | Path, step: int) -> Path:
    """A fresh temporary directory for the parts of checkpoint `step`; stale ones are removed."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def write_driver_parts(tmp: Path, state: DriverState, config: dict) -> None:
    torch.save(state.__dict__, tmp / "driver.pt")
    (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str) + "\n")


def commit(root: str | Path, tmp: Path, step: int, keep: int) -> Path:
    """Make the checkpoint in `tmp` visible as step_N and point `latest` at it."""
    root = Path(root)
    (tmp / COMPLETE).write_text(f"{step}\n")
    _fsync_tree(tmp)
    final = root / step_dir_name(step)
    if final.exists():  # a re-save of the same step (e.g. preemption right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = root / f".{LATEST}.tmp"
    with open(pointer, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    prune(root, keep, protect=final)
    return final


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if _STEP_DIR.match(d.name) and (d / COMPLETE).is_file()]
    return sorted(dirs, key=lambda d: d.name)


def prune(root: Path, keep: int, protect: Path) -> None:
    dirs = complete_checkpoints(root)
    for d in dirs[:max(len(dirs) - keep, 0)]:
        if d != protect:
            shutil.rmtree(d, ignore_errors=True)


def latest(root: str | Path) -> Path | None:
    """The checkpoint `latest` names if it is complete, else the newest complete one, else None."""
    root = Path(root)
    try:
        named = root / (root / LATEST).read_text().strip()
        if _STEP_DIR.match(named.name) and (named / COMPLETE).is_file():
            return named
    except OSError:
        pass
    dirs = complete_checkpoints(root)
    return dirs[-1] if dirs else None


def read_driver_state(ckpt: Path) -> DriverState:
    return DriverState(**torch.load(ckpt / "driver.pt", weights_only=False))


def read_queued(ckpt: Path) -> list[dict]:
    """The async calls a checkpoint saved with their results ([] where it saved none)."""
    path = ckpt / "queued.pt"
    return torch.load(path, weights_only=False) if path.is_file() else []


def resolve_resume(resume: str, root: str | Path) -> Path | None:
    """trainer.resume -> the checkpoint to load: 'never' -> None; 'auto' -> latest(root) or None;
    a path -> that checkpoint directory (or the latest inside a checkpoint root)."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(root)
    path = Path(resume).expanduser()
    if (path / COMPLETE).is_file():
        return path
    found = latest(path)
    if found is None:
        raise ConfigError(f"trainer.resume={resume!r}: no complete checkpoint there")
    return found


# -- the whole run: driver state plus every actor's part ----------------------------------------
class Checkpointer:
    """Saves the run's state after a step, and restores it into the actors and the driver
    (actors must be idle or waiting on this)."""

    def __init__(self, root: str | Path, keep: int, actors: Actors, log: RunLog, config: dict):
        self.root, self.keep, self.actors, self.log, self.config = Path(root), keep, actors, log, config

    def save(self, position: dict, step: int, counters: Counters, queued: list[dict] = ()) -> Path:
        """Checkpoint of the state after `step`; position: the data position (sampler state) a
        resume continues from; queued: async, the calls out with their results
        (RolloutQueue.checkpoint), which the resumed run trains on before drawing from `position`."""
        done = self.root / step_dir_name(step)
        if (done / COMPLETE).is_file() and latest(self.root) == done:
            return done  # this very state is on disk already (a preemption right after a save)
        tmp = begin(self.root, step)
        a = self.actors
        wait([*a.learners.save_checkpoint(str(tmp)), *a.logprobs.save_reference(str(tmp / "reference.pt")),
              *([a.draft_trainer.save(str(tmp / "draft.pt"))] if a.draft_trainer is not None else []),
              *(a.generators.save_history(str(tmp)) if a.generators.sticky else [])],
             a.timeout_s)
        state = DriverState(step=step, sampler=position, rng=rng_state(), records=[asdict(r) for r in self.log.records],
                            val=list(self.log.val), counters=counters.as_dict())
        write_driver_parts(tmp, state, self.config)
        if queued:
            torch.save(list(queued), tmp / "queued.pt")
        final = commit(self.root, tmp, step, self.keep)
        self.log.write(f"checkpoint: step {step} -> {final}")
        return final

    def restore(self, ckpt: Path, sampler) -> tuple[DriverState, Counters]:
        """Load `ckpt` into the actors and the driver; the refit then puts its policy (and
        the online-trained draft head) into every engine and log-prob worker."""
        a = self.actors
        state = read_driver_state(ckpt)
        wait([*a.learners.load_checkpoint(str(ckpt)), *a.logprobs.load_reference(str(ckpt / "reference.pt"))],
             a.timeout_s)
        a.refit.run(state.step)
        if a.draft_trainer is not None and (ckpt / "draft.pt").is_file():
            # the online-trained head (its optimizer too); its feature cache refills from new rollouts
            wait(a.draft_trainer.load(str(ckpt / "draft.pt")), a.timeout_s)
            a.refit.draft(a.draft_trainer, state.step)
        if a.generators.sticky:  # speculation=history: the drafter's store, so drafting pays at once
            wait(a.generators.load_history(str(ckpt)), a.timeout_s)
        sampler.load_state(state.sampler)
        set_rng_state(state.rng)
        self.log.records = [StepRecord(**r) for r in state.records]
        self.log.val = [tuple(v) for v in state.val]
        if self.log.bar is not None:
            self.log.bar.update(state.step)
        self.log.write(f"resumed from {ckpt} (step {state.step})")
        return state, Counters.from_dict(state.counters)
