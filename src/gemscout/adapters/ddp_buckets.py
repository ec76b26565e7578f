"""DDP's rebuilt gradient-bucket layout, carried across a restart so the resumed step reduces as the uninterrupted one.

Why: a ``DistributedDataParallel`` that does not look for unused parameters (the default) starts with one bucket in
registration order and, after the first backward of *every process*, rebuilds its buckets in the order its gradients
became ready there (rank 0 of its group decides and broadcasts). gloo's and NCCL's ring all-reduce add the ranks'
values of an element in an order that depends on the element's offset in its bucket, so with 3+ ranks a restarted
process — whose first step reduces in the initial layout — differs in the last bits from the uninterrupted run, which
reduced that step in the rebuilt one. The rebuilt layout is a pure function of the first backward, so gemscout
records it and brings it back:

1. **record** (a fresh process): post-accumulate-grad hooks on the reducer's parameters note the order of the first
   backward; the layout follows with DDP's own assignment function and the limits its reducer rebuilds with. The
   hooks go away once the layout is known (or at the session's close). Under ``static_graph`` DDP rebuilds after
   the second backward: a restart from a capture of step 1 then keeps the initial layout and is not bitwise.
2. **store**: the layout rides in every capture's caller state (``{STATE_KEY: ..., "caller": <yours>}``), so it comes
   back with its step from memory, a peer's replica or the durable tier.
3. **replay** (a restart that restores a step >= 1): before the first forward, ``ddp.reducer`` (and ``ddp.logger``)
   are replaced by a reducer built on the recorded layout — the layout DDP's group rank 0 recorded, as DDP itself
   would broadcast — and the DDP's registered comm hooks are registered on it again. That reducer rebuilds once more
   after its first backward, into the same layout. The replacement is the DDP's own from then on (it outlives the
   session, like any reducer state).
4. **check**: once DDP has rebuilt, its logging data names the layout it chose; a recorded layout that differs is
   warned about and replaced by DDP's, so later captures hold the exact one.

``GEMSCOUT_DDP_BUCKET_REPLAY=0`` turns recording and replay off (the restarted step then reduces in DDP's initial
layout); the caller state is wrapped either way, so a checkpoint loads whichever way it was written.
Not replayed, with a warning on a restart: DDP's ``mixed_precision``, a built-in C++ comm hook, a DDP whose forward
already ran before ``enable_resiliency``. ``find_unused_parameters=True`` needs nothing: that reducer never rebuilds.
Written against torch 2.13's ``torch/nn/parallel/distributed.py`` (the private attributes it reads are named there).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["DISABLE_ENV", "STATE_KEY", "DdpBuckets", "attach", "logged_layout", "rebuilt_layout"]

log = logging.getLogger("gemscout")
STATE_KEY = "gemscout.ddp_buckets"
"""The key of the recorded layouts in the caller state gemscout captures for a job with DDP."""
DISABLE_ENV = "GEMSCOUT_DDP_BUCKET_REPLAY"
"""Set to ``0`` to leave DDP's reducer alone (no recording, no replay)."""

Layout = list[list[int]]
"""Per bucket, in reduction order, the reducer's parameter indices in their order inside the bucket."""


def _rebuilds(ddp: DistributedDataParallel) -> bool:
    """Whether DDP's C++ reducer rebuilds its buckets after the first backward (its ``should_rebuild_buckets``)."""
    if (
        getattr(ddp, "reducer", None) is None or ddp._use_python_reducer
    ):  # all params on a delayed hook, compiled DDP
        return False
    return bool(ddp.static_graph or not ddp.find_unused_parameters)


def _rebuild_limits(ddp: DistributedDataParallel) -> list[int]:
    """The bucket size limits the reducer rebuilds with: the per-bucket list given to DDP, else its C++ default
    (the first bucket small, then ``bucket_cap_mb``)."""
    _, limits = ddp._bucket_config.compute_bucket_size_limits(
        static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters
    )
    return list(limits) or [ddp._bucket_config.first_bucket_bytes_cap, ddp.bucket_bytes_cap]


def rebuilt_layout(
    ddp: DistributedDataParallel, ready_order: Sequence[int]
) -> tuple[Layout, list[int]]:
    """The layout (and per-bucket size limits) DDP's reducer rebuilds into when the gradients of its parameters
    (reducer indices) became ready in ``ready_order``: DDP's own assignment function with the reducer's limits."""
    params, expect_sparse = ddp._build_params_for_reducer()
    order = list(ready_order)
    last_small = os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1"
    if (
        last_small
    ):  # the reducer then assigns from the other end, so that the small bucket is the last one
        order.reverse()
    buckets, limits = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], _rebuild_limits(ddp), expect_sparse, order
    )
    layout, sizes = [list(b) for b in buckets], list(limits)
    if last_small:
        layout.reverse()
        sizes.reverse()
    return layout, sizes


def logged_layout(ddp: DistributedDataParallel) -> Layout | None:
    """The layout DDP reports it rebuilt into (its logging data, filled at the forward after the rebuild), or None."""
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not isinstance(text, str) or not text.strip():
        return None
    return [[int(i) for i in bucket.split()] for bucket in text.split(",")]


def _not_replayable(ddp: DistributedDataParallel) -> str | None:
    """Why gemscout cannot rebuild this DDP's reducer on a recorded layout, or None when it can."""
    if ddp.mixed_precision is not None:
        return (
            "DDP mixed_precision is set (its reducer takes private casts gemscout does not repeat)"
        )
    if ddp._get_ddp_logging_data().get("comm_hook") and not ddp._comm_hooks:
        return "a built-in comm hook is registered (it cannot be registered again on a new reducer)"
    if ddp._lazy_init_ran:
        return "the DDP ran a forward before enable_resiliency (its reducer may be mid-iteration)"
    return None


def _rebuild_reducer(ddp: DistributedDataParallel, layout: Layout, limits: list[int]) -> None:
    """Replace ``ddp.reducer`` and ``ddp.logger`` by ones built on ``layout``, as DDP's ``_ddp_init_helper`` builds
    them on its initial layout; the DDP's comm hooks and static-graph mode carry over."""
    params, expect_sparse = ddp._build_params_for_reducer()
    if sorted(i for bucket in layout for i in bucket) != list(range(len(params))):
        raise ValueError(
            f"recorded DDP bucket layout does not cover the reducer's {len(params)} parameters"
        )
    sizes = limits if len(limits) == len(layout) else [ddp.bucket_bytes_cap] * len(layout)
    # The old reducer's hooks on the parameters' grad accumulators would reduce every gradient a second time.
    ddp.reducer._remove_autograd_hooks()
    reducer = dist.Reducer(
        params,
        layout,
        sizes,
        ddp.process_group,
        expect_sparse,
        ddp.bucket_bytes_cap,
        ddp.find_unused_parameters,
        ddp.gradient_as_bucket_view,
        ddp._build_debug_param_to_name_mapping(params),
        ddp._bucket_config.first_bucket_bytes_cap,
        ddp.skip_all_reduce_unused_params,
        ddp._use_python_reducer,
        _rebuild_limits(ddp) if ddp._bucket_config.has_custom_per_bucket_caps else [],
        ddp.batched_grad_copy,
    )
    logger = dist.Logger(reducer)
    reducer.set_logger(logger)
    logger.set_construction_data_and_log(
        ddp.module.__class__.__name__,
        [] if ddp.device_ids is None else ddp.device_ids,
        -1 if ddp.output_device is None else ddp.output_device,
        ddp.forward_sync_buffers,
        any(isinstance(m, nn.SyncBatchNorm) for m in ddp.module.modules()),
        ddp.static_graph,
    )
    if ddp.static_graph:
        reducer._set_static_graph()
        logger._set_static_graph()
    ddp.reducer, ddp.logger = reducer, logger
    for hook, state in ddp._comm_hooks:
        logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(reducer, state, hook)


@dataclass(slots=True)
class _Tracked:
    """One DDP of the model: its layout once known, and the hooks recording its first backward until then."""

    name: str
    ddp: DistributedDataParallel
    n_params: int
    layout: Layout | None = None
    limits: list[int] = field(default_factory=list)
    checked: bool = False
    backwards: int = 0
    order: list[int] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)

    def record(self) -> None:
        params, _ = self.ddp._build_params_for_reducer()
        seen: set[int] = set()

        def ready(index: int) -> Callable[[torch.Tensor], None]:
            def hook(_: torch.Tensor) -> None:
                # The reducer's own hook sits on the same grad accumulator: the order seen here is the order in
                # which it pushes its parameters for the rebuild.
                if self.backwards == 0:
                    self.order.append(index)
                seen.add(index)
                if len(seen) == self.n_params:
                    self.backwards += 1
                    seen.clear()

            return hook

        self.handles = [
            p.register_post_accumulate_grad_hook(ready(i)) for i, p in enumerate(params)
        ]

    def settle(self) -> None:
        """Derive the layout once DDP has what it rebuilds from — the first backward, or under ``static_graph`` the
        second (its first one only counts the hooks) — so a capture holds the layout of the step after it."""
        if self.layout is None and self.backwards >= (2 if self.ddp.static_graph else 1):
            self.layout, self.limits = rebuilt_layout(self.ddp, self.order)
        if self.layout is not None:
            self.unhook()

    def unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def check(self) -> None:
        """Compare the recorded layout with the one DDP reports once it has rebuilt; DDP's wins."""
        if self.checked or self.layout is None:
            return
        logged = logged_layout(self.ddp)
        if logged is None:
            return
        self.checked = True
        if logged != self.layout:
            log.warning(
                "gemscout: DDP %r rebuilt its gradient buckets as %s, not as gemscout recorded (%s); keeping DDP's "
                "from now on (a restart from an earlier capture reduces its first step differently)",
                self.name or "model",
                logged,
                self.layout,
            )
            self.layout = logged


class DdpBuckets:
    """The rebuilt bucket layouts of every DDP in a model, recorded, stored with each capture and replayed on a
    restart. Build with :func:`attach`; used by ``enable_resiliency`` only."""

    def __init__(self, tracked: list[_Tracked], *, enabled: bool = True) -> None:
        self._tracked = tracked
        self._enabled = enabled
        """False under ``GEMSCOUT_DDP_BUCKET_REPLAY=0``: nothing recorded or replayed; the caller state is still
        wrapped and unwrapped, so checkpoints written with the replay on or off load either way."""
        self._restored: dict[str, Any] = {}

    def wrap_state(
        self,
        extra_state_fn: Callable[[], Any] | None,
        load_extra_state_fn: Callable[[Any], None] | None,
    ) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        """The caller-state pair to capture with: the caller's own state beside the layouts."""

        def extra() -> dict[str, Any]:
            for t in self._tracked:
                t.settle()
                t.check()
            layouts = {
                t.name: {"buckets": t.layout, "limits": t.limits} for t in self._tracked if t.layout
            }
            return {
                STATE_KEY: layouts,
                "caller": extra_state_fn() if extra_state_fn is not None else None,
            }

        def load(state: Any) -> None:
            if isinstance(state, dict) and STATE_KEY in state:
                self._restored, caller = dict(state[STATE_KEY]), state.get("caller")
            else:  # written before gemscout kept DDP's layout: the caller's state as it was
                self._restored, caller = {}, state
            if load_extra_state_fn is not None and caller is not None:
                load_extra_state_fn(caller)

        return extra, load

    def start(self, *, restored: bool, group: dist.ProcessGroup, timeout: timedelta) -> list[str]:
        """Right after the session's recovery, before the first forward: when a step was ``restored``, put every
        DDP whose layout that step recorded on it; start recording every other DDP's first backward. Collective over
        ``group`` when ``restored`` (every rank restores, or none). Returns the names of the DDPs rebuilt."""
        if not self._enabled:
            return []
        rebuilt = self._replay(group, timeout) if restored else []
        for t in self._tracked:
            if t.name not in rebuilt:
                t.record()
        return rebuilt

    def _replay(self, group: dist.ProcessGroup, timeout: timedelta) -> list[str]:
        from gemscout import _dist as comm

        every = comm.gather_json(self._restored, group=group, timeout=timeout)
        rebuilt = []
        for t in self._tracked:
            # DDP takes the layout of its group's rank 0 (it broadcasts it): take the one that rank restored.
            source = dist.get_group_rank(group, dist.get_global_rank(t.ddp.process_group, 0))
            entry = every[source].get(t.name)
            if not entry:
                continue  # a step before the first backward (or an older checkpoint): the initial layout is right
            reason = _not_replayable(t.ddp)
            if reason is not None:
                log.warning(
                    "gemscout: DDP %r keeps its initial gradient buckets after this restart: %s; with 3+ ranks the "
                    "first resumed step then differs from the uninterrupted run in the last bits (docs/gemini.md)",
                    t.name or "model",
                    reason,
                )
                continue
            _rebuild_reducer(t.ddp, entry["buckets"], entry["limits"])
            t.layout, t.limits = entry["buckets"], entry["limits"]
            rebuilt.append(t.name)
        if rebuilt:
            log.info("gemscout: DDP gradient buckets rebuilt on the restored layout: %s", rebuilt)
        return rebuilt

    def remove(self) -> None:
        """Remove the recording hooks still in place (the session's close calls it with its other handles)."""
        for t in self._tracked:
            t.unhook()


def attach(model: nn.Module) -> DdpBuckets | None:
    """The bucket layouts of every DDP in ``model`` (itself or a submodule) whose reducer rebuilds; nothing is
    installed before :meth:`DdpBuckets.start`. None when there is no such DDP."""
    ddps = [
        (name, m) for name, m in model.named_modules() if isinstance(m, DistributedDataParallel)
    ]
    ddps = [(name, m) for name, m in ddps if _rebuilds(m)]
    if not ddps:
        return None
    enabled = os.environ.get(DISABLE_ENV, "1") != "0"
    if not enabled:
        log.warning(
            "gemscout: %s=0: DDP's rebuilt gradient buckets are not carried across restarts; with 3+ ranks the first "
            "step after a restart differs from the uninterrupted run in the last bits",
            DISABLE_ENV,
        )
    return DdpBuckets(
        [_Tracked(name, m, len(m._build_params_for_reducer()[0])) for name, m in ddps],
        enabled=enabled,
    )
