"""Fail-stop faults as one object: the SIGKILLs and the SIGTERM a rank program injects into its own run.

The numerical faults (:mod:`qualification.faults`) corrupt what a rank computes; these end the process. A rank
program builds a :class:`FailStop` from its spec (``kill_rank``, ``kill_step``, ``kill_phase``, ``kill_seed``,
``sigterm_step``: :class:`qualification.programs.specs.common.FailStopSpec`) and calls it at the points of its step
where a phase can land; each call does nothing unless this rank, this step and this phase are the ones asked for.

Phases: ``capture`` (inside GEMINI's capture, from the caller-state callback: :meth:`FailStop.in_capture`),
``persist``, ``replicate``, ``persist_replica`` (on GEMINI's io thread through its phase hook: :meth:`FailStop.arm_io`),
``in-step`` (between backward and the optimizer step: :meth:`FailStop.in_step`), ``after-step`` (the step's capture
drained first, so the process dies before the next step) and ``random:<max_ms>`` (a timer fires a seeded random
delay after the step, wherever the rank then is: both :meth:`FailStop.after_step`). Every SIGKILL is recorded under
``out`` before it is sent (:mod:`qualification.programs._kills`). ``sigterm_step``: rank 0 sends itself SIGTERM after
that step; GEMINI's handler flushes and re-raises, so the process ends there.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualification.programs._kills import sigkill_self, sigkill_self_later

IO_PHASES = ("persist", "replicate", "persist_replica")


@dataclass(frozen=True, slots=True)
class FailStop:
    """The fail-stop faults of one rank's run (see the module docstring for the phases)."""

    out: Path
    rank: int
    kill_rank: int = -1
    kill_step: int = -1
    phase: str = "after-step"
    seed: int = 0
    """Seeds a ``random:<max_ms>`` kill's delay."""
    sigterm_step: int = -1
    attempt: int | None = None
    """Recorded with each kill (torchrun's restart count); None outside torchrun."""
    armed: bool = True
    """False: no kill fires in this attempt (torchrun's ``kill_attempt`` names the one that kills)."""

    @classmethod
    def of(cls, spec: Any, rank: int, **overrides: Any) -> FailStop:
        """From a spec's fail-stop fields; a spec without ``kill_phase``, ``kill_seed`` or ``sigterm_step`` gets
        the defaults. ``overrides`` replace any field (``seed=spec.seed``, ``attempt=...``, ``armed=...``)."""
        fields: dict[str, Any] = {
            "out": spec.out,
            "rank": rank,
            "kill_rank": spec.kill_rank,
            "kill_step": spec.kill_step,
            "phase": getattr(spec, "kill_phase", "after-step"),
            "seed": getattr(spec, "kill_seed", 0),
            "sigterm_step": getattr(spec, "sigterm_step", -1),
        }
        return cls(**(fields | overrides))

    @property
    def killer(self) -> bool:
        """This rank is the one to SIGKILL (in this attempt)."""
        return self.armed and self.rank == self.kill_rank

    def _due(self, step: int | None, phase: str) -> bool:
        return self.killer and step == self.kill_step and self.phase == phase

    def _kill(self, step: int | None, phase: str) -> None:
        sigkill_self(self.out, rank=self.rank, step=step, phase=phase, attempt=self.attempt)

    def in_capture(self, session: Any) -> None:
        """Call from the caller-state callback (``extra_state_fn``): ``capture`` kills inside the capture of
        ``kill_step``."""
        if session is not None and self._due(session.step, "capture"):
            self._kill(self.kill_step, "capture")

    def arm_io(self, session: Any) -> None:
        """Call once after ``enable_resiliency``: an io phase kills on GEMINI's io thread as the capture of
        ``kill_step`` reaches it. Replaces the checkpointer's phase hook, so call it after any other."""
        if not (self.killer and self.phase in IO_PHASES and session.checkpointer):
            return

        def hook(phase: str, step: int) -> None:
            if phase == self.phase and step == self.kill_step:
                self._kill(step, phase)

        session.checkpointer.phase_hook = hook

    def in_step(self, step: int) -> None:
        """Call between backward and the optimizer step."""
        if self._due(step, "in-step"):
            self._kill(step, "in-step")

    def after_step(self, session: Any, step: int) -> None:
        """Call after the step's optimizer update (and its capture): ``after-step``, ``random:<max_ms>`` and the
        SIGTERM."""
        if self.killer and step == self.kill_step:
            if self.phase == "after-step":
                if session is not None and session.checkpointer is not None:
                    session.checkpointer.drain()  # the step's checkpoint is out; the process dies before the next
                self._kill(step, "after-step")
            elif self.phase.startswith("random:"):
                delay = random.Random(self.seed).uniform(0, float(self.phase.split(":")[1]) / 1000)
                sigkill_self_later(
                    self.out,
                    delay,
                    rank=self.rank,
                    step=step,
                    phase=self.phase,
                    attempt=self.attempt,
                )
        if self.rank == 0 and step == self.sigterm_step:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler flushes and re-raises; the process never gets here
