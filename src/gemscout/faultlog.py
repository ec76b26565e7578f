"""Every FaultReport a rank delivers, kept on disk beside its checkpoints: ``<rank folder>/faults.jsonl``.

A job that dies of the fault it reported (a hang killed by the scheduler, an SDC the operator restarts for) leaves
its reports where ``gemscout inspect`` reads them. One JSON object per line, appended with a single ``write`` on an
``O_APPEND`` descriptor (whole lines from several threads never interleave) and fsynced when the checkpoints are;
past ``max_bytes`` the file rolls to ``faults.jsonl.1`` (one older generation). Readers skip a torn last line.

With the job's integrity key every line carries a MAC bound to its rank folder (:mod:`gemscout.record_mac`);
readers with the key skip (and count, in one log line) every line without a valid one, so a report written by
someone without the key — a forged hang, a forged SDC naming a healthy rank — never reaches ``gemscout inspect``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from gemscout import record_mac
from gemscout.errors import ConfigError, EvidenceError, IntegrityError
from gemscout.files import is_int, parse_json, read_bounded
from gemscout.state import integrity

log = logging.getLogger("gemscout")
MAX_READ_BYTES = 64 << 20

FILE_NAME = "faults.jsonl"


class FaultLog:
    def __init__(self, path: Path, *, fsync: bool = True, max_bytes: int = 4 << 20) -> None:
        self.path, self.fsync, self.max_bytes = Path(path), fsync, max_bytes
        self._lock = threading.Lock()

    def append(self, report: dict[str, Any]) -> None:
        """Append one report; never raises (a full disk must not break training or a watchdog), logs instead."""
        try:
            signed = record_mac.sign(report, _scope(self.path.parent))
        except (
            Exception
        ) as exc:  # an unreadable key file: keep the report unsigned rather than lose it
            log.warning("gemscout: fault report kept without a MAC: %s", exc)
            signed = report
        line = (json.dumps(signed, sort_keys=True, separators=(",", ":")) + "\n").encode()
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


def _scope(folder: Path) -> str:
    return record_mac.rank_scope(FILE_NAME, folder)


def read(folder: Path) -> list[dict[str, Any]]:
    """The JSON objects kept in ``folder`` (a rank's folder), oldest first. A torn last line, a line of junk or one
    nested past the depth cap is skipped, and so is a file that is not a regular file or is over
    ``MAX_READ_BYTES`` (logged). With the job's integrity key, a line without a valid MAC is skipped too (counted
    in one log line); without one, a line that carries a MAC is kept (nothing here can verify it). Never raises."""
    out: list[dict[str, Any]] = []
    scope, refused = _scope(folder), 0
    try:
        keyed = integrity.current_key() is not None
    except ConfigError as exc:  # the key setting cannot be read: nothing can be told authentic
        log.warning("gemscout: fault log of %s skipped: %s", folder, exc)
        return out
    for path in (folder / (FILE_NAME + ".1"), folder / FILE_NAME):
        try:
            text = read_bounded(path, MAX_READ_BYTES)
        except (OSError, IntegrityError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("gemscout: fault log %s skipped: %s", path, exc)
            continue
        for line in text.splitlines():
            try:
                doc = parse_json(line, f"a line of {path}")
            except IntegrityError:
                continue  # a line torn by a crash mid-write
            if not isinstance(doc, dict):
                continue
            if keyed:
                try:
                    record_mac.check(doc, scope, f"a line of {path}")
                except IntegrityError:
                    refused += 1
                    continue
            out.append({k: v for k, v in doc.items() if k != record_mac.FIELD})
    if refused:
        log.warning(
            "gemscout: fault log of %s: %d line(s) without a valid MAC under this job's integrity key skipped "
            "(written without the key: forged, or another rank's)",
            folder,
            refused,
        )
    return out


def read_reports(folder: Path) -> list[dict[str, Any]]:
    """:func:`read`, keeping only whole, valid reports: :meth:`FaultReport.from_dict` accepts the line (a string
    timestamp, a missing field, a bad kind are not a report) and ``reported_by``, when present, is a rank. Each in
    its canonical dict form. Never raises."""
    from gemscout.reports import (
        FaultReport,
    )  # the report type is SCOUT's; only this reader needs it

    out: list[dict[str, Any]] = []
    for doc in read(folder):
        by = doc.get("reported_by")
        if by is not None and not is_int(by):
            continue
        try:
            report = FaultReport.from_dict({k: v for k, v in doc.items() if k != "reported_by"})
        except EvidenceError:
            continue
        out.append({**report.to_dict(), **({"reported_by": by} if by is not None else {})})
    return out
