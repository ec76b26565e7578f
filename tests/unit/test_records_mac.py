"""The trust ledger and the fault log under the job's integrity key (real files): a record written without the key,
under another key, edited after signing, or copied from another rank's folder is refused with IntegrityError (the
ledger loads empty and names why; the fault-log reader skips the line); a process without the key refuses a signed
ledger naming the setting; an unkeyed job reads and writes as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemscout import faultlog, record_mac
from gemscout.config import TrustState
from gemscout.errors import IntegrityError
from gemscout.gemini.lifecycle import TrustLedger
from gemscout.state import integrity

KEY = bytes(range(32))  # the key the conftest's ``keyed`` fixture sets
REPORT = {
    "version": 1,
    "kind": "sdc",
    "scope": "rank",
    "ranks": [1],
    "step": 7,
    "recipe": "hidden.0",
    "evidence": {},
    "confirmations": 1,
    "reason": "authentic",
    "host": None,
    "timestamp": 1.0,
}


def _rank(tmp_path: Path, rank: int) -> Path:
    folder = tmp_path / "node-0" / f"rank-{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _ledger(folder: Path) -> TrustLedger:
    ledger = TrustLedger(path=folder / "status.json", run_id="r", fsync=False)
    ledger.add_candidate(1)
    ledger.add_candidate(2)
    ledger.certify_through(1)
    assert ledger.save()
    return ledger


@pytest.mark.timeout(30)
def test_a_signed_ledger_loads_and_every_forgery_is_refused(tmp_path: Path, keyed: None) -> None:
    folder = _rank(tmp_path, 0)
    _ledger(folder)
    path = folder / "status.json"
    doc = json.loads(path.read_text())
    assert isinstance(doc["mac"], str)
    back = TrustLedger.load(path)
    assert back.load_problem is None and back.states == {
        1: TrustState.RECOVERY_VERIFIED,
        2: TrustState.CANDIDATE,
    }

    def refused(edit: dict[str, object], why: str) -> None:
        path.write_text(json.dumps(edit))
        got = TrustLedger.load(path)
        assert got.states == {} and got.attempts == {}, got
        assert got.load_problem is not None and why in got.load_problem, got.load_problem

    unsigned = {k: v for k, v in doc.items() if k != "mac"}
    refused(
        {**unsigned, "states": {"1": "recovery_verified", "2": "recovery_verified"}},
        "not authenticated",
    )
    refused({**doc, "states": {"1": "recovery_verified", "2": "durable"}}, "MAC does not match")
    refused({**doc, "mac": 5}, "MAC does not match")
    integrity.use_key(b"a forger's own key, 32 bytes lo")
    forged = record_mac.sign({**unsigned, "states": {"2": "durable"}}, "status.json node-0/rank-0")
    integrity.use_key(KEY)
    refused(forged, "MAC does not match")
    # Authentic, but rank 1's: bound to its own rank folder.
    other = _rank(tmp_path, 1)
    _ledger(other)
    refused(json.loads((other / "status.json").read_text()), "MAC does not match")


@pytest.mark.timeout(30)
def test_a_process_without_the_key_refuses_a_signed_ledger_and_unkeyed_jobs_are_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(integrity.ENV_KEY, raising=False)
    monkeypatch.delenv(integrity.ENV_KEY_FILE, raising=False)
    folder = _rank(tmp_path, 0)
    integrity.use_key(KEY)
    try:
        _ledger(folder)
    finally:
        integrity.use_key(None)
    got = TrustLedger.load(folder / "status.json")
    assert got.states == {} and "integrity key this process does not have" in (
        got.load_problem or ""
    )
    _ledger(folder)  # unkeyed: no MAC written, none asked for
    assert "mac" not in json.loads((folder / "status.json").read_text())
    assert TrustLedger.load(folder / "status.json").states[1] == TrustState.RECOVERY_VERIFIED


@pytest.mark.timeout(30)
def test_the_fault_log_keeps_only_lines_signed_for_this_rank(tmp_path: Path, keyed: None) -> None:
    folder, other = _rank(tmp_path, 0), _rank(tmp_path, 1)
    log = faultlog.FaultLog(folder / faultlog.FILE_NAME, fsync=False)
    log.append(REPORT)
    faultlog.FaultLog(other / faultlog.FILE_NAME, fsync=False).append(
        {**REPORT, "reason": "rank 1's"}
    )
    line = json.loads((folder / faultlog.FILE_NAME).read_text())
    lines = [
        {**REPORT, "kind": "hang", "ranks": [0], "reason": "forged, unsigned"},
        {**line, "ranks": [0], "reason": "edited after signing"},
        json.loads((other / faultlog.FILE_NAME).read_text()),  # authentic, another rank's
        {**line, "mac": ["not", "a", "mac"]},
    ]
    with (folder / faultlog.FILE_NAME).open("a") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in lines)
    assert [r["reason"] for r in faultlog.read_reports(folder)] == ["authentic"]
    assert all("mac" not in r for r in faultlog.read(folder))
    with pytest.raises(IntegrityError, match="not authenticated"):
        record_mac.check(lines[0], record_mac.rank_scope(faultlog.FILE_NAME, folder), "a line")
    integrity.use_key(
        None
    )  # a reader without the key cannot verify: it keeps every well-formed report
    assert len(faultlog.read_reports(folder)) == 5
