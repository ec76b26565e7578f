"""Launching torchrun from a cell: the command lines, one agent's whole process tree, and what the ranks wrote.

Used by :mod:`qualification.programs.torchrun_cell`; the rank program is :mod:`qualification.programs.torchrun_rank`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from qualification.programs import _kills
from qualification.programs.specs import spec_argv
from qualification.programs.specs.torchrun import TorchrunSpec

RANK_PROGRAM = "qualification.programs.torchrun_rank"


class Agent:
    """One torchrun agent, its log, and its whole process tree (torchrun gives each worker a session of its own, so
    the agent's process group is not enough: the tree is walked)."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def tree(self) -> list[psutil.Process]:
        try:
            me = psutil.Process(self.proc.pid)
            return [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_tree(self, record: Path | None = None, detail: str = "") -> list[int]:
        """SIGKILL the agent and every descendant at once (collected first, so a dying agent restarts nothing).

        ``record``: this kill is an injected fault; its event (:mod:`qualification.programs._kills`) is written under
        that folder, durably, right before the signals (a cleanup or timeout kill passes none)."""
        procs = self.tree()
        if record is not None:
            _kills.record(
                record,
                rank=None,
                step=None,
                phase="node-loss",
                target_pids=[p.pid for p in procs],
                by="driver",
                detail=detail,
            )
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        self.proc.wait(timeout=10)
        return [p.pid for p in procs]

    def wait(self, deadline: float) -> int | None:
        """The agent's exit code, or None when it is still running at ``deadline`` (then its tree is killed)."""
        try:
            return self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_tree()
            return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env(share_store: bool = True) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def torchrun(
    launch: list[str], out: Path, cell: dict[str, Any], label: str, **fields: Any
) -> list[str]:
    """torchrun's command line: the launch flags, the rank program and the spec file every attempt of every rank
    reads (``out/spec-<label>.json``, kept with the run). ``fields``: further :class:`TorchrunSpec` fields."""
    p = cell.get("params", {})
    spec = TorchrunSpec(
        out=out,
        workload=cell["workload"],
        steps=int(p.get("steps", 8)),
        seed=int(cell.get("seed", 0)),
        timeout_s=float(p.get("rank_timeout_s", 60)),
        find_unused_parameters=bool(p.get("find_unused_parameters", False)),
        step_sleep=float(p["step_sleep"]) if p.get("step_sleep") else 0.0,
        inline_baseline=p.get("baseline", "process") == "inline",
        **fields,
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launch,
        "-m",
        RANK_PROGRAM,
        *spec_argv(spec, out / f"spec-{label}.json"),
    ]


def single_node(world: int, restarts: int) -> list[str]:
    return [
        "--standalone",
        f"--nproc-per-node={world}",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.2",
    ]


def read_results(out: Path, world: int) -> list[dict[str, Any]] | None:
    try:
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    except (OSError, ValueError):
        return None


def attempts(out: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """attempt -> rank -> that attempt's record."""
    found: dict[int, dict[int, dict[str, Any]]] = {}
    for path in sorted((out / "attempts").glob("rank*-attempt*.json")):
        rank, attempt = (int(x) for x in path.stem.removeprefix("rank").split("-attempt"))
        found.setdefault(attempt, {})[rank] = json.loads(path.read_text())
    return found
