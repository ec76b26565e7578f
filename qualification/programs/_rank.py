"""What every rank program does at its two ends: leave with the documented exit code, and write its result (checked
against ``rank-result.schema.json``) and leave without teardown. Fail-stop faults: :mod:`._failstop`."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist


def write_result(out: Path, rank: int, result: dict[str, Any], name: str | None = None) -> Path:
    """Write ``out/<name or rank<r>>.json`` after checking it against ``rank-result.schema.json``: the keys that
    schema names (rank, losses, state_digest, decision, ...) mean the same in every program. A result that does not
    match is the harness's own bug: it raises ``ValueError`` naming the key, and nothing is written."""
    from jsonschema import Draft202012Validator

    from qualification.campaign import load_schema

    errors = list(Draft202012Validator(load_schema("rank-result.schema.json")).iter_errors(result))
    if errors:
        where = ".".join(str(p) for p in errors[0].absolute_path) or "top level"
        raise ValueError(
            f"rank {rank}'s result breaks rank-result.schema.json at {where}: {errors[0].message}"
        )
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name or f'rank{rank}'}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def finish(out: Path, rank: int, result: dict[str, Any]) -> None:
    """Write ``out/rank<r>.json`` (:func:`write_result`), wait for every rank, and exit the process.

    Process-group teardown can deadlock in gloo (its worker frees tensors and needs the GIL while the group's
    destructor holds it): every rank has written its result and passed the barrier, so leave without it.
    """
    write_result(out, rank, result)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def run(main: Callable[[], None]) -> None:
    """Run ``main``; a gemscout error ends the rank with its documented exit code and one line, no traceback.

    The rank leaves with ``os._exit``, as :func:`finish` does: a normal interpreter exit runs the process group's
    and the TCPStore's destructors while peers are still inside their own failure path, and gloo can abort there
    (SIGABRT instead of the documented code; seen once in CI for a STOP decision on rank 0, which hosts the store).
    """
    from gemscout.errors import GemscoutError

    try:
        main()
    except GemscoutError as exc:
        print(f"gemscout: {type(exc).__name__}: {exc}", flush=True)
        sys.stderr.flush()
        os._exit(exc.exit_code)


def trust_states(session: Any) -> dict[str, str]:
    """Drain GEMINI's io and return its trust state per step (empty without GEMINI)."""
    if session is None or session.checkpointer is None:
        return {}
    session.checkpointer.drain()
    return {str(s): st.value for s, st in sorted(session.checkpointer.ledger.states.items())}
