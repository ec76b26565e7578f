"""Every FaultReport a rank delivers, kept on disk beside its checkpoints: ``<rank folder>/faults.jsonl``.

A job that dies of the fault it reported (a hang killed by the scheduler, an SDC the operator restarts for) leaves
its reports where ``gemscout inspect`` reads them. One JSON object per line, appended with a single ``write`` on an
``O_APPEND`` descriptor (whole lines from several threads never interleave) and fsynced when the checkpoints are;
past ``max_bytes`` the file rolls to ``faults.jsonl.1`` (one older generation). Readers skip a torn last line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("gemscout")

FILE_NAME = "faults.jsonl"


class FaultLog:
    def __init__(self, path: Path, *, fsync: bool = True, max_bytes: int = 4 << 20) -> None:
        self.path, self.fsync, self.max_bytes = Path(path), fsync, max_bytes
        self._lock = threading.Lock()

    def append(self, report: dict[str, Any]) -> None:
        """Append one report; never raises (a full disk must not break training or a watchdog), logs instead."""
        line = (json.dumps(report, sort_keys=True, separators=(",", ":")) + "\n").encode()
        try:
            with self._lock:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if self.path.exists() and self.path.stat().st_size + len(line) > self.max_bytes:
                    os.replace(self.path, self.path.with_name(FILE_NAME + ".1"))
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, line)
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as exc:
            log.warning("gemscout: cannot record a fault report in %s: %s", self.path, exc)


def read(folder: Path) -> list[dict[str, Any]]:
    """The reports kept in ``folder`` (a rank's folder), oldest first; unreadable lines are skipped."""
    out: list[dict[str, Any]] = []
    for path in (folder / (FILE_NAME + ".1"), folder / FILE_NAME):
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue  # a line torn by a crash mid-write
            if isinstance(doc, dict):
                out.append(doc)
    return out
