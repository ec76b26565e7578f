"""The on-disk fault log: whole lines from concurrent writers, a torn last line skipped, one rolled generation."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gemscout.faultlog import FILE_NAME, FaultLog, read


@pytest.mark.timeout(30)
def test_concurrent_appends_stay_whole_lines(tmp_path: Path) -> None:
    log = FaultLog(tmp_path / FILE_NAME, fsync=False)
    threads = [
        threading.Thread(
            target=lambda t=t: [log.append({"t": t, "i": i, "pad": "x" * 300}) for i in range(200)]
        )
        for t in range(4)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=20)
    docs = read(tmp_path)
    assert len(docs) == 800 and {(d["t"], d["i"]) for d in docs} == {
        (t, i) for t in range(4) for i in range(200)
    }


@pytest.mark.timeout(30)
def test_a_torn_line_is_skipped_and_the_file_rolls_once(tmp_path: Path) -> None:
    log = FaultLog(tmp_path / FILE_NAME, fsync=True, max_bytes=1000)
    for i in range(50):
        log.append({"i": i, "pad": "x" * 40})
    with open(tmp_path / FILE_NAME, "ab") as fh:
        fh.write(b'{"i": 99, "torn')  # a crash mid-write
    docs = read(tmp_path)
    assert (tmp_path / (FILE_NAME + ".1")).exists()
    assert [d["i"] for d in docs] == list(range(docs[0]["i"], 50)) and docs[0][
        "i"
    ] > 0  # oldest rolled away
    assert sum((tmp_path / n).stat().st_size for n in (FILE_NAME, FILE_NAME + ".1")) < 2100


@pytest.mark.timeout(30)
def test_an_unwritable_folder_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    FaultLog(tmp_path / "file" / FILE_NAME).append(
        {"i": 1}
    )  # the parent is a file: cannot be created
    assert "cannot record a fault report" in caplog.text
