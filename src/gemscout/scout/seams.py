"""The seams SCOUT offers the harness and instrumentation: which replay runs on this rank right now, and hooks on a
replay's inputs, outputs and collectives (fault injection lives in the harness; these are the places it plugs in).
Ordinary module and tensor hooks serve persistent faults; these reach the replay only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from torch.utils.hooks import RemovableHandle

from gemscout.scout.replay import ReplayContext, ReplayHook, ReplayHooks

__all__ = ["ReplaySeams"]


class ReplaySeams:
    """What :class:`~gemscout.scout.engine.Scout` exposes about its replays (a base class: the engine sets
    ``_current`` around each replay and calls the registered hooks)."""

    def __init__(self) -> None:
        self._hooks = ReplayHooks()
        self._collective_hooks: OrderedDict[int, Callable[[ReplayContext, str], None]] = (
            OrderedDict()
        )
        self._current: ReplayContext | None = None

    @property
    def current_replay(self) -> ReplayContext | None:
        """The replay running on this rank right now (recipe, step, rank, source), or None outside replay."""
        return self._current

    def register_replay_input_hook(self, hook: ReplayHook) -> RemovableHandle:
        """Call ``hook(ctx, inputs)`` before each replay on this rank; it may return replacement inputs. The
        precondition digests are taken before it runs. For fault injection and instrumentation."""
        return ReplayHooks.add(self._hooks.inputs, hook)

    def register_replay_collective_hook(
        self, hook: Callable[[ReplayContext, str], None]
    ) -> RemovableHandle:
        """Call ``hook(ctx, op)`` on this rank right before each collective a replay issues (the TP all-reduces of a
        TP-sharded block); ``op`` names the collective. For fault injection: a delayed collective."""
        if not callable(hook):
            raise TypeError(f"a replay collective hook must be callable, got {type(hook).__name__}")
        handle = RemovableHandle(self._collective_hooks)
        self._collective_hooks[handle.id] = hook
        return handle

    def register_replay_output_hook(self, hook: ReplayHook) -> RemovableHandle:
        """Call ``hook(ctx, outputs)`` after each replay on this rank with every tensor about to be digested
        (``output``, ``grad.*``; ``param.*``/``state.*`` for optimizer slices); it may return replacements."""
        return ReplayHooks.add(self._hooks.outputs, hook)
