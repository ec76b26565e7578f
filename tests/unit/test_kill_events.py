"""The SIGKILL's own record (qualification.programs._kills): written durably before the signal, read back in order.

Real processes and real SIGKILLs: a child that records and kills itself leaves exactly one record, naming its own pid,
with a wall time inside the child's lifetime. No torch in the children, so each case costs a fraction of a second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qualification.programs import _kills

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def _child(code: str, out: Path) -> tuple[subprocess.CompletedProcess[str], float, float]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    before = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(out)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    return proc, before, time.time()


def test_a_rank_that_kills_itself_leaves_its_record(tmp_path: Path) -> None:
    proc, before, after = _child(
        """
        import os, sys
        from pathlib import Path
        from qualification.programs._kills import sigkill_self
        print(os.getpid(), flush=True)
        sigkill_self(Path(sys.argv[1]), rank=3, step=7, phase="after-step", attempt=0)
        print("survived", flush=True)
    """,
        tmp_path,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "survived" not in proc.stdout
    (event,) = _kills.read(tmp_path)
    pid = int(proc.stdout.split()[0])
    assert event["target_pids"] == [pid] and event["killer_pid"] == pid and event["by"] == "self"
    assert (event["rank"], event["step"], event["phase"], event["attempt"]) == (
        3,
        7,
        "after-step",
        0,
    )
    assert before <= event["wall"] <= after
    assert _kills.describe(event) == "SIGKILL rank 3 at step 7 (after-step, attempt 0)"


def test_a_timed_kill_records_when_it_fires_not_when_it_was_armed(tmp_path: Path) -> None:
    proc, before, _ = _child(
        """
        import sys, time
        from pathlib import Path
        from qualification.programs._kills import sigkill_self_later
        armed = time.time()
        print(armed, flush=True)
        sigkill_self_later(Path(sys.argv[1]), 0.3, rank=1, step=2, phase="random:300")
        time.sleep(20)
    """,
        tmp_path,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (event,) = _kills.read(tmp_path)
    assert event["wall"] >= float(proc.stdout.split()[0]) + 0.3 and event["phase"] == "random:300"


def test_records_read_oldest_first_and_become_fault_events(tmp_path: Path) -> None:
    first = _kills.record(tmp_path, rank=1, step=4, phase="after-step", target_pids=[11])
    second = _kills.record(
        tmp_path,
        rank=None,
        step=None,
        phase="node-loss",
        target_pids=[21, 22],
        by="driver",
        detail="node 1's agent and workers",
    )
    assert [e["wall"] for e in _kills.read(tmp_path)] == [first["wall"], second["wall"]]
    events = _kills.timeline_events(_kills.read(tmp_path), wall0=first["wall"] - 2.0)
    assert events[0] == {
        "t": 2.0,
        "event": "fault",
        "detail": "SIGKILL rank 1 at step 4 (after-step)",
        "rank": 1,
    }
    assert events[1]["event"] == "fault" and "rank" not in events[1]
    assert (
        events[1]["detail"]
        == "SIGKILL pids [21, 22] (node-loss) by driver; node 1's agent and workers"
    )


def test_nothing_recorded_reads_empty_and_a_torn_record_is_ignored(tmp_path: Path) -> None:
    assert _kills.read(tmp_path) == []
    _kills.record(tmp_path, rank=0, step=1, phase="in-step", target_pids=[5])
    (tmp_path / _kills.FOLDER / "sigkill-9-9.json").write_text(
        '{"event": "sigkill", "wa'
    )  # cut short
    (tmp_path / _kills.FOLDER / "sigkill-8-8.json").write_text(
        json.dumps({"event": "sigkill"})
    )  # no time
    assert [e["rank"] for e in _kills.read(tmp_path)] == [0]
