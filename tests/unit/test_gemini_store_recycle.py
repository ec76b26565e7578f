"""Recycled generation files (store.Spares): a pruned file is overwritten by the next write in its folder.

Real files in a real folder; the crash is a real one: a child process whose file-size limit (RLIMIT_FSIZE) stops it
half-way through overwriting a recycled file, first with an error (SIGXFSZ ignored: EFBIG), then with the kernel's
SIGXFSZ, which kills it mid-write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from frames_support import frame_of

from gemscout.errors import IntegrityError
from gemscout.gemini import store


def _frame(step: int, n: int) -> tuple[bytes, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return frame_of({"w": torch.randn(n, generator=g), "step": step}, step=step)


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".tmp-"))


@pytest.mark.timeout(60)
def test_pruned_file_is_recycled_in_place_and_every_published_file_verifies(tmp_path: Path) -> None:
    folder, spares = tmp_path / "own", store.Spares()
    inodes: dict[int, int] = {}
    for step in range(1, 9):
        # sizes change from step to step: a recycled file that was longer must be cut to the new size
        store.write_checkpoint(
            store.step_file(folder, step),
            *_frame(step, 4096 * (1 + step % 2)),
            fsync=False,
            spares=spares,
        )
        inodes[step] = os.stat(store.step_file(folder, step)).st_ino
        store.prune_safe(folder, frontier=step, keep=2, spares=spares)
        assert store.list_steps(folder) == [s for s in (step, step - 1) if s >= 1]
        for s in store.list_steps(folder):
            parsed, _ = store.read_verified(store.step_file(folder, s))
            assert parsed.identity == {"step": s}
        assert len(_temps(folder)) == (1 if step >= 3 else 0)  # one spare once something was pruned
        assert all(
            name.startswith(f".tmp-{os.getpid()}-") and name.endswith("-spare")
            for name in _temps(folder)
        )
    # from step 4 on every write went into the file pruned one capture earlier: three inodes in rotation
    assert len({inodes[s] for s in range(4, 9)}) == 3
    assert inodes[4] == inodes[1] and inodes[8] == inodes[5]
    spares.discard()
    assert _temps(folder) == [] and len(spares) == 0


@pytest.mark.timeout(60)
def test_prune_without_spares_still_deletes(tmp_path: Path) -> None:
    folder = tmp_path / "own"
    for step in range(1, 5):
        store.write_checkpoint(store.step_file(folder, step), *_frame(step, 256), fsync=True)
    store.prune_safe(folder, frontier=4, keep=2)
    assert sorted(p.name for p in folder.iterdir()) == [
        store.step_file(folder, s).name for s in (3, 4)
    ]


@pytest.mark.timeout(60)
def test_hard_linked_file_is_never_recycled(tmp_path: Path) -> None:
    folder, spares = tmp_path / "own", store.Spares()
    store.write_checkpoint(store.step_file(folder, 1), *_frame(1, 1024), fsync=False, spares=spares)
    backup = tmp_path / "backup.gsc"
    os.link(store.step_file(folder, 1), backup)
    before = backup.read_bytes()
    store.prune_safe(folder, frontier=1, keep=0, spares=spares)
    assert len(spares) == 0 and _temps(folder) == [] and store.list_steps(folder) == []
    store.write_checkpoint(store.step_file(folder, 2), *_frame(2, 1024), fsync=False, spares=spares)
    assert backup.read_bytes() == before  # the other name still holds the old generation, untouched


@pytest.mark.timeout(60)
def test_spare_removed_behind_our_back_falls_back_to_a_new_file(tmp_path: Path) -> None:
    folder, spares = tmp_path / "own", store.Spares()
    for step in (1, 2):
        store.write_checkpoint(
            store.step_file(folder, step), *_frame(step, 512), fsync=False, spares=spares
        )
    store.prune_safe(folder, frontier=2, keep=1, spares=spares)
    (spare,) = _temps(folder)
    (folder / spare).unlink()
    store.write_checkpoint(store.step_file(folder, 3), *_frame(3, 512), fsync=False, spares=spares)
    assert store.read_verified(store.step_file(folder, 3))[0].identity == {"step": 3}
    assert _temps(folder) == [] and store.list_steps(folder) == [3, 2]


@pytest.mark.timeout(60)
def test_failed_write_into_a_spare_deletes_it_and_publishes_nothing(tmp_path: Path) -> None:
    folder, spares = tmp_path / "own", store.Spares()
    for step in (1, 2):
        store.write_checkpoint(
            store.step_file(folder, step), *_frame(step, 512), fsync=False, spares=spares
        )
    store.prune_safe(folder, frontier=2, keep=1, spares=spares)
    prefix, data = _frame(3, 512)
    with pytest.raises(
        TypeError
    ):  # a non-contiguous region cannot be written: the write fails after the prefix
        store.write_checkpoint(
            store.step_file(folder, 3), prefix, data.view(-1, 2)[:, 0], fsync=False, spares=spares
        )
    assert _temps(folder) == [] and len(spares) == 0 and store.list_steps(folder) == [2]
    store.read_verified(store.step_file(folder, 2))


CHILD = textwrap.dedent("""
    import os, resource, signal, sys
    sys.path.insert(0, sys.argv[2])
    import torch
    from frames_support import frame_of
    from gemscout.gemini import store

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXFSZ's default action dumps core: not here
    print("PID", os.getpid(), flush=True)
    folder, spares = __import__("pathlib").Path(sys.argv[1]), store.Spares()
    small = 64 * 1024
    for step in (1, 2, 3):
        g = torch.Generator().manual_seed(step)
        store.write_checkpoint(store.step_file(folder, step), *frame_of({"w": torch.randn(small, generator=g)},
                               step=step), fsync=True, spares=spares)
        store.prune_safe(folder, frontier=step, keep=2, spares=spares)
    assert len(spares) == 1  # step 1's file, now this process's spare
    big = frame_of({"w": torch.randn(4 * small)}, step=4)
    size = os.stat(store.step_file(folder, 3)).st_size
    # past the recycled file's end, but short of the new one: the write overwrites the spare, then hits the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 8192, resource.RLIM_INFINITY))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        store.write_checkpoint(store.step_file(folder, 4), *big, fsync=True, spares=spares)
    except OSError as exc:
        print("EFBIG", exc.errno, flush=True)
    assert len(spares) == 0 and not store.step_file(folder, 4).exists()
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp-")], "the failed temp was deleted"
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    store.prune_safe(folder, frontier=3, keep=1, spares=spares)  # step 2's file becomes the spare
    assert len(spares) == 1
    size = os.stat(store.step_file(folder, 3)).st_size
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 8192, resource.RLIM_INFINITY))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    print("DYING", flush=True)
    store.write_checkpoint(store.step_file(folder, 4), *big, fsync=True, spares=spares)
    print("SURVIVED", flush=True)
""")


@pytest.mark.timeout(120)
def test_crash_while_overwriting_a_recycled_file_leaves_the_previous_generation_and_a_stale_temp(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "own"
    folder.mkdir()
    support = str(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), support],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    pid = proc.stdout.split("PID ", 1)[1].split()[0] if "PID " in proc.stdout else "?"
    assert "EFBIG 27" in proc.stdout and "DYING" in proc.stdout, (proc.stdout, proc.stderr)
    assert proc.returncode == -signal.SIGXFSZ and "SURVIVED" not in proc.stdout, (
        proc.returncode,
        proc.stderr,
    )
    # what the crash left: step 3 published and whole, step 4 never published, the dead writer's half-written spare
    assert store.list_steps(folder) == [3]
    parsed, _ = store.read_verified(store.step_file(folder, 3))
    assert parsed.identity == {"step": 3}
    (stale,) = _temps(folder)
    assert stale.startswith(f".tmp-{pid}-") and stale.endswith("-spare")
    with pytest.raises(
        IntegrityError
    ):  # half new, half old bytes: it would fail closed even if someone read it
        store.read_verified(folder / stale)
    assert store.clean_stale_temps(folder) == 1
    assert _temps(folder) == [] and store.list_steps(folder) == [3]
