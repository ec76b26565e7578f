"""Name the root of a stall from the ranks' published progress (pure logic, no I/O).

When a job stops, most ranks are usually waiting inside the same collective and the root is the rank that never got
there: three ranks wait in ``all_reduce`` #42 of the world group while rank 1 is still past #41 → rank 1. The rules,
in order:

1. A rank whose heartbeat stopped (its process is gone) is the root.
2. Among ranks waiting inside a collective, the reference is the ``(group, sequence)`` most of them wait in (ties go to
   the newest sequence). Roots are the group's ranks that have not entered it (their count on that group is lower),
   plus ranks waiting in it with a fingerprint (op, shapes) that differs from the strict majority's (a desync).
3. With nobody inside a collective: ranks behind the most common step are roots; failing that, the stuck ranks when
   they are a minority; failing that, nobody (a stall without a culprit, reported as such).

Group membership: every rank belongs to the default group (``"world"``); for other groups only ranks that have entered
the group at least once are known members, so a rank that hangs before its first collective on a subgroup is found by
rule 3 or by its peers' heartbeat evidence, not by rule 2.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from gemscout.watch.findings import StallKind
from gemscout.watch.records import DEFAULT_GROUP, ProgressRecord
from gemscout.watch.stalls import section_kind


@dataclass(kw_only=True, slots=True, frozen=True)
class RootVerdict:
    """Where a stall comes from, as far as the records show."""

    kind: StallKind
    ranks: tuple[int, ...]
    """Ascending root ranks; empty when no rank can be singled out."""
    reason: str
    step: int | None
    evidence: Mapping[str, Any] = field(default_factory=dict)


def locate_root(
    records: Mapping[int, ProgressRecord],
    *,
    stuck: Collection[int],
    dead: Collection[int] = (),
) -> RootVerdict:
    """Apply the rules of this module to the live ranks' ``records``.

    ``stuck``: ranks whose progress has not changed for the stall threshold; ``dead``: ranks whose heartbeat stopped
    or that never published. Closed records are ignored. Never raises on well-formed records.
    """
    live = {r: rec for r, rec in records.items() if not rec.closed}
    evidence: dict[str, Any] = {
        "positions": {str(r): _position(rec) for r, rec in sorted(live.items())},
        "stuck": sorted(stuck),
        "dead": sorted(dead),
    }
    if dead:
        roots = tuple(sorted(dead))
        return RootVerdict(
            kind="hang",
            ranks=roots,
            step=_min_step(live, roots),
            evidence=evidence,
            reason=f"rank(s) {list(roots)} stopped publishing heartbeats: the process is gone or frozen",
        )
    waiting = {
        r: rec.collective
        for r, rec in live.items()
        if rec.collective is not None and rec.collective.active
    }
    if waiting:
        places = Counter((c.group, c.seq) for c in waiting.values())
        (group, seq), n_waiting = max(places.items(), key=lambda item: (item[1], item[0][1]))
        at_ref = sorted(r for r, c in waiting.items() if (c.group, c.seq) == (group, seq))
        fingerprints = Counter((waiting[r].op, waiting[r].shapes) for r in at_ref)
        (op, shapes), n_same = fingerprints.most_common(1)[0]
        desynced = (
            []
            if 2 * n_same <= len(at_ref)
            else [r for r in at_ref if (waiting[r].op, waiting[r].shapes) != (op, shapes)]
        )
        members = sorted(
            live
            if group == DEFAULT_GROUP
            else (r for r, rec in live.items() if group in rec.group_seqs)
        )
        behind = [r for r in members if r not in at_ref and live[r].group_seqs.get(group, 0) < seq]
        evidence["reference"] = {
            "group": group,
            "seq": seq,
            "op": op,
            "shapes": [list(s) for s in shapes],
            "waiting": n_waiting,
            "members": len(members),
        }
        evidence["desynced"] = desynced
        roots = tuple(sorted(set(behind) | set(desynced)))
        if roots:
            parts = []
            if behind:
                parts.append(
                    f"rank(s) {behind} never entered {op} #{seq} on group {group!r}, "
                    f"where {n_waiting} of {len(members)} rank(s) wait"
                )
            if desynced:
                parts.append(
                    f"rank(s) {desynced} entered #{seq} on {group!r} with a different op or shapes"
                )
            return RootVerdict(
                kind=_kind_of(live, roots),
                ranks=roots,
                step=_min_step(live, roots),
                evidence=evidence,
                reason="; ".join(parts),
            )
        return RootVerdict(
            kind="hang",
            ranks=(),
            step=_min_step(live, at_ref),
            evidence=evidence,
            reason=f"{n_waiting} rank(s) wait in {op} #{seq} on group {group!r} and no rank lags: "
            "the collective itself (network or library) is stuck",
        )
    steps = Counter(rec.step for rec in live.values())
    if steps:
        ref_step = max(steps.items(), key=lambda item: (item[1], item[0]))[0]
        evidence["reference"] = {"step": ref_step}
        late = tuple(sorted(r for r, rec in live.items() if rec.step < ref_step))
        if late:
            return RootVerdict(
                kind=_kind_of(live, late),
                ranks=late,
                step=_min_step(live, late),
                evidence=evidence,
                reason=f"rank(s) {list(late)} are behind step {ref_step} of the majority",
            )
    stuck_live = tuple(sorted(r for r in stuck if r in live))
    if stuck_live and 2 * len(stuck_live) < len(live):
        return RootVerdict(
            kind=_kind_of(live, stuck_live),
            ranks=stuck_live,
            step=_min_step(live, stuck_live),
            evidence=evidence,
            reason=f"rank(s) {list(stuck_live)} made no progress while the majority did",
        )
    return RootVerdict(
        kind="hang",
        ranks=(),
        step=_min_step(live, tuple(live)),
        evidence=evidence,
        reason="every rank stopped at the same place outside any collective; no rank lags",
    )


def _position(rec: ProgressRecord) -> dict[str, Any]:
    coll = rec.collective
    return {
        "host": rec.host,
        "step": rec.step,
        "section": rec.section,
        "group_seqs": dict(rec.group_seqs),
        "collective": None
        if coll is None
        else {
            "op": coll.op,
            "group": coll.group,
            "seq": coll.seq,
            "active": coll.active,
            "shapes": [list(s) for s in coll.shapes],
        },
    }


def _kind_of(live: Mapping[int, ProgressRecord], roots: Collection[int]) -> StallKind:
    """A stall whose roots all sit in timed sections of one kind is that kind of stall; otherwise a hang."""
    kinds = {section_kind(s) if (s := live[r].section) else "hang" for r in roots if r in live}
    return kinds.pop() if len(kinds) == 1 else "hang"


def _min_step(live: Mapping[int, ProgressRecord], ranks: Collection[int]) -> int | None:
    steps = [live[r].step for r in ranks if r in live]
    return min(steps) if steps else None
