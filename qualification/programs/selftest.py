"""The engine's self-test program: a cell driver whose outcome is chosen by ``params.mode``.

It follows the cell contract like any program (``--cell cell.json --out celldir``, writes ``result.json``), so each
verdict path of the engine has a cell that produces it:

``pass``              observes ``answer = 42`` and passes.
``fail-expectation``  runs cleanly but observes ``answer = 41``: the engine must fail it on the expectation.
``crash``             raises before writing a result: a non-zero exit and no result.json.
``hang``              sleeps forever; with ``params.ignore_sigterm`` it also ignores SIGTERM, so only the engine's
                      SIGKILL escalation ends it.
``hang-children``     spawns ``world_size`` real ranks that join a gloo process group and block in a receive that never
                      completes; with ``params.escape_session`` each rank first calls ``setsid()`` so it leaves the
                      driver's process group and session, which only the engine's sweep by cell token can find.
                      Each rank writes ``rank<r>.pid`` once it is inside the group, so a test can check the pids died.
``dist-pass``         ``world_size`` ranks all-reduce ``rank + 1`` over gloo and report the sum (3.0 for two ranks).
``leak``              passes, but leaves a child process running in a session of its own (pid in ``leak.pid``): the
                      engine's sweep after a normal exit must find and end it.

torch is imported only by the distributed modes, so the single-process cells start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_START = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qualification.programs.selftest")
    parser.add_argument("--cell", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cell = json.loads(args.cell.read_text(encoding="utf-8"))
    mode = cell["params"].get("mode", "pass")
    timeline: list[dict[str, Any]] = []
    _event(timeline, "start", f"mode {mode}")
    print(f"selftest: cell {cell['id']} mode {mode}", flush=True)

    if mode == "pass":
        observed: dict[str, Any] = {"answer": 42, "mode": mode}
    elif mode == "leak":
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True
        )
        _write_json(args.out / "leak.pid", {"pid": child.pid})
        observed = {"answer": 42, "mode": mode}
    elif mode == "fail-expectation":
        observed = {"answer": 41, "mode": mode}
    elif mode == "crash":
        raise RuntimeError("selftest: crashing on purpose (mode 'crash')")
    elif mode == "hang":
        if cell["params"].get("ignore_sigterm", False):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("selftest: ignoring SIGTERM", flush=True)
        _block_forever()
    elif mode == "hang-children":
        _run_ranks(cell, args.out, _hang_rank)
        raise AssertionError("unreachable: hung ranks never return")
    elif mode == "dist-pass":
        sums = _run_ranks(cell, args.out, _all_reduce_rank)
        _event(timeline, "all_reduce", f"{len(sums)} ranks reported {sorted(set(sums))}")
        observed = {
            "all_reduce_sum": sums[0] if len(set(sums)) == 1 else sums,
            "ranks_reporting": len(sums),
        }
    else:
        print(f"selftest: unknown mode {mode!r}", file=sys.stderr)
        return 2

    _event(timeline, "finish", "done")
    result = {
        "cell_id": cell["id"],
        "status": "passed",
        "observed": observed,
        "metrics": {"wall_s": round(time.monotonic() - _START, 3)},
        "timeline": timeline,
        "message": f"selftest mode {mode} ran to the end",
    }
    _write_json(args.out / "result.json", result)
    return 0


def _run_ranks(cell: dict[str, Any], out: Path, target: Any) -> list[float]:
    """Start ``world_size`` spawned ranks running ``target(rank, world_size, out, escape)`` and collect their sums."""
    import torch.multiprocessing as mp

    world_size = int(cell["world_size"])
    escape = bool(cell["params"].get("escape_session", False))
    store = out / "pg.store"
    store.unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=target, args=(rank, world_size, str(out), escape))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    codes = [proc.exitcode for proc in procs]
    if any(code != 0 for code in codes):
        raise RuntimeError(f"selftest: rank exit codes {codes}")
    return [json.loads((out / f"rank{r}.json").read_text())["sum"] for r in range(world_size)]


def _init_group(rank: int, world_size: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{out}/pg.store", rank=rank, world_size=world_size
    )


def _all_reduce_rank(rank: int, world_size: int, out: str, escape: bool) -> None:
    import torch
    import torch.distributed as dist

    _init_group(rank, world_size, out)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    _write_json(Path(out) / f"rank{rank}.json", {"rank": rank, "sum": value.item()})
    dist.destroy_process_group()


def _hang_rank(rank: int, world_size: int, out: str, escape: bool) -> None:
    import torch
    import torch.distributed as dist

    if escape:
        os.setsid()
    _init_group(rank, world_size, out)
    _write_json(
        Path(out) / f"rank{rank}.pid", {"rank": rank, "pid": os.getpid(), "sid": os.getsid(0)}
    )
    print(
        f"selftest: rank {rank} (pid {os.getpid()}) in the group, now blocking in recv", flush=True
    )
    # Every rank receives from its neighbour and nobody sends: a hung collective, as a real deadlock looks.
    dist.recv(torch.zeros(1), src=(rank + 1) % world_size)
    _block_forever()


def _block_forever() -> None:
    while True:
        time.sleep(3600)


def _event(timeline: list[dict[str, Any]], event: str, detail: str) -> None:
    timeline.append({"t": round(time.monotonic() - _START, 6), "event": event, "detail": detail})


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    # Write then rename, so a reader (the engine, a test) never sees half a file.
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
