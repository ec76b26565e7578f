"""Live sessions close before torch's process groups go away — arranged only while a session is live.

A live session runs threads (GEMINI's io thread, the watchdog, health polling) that use gemscout's own gloo groups;
``dist.destroy_process_group()`` while one of them is inside a collective would pull the group from under it. So while
at least one session is live, ``torch.distributed.destroy_process_group`` is wrapped: the wrapper closes every live
session, then calls torch's function. When the last live session closes, torch's own function is put back.
``import gemscout`` changes nothing in torch.

A caller that bound torch's function before the session started (``from torch.distributed import
destroy_process_group``) calls it unwrapped: close the session (or leave its ``with`` block) first.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

_lock = threading.Lock()
_original: Callable[..., Any] | None = None
_MARK = "_gemscout_closes_sessions_first"


def hold(close_all: Callable[[], None]) -> None:
    """Wrap ``dist.destroy_process_group`` so that it runs ``close_all`` first (once; later calls keep the wrap)."""
    global _original
    with _lock:
        if _original is not None:
            return
        original = dist.destroy_process_group

        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            close_all()  # the sessions' close releases the wrap: torch's function is back before it runs
            return original(*args, **kwargs)

        setattr(destroy_process_group, _MARK, True)
        _original = original
        dist.destroy_process_group = destroy_process_group


def release() -> None:
    """Put torch's ``destroy_process_group`` back (the last live session has closed)."""
    global _original
    with _lock:
        if _original is None:
            return
        if getattr(dist.destroy_process_group, _MARK, False):
            dist.destroy_process_group = _original
        # Otherwise someone wrapped ours since: theirs stays, and ours inside it closes nothing and calls torch's.
        _original = None


def holding() -> bool:
    """Whether ``dist.destroy_process_group`` is wrapped now (for tests and diagnostics)."""
    return _original is not None
