"""Launching under torchrun: a process group that survives ``--max-restarts``, and a STOP that outlives the process.

**The process group.** Under torchrun (torch >= 2.4) the elastic agent hosts one TCPStore for the whole life of the
job and hands its address to every attempt's workers (``TORCHELASTIC_USE_AGENT_STORE=True``). ``env://`` start-up
writes the default group's keys into it without a per-attempt prefix, so a relaunched worker group reads the gloo
addresses of the dead one and fails (``Gloo connectFullMesh failed ... Connection refused``; pytorch/pytorch#135712,
#167288). Torch's own per-retry key, ``TORCHELASTIC_RESTART_COUNT``, is kept by each agent and is not consistent
across nodes (a replacement agent starts again at 0; a membership change restarts workers without counting).
:func:`init_process_group` therefore gives every attempt a store of its own: rank 0 serves a fresh TCPStore, and
advertises its port with a random nonce in the agent's store; the other ranks connect to the advertised port and
accept it only when the fresh store answers with that nonce. An advertisement left by an earlier attempt points at a
server that died with that attempt's rank 0 (torchrun stops every worker before it starts the next attempt), so it
can never be taken for this attempt's. Outside torchrun, or when the agent's store is not shared, it is plain
``torch.distributed.init_process_group``.

**STOP.** torchrun relaunches after any non-zero exit, and an agent offers its workers no way to say "do not retry".
A STOP decision at attach (``RecoveryError``, exit 4) is recorded in ``<checkpoint dir>/STOP.json`` on every rank; a
later attempt that finds the record stops at once, before any collective, with the same one-line message and exit 4.
Delete the file (or point the job at a fresh directory) to try again.

**Slurm without torchrun** (``srun python train.py``, one task per GPU): Slurm sets ``SLURM_PROCID`` and
``SLURM_NTASKS``, not ``RANK`` and ``WORLD_SIZE``. When neither torchrun's variables nor ``rank``/``world_size``/
``init_method``/``store`` are given, the rank and world size are read from Slurm's; ``MASTER_ADDR`` and ``MASTER_PORT``
stay the job script's to export (docs/torchrun.md). A requeued job restarts every task, so no per-attempt store is
needed there.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gemscout.errors import CollectiveTimeout, ConfigError, RecoveryError

log = logging.getLogger("gemscout")

STOP_FILE = "STOP.json"
_ADVERT = (
    "gemscout/pg-store/"  # + TORCHELASTIC_RUN_ID: where rank 0 advertises its per-attempt store
)
_NONCE = "gemscout/nonce"
_PROBE = timedelta(
    seconds=1
)  # one connection attempt to an advertised port (a dead one is refused at once)
_OWNED = ("store", "rank", "world_size", "init_method")
_KEEP: list[
    Any
] = []  # rank 0's server lives as long as the process (the group holds a reference too)


def under_agent_store() -> bool:
    """True inside a worker that torchrun started with its shared store (the case that needs a per-attempt store)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"


def init_process_group(
    backend: str | None = None, *, timeout: timedelta = timedelta(minutes=10), **kwargs: Any
) -> None:
    """``torch.distributed.init_process_group`` that also works on every torchrun relaunch.

    ``timeout`` bounds the start-up (connecting, finding this attempt's store) and becomes the group's timeout.
    Other keyword arguments go to torch unchanged; under torchrun's shared store ``store``, ``rank``,
    ``world_size`` and ``init_method`` are set here (passing one is a ConfigError). Raises CollectiveTimeout when
    this attempt's rank 0 does not advertise its store within ``timeout``.
    """
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ConfigError(
            f"gemscout.init_process_group.timeout: a positive datetime.timedelta, got {timeout!r}"
        )
    if not under_agent_store():
        dist.init_process_group(backend, timeout=timeout, **{**_slurm_rank(kwargs), **kwargs})
        return
    given = sorted(k for k in _OWNED if k in kwargs)
    if given:
        raise ConfigError(
            f"gemscout.init_process_group: {given[0]}= is set from torchrun's environment; leave it "
            "out, or call torch.distributed.init_process_group yourself"
        )
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as exc:
        raise ConfigError(
            f"gemscout.init_process_group: torchrun's {exc} is missing or not a number; launch "
            "with torchrun, or unset TORCHELASTIC_USE_AGENT_STORE"
        ) from None
    if rank == 0 and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        log.warning(
            "gemscout: torchrun shares its rendezvous TCPStore with the workers (torch's default); torch 2.13 "
            "cannot re-admit a replacement node into a running job that way. Set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every agent's environment (docs/torchrun.md)"
        )
    store = attempt_store(addr, port, rank, os.environ.get("TORCHELASTIC_RUN_ID", "none"), timeout)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs
    )


def _slurm_rank(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``rank`` and ``world_size`` from a Slurm task's environment, when nothing else names them; else nothing."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or any(k in kwargs for k in _OWNED):
        return {}
    values = {name: os.environ.get(name, "") for name in ("SLURM_PROCID", "SLURM_NTASKS")}
    bad = [f"{name}={raw!r}" for name, raw in values.items() if not raw.isdigit()]
    if bad:
        raise ConfigError(
            f"gemscout.init_process_group: Slurm's {bad[0]} is missing or not a number; launch with srun, or export "
            "RANK and WORLD_SIZE"
        )
    rank, world = int(values["SLURM_PROCID"]), int(values["SLURM_NTASKS"])
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigError(
            f"gemscout.init_process_group: under srun without torchrun, export {' and '.join(missing)} in the job "
            'script (MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1); any free port)'
        )
    return {"rank": rank, "world_size": world}


def attempt_store(addr: str, port: int, rank: int, run_id: str, timeout: timedelta) -> dist.Store:
    """A store no earlier attempt has written to, agreed on by every rank through the agent's store at addr:port."""
    deadline = time.monotonic() + timeout.total_seconds()
    agent = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    key = _ADVERT + run_id
    if rank == 0:
        fresh = dist.TCPStore(addr, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = uuid.uuid4().hex
        fresh.set(
            _NONCE, nonce
        )  # before the advertisement: whoever reads it finds the nonce in place
        agent.set(key, f"{fresh.port} {nonce}")
        _KEEP.append(fresh)
        return fresh
    refused: set[str] = set()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(
                f"gemscout.init_process_group: rank 0 of this torchrun attempt did not advertise "
                f"its store at {addr}:{port} within {timeout}; is rank 0 alive?"
            )
        agent.set_timeout(timedelta(seconds=left))
        try:
            advert = agent.get(key).decode()
        except RuntimeError as exc:  # DistStoreError: the wait passed the deadline
            raise CollectiveTimeout(
                f"gemscout.init_process_group: no store advertised at {addr}:{port} within {timeout}: {exc}"
            ) from None
        if advert not in refused:
            store = _probe(addr, advert, left)
            if store is not None:
                store.set_timeout(timeout)
                return store
            refused.add(
                advert
            )  # an earlier attempt's: wait for this attempt's rank 0 to overwrite it
        time.sleep(0.05)


def _probe(addr: str, advert: str, left: float) -> dist.Store | None:
    """The store behind an advertisement, or None when it is an earlier attempt's (gone, or answering another nonce)."""
    port_text, _, nonce = advert.partition(" ")
    probe = timedelta(seconds=max(0.1, min(left, _PROBE.total_seconds())))
    if not _listening(addr, int(port_text), probe.total_seconds()):
        return None  # refused at once: TCPStore's own client would retry a dead port for its whole timeout
    try:
        store = dist.TCPStore(addr, int(port_text), is_master=False, timeout=probe)
        if not store.check([_NONCE]) or store.get(_NONCE).decode() != nonce:
            return None  # the port was reused by someone else's server
    except (RuntimeError, ValueError):  # refused / timed out: that attempt's rank 0 is dead
        return None
    return store


def _listening(addr: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts a TCP connection at addr:port within ``timeout_s`` (a plain connect, closed at
    once); False when refused or silent."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def stop_marker(directory: Path) -> Path:
    return Path(directory) / STOP_FILE


def check_stop(directory: Path, run_id: str | None) -> None:
    """Raise the recorded RecoveryError when an earlier attempt of this run stopped on ``directory``.

    Rank-local and before any collective, so every rank of a relaunch that finds the record exits at once.
    A record of another explicit run id is not this run's: it is left alone (the run check refuses that directory)."""
    path = stop_marker(directory)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        raise RecoveryError(
            f"{path} is unreadable ({exc}); an earlier attempt stopped here: read its log, then "
            "delete the file to try again"
        ) from None
    if run_id and doc.get("run_id") and doc["run_id"] != run_id:
        return
    raise RecoveryError(str(doc.get("message", "recovery stopped (no reason recorded)")))


def record_stop(directory: Path, exc: RecoveryError, run_id: str, *, fsync: bool) -> RecoveryError:
    """Write the STOP record (every rank does; the write is atomic) and return the error to raise: the decision's
    reason plus where it is recorded, the same line every later attempt prints."""
    from gemscout.gemini.store import write_json_atomic

    path = stop_marker(directory)
    message = (
        f"{exc}; recorded in {path}: every relaunch stops here with exit {RecoveryError.exit_code} until "
        "that file is deleted"
    )
    try:
        write_json_atomic(
            path,
            {"run_id": run_id, "message": message, "pid": os.getpid(), "time": time.time()},
            fsync=fsync,
        )
    except OSError as err:
        log.warning(
            "gemscout: cannot record the STOP in %s (%s); a relaunch will try to recover again",
            path,
            err,
        )
        return exc
    return RecoveryError(message)
