"""Run cells as isolated process trees, have each judged, and write the campaign summary.

Each cell gets ``<out>/cells/<safe-id>/`` holding ``cell.json`` (its input), ``log.txt`` (stdout + stderr of the whole
tree) and ``result.json`` (written by the program). The driver is ``python -m qualification.programs.<program>`` in a
session of its own; at its timeout the whole tree is terminated (SIGTERM, grace, SIGKILL), and after every cell a
sweep ends any process the cell left behind. One cell's failure, crash or hang never hides another's result.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

from qualification import _proctree
from qualification.campaign import REPO_ROOT, Campaign, Cell
from qualification.outcome import CellOutcome, Verdict, iso, judge, now, relative

SUMMARY_VERSION = 2
"""2: ``scope``, claim records in ``boundaries``, the ``measured`` count and verdicts."""


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineOptions:
    """How cells are run."""

    jobs: int = 1
    """Cells run at once; capped at ``os.cpu_count()``."""
    grace: timedelta = timedelta(seconds=5)
    """Between SIGTERM and SIGKILL when a cell is terminated."""
    python: str = sys.executable
    """The interpreter that runs each driver; the one running ``qualify`` unless told otherwise."""
    cwd: Path = field(
        default_factory=lambda: (
            REPO_ROOT if (REPO_ROOT / "pyproject.toml").is_file() else Path.cwd()
        )
    )
    """Working directory of every driver: the checkout (editable install), else where ``qualify`` was started."""


def run_cells(
    cells: Sequence[Cell],
    out_dir: Path,
    options: EngineOptions = EngineOptions(),
    *,
    on_start: Callable[[Cell], None] | None = None,
    on_finish: Callable[[CellOutcome], None] | None = None,
) -> list[CellOutcome]:
    """Run every cell, up to ``options.jobs`` at once; return their outcomes in the order of ``cells``.

    Blocks until every cell has finished, timed out or been skipped. On KeyboardInterrupt every running tree is
    terminated before the interrupt propagates. The callbacks run on worker threads.
    """
    runner = _Runner(out_dir, options, on_start, on_finish)
    jobs = max(1, min(options.jobs, os.cpu_count() or 1))
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="cell")
    try:
        futures = [pool.submit(runner.run, cell) for cell in cells]
        return [f.result() for f in futures]
    except KeyboardInterrupt:
        runner.stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def prepare_out_dir(out_dir: Path, campaign: Campaign) -> None:
    """Create the run directory (it must be absent or empty) and copy the campaign file into it byte for byte."""
    from qualification.errors import UsageError

    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UsageError(f"--out {out_dir} exists and is not empty; evidence is never overwritten")
    (out_dir / "cells").mkdir(parents=True, exist_ok=True)
    (out_dir / "campaign.toml").write_bytes(campaign.source)


def build_summary(
    campaign: Campaign,
    outcomes: Sequence[CellOutcome],
    *,
    started_at: datetime,
    finished_at: datetime,
    invocation: dict[str, Any],
) -> dict[str, Any]:
    """The content of ``summary.json``: campaign, scope, boundaries as this run backs them, counts, verdict and one
    record per cell.

    ``invocation`` holds ``filter`` and ``seed_override`` (None when unused): they narrow the run, so they decide its
    scope. The verdict is :func:`campaign_verdict` of the counts."""
    from qualification.claims import evaluate, scope_of

    counts = {v.value: sum(o.verdict is v for o in outcomes) for v in Verdict}
    scope = scope_of(
        campaign,
        outcomes,
        filter_expr=invocation.get("filter"),
        seed_override=invocation.get("seed_override"),
    )
    return {
        "summary_version": SUMMARY_VERSION,
        "campaign": {
            "name": campaign.name,
            "tier": campaign.tier,
            "description": campaign.description,
            "file": "campaign.toml",
            "source_path": str(campaign.path),
        },
        "scope": scope.to_json(),
        "boundaries": evaluate(campaign, outcomes, scope),
        "started_at": iso(started_at),
        "finished_at": iso(finished_at),
        "duration_s": round((finished_at - started_at).total_seconds(), 3),
        "invocation": invocation,
        "counts": {"total": len(outcomes), **counts},
        "verdict": campaign_verdict(counts),
        "cells": [o.to_json() for o in outcomes],
    }


def campaign_verdict(counts: dict[str, int]) -> str:
    """``failed`` if a cell failed; ``skipped`` if nothing ran (it proves nothing); ``passed-with-skips`` if any cell
    was skipped; ``measured`` if only measurement cells ran; else ``passed``. Measured cells never make a campaign
    PASSED on their own: a measurement is read, not passed."""
    if counts.get("failed", 0):
        return "failed"
    if not counts.get("passed", 0) and not counts.get("measured", 0):
        return "skipped"
    if counts.get("skipped", 0):
        return "passed-with-skips"
    if not counts.get("passed", 0):
        return "measured"
    return "passed"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write canonical JSON (sorted keys, trailing newline) via a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def unmet_requirement(requirement: str) -> str | None:
    """Why ``requirement`` is not met on this machine, or None when it is.

    ``gpu`` / ``gpu:N``: CUDA devices; ``torchtitan_cpu``: the separate TorchTitan interpreter
    (:mod:`qualification.frameworks.titan_env`: ``$GEMSCOUT_TT_PYTHON`` or ``.venv-tt``) has torchtitan 0.3.0;
    anything else: a module importable by this interpreter."""
    return _probe(requirement)


@cache
def _probe(requirement: str) -> str | None:
    name, _, count = requirement.partition(":")
    if name in ("gpu", "cuda"):
        need = int(count or 1)
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return None if have >= need else f"needs {need} CUDA device(s), this machine has {have}"
    if name == "torchtitan_cpu":  # runs in another interpreter: the main one never has torchtitan
        from qualification.frameworks import titan_env

        return titan_env.unavailable()
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        found = False
    return None if found else f"needs module {name}, which is not installed"


class _Runner:
    def __init__(
        self,
        out_dir: Path,
        options: EngineOptions,
        on_start: Callable[[Cell], None] | None,
        on_finish: Callable[[CellOutcome], None] | None,
    ) -> None:
        self.out_dir = out_dir.resolve()
        self.options = options
        self.on_start = on_start
        self.on_finish = on_finish
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def run(self, cell: Cell) -> CellOutcome:
        if self.on_start:
            self.on_start(cell)
        outcome = self._run(cell)
        if self.on_finish:
            self.on_finish(outcome)
        return outcome

    def stop(self) -> None:
        self.stopping.set()
        with self.lock:
            running = list(self.running.items())
        for token, proc in running:
            _proctree.terminate(proc, token, grace=timedelta(seconds=1))

    def _run(self, cell: Cell) -> CellOutcome:
        for requirement in cell.requires:
            why = unmet_requirement(requirement)
            if why:
                return CellOutcome(
                    cell=cell, verdict=Verdict.SKIPPED, reason=f"requires {requirement}: {why}"
                )
        module = f"qualification.programs.{cell.program}"
        if importlib.util.find_spec(module) is None:
            return CellOutcome(
                cell=cell, verdict=Verdict.FAILED, reason=f"program module {module} does not exist"
            )
        if self.stopping.is_set():
            return CellOutcome(
                cell=cell, verdict=Verdict.FAILED, reason="not run: the campaign was interrupted"
            )

        cell_dir = self.out_dir / "cells" / cell.safe_id
        cell_dir.mkdir(parents=True, exist_ok=True)
        write_json(cell_dir / "cell.json", cell.to_json())
        argv = [
            self.options.python,
            "-m",
            module,
            "--cell",
            str(cell_dir / "cell.json"),
            "--out",
            str(cell_dir),
        ]
        token = uuid.uuid4().hex
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "GEMSCOUT_CELL_ID": cell.id,
            _proctree.TOKEN_VAR: token,
        }
        started_at, t0 = now(), time.monotonic()
        with open(cell_dir / "log.txt", "wb") as log:
            proc = subprocess.Popen(
                argv,
                cwd=self.options.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            with self.lock:
                self.running[token] = proc
            try:
                proc.wait(timeout=cell.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            # Runs after a clean exit too: ranks a driver left behind must not leak into the next cell.
            swept = _proctree.terminate(proc, token, grace=self.options.grace)
            with self.lock:
                self.running.pop(token, None)
        duration = time.monotonic() - t0
        outcome = CellOutcome(
            cell=cell,
            verdict=Verdict.FAILED,
            reason="",
            duration_s=duration,
            pid=proc.pid,
            exit_code=proc.returncode,
            timed_out=timed_out,
            argv=argv,
            cwd=str(self.options.cwd),
            log=relative(cell_dir / "log.txt", self.out_dir),
            result_file=None,
            started_at=started_at,
            finished_at=now(),
            swept_pids=swept,
        )
        judge(outcome, cell_dir, self.out_dir)
        if self.stopping.is_set() and outcome.verdict is Verdict.FAILED:
            outcome.reason = f"interrupted by the user: {outcome.reason}"
        return outcome
