"""Experiment tracking shared by the RL loop's run log (rlspec/loops/runlog.py) and the offline
draft trainer (rlspec/draft/train.py): a wandb run and a progress bar, as logging.* says."""
from __future__ import annotations

import os
from pathlib import Path

from rlspec.config import LoggingConfig


def progress_bar(log: LoggingConfig, total: int, desc: str):
    """A tqdm bar when logging.progress_bar is on, else None."""
    if not log.progress_bar:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)


def open_wandb(log: LoggingConfig, run_dir: str | Path, config: dict, job_type: str | None = None):
    """A wandb run in logging.wandb_mode (offline by default: no network), or None when disabled."""
    if log.wandb_mode == "disabled":
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    return wandb.init(project=log.wandb_project, entity=log.wandb_entity, mode=log.wandb_mode, dir=str(run_dir),
                      config=config, job_type=job_type, settings=wandb.Settings(console="off"))
