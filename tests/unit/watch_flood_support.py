"""A one-rank training process with a ``Watch``, driven line by line by ``test_oob_hostile.py`` (run as a script).

Its own process because a ``Watch`` needs a process group, and because the test must SIGKILL it and then look for its
store process. It trains (steps every 20 ms, a gloo all-reduce each) and prints one JSON line per event; it waits for
the test's word on stdin between phases:

1. ``ready`` (port, store pid) — the test floods the store above its cap (its sweeps, 2 s apart, cannot keep up),
   writes ``flooded``;
2. ``flood_seen`` (the reports so far) — the test SIGKILLs the store process (if the flood did not end it), writes
   ``killed``;
3. ``lost`` (the reports), then ``closed`` (seconds ``Watch.close`` took), then a second ``Watch``: ``second`` (its
   store pid) — the test SIGKILLs this process and checks that the store process goes too.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gemscout.watch import StoreServerConfig, Watch, WatchConfig

STEP_S = 0.02


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def kinds(watch: Watch) -> list[list[object]]:
    return [
        [r.kind.value, r.evidence.get("tamper", {}).get("kind"), r.reason[:300]]
        for r in list(watch.reports)
    ]


def main() -> None:
    cap_mib = int(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{Path(tmp) / 'pg'}", rank=0, world_size=1
        )
        config = WatchConfig(
            insecure_dev=True,
            stall_threshold=timedelta(seconds=3),
            poll_interval=timedelta(milliseconds=50),
            store=StoreServerConfig(
                memory_cap_bytes=cap_mib << 20, sweep_interval=timedelta(seconds=2)
            ),
        )
        watch = Watch(config, rank=0, world_size=1, on_report=lambda report, finding: None)
        server = watch.store_server
        assert server is not None
        step = 0
        stop = threading.Event()

        def train() -> None:
            nonlocal step
            while not stop.is_set():
                step += 1
                dist.all_reduce(torch.ones(4))
                watch.step(step)
                time.sleep(STEP_S)

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        say("ready", port=server.port, store_pid=server.pid)
        assert sys.stdin.readline().strip() == "flooded"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
            k[1] in ("foreign_keys", "store_lost") for k in kinds(watch)
        ):
            time.sleep(0.05)
        time.sleep(0.5)  # a hang would need 3 s without progress: none may come from the flood
        say("flood_seen", reports=kinds(watch), step=step, store=server.status().lost)
        assert sys.stdin.readline().strip() == "killed"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(k[1] == "store_lost" for k in kinds(watch)):
            time.sleep(0.05)
        before = step
        time.sleep(0.3)
        say("lost", reports=kinds(watch), trained=step - before)
        stop.set()
        trainer.join(5)
        started = time.monotonic()
        watch.close()
        say("closed", seconds=round(time.monotonic() - started, 3))
        second = Watch(
            WatchConfig(insecure_dev=True),
            rank=0,
            world_size=1,
            on_report=lambda report, finding: None,
        )
        assert second.store_server is not None
        say("second", store_pid=second.store_server.pid)
        time.sleep(60)  # the test SIGKILLs this process long before


if __name__ == "__main__":
    main()
