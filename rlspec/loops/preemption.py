"""Signals that end or pause a run cleanly.

SIGTERM / SIGUSR1 (what slurm sends before it kills a job): the driver abandons the current step
if it has not reached the update yet (its rollouts are redone identically after the resume), or
else finishes it, writes a checkpoint and exits with EXIT_PREEMPTED so the batch script requeues.
SIGUSR2: write a checkpoint after the current step and go on."""
from __future__ import annotations

import signal
from dataclasses import dataclass

EXIT_PREEMPTED = 3
EXIT_NUMERICAL = 4


class Preempted(Exception):
    """Raised once the preemption checkpoint is written; `step` is the step it holds."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"{signal_name}: checkpoint of step {step} written")
        self.step = step


class NumericalDivergence(Exception):
    """Too many non-finite updates in a row; a checkpoint of the last good state was written."""


@dataclass
class StopRequest:
    preempt_signal: str | None = None   # name of the signal that asked the run to stop
    checkpoint_now: bool = False        # SIGUSR2: checkpoint after this step and continue

    @property
    def preempt(self) -> bool:
        return self.preempt_signal is not None

    def install(self) -> "StopRequest":
        """Handle the signals in this (main) thread; the handlers only set flags."""
        def stop(signum, frame):
            self.preempt_signal = signal.Signals(signum).name

        def save(signum, frame):
            self.checkpoint_now = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGUSR1, stop)
        signal.signal(signal.SIGUSR2, save)
        return self
