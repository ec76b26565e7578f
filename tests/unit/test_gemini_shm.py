"""GEMINI's memory tier (gemini/shm.py) with real files in /dev/shm and real SIGKILLed processes: a sealed slot
outlives its process in the disk format, a torn one is never adopted, losing the rank's disk folder loses the memory,
dead jobs' leftovers are swept (never a live job's), a full tmpfs is a ConfigError before the first capture, and
kill/restart cycles leak nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from gemscout.errors import ConfigError
from gemscout.gemini import shm, shm_sweep, store
from gemscout.gemini.replication import ReplicaBuffers
from gemscout.gemini.slots import SlotPool
from gemscout.gemini.snapshot import Capturer

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs a /dev/shm tmpfs")


@pytest.fixture
def base() -> Path:
    """A memory directory of this test's own (removed after it)."""
    root = SHM / f"gemscout-test-{uuid.uuid4().hex[:8]}"
    yield root
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def tier(base: Path, disk: Path, *, run_id: str = "run-a", rank: int = 0) -> shm.MemoryTier:
    return shm.MemoryTier.open(
        base,
        run_id=run_id,
        directory=disk,
        node=rank,
        rank=rank,
        disk_root=store.RankPaths.of(disk, node=rank, rank=rank).root,
        stale_after_s=0.0,
        fsync=False,
    )


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(300_000, generator=g),
        "b": torch.arange(7) + step,
        "note": f"step {step}" * step,
    }


def capture(pool: SlotPool, step: int, *, async_ptrs: set[int] | None = None) -> None:
    st = state(step)
    cap = Capturer(pool, async_copy=True, timeout=timedelta(seconds=10))
    ptrs = {st["w"].data_ptr()} if async_ptrs is None else async_ptrs
    slot = cap.capture(st, {"run_id": "run-a", "owner": 0, "step": step}, ptrs).result(timeout=10)
    pool.release(slot)
    cap.shutdown()


@pytest.mark.timeout(60)
def test_a_sealed_slot_is_a_published_file_in_the_disk_format(base: Path, tmp_path: Path) -> None:
    t = tier(base, tmp_path)
    pool = SlotPool(2, t)
    for step in (1, 2, 3):
        capture(pool, step)
    assert store.list_steps(t.paths.own) == [
        3,
        2,
    ]  # two slots: the oldest was taken out of view and reused
    parsed, data = store.read_verified(
        store.step_file(t.paths.own, 3)
    )  # every digest, as recovery checks it
    assert parsed.identity["step"] == 3
    w = parsed.layout.views(data)[0]
    assert torch.equal(w, state(3)["w"])
    assert not list(t.root.rglob(".tmp-*"))  # no temp left between captures


@pytest.mark.timeout(60)
def test_a_header_larger_than_its_room_moves_the_slot_and_still_verifies(
    base: Path, tmp_path: Path
) -> None:
    t = tier(base, tmp_path)
    pool = SlotPool(2, t)
    capture(pool, 1)
    capture(pool, 2)
    room = max(s.file.data_offset for s in pool._slots if s.file is not None)
    cap = Capturer(pool, async_copy=False, timeout=timedelta(seconds=10))
    big = dict(
        state(3), note="x" * (3 * room)
    )  # the caller's state grew past the reserved header room
    got = cap.capture(big, {"run_id": "run-a", "owner": 0, "step": 3}, set()).result(timeout=10)
    pool.release(got)
    cap.shutdown()
    parsed, _ = store.read_verified(store.step_file(t.paths.own, 3))
    assert parsed.skeleton is not None and got.file is not None and got.file.data_offset > room


def _child(base: Path, disk: Path, first: int) -> None:
    """A rank's life in a forked process: adopt what the last one left (as Checkpointer does), capture two steps
    and receive their replicas, then die by SIGKILL half-way through overwriting the oldest slot."""
    t = tier(base, disk)
    pool = SlotPool(2, t)
    pool.adopt(t.adopt(t.paths.own, 2))
    buffers = ReplicaBuffers(2, t, owner=1)
    buffers.adopt(t.adopt(t.paths.replicas(1), 2))
    cap = Capturer(pool, async_copy=True, timeout=timedelta(seconds=10))
    for step in (first, first + 1):
        w = torch.full(
            (20_000,), float(step)
        )  # under the intra-op grain: a forked child must not use the pool
        slot = cap.capture(
            {"w": w}, {"run_id": "run-a", "owner": 0, "step": step}, {w.data_ptr()}
        ).result(10)
        pool.release(slot)
        buf = buffers.buffer_for(
            slot.data.numel(), len(slot.prefix)
        )  # a replica lands in its own file
        buf.copy_(slot.data)
        buffers.add(step, slot.prefix, buf)
    layout = pool.ready_slots()[-1].layout
    assert layout is not None
    slot = pool.acquire(
        layout, timeout=timedelta(seconds=5)
    )  # the oldest slot: out of view, then written
    slot.data[: slot.data.numel() // 2].fill_(7)
    os.kill(os.getpid(), signal.SIGKILL)


_DRIVER = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from test_gemini_shm import _child  # imports torch, runs no torch op: the forks below start clean
base, disk, n = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
for i in range(n):
    pid = os.fork()
    if pid == 0:
        try:
            _child(base, disk, 1 + 2 * i)
        finally:
            os._exit(3)  # only reached if the child failed before its SIGKILL
    _, status = os.waitpid(pid, 0)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        sys.exit(f"cycle {i}: child ended with status {status}")
"""


def kill_restart(base: Path, disk: Path, n: int, timeout: float) -> None:
    """``n`` lives of one rank, each SIGKILLed mid-capture. One interpreter imports torch once and forks every
    life from a state in which torch never ran an op (a fork of a process whose intra-op pool has started can
    hang in its first parallel op), so a cycle costs a fork, not an interpreter start."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(Path(__file__).parent), str(base), str(disk), str(n)],
        env=env,
        capture_output=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]


def check_after_kills(base: Path, disk: Path, n: int) -> None:
    newest = 2 * n  # the last life captured 2n - 1 and 2n, then died overwriting the slot of 2n - 1
    t = tier(base, disk)  # the restarted rank
    own = t.adopt(t.paths.own, 2)
    # The slot being overwritten when the process died was out of view: only the sealed one is left, whole.
    assert [a.parsed.identity["step"] for a in own] == [newest]
    parsed, data = store.read_verified(
        own[0].file.path
    )  # every digest, as recovery checks before restoring
    assert torch.equal(parsed.layout.views(data)[0], torch.full((20_000,), float(newest)))
    pool = SlotPool(2, t)
    pool.adopt(own)
    assert [s.step for s in pool.ready_slots()] == [newest]
    held = t.adopt(t.paths.replicas(1), 2)
    assert [a.parsed.identity["step"] for a in held] == [newest, newest - 1]
    for a in held:
        store.read_verified(a.file.path)
    files = sorted(p.relative_to(t.root).as_posix() for p in t.root.rglob("*") if p.is_file())
    assert files == sorted(
        [
            "owner.json",
            f"own/step-{newest:09d}.gsc",
            f"replicas/owner-1/step-{newest - 1:09d}.gsc",
            f"replicas/owner-1/step-{newest:09d}.gsc",
        ]
    ), "the torn temp was removed, nothing else is left"
    assert len(list(base.glob("*/node-*/rank-*"))) == 1, "one folder per rank however many restarts"


@pytest.mark.timeout(120)
def test_kill_restart_cycles_leave_whole_slots_never_a_torn_one_and_leak_nothing(
    base: Path, tmp_path: Path
) -> None:
    kill_restart(base, tmp_path, 3, timeout=100)
    check_after_kills(base, tmp_path, 3)


@pytest.mark.skipif(
    not os.environ.get("GEMSCOUT_HEAVY_TESTS"), reason="100 cycles: set GEMSCOUT_HEAVY_TESTS=1"
)
@pytest.mark.timeout(1800)
def test_a_hundred_kill_restart_cycles_leak_nothing(base: Path, tmp_path: Path) -> None:
    kill_restart(base, tmp_path, 100, timeout=1700)
    check_after_kills(base, tmp_path, 100)


@pytest.mark.timeout(90)
def test_losing_the_rank_disk_folder_loses_its_memory(base: Path, tmp_path: Path) -> None:
    t = tier(base, tmp_path)
    capture(SlotPool(2, t), 1)  # the process "dies" here: nothing closed, the files stay
    import shutil

    shutil.rmtree(tmp_path / "node-0")  # how the harness loses a node: its checkpoint folder goes
    t = tier(base, tmp_path)
    assert t.adopt(t.paths.own, 2) == [] and not list(t.root.rglob("*.gsc"))
    assert json.loads((tmp_path / "node-0" / "rank-0" / shm_sweep.ANCHOR).read_text())[
        "path"
    ] == str(t.root)


@pytest.mark.timeout(60)
def test_a_start_sweeps_dead_jobs_of_other_runs_but_never_a_live_one(
    base: Path, tmp_path: Path
) -> None:
    dead = tier(base, tmp_path / "dead", run_id="run-dead")
    pool = SlotPool(2, dead)
    capture(pool, 1)
    doc = json.loads((dead.root / shm_sweep.OWNER).read_text())
    doc["pid"] = 2**22 + 17  # above any pid this kernel hands out: a process that is gone
    (dead.root / shm_sweep.OWNER).write_text(json.dumps(doc))
    live = tier(base, tmp_path / "live", run_id="run-live")  # this process: alive
    mine = tier(base, tmp_path / "mine", run_id="run-mine")
    assert not dead.root.exists(), "a dead job's memory of another run is removed"
    assert live.root.exists() and mine.root.exists()
    shm_sweep.sweep_dead(base, keep=None, stale_after_s=0.0)
    assert live.root.exists(), "never a live job's"


@pytest.mark.timeout(60)
def test_a_tmpfs_too_small_is_a_config_error_naming_the_limit_and_the_fix(
    base: Path, tmp_path: Path
) -> None:
    t = tier(base, tmp_path)
    free = os.statvfs(t.root).f_bavail * os.statvfs(t.root).f_frsize
    pool = SlotPool(2, t, files_expected=free // (state(1)["w"].numel() * 4) + 10)
    with pytest.raises(ConfigError) as err:
        capture(pool, 1)
    text = str(err.value)
    assert "MiB limit" in text and "--shm-size" in text and "memory_directory=None" in text
    assert store.list_steps(t.paths.own) == []
    assert pool.has_free(), "a refused capture leaves its slot free"


@pytest.mark.timeout(60)
def test_close_releases_the_memory_and_its_anchor(base: Path, tmp_path: Path) -> None:
    t = tier(base, tmp_path)
    capture(SlotPool(2, t), 1)
    t.close(release=False)
    assert store.list_steps(t.paths.own) == [1]  # kept for a restart
    t.close(release=True)
    assert not t.root.exists() and not t.anchor.exists()


@pytest.mark.timeout(30)
def test_a_replica_lands_in_its_file_and_the_newest_stays_whole_while_the_next_arrives(
    base: Path, tmp_path: Path
) -> None:
    t = tier(base, tmp_path)
    pool = SlotPool(2, t)
    buffers = ReplicaBuffers(2, t, owner=3)
    for step in (1, 2, 3):
        capture(pool, step)
        slot = pool.newest_ready()
        assert slot is not None
        buf = buffers.buffer_for(slot.data.numel(), len(slot.prefix))
        assert buf.data_ptr() not in {e[2].data_ptr() for e in buffers.entries}
        buf.copy_(slot.data)
        buffers.add(step, slot.prefix, buf)
    assert buffers.steps() == [3, 2] and store.list_steps(t.paths.replicas(3)) == [3, 2]
    store.read_verified(store.step_file(t.paths.replicas(3), 3))


@pytest.mark.timeout(30)
def test_inspect_sees_the_memory_tier_and_predicts_the_restart_from_it(
    base: Path, tmp_path: Path
) -> None:
    from gemscout.inventory import inventory

    t = tier(base, tmp_path)
    capture(SlotPool(2, t), 1)
    capture_pool = SlotPool(2, t)
    capture_pool.adopt(t.adopt(t.paths.own, 2))
    capture(capture_pool, 2)  # the killed process's last capture: only in memory, nothing on disk
    inv = inventory(tmp_path, world_size=1)
    kinds = {(f.kind, f.step) for f in inv.ranks[0].files}
    assert kinds == {("memory", 1), ("memory", 2)}, kinds
    assert inv.decision.step == 2 and inv.decision.sources == {0: "memory"}, inv.decision
    t.close(release=True)
    assert (
        inventory(tmp_path, world_size=1).ranks[0].files == []
    )  # released: nothing left to restore from


@pytest.mark.timeout(30)
def test_a_full_tmpfs_first_sweeps_dead_jobs_within_their_grace(base: Path, tmp_path: Path) -> None:
    dead = tier(base, tmp_path / "dead", run_id="run-dead")
    capture(SlotPool(2, dead), 1)
    doc = json.loads((dead.root / shm_sweep.OWNER).read_text())
    doc["pid"] = 2**22 + 17  # a process that is gone
    (dead.root / shm_sweep.OWNER).write_text(json.dumps(doc))
    mine = shm.MemoryTier.open(
        base,
        run_id="run-mine",
        directory=tmp_path / "mine",
        node=0,
        rank=0,
        disk_root=tmp_path / "mine" / "node-0" / "rank-0",
        stale_after_s=3600.0,
        fsync=False,
    )
    assert dead.root.exists(), "inside its grace period: kept for a restart of that job"
    free = os.statvfs(mine.root).f_bavail * os.statvfs(mine.root).f_frsize
    mine.check_room(free + 1000)  # fits only once the dead job's ~2.4 MB are gone
    assert not dead.root.exists()


@pytest.mark.timeout(30)
def test_recapturing_a_step_after_a_rollback_replaces_the_stale_slot_cleanly(
    base: Path, tmp_path: Path
) -> None:
    """A restart (or rollback) to step 1 while memory holds steps 1 and 2: the next capture of step 2 must take the
    stale slot of step 2 out of view, not rename over its file (found by a randomized SIGKILL lifecycle test: the
    stale slot later renamed the new file away and the capture after failed)."""
    t = tier(base, tmp_path)
    pool = SlotPool(2, t)
    for step in (1, 2):
        capture(pool, step)
    for step in (2, 3, 4):  # the resumed trajectory re-captures step 2, then goes on
        capture(pool, step)
    assert store.list_steps(t.paths.own) == [4, 3]
    assert sorted(s.step for s in pool.ready_slots()) == [3, 4]
    for step in (3, 4):
        parsed, data = store.read_verified(store.step_file(t.paths.own, step))
        assert torch.equal(parsed.layout.views(data)[0], state(step)["w"])


@pytest.mark.timeout(30)
def test_hostile_files_in_a_memory_folder_are_never_adopted_and_never_hang_the_start(
    base: Path, tmp_path: Path
) -> None:
    """What a restart finds in shared memory was left by another process: it is read like a checkpoint folder
    (gemscout.files). A FIFO and a link to /dev/zero named like step files, a truncated slot and one with bytes
    past its declared end are removed, the whole slot is kept, and a FIFO as owner.json is no owner at all."""
    t = tier(base, tmp_path)
    capture(SlotPool(2, t), 1)
    good = store.step_file(t.paths.own, 1)
    raw = good.read_bytes()
    store.step_file(t.paths.own, 2).write_bytes(raw[: len(raw) - 100])  # truncated
    store.step_file(t.paths.own, 3).write_bytes(raw + b"\0" * 4096)  # longer than declared
    os.mkfifo(store.step_file(t.paths.own, 4))
    store.step_file(t.paths.own, 5).symlink_to("/dev/zero")
    (t.root / shm_sweep.OWNER).unlink()
    os.mkfifo(t.root / shm_sweep.OWNER)
    assert (
        shm_sweep.read_json(t.root / shm_sweep.OWNER) is None
    )  # returns at once: a FIFO is not read
    found = t.adopt(t.paths.own, 5)
    assert [a.parsed.identity["step"] for a in found] == [1]
    assert store.list_steps(t.paths.own) == [1], "every unusable file is removed"
    (t.root / shm_sweep.OWNER).unlink()
