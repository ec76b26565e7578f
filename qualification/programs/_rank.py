"""What every rank program does at its two ends — leave with the documented exit code, leave without teardown — and
the lifecycle driver's fail-stop faults between steps."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from qualification.programs._kills import sigkill_self


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


def fail_stop(session: Any, rank: int, step: int, args: Any) -> None:
    """After ``step``: ``--kill-rank R --kill-step S`` SIGKILLs rank R once its checkpoint of S is out (drained, so the
    process dies before the next step; the kill is recorded under ``args.out`` first); ``--sigterm-step S`` sends SIGTERM to rank 0 (GEMINI's handler flushes the
    newest recoverable state and re-raises; the sleep is never reached)."""
    if rank == args.kill_rank and step == args.kill_step:
        if session is not None and session.checkpointer is not None:
            session.checkpointer.drain()
        sigkill_self(args.out, rank=rank, step=step, phase="after-step")
    if rank == 0 and step == getattr(args, "sigterm_step", None):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)


def trust_states(session: Any) -> dict[str, str]:
    """Drain GEMINI's io and return its trust state per step (empty without GEMINI)."""
    if session is None or session.checkpointer is None:
        return {}
    session.checkpointer.drain()
    return {str(s): st.value for s, st in sorted(session.checkpointer.ledger.states.items())}


def megatron_run_arguments(ap: Any) -> None:
    """The run arguments the Megatron rank programs share with the lifecycle driver (an ``argparse`` parser)."""
    ap.add_argument(
        "--workload",
        default="gpt-megatron",
        help="accepted for the lifecycle driver; always GPTModel",
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interval", type=int, default=1)
    ap.add_argument("--persist-every", type=int, default=1)
    ap.add_argument("--ranks-per-node", type=int, default=1)
