"""The job's own FSDP2 collectives as communication evidence: FSDP2's parameter all-gathers and gradient
reduce-scatters, timed on every rank.

FSDP2 lets a caller replace the function that runs each parameter group's all-gather and reduce-scatter
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``). :class:`FsdpCollectiveTimer` installs, on
every ``fully_shard`` module, a thin wrapper around the comm already installed there (FSDP2's default unless the
caller set one): it calls the same function with the same arguments — the bytes exchanged are FSDP's own, so
training does not change by a bit — and adds up how long this rank waited in it, from its entry until the
collective completed (the call's return when synchronous, as FSDP2 runs them on CPU; the work's future otherwise).

As with DDP's all-reduces (:class:`~gemscout.scout.comm_probe.JobCollectiveTimer`), a rank that enters late waits
the least and its shard-group partners wait about as long as it was late, so each rank's *lateness* in its shard
group (the longest wait of the group minus its own) names the late rank. HSDP's gradient all-reduce across the
replicas is not replaceable in FSDP2 and is not timed; the probe groups (:class:`~gemscout.scout.comm_probe.CommProbe`)
cover the replicate dim.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from gemscout.errors import ConfigError
from gemscout.scout.comm_probe import gather_hosts

__all__ = ["FsdpCollectiveTimer", "fsdp_modules"]


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """Every ``fully_shard`` module of ``model`` (itself included), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class FsdpCollectiveTimer:
    """Times a ``fully_shard`` model's own all-gathers and reduce-scatters. Construct on every rank of ``group``
    (host names are gathered over it). ``groups``: the shard groups (global ranks), inside which lateness is judged.

    Raises ``ConfigError`` when the model has no ``fully_shard`` module, or one whose comms cannot be replaced (a
    module with several parameter groups, from a per-parameter mesh). :meth:`take` returns this rank's summed wait
    since the last call."""

    def __init__(
        self,
        model: nn.Module,
        *,
        group: dist.ProcessGroup,
        groups: Sequence[Sequence[int]],
        timeout: timedelta,
    ) -> None:
        modules = fsdp_modules(model)
        if not modules:
            raise ConfigError(
                "time_job_collectives: the model has no fully_shard module (FSDP2); "
                "job-collective timing covers DDP and FSDP2 models"
            )
        self.groups: tuple[tuple[int, ...], ...] = tuple(tuple(g) for g in groups)
        self.rank_to_host = gather_hosts(group, timeout)
        self._lock = threading.Lock()
        self._wait_s = 0.0
        self._calls = 0
        self._before: OrderedDict[int, Callable[[str], None]] = OrderedDict()
        self._installed: list[tuple[Any, Any, Any]] = []
        gather_cls, scatter_cls = _wrapper_classes(self)
        for module in modules:
            state = module._get_fsdp_state()  # type: ignore[operator]
            param_groups = list(state._fsdp_param_groups)
            if len(param_groups) > 1:
                raise ConfigError(
                    "time_job_collectives: a fully_shard module with several parameter groups (a "
                    "per-parameter mesh) takes no custom comm; turn ScoutConfig.job_collectives off"
                )
            for pg in param_groups:
                self._installed.append((pg, pg._all_gather_comm, pg._reduce_scatter_comm))
                pg._all_gather_comm = gather_cls(pg._all_gather_comm)
                pg._reduce_scatter_comm = scatter_cls(pg._reduce_scatter_comm)

    def register_before_collective(self, fn: Callable[[str], None]) -> RemovableHandle:
        """Fault-injection seam: ``fn(kind)`` (``"all_gather"`` or ``"reduce_scatter"``) runs on this rank right
        before it enters one of FSDP2's collectives (a delay here is a late arrival)."""
        handle = RemovableHandle(self._before)
        self._before[handle.id] = fn
        return handle

    def take(self) -> float | None:
        """Seconds this rank waited in FSDP2's collectives since the last call (None when none ran); resets."""
        with self._lock:
            waited, calls = self._wait_s, self._calls
            self._wait_s, self._calls = 0.0, 0
        return waited if calls else None

    def remove(self) -> None:
        """Put back the comms that were installed before; idempotent."""
        for pg, gather, scatter in self._installed:
            pg._all_gather_comm, pg._reduce_scatter_comm = gather, scatter
        self._installed.clear()

    # -- used by the wrappers ---------------------------------------------------------------------------------------
    def _enter(self, kind: str) -> float:
        for fn in list(self._before.values()):
            fn(kind)
        return time.perf_counter()  # started after the seam: a late rank is measured from its entry

    def _done(self, start: float) -> None:
        waited = time.perf_counter() - start
        with self._lock:  # an async work completes on the backend's thread
            self._wait_s += waited
            self._calls += 1

    def _timed(self, kind: str, call: Callable[[], Any]) -> Any:
        start = self._enter(kind)
        work = call()
        if work is None:
            self._done(start)
            return None
        work.get_future().then(lambda _fut: self._done(start))
        return work


def _wrapper_classes(timer: FsdpCollectiveTimer) -> tuple[type, type]:
    """FSDP2's comm interfaces (torch-private, so imported here, only when a timer is built), wrapped."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class TimedAllGather(AllGather):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(
            self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False
        ) -> Any:
            return timer._timed(
                "all_gather",
                lambda: self.inner(output_tensor, input_tensor, group, async_op=async_op),
            )

    class TimedReduceScatter(ReduceScatter):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(
            self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
        ) -> Any:
            return timer._timed(
                "reduce_scatter",
                lambda: self.inner(output_tensor, input_tensor, group, op, async_op=async_op),
            )

    return TimedAllGather, TimedReduceScatter
