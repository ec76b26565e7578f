"""The pure half of the AllToAll check: the replay plan, the deterministic payloads, the judgement and the reports.

No process group here: :mod:`~gemscout.scout.alltoall.check` gathers what these functions read, on every rank alike, so
every rank of an EP group computes the same plan and the same verdict from the same data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from gemscout.reports import FaultKind, FaultReport, Scope

__all__ = ["CASES", "judge", "payload", "plan_cases", "reports_for"]

CASES: tuple[str, ...] = ("recorded", "balanced", "cyclic")
"""The representative AllToAlls replayed at a due step, in replay order."""


def _splits_valid(split: Any, width: int) -> bool:
    return (
        isinstance(split, list)
        and len(split) == width
        and all(type(n) is int and n >= 0 for n in split)
    )


def plan_cases(
    group: Sequence[int], gathered: Sequence[Sequence[Any]], cases: Sequence[str], max_rows: int
) -> tuple[dict[str, list[list[int]]], str, list[int]] | str:
    """The send-row matrix ``[src][dst]`` of each case, the dtype and the row shape, from every group rank's recorded
    metadata (``gathered[i]``: group rank ``i``'s records for this group, as :meth:`AllToAllRecord.to_json`); or a
    reason string when the records cannot support a replay. Pure: every rank computes the same plan."""
    width = len(group)
    counts = {len(records) for records in gathered}
    if len(gathered) != width or counts == {0}:
        return "no AllToAll was recorded on this group since the last check"
    if len(counts) > 1:
        return f"ranks recorded different numbers of AllToAlls (by group rank: {[len(r) for r in gathered]})"
    best, best_bytes = None, -1
    for index in range(counts.pop()):
        calls = [records[index] for records in gathered]
        if any(list(call[0]) != list(group) for call in calls):
            return f"AllToAll #{index} was recorded on different groups"
        if len({(call[1], tuple(call[2])) for call in calls}) > 1:
            return f"AllToAll #{index} has different dtypes or row shapes across ranks"
        if not all(
            _splits_valid(call[3], width) and _splits_valid(call[4], width) for call in calls
        ):
            return f"AllToAll #{index} has malformed split sizes"
        for src in range(width):
            for dst in range(width):
                if calls[src][3][dst] != calls[dst][4][src]:
                    return (
                        f"AllToAll #{index}: group rank {src} recorded sending {calls[src][3][dst]} rows to group "
                        f"rank {dst}, which recorded receiving {calls[dst][4][src]}"
                    )
        row = 1
        for n in calls[0][2]:
            row *= int(n)
        size = sum(sum(call[3]) for call in calls) * row
        if size > best_bytes:
            best, best_bytes = calls, size
    assert best is not None
    dtype, row_shape = str(best[0][1]), [int(n) for n in best[0][2]]
    recorded = [list(call[3]) for call in best]
    for (
        row_splits
    ) in recorded:  # keep each sender's rows within max_rows, trimming its largest splits first
        while sum(row_splits) > max_rows:
            row_splits[max(range(width), key=lambda k: row_splits[k])] -= 1
    mean_rows = sum(sum(r) for r in recorded) // width
    per_pair = max(1, min(max_rows // width, mean_rows // width))
    out: dict[str, list[list[int]]] = {}
    for case in cases:
        if case == "recorded":
            out[case] = recorded
        elif case == "balanced":
            out[case] = [[per_pair] * width for _ in range(width)]
        elif case == "cyclic":
            total = min(max_rows, per_pair * width)
            out[case] = [
                [total if dst == (src + 1) % width else 0 for dst in range(width)]
                for src in range(width)
            ]
    return out, dtype, row_shape


def payload(
    *,
    step: int,
    case: str,
    src: int,
    dst: int,
    rows: int,
    row_shape: Sequence[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The deterministic chunk global rank ``src`` sends to ``dst`` in ``case`` at ``step``: random bytes from a
    private generator, viewed as ``dtype`` (any bit pattern, NaNs included: the check compares bytes, not values)."""
    seed = (
        int.from_bytes(
            hashlib.sha256(f"a2a:{step}:{case}:{src}:{dst}".encode()).digest()[:8], "little"
        )
        >> 1
    )
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = rows
    for n in row_shape:
        numel *= int(n)
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(rows, *row_shape)


def judge(
    group: Sequence[int], matrices: dict[str, list[list[int]]], gathered: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every mismatching chunk of the replay, from each group rank's digests (``gathered[i]`` holds, per case,
    ``sent`` (digest per dst), ``expected_in`` and ``received`` (digest per src)). Pure and the same on every rank.

    A chunk whose sender digest differs from what the receiver regenerated blames the sender (``kind: sender``); one
    that arrived different from what its sender digested blames the pair (``kind: transit``)."""
    out = []
    for case, matrix in matrices.items():
        for src in range(len(group)):
            for dst in range(len(group)):
                if matrix[src][dst] == 0:
                    continue
                sent = gathered[src][case]["sent"][dst]
                expected = gathered[dst][case]["expected_in"][src]
                received = gathered[dst][case]["received"][src]
                if sent != expected:
                    out.append(
                        {
                            "case": case,
                            "src": group[src],
                            "dst": group[dst],
                            "kind": "sender",
                            "sent": sent,
                            "expected": expected,
                            "received": received,
                        }
                    )
                elif received != sent:
                    out.append(
                        {
                            "case": case,
                            "src": group[src],
                            "dst": group[dst],
                            "kind": "transit",
                            "sent": sent,
                            "expected": expected,
                            "received": received,
                        }
                    )
    return out


def reports_for(
    step: int, group: Sequence[int], mismatches: Sequence[dict[str, Any]]
) -> list[FaultReport]:
    """One report per culprit: a sender whose own chunks were wrong (scope ``rank``), or a (sender, receiver) pair
    whose bytes changed between them (scope ``peer_group``). Pure."""
    reports = []
    senders = sorted({m["src"] for m in mismatches if m["kind"] == "sender"})
    for src in senders:
        mine = [m for m in mismatches if m["kind"] == "sender" and m["src"] == src]
        reports.append(
            FaultReport(
                kind=FaultKind.SDC,
                scope=Scope.RANK,
                ranks=(src,),
                step=step,
                recipe="alltoall",
                reason=(
                    f"AllToAll replay: rank {src} sent bytes that differ from the deterministic payload it was due to "
                    f"send ({len(mine)} chunk(s), cases {sorted({m['case'] for m in mine})}) in EP group "
                    f"{list(group)}"
                ),
                evidence={"signal": "alltoall", "group": list(group), "mismatches": list(mine)},
            )
        )
    pairs = sorted({(m["src"], m["dst"]) for m in mismatches if m["kind"] == "transit"})
    for src, dst in pairs:
        mine = [
            m for m in mismatches if m["kind"] == "transit" and (m["src"], m["dst"]) == (src, dst)
        ]
        reports.append(
            FaultReport(
                kind=FaultKind.SDC,
                scope=Scope.PEER_GROUP,
                ranks=(src, dst),
                step=step,
                recipe="alltoall",
                reason=(
                    f"AllToAll replay: bytes sent by rank {src} arrived changed at rank {dst} ({len(mine)} chunk(s), "
                    f"cases {sorted({m['case'] for m in mine})}); the sender, the receiver or the link between them "
                    f"corrupts data in EP group {list(group)}"
                ),
                evidence={
                    "signal": "alltoall",
                    "group": list(group),
                    "pair": [src, dst],
                    "mismatches": list(mine),
                },
            )
        )
    return reports
