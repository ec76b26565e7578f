"""What every rank program does at its two ends: leave with the documented exit code, and leave without teardown."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist


def finish(out: Path, rank: int, result: dict[str, Any]) -> None:
    """Write ``out/rank<r>.json``, wait for every rank, and exit the process.

    Process-group teardown can deadlock in gloo (its worker frees tensors and needs the GIL while the group's
    destructor holds it): every rank has written its result and passed the barrier, so leave without it.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
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
