"""Real processes, real gloo: a DataLoader stall, a checkpoint-write stall and a hang, each on a different rank.

Three rank processes join a gloo process group through the test's TCPStore and publish progress out of band. In one
launch (process start costs seconds here): rank 2's DataLoader fetches become slow, then rank 0's checkpoint writes,
then rank 1 stops forever before an ``all_reduce`` the others wait in. A watchdog in the test process, reading only the
store, must localize each fault to its rank: data_stall → 2, checkpoint_stall → 0 (both after 2 confirmations), and
hang → 1 within the stall threshold plus the confirmation polls.

Run as a script (``python test_oob_hang.py RANK WORLD PORT``) this file is the rank program.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

WORLD = 3
DATA_RANK, CKPT_RANK, HANG_RANK = 2, 0, 1
SLOW_S = 0.5  # injected delay per slow round
ROUNDS = 4  # rounds 1..3 slow on the faulty rank: confirmed at round 2
THRESHOLD = timedelta(seconds=1.5)
POLL = timedelta(milliseconds=100)
CONFIRMATIONS = 2
HANG_MARK = "test/hang_started"


def rank_main(rank: int, world: int, port: int) -> None:
    """One rank: join gloo through the store, run the three phases while publishing progress."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    from gemscout.watch import (
        InstrumentedLoader,
        OobChannel,
        OobConfig,
        ProgressConfig,
        ProgressPublisher,
        checkpoint_io,
    )

    parent = os.getppid()

    def exit_with_parent() -> (
        None
    ):  # a rank must never outlive the test, even if the test itself is killed
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    channel = OobChannel(
        store, config=OobConfig(rank=rank)
    )  # the secret comes from GEMSCOUT_OOB_SECRET
    progress = ProgressConfig(
        publish_interval=timedelta(milliseconds=50), heartbeat_interval=timedelta(milliseconds=200)
    )
    pub = ProgressPublisher(channel, config=progress).start()
    grads = torch.ones(4)
    step = 0

    def train_step() -> None:
        nonlocal step
        step += 1
        pub.step(step)
        with pub.collective("all_reduce", "world", [tuple(grads.shape)]):
            dist.all_reduce(grads)

    class Shard(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return ROUNDS

        def __getitem__(self, index: int) -> torch.Tensor:
            if rank == DATA_RANK and index >= 1:
                time.sleep(SLOW_S)  # this rank's storage turned slow
            return torch.full((2,), float(index))

    for _batch in InstrumentedLoader(DataLoader(Shard(), batch_size=1), pub):
        train_step()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ROUNDS):
            with checkpoint_io(pub, "write"):
                torch.save({"w": grads}, Path(tmp) / f"ckpt{i}.pt")  # test-only local file
                if rank == CKPT_RANK and i >= 1:
                    time.sleep(SLOW_S)
            train_step()
    for _ in range(2):
        train_step()
    if rank == HANG_RANK:
        pub.flush()
        store.set(HANG_MARK, repr(time.time()))
        time.sleep(120)  # stops before the next all_reduce; the test kills us
    train_step()  # the other ranks block here, waiting for HANG_RANK


@pytest.mark.timeout(90)
def test_stalls_and_hang_localized_to_their_ranks(tmp_path: Path) -> None:
    import torch.distributed as dist

    from gemscout.watch import (
        OobChannel,
        OobConfig,
        StallConfig,
        StallFinding,
        Watchdog,
        WatchdogConfig,
        generate_secret,
    )
    from gemscout.watch.records import PROGRESS_KEY
    from gemscout.watch.secret import SECRET_ENV

    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    secret = generate_secret()
    env = {**os.environ, "OMP_NUM_THREADS": "1", SECRET_ENV: secret}
    logs = [tmp_path / f"rank{r}.log" for r in range(WORLD)]
    procs: list[subprocess.Popen[bytes]] = []
    watchdog: Watchdog | None = None
    launched = time.monotonic()

    def tails() -> str:
        return "\n".join(
            f"--- rank {r} ---\n{p.read_text()[-2000:]}" for r, p in enumerate(logs) if p.exists()
        )

    def require_alive() -> None:
        dead = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() is not None]
        assert not dead, f"rank process(es) exited early {dead}\n{tails()}"

    try:
        for r in range(WORLD):
            with logs[r].open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, str(r), str(WORLD), str(master.port)],
                        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                )  # fmt: skip
        observer = OobChannel(master, config=OobConfig(rank=None, secret=secret.encode()))
        deadline = time.monotonic() + 45
        while len(observer.read_many(range(WORLD), PROGRESS_KEY)) < WORLD:
            require_alive()
            assert time.monotonic() < deadline, f"ranks did not start in time\n{tails()}"
            time.sleep(0.05)
        started = time.monotonic()
        watchdog = Watchdog(
            observer,
            world_size=WORLD,
            config=WatchdogConfig(
                stall_threshold=THRESHOLD, poll_interval=POLL, confirmations=CONFIRMATIONS
            ),
            stall_config=StallConfig(
                absolute_threshold=timedelta(seconds=0.25),
                relative_factor=3.0,
                confirmations=CONFIRMATIONS,
            ),
        ).start()
        while not any(f.kind == "hang" for f in watchdog.findings):
            require_alive()
            assert time.monotonic() < started + 30, (
                f"no hang reported; findings {watchdog.findings}\n{tails()}"
            )
            time.sleep(0.05)
        findings: list[StallFinding] = watchdog.findings
        hang_started = float(master.get(HANG_MARK).decode())
    finally:
        if watchdog is not None:
            watchdog.stop(timeout=timedelta(seconds=5))
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)

    by_kind = {f.kind: f for f in findings}
    assert sorted(f.kind for f in findings) == ["checkpoint_stall", "data_stall", "hang"], findings
    data, ckpt, hang = by_kind["data_stall"], by_kind["checkpoint_stall"], by_kind["hang"]
    assert data.ranks == (DATA_RANK,) and data.evidence["section"] == "dataloader"
    assert ckpt.ranks == (CKPT_RANK,) and ckpt.evidence["section"] == "checkpoint_write"
    assert data.confirmations == ckpt.confirmations == CONFIRMATIONS
    assert (
        data.evidence["round"] == ckpt.evidence["round"] == 2
    )  # slow from round 1, confirmed on the second
    assert hang.ranks == (HANG_RANK,), hang.to_json()
    assert hang.recommendation == "restart_from_verified"
    assert (
        hang.evidence["reference"]["op"] == "all_reduce"
        and hang.evidence["reference"]["waiting"] == WORLD - 1
    )
    latency = hang.timestamp - hang_started
    budget = THRESHOLD.total_seconds() + CONFIRMATIONS * POLL.total_seconds()
    # Not before the threshold; within it plus the confirmation polls (+1 s for publish interval and a busy CPU).
    assert THRESHOLD.total_seconds() - 0.2 <= latency <= budget + 1.0, (latency, budget)
    print(
        f"launch→hang report {time.monotonic() - launched:.1f}s; hang latency {latency:.2f}s (budget {budget:.2f}s)"
    )


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
