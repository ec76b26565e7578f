"""The places in GEMINI's recovery where fault injection and instrumentation plug in (the runtime injects nothing).

Recovery runs inside :func:`gemscout.enable_resiliency`, before the caller holds a session, so its seams are
registered for the process, the way torch's global module hooks are: :func:`register_recovery_hook` returns a
handle whose ``remove()`` takes the hook out again. A hook is called as ``hook(point, owner, landed, total)``:

- ``"send"``: this rank is about to send the replica it holds of ``owner`` (``landed`` and ``total`` are 0);
- ``"received"``: bytes ``[0, landed)`` of the ``total`` of the replica this rank (``owner``) restores from have
  arrived, while the next chunk is still in flight; called once per chunk.

The io-thread phases of a running checkpointer (persist, replicate, ...) are
:attr:`gemscout.gemini.checkpointer.Checkpointer.phase_hook`. A hook must not raise; one that does is logged and
ignored, so an instrumentation bug cannot break a recovery.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from torch.utils.hooks import RemovableHandle

log = logging.getLogger("gemscout.gemini")

RecoveryPoint = Literal["send", "received"]
RecoveryHook = Callable[[RecoveryPoint, int, int, int], None]

_hooks: OrderedDict[int, RecoveryHook] = OrderedDict()


def register_recovery_hook(hook: RecoveryHook) -> RemovableHandle:
    """Call ``hook(point, owner, landed, total)`` at each recovery seam of this process until the handle is removed."""
    handle = RemovableHandle(_hooks)
    _hooks[handle.id] = hook
    return handle


def fire(point: RecoveryPoint, owner: int, landed: int = 0, total: int = 0) -> None:
    for hook in list(_hooks.values()):
        try:
            hook(point, owner, landed, total)
        except Exception as exc:  # an instrumentation bug must not break a recovery
            log.warning("gemini recovery hook %r failed at %s: %s", hook, point, exc)
