"""What a torchrun cell expects and what it observed of the ranks' restore: the drawn kill (:func:`draw`), the steps a
kill may leave restorable (:func:`expected_steps`), what every rank held when recovery began (:func:`held_restore`)
and the comparison of the ranks' results with the uninterrupted run (:func:`compare`)."""

from __future__ import annotations

import random
from typing import Any

from qualification.programs._contract import against_reference

PHASES = (
    "after-step",
    "in-step",
    "capture",
    "persist",
    "replicate",
    "persist_replica",
    "random:40",
)


def draw(fault: dict[str, Any], steps: int, seed: int) -> tuple[int, str]:
    rng = random.Random(f"torchrun-cell:{seed}")
    step = fault.get("step", "random")
    phase = fault.get("phase", "random")
    step = rng.randint(2, steps - 2) if step == "random" else int(step)
    phase = rng.choice(PHASES) if phase == "random" else str(phase)
    return step, phase


def expected_steps(step: int, phase: str) -> list[int]:
    """Steps a kill at (step, phase) may leave as the newest one every rank can restore. ``after-step`` drains the
    step's io first: exactly that step. Otherwise the killed rank's copy is its replica on a peer, which is written in
    the background while the next step runs (measured under load: a kill inside step 3 found step 2's replica exchange
    still in flight and recovered step 1): inside step S (``in-step``, ``capture``) S-2 or S-1; on S's io thread S-2
    to S; ``random:<ms>`` fires up to that long after step S, so possibly inside S+1: S-2 to S+1."""
    if phase == "after-step":
        return [step]
    newest = {"in-step": step - 1, "capture": step - 1}.get(
        phase, step + 1 if phase.startswith("random:") else step
    )
    return list(range(max(0, step - 2), newest + 1))


_OWN_TIERS = (("memory", "memory"), ("own", "local"))
_PEER_TIERS = ("memory_replica", "replica")


def held_restore(
    held: dict[str, dict[str, dict[str, list[int]]]], world: int
) -> tuple[int | None, list[str | None]]:
    """From what each rank held when recovery began (``held``, see :mod:`qualification.programs.torchrun_rank`):
    the newest step every rank held a copy of, and for each rank where that copy was — its own memory slot
    (``memory``), else its own file (``local``), else a peer's replica (``peer:N``, a replica in memory before one on
    disk, the lowest such rank first). ``(None, [None, ...])`` when no step was held by every rank: then the only
    correct outcome is no restore, and a recovered step must not match."""

    def copy_of(rank: int, step: int) -> str | None:
        mine = held.get(str(rank), {})
        for kind, name in _OWN_TIERS:
            if step in mine.get(kind, {}).get(str(rank), []):
                return name
        for kind in _PEER_TIERS:
            for peer in range(world):
                if step in held.get(str(peer), {}).get(kind, {}).get(str(rank), []):
                    return f"peer:{peer}"
        return None

    steps = {
        s
        for tiers in held.values()
        for owners in tiers.values()
        for v in owners.values()
        for s in v
    }
    for step in sorted(steps, reverse=True):
        where = [copy_of(r, step) for r in range(world)]
        if all(where):
            return step, where
    return None, [None] * world


def compare(
    observed: dict[str, Any], ranks: list[dict[str, Any]], reference: list[dict[str, Any]] | None
) -> None:
    if reference is None:
        reference = [r["baseline"] for r in ranks]
    decision = ranks[0].get("decision") or {}
    observed["mode"] = decision.get("mode")
    observed["recovered_step"] = decision.get("step")
    by_rank = decision.get("sources", {})
    observed["sources"] = [
        by_rank.get(str(r)) for r in range(len(ranks))
    ]  # a list: expect tables are operators
    observed.update(against_reference(ranks, reference))
    held: dict[str, dict[str, dict[str, list[int]]]] = {}
    for r in ranks:  # each node's local rank 0 reported its node's ranks
        held.update(r.get("held") or {})
    observed["held"] = held
    observed["held_step"], observed["held_sources"] = held_restore(held, len(ranks))
    observed["local_world_size"] = sorted({r.get("local_world_size", 0) for r in ranks})
