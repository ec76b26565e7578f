"""The runtime half of the AllToAll check (:class:`AllToAllCheck`): record the dispatch module's AllToAlls during
the step, and at a due step replay the planned set (:mod:`~gemscout.scout.alltoall.plan`) on every rank of each EP
group and gather the digests. The package doc says what is replayed and how it is judged.

How recording works: while the installed module's forward runs on the thread that called it,
``torch.distributed.all_to_all_single`` is wrapped so each call is noted and then passed through unchanged. Code that
bound the function before (``from torch.distributed import all_to_all_single``) is not seen; call it through the
module. Backward AllToAlls (the reverse of the forward ones) are not recorded.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from gemscout._dist import gather_json, wait_all
from gemscout.reports import FaultReport
from gemscout.scout.alltoall.config import AllToAllConfig
from gemscout.scout.alltoall.plan import judge, payload, plan_cases, reports_for
from gemscout.scout.alltoall.records import AllToAllRecord, AllToAllResult
from gemscout.scout.digests import tensor_digest

__all__ = ["AllToAllCheck", "Installed", "SendHook"]

SendHook = Callable[[str, int, torch.Tensor], torch.Tensor | None]
"""``fn(case, step, send_buffer)`` runs after the sender digested its chunks, right before the AllToAll; it may
return a replacement buffer (a fault seam: what a corrupting send path would do)."""


class Installed:
    """What :meth:`AllToAllCheck.install` returns: ``remove()`` stops recording that module."""

    def __init__(self, *handles: RemovableHandle) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# -- the runtime piece --------------------------------------------------------------------------------------------
class _Recording:
    """Wraps ``dist.all_to_all_single`` while an installed module's forward runs (process-wide, counted)."""

    lock = threading.Lock()
    depth = 0
    original: Any = None
    active: dict[int, list[AllToAllCheck]] = {}

    @classmethod
    def enter(cls, check: AllToAllCheck) -> None:
        with cls.lock:
            cls.active.setdefault(threading.get_ident(), []).append(check)
            if cls.depth == 0:
                cls.original = dist.all_to_all_single
                dist.all_to_all_single = cls.wrapper  # type: ignore[assignment]
            cls.depth += 1

    @classmethod
    def exit(cls, check: AllToAllCheck) -> None:
        with cls.lock:
            stack = cls.active.get(threading.get_ident(), [])
            if check in stack:
                stack.remove(check)
            cls.depth -= 1
            if cls.depth == 0:
                dist.all_to_all_single = cls.original
                cls.original = None

    @staticmethod
    def wrapper(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        for check in list(_Recording.active.get(threading.get_ident(), [])):
            check._note(output, input, output_split_sizes, input_split_sizes, group)
        return _Recording.original(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )


class AllToAllCheck:
    """Records the AllToAlls of the modules it is installed on and, at due steps, replays and verifies a bounded set
    of them on every rank of each EP group. Every rank of a group must call :meth:`before_step` at the same steps
    (or :meth:`register_step_hook` once); ``on_report`` receives each :class:`FaultReport`."""

    def __init__(
        self,
        config: AllToAllConfig | None = None,
        on_report: Callable[[FaultReport], None] | None = None,
    ) -> None:
        self.config = config if config is not None else AllToAllConfig()
        self.on_report = on_report
        self.records: list[tuple[AllToAllRecord, Any]] = []
        """Recorded calls since the last check, oldest first (at most ``max_records``), each with its group."""
        self.last_results: list[AllToAllResult] = []
        """The newest due step's results, one per EP group this rank belongs to."""
        self.job_mismatch = False
        """True when some group of the job found a mismatch at the newest due step (the same on every rank)."""
        self._control: Any = None
        self._gloo: dict[tuple[int, ...], Any] = {}
        self._send_hooks: OrderedDict[int, SendHook] = OrderedDict()
        # Where each group's AllToAlls ran: NCCL moves CUDA tensors only, so the replay runs on the same device.
        self._devices: dict[tuple[int, ...], torch.device] = {}

    # -- setup --------------------------------------------------------------------------------------------------
    def install(self, module: nn.Module) -> Installed:
        """Record every ``dist.all_to_all_single`` the forward of ``module`` issues. Returns a removable handle."""
        pre = module.register_forward_pre_hook(lambda m, a: _Recording.enter(self))
        post = module.register_forward_hook(lambda m, a, o: _Recording.exit(self), always_call=True)
        return Installed(pre, post)

    def register_step_hook(
        self, optimizer: torch.optim.Optimizer, *, first_step: int = 1
    ) -> RemovableHandle:
        """Run :meth:`before_step` from ``optimizer``'s step pre-hook, counting steps from ``first_step`` (the next
        optimizer step's number: ``resume_step + 1`` after a recovery). The check then sees the step's forward."""
        counter = {"step": first_step - 1}

        def hook(opt: Any, args: Any, kwargs: Any) -> None:
            counter["step"] += 1
            self.before_step(counter["step"])

        return optimizer.register_step_pre_hook(hook)

    def register_send_hook(self, hook: SendHook) -> RemovableHandle:
        """Add a hook run on each replayed send buffer after it was digested (see :data:`SendHook`)."""
        handle = RemovableHandle(self._send_hooks)
        self._send_hooks[handle.id] = hook
        return handle

    def _note(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None,
        input_splits: Sequence[int] | None,
        group: Any,
    ) -> None:
        ranks = (
            tuple(dist.get_process_group_ranks(group))
            if group is not None
            else tuple(range(dist.get_world_size()))
        )
        width = len(ranks)
        rows_in, rows_out = (
            (input.shape[0] if input.dim() else 0),
            (output.shape[0] if output.dim() else 0),
        )
        # Split sizes may come as a list, a tensor or a numpy array (Megatron's dispatcher): test for None and
        # length, never truthiness, which an array of several sizes refuses.
        ins = (
            tuple(int(n) for n in input_splits)
            if input_splits is not None and len(input_splits)
            else tuple([rows_in // width] * width)
        )
        outs = (
            tuple(int(n) for n in output_splits)
            if output_splits is not None and len(output_splits)
            else tuple([rows_out // width] * width)
        )
        record = AllToAllRecord(
            ranks, str(input.dtype).removeprefix("torch."), tuple(input.shape[1:]), ins, outs
        )
        self.records.append((record, group))
        self._devices[ranks] = input.device
        # Per group, so every member of a group keeps the same calls whatever its other groups recorded.
        mine = [i for i, (r, _) in enumerate(self.records) if r.group == ranks]
        if len(mine) > self.config.max_records:
            del self.records[mine[0]]

    # -- the check ----------------------------------------------------------------------------------------------
    def before_step(self, step: int) -> list[AllToAllResult] | None:
        """At a due step: replay and verify on every EP group seen since the last check, return one result per group
        (and deliver their reports); None when ``step`` is not due, an empty list when this rank recorded nothing.

        Collective over the whole job: every rank must call it at the same steps (every rank of a group recorded the
        same AllToAlls, since they were collectives). The metadata, digests and the job verdict travel on SCOUT's own
        gloo groups, created here the first time a group is seen (every rank creates every group, in one order); the
        replayed AllToAlls run on the recorded group, on the device the recorded ones used (CUDA under NCCL). Sets
        :attr:`job_mismatch`. Raises ``CollectiveTimeout`` when a rank misses a collective."""
        if step % self.config.interval:
            return None
        timeout = self.config.timeout
        if self._control is None:
            self._control = dist.new_group(backend="gloo", timeout=timeout)
        groups: dict[tuple[int, ...], Any] = {}
        for record, group in self.records:
            groups.setdefault(record.group, group)
        known = gather_json(sorted(list(g) for g in groups), group=self._control, timeout=timeout)
        for ranks in sorted({tuple(g) for listed in known for g in listed}):
            if (
                ranks not in self._gloo
            ):  # every rank calls new_group for every group, in the same order
                self._gloo[ranks] = dist.new_group(sorted(ranks), backend="gloo", timeout=timeout)
        mine = [(ranks, groups[ranks]) for ranks in sorted(groups)]  # the same order on every rank
        by_group = {
            ranks: [r.to_json() for r, _ in self.records if r.group == ranks] for ranks, _ in mine
        }
        self.records = []
        results = [self._check(step, ranks, group, by_group[ranks]) for ranks, group in mine]
        self.last_results = results
        flag = torch.tensor([int(any(r.verdict == "mismatch" for r in results))], dtype=torch.int64)
        wait_all(
            [dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control, async_op=True)],
            timeout,
            "alltoall job verdict",
        )
        self.job_mismatch = bool(flag.item())
        for result in results:
            for report in result.reports:
                if self.on_report is not None:
                    self.on_report(report)
        return results

    def _gather(self, ranks: tuple[int, ...], obj: Any) -> list[Any]:
        """One JSON object per rank of ``ranks``, in ``ranks`` order, over SCOUT's gloo twin of the group."""
        by_sorted = gather_json(obj, group=self._gloo[ranks], timeout=self.config.timeout)
        order = sorted(ranks)
        return [by_sorted[order.index(rank)] for rank in ranks]

    def _check(
        self, step: int, ranks: tuple[int, ...], group: Any, records: list[list[Any]]
    ) -> AllToAllResult:
        start = time.perf_counter()
        timeout = self.config.timeout
        plan = plan_cases(
            ranks, self._gather(ranks, records), self.config.cases, self.config.max_rows
        )
        if isinstance(plan, str):
            return AllToAllResult(
                step=step,
                group=ranks,
                verdict="inconclusive",
                reason=plan,
                seconds=time.perf_counter() - start,
            )
        matrices, dtype_name, row_shape = plan
        dtype = getattr(torch, dtype_name)
        me = ranks.index(dist.get_rank())
        device = self._devices.get(ranks, torch.device("cpu"))
        digests: dict[str, dict[str, list[str]]] = {}
        for case, matrix in matrices.items():
            sends = [
                payload(
                    step=step,
                    case=case,
                    src=ranks[me],
                    dst=ranks[j],
                    rows=matrix[me][j],
                    row_shape=row_shape,
                    dtype=dtype,
                )
                for j in range(len(ranks))
            ]
            expected = [
                payload(
                    step=step,
                    case=case,
                    src=ranks[i],
                    dst=ranks[me],
                    rows=matrix[i][me],
                    row_shape=row_shape,
                    dtype=dtype,
                )
                for i in range(len(ranks))
            ]
            buffer = torch.cat(sends).to(device)
            entry = {
                "sent": [tensor_digest(t) for t in sends],
                "expected_in": [tensor_digest(t) for t in expected],
            }
            for hook in list(self._send_hooks.values()):
                replaced = hook(case, step, buffer)
                buffer = replaced if replaced is not None else buffer
            out_splits = [matrix[i][me] for i in range(len(ranks))]
            received = torch.empty((sum(out_splits), *row_shape), dtype=dtype, device=device)
            work = (
                _Recording.original if _Recording.original is not None else dist.all_to_all_single
            )
            wait_all(
                [
                    work(
                        received,
                        buffer.contiguous(),
                        out_splits,
                        list(matrix[me]),
                        group=group,
                        async_op=True,
                    )
                ],
                timeout,
                f"alltoall replay ({case})",
            )
            entry["received"] = [tensor_digest(t) for t in received.split(out_splits)]
            digests[case] = entry
        everyone = self._gather(ranks, digests)
        mismatches = judge(ranks, matrices, everyone)
        reports = reports_for(step, ranks, mismatches)
        return AllToAllResult(
            step=step,
            group=ranks,
            verdict="mismatch" if mismatches else "clean",
            reason="" if not mismatches else reports[0].reason if reports else "mismatch",
            cases=matrices,
            mismatches=mismatches,
            reports=reports,
            seconds=time.perf_counter() - start,
        )
