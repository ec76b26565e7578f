"""The pure half of a SCOUT cycle: precondition records, parameter digests, and the verdict from gathered records.

Everything here runs on data already in hand (no process group), so every peer, given the same gathered records,
computes the same verdicts. :mod:`gemscout.scout.engine` does the collectives around it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch
from torch import nn

from gemscout.errors import EvidenceError
from gemscout.reports import FaultKind, FaultReport
from gemscout.scout.capture import Captured, to_json_value
from gemscout.scout.consensus import C3Result, Verdict
from gemscout.scout.digests import digest_many
from gemscout.scout.preconditions import Precondition, judge
from gemscout.scout.recipes import Recipe
from gemscout.scout.rotation import is_sdc

__all__ = [
    "CycleResult",
    "combine_groups",
    "inconclusive",
    "judge_gathered",
    "param_digest",
    "precondition_for",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CycleResult:
    """What one SCOUT cycle found; identical on every peer."""

    step: int
    """The step whose forward/backward/update inputs were replayed."""
    source_rank: int
    """Global rank whose captured inputs were broadcast."""
    peers: tuple[int, ...]
    """Global ranks that took part."""
    results: Mapping[str, C3Result]
    """Verdict per recipe replayed, in replay order."""
    replay_s: Mapping[str, Mapping[int, float]]
    """Replay seconds per recipe per rank (ranks whose replay failed are absent)."""
    reports: tuple[FaultReport, ...] = ()
    """SDC reports (attributed, or peer-group when no majority) and confirmed compute-straggler reports."""
    certified_step: int | None = None
    """The rotation tracker's answer after this cycle: the newest step every recipe has vouched for."""
    peer_groups: tuple[tuple[int, ...], ...] = ()
    """Every peer group judged in this cycle (one group, ``peers``, for DDP; one per model coordinate on a mesh).
    ``results`` combine them: every rank of the job holds the same verdicts."""
    gather_s: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    """Seconds per recipe per rank spent gathering sharded parameters before replay (empty when nothing is sharded):
    communication evidence, never counted as replay compute."""
    collective_s: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    """Seconds per recipe per rank spent in the replay's own collectives (TP); already left out of ``replay_s``."""

    @property
    def clean(self) -> bool:
        """True when every recipe agreed on every peer."""
        return all(result.verdict is Verdict.AGREE for result in self.results.values())

    @property
    def sdc(self) -> bool:
        """True when corrupted output was seen (attributed or not): GEMINI must not capture this step."""
        return any(report.kind is FaultKind.SDC for report in self.reports)

    @property
    def attributed_ranks(self) -> tuple[int, ...]:
        """Every rank named by an ATTRIBUTED verdict, sorted."""
        return tuple(sorted({r for result in self.results.values() for r in result.ranks}))

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (rank keys as strings); the topology fields only when the cycle ran on a mesh."""
        out = {
            "step": self.step,
            "source_rank": self.source_rank,
            "peers": list(self.peers),
            "results": {name: result.to_dict() for name, result in self.results.items()},
            "replay_s": _by_rank(self.replay_s),
            "reports": [report.to_dict() for report in self.reports],
            "certified_step": self.certified_step,
        }
        if len(self.peer_groups) > 1 or self.gather_s or self.collective_s:
            out.update(
                peer_groups=[list(g) for g in self.peer_groups],
                gather_s=_by_rank(self.gather_s),
                collective_s=_by_rank(self.collective_s),
            )
        return out


def _by_rank(times: Mapping[str, Mapping[int, float]]) -> dict[str, dict[str, float]]:
    return {name: {str(r): s for r, s in by_rank.items()} for name, by_rank in times.items()}


def _combine(*parts: str) -> str:
    """One digest over several digests and JSON texts (each length-prefixed, so boundaries cannot shift)."""
    hasher = blake3.blake3(b"gemscout.scout.combine.v1\0")
    for part in parts:
        data = part.encode()
        hasher.update(len(data).to_bytes(8, "little") + data)
    return f"blake3:{hasher.hexdigest()}"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def precondition_for(
    recipe: Recipe, step: int, captured: Captured, own_param_digest: str
) -> Precondition:
    """This peer's precondition record for replaying ``captured`` (the inputs as received from the source).

    ``rng_digest`` covers the RNG state and the replay context (autocast, train/eval): each changes the numbers.
    """
    inputs = {k: t for k, t in captured.tensors.items() if not k.startswith("rng.")}
    rng = {k: t for k, t in captured.tensors.items() if k.startswith("rng.")}
    context = {k: captured.meta.get(k) for k in ("autocast", "training")}
    meta = {k: v for k, v in captured.meta.items() if k not in context}
    return Precondition(
        step=step,
        recipe=recipe.name,
        shapes=tuple(tuple(inputs[k].shape) for k in sorted(inputs)),
        input_digest=_combine(captured.received_digest or digest_many(inputs), _canonical(meta)),
        rng_digest=_combine(digest_many(rng), _canonical(context)),
        param_digest=own_param_digest,
    )


def param_digest(
    recipe: Recipe,
    modules: Sequence[nn.Module],
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    gathered: Mapping[str, torch.Tensor] | None = None,
) -> str:
    """Digest of this peer's *own* copy of what the replay depends on besides its inputs.

    Forward recipes: the parameters and buffers of the recipe's modules. Optimizer slices: the live pre-update
    parameters, hyper-parameters and optimizer class. Not the optimizer state: the replay runs on the source's state,
    never this peer's, and a peer whose state diverged shows it in its parameters one update later.
    ``gathered``: on a sharded model, the parameters as gathered for replay (``"<path>.<name>"`` for forward recipes,
    ``"param.<name>"`` for slices; local tensors), digested instead of this rank's shards.
    Raises ``TypeError`` for a hyper-parameter that is neither a tensor nor plain JSON.
    """
    if recipe.has_module:
        named: dict[str, torch.Tensor] = {}
        for path, module in zip(recipe.modules, modules, strict=True):
            # Attribute names, not state_dict keys: a checkpoint wrapper's state_dict drops its
            # "_checkpoint_wrapped_module." prefix, and ``gathered`` (which must replace every DTensor shard) uses these.
            named.update(
                {f"{path}.{n}": t for n, t in [*module.named_parameters(), *module.named_buffers()]}
            )
        named.update(gathered or {})
        return digest_many(named)
    if gathered is not None:
        own = {f"param.{name}": gathered[f"param.{name}"] for name in recipe.params}
    else:
        own = {f"param.{name}": params[name].detach() for name in recipe.params}
    group = optimizer.param_groups[recipe.group_index]
    hyper = {k: v for k, v in group.items() if k != "params"}
    own.update({f"hyper.{k}": v.detach() for k, v in hyper.items() if isinstance(v, torch.Tensor)})
    described = {
        "class": type(optimizer).__qualname__,
        "hyper": {
            k: to_json_value(v, f"hyper-parameter {k!r}")
            for k, v in hyper.items()
            if not isinstance(v, torch.Tensor)
        },
    }
    return _combine(digest_many(own), _canonical(described))


def inconclusive(due: Sequence[Recipe], step: int, reason: str) -> dict[str, C3Result]:
    """Every due recipe INCONCLUSIVE with ``reason`` and ``preconditions_ok=False`` (nothing was compared)."""
    return {
        r.name: C3Result(
            verdict=Verdict.INCONCLUSIVE,
            recipe=r.name,
            step=step,
            reason=reason,
            preconditions_ok=False,
        )
        for r in due
    }


def judge_gathered(
    name: str, step: int, peers: Sequence[int], gathered: Sequence[Mapping[str, Any]]
) -> tuple[C3Result, dict[int, float]]:
    """The verdict for recipe ``name`` from every peer's gathered record, and the replay times by rank.

    ``gathered[i]`` is peer ``peers[i]``'s ``{"threads": n, "records": {recipe: record}}``. INCONCLUSIVE (not
    attributed, ``preconditions_ok=False``) when a peer has no record or reports an error, when intra-op thread
    counts differ, or when a precondition record is malformed; otherwise :func:`judge`.
    """
    by_rank = {peers[i]: entry["records"].get(name) for i, entry in enumerate(gathered)}
    digests = {r: rec["digest"] for r, rec in by_rank.items() if rec and rec.get("digest")}
    times = {
        r: float(rec["replay_s"])
        for r, rec in by_rank.items()
        if rec and rec.get("replay_s") is not None
    }
    failed = {
        r: (rec or {}).get("error") or "no record"
        for r, rec in by_rank.items()
        if not rec or rec["error"]
    }
    threads = {peers[i]: entry["threads"] for i, entry in enumerate(gathered)}
    reason = None
    if failed:
        reason = "replay did not run on every peer (" + "; ".join(
            f"rank {r}: {e}" for r, e in failed.items()
        )
        reason += "); outputs were not compared"
    elif len(set(threads.values())) > 1:
        reason = (
            f"intra-op thread counts differ across peers {threads}; replay is bitwise equal only with equal "
            "counts; outputs were not compared"
        )
    if reason is None:
        try:
            records = {r: Precondition.from_dict(rec["precondition"]) for r, rec in by_rank.items()}
            return judge(records, digests, recipe=name, step=step), times
        except (EvidenceError, TypeError) as exc:
            reason = f"a precondition record is malformed: {exc}; outputs were not compared"
    return C3Result(
        verdict=Verdict.INCONCLUSIVE,
        recipe=name,
        step=step,
        digests_by_rank=digests,
        reason=reason,
        preconditions_ok=False,
    ), times


def combine_groups(
    name: str, step: int, judged: Sequence[tuple[Sequence[int], C3Result]]
) -> C3Result:
    """One verdict for recipe ``name`` from the verdicts of every peer group, identical on every rank of the job.

    Peer groups on a mesh replay different things (other inputs, other TP shards), so digests are compared inside a
    group only; what is combined are the verdicts. One group: its verdict unchanged. Otherwise, in this order:
    any group shows SDC → SDC (ATTRIBUTED naming every culprit when each such group named one, else INCONCLUSIVE
    over the digests of the groups that saw it, so its peer-group report names exactly those peers); any group
    failed a precondition → INCONCLUSIVE with ``preconditions_ok=False``; any group inconclusive for another reason
    → INCONCLUSIVE with no digests (nothing was seen to differ); else AGREE. Reasons name each group. Pure.
    """
    if len(judged) == 1:
        return judged[0][1]

    def said(groups: Sequence[tuple[Sequence[int], C3Result]]) -> str:
        return "; ".join(f"peer group {list(g)}: {r.reason}" for g, r in groups)

    def digests(groups: Sequence[tuple[Sequence[int], C3Result]]) -> dict[int, str]:
        return {rank: d for _, r in groups for rank, d in r.digests_by_rank.items()}

    def groups(chosen: Sequence[tuple[Sequence[int], C3Result]]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(g) for g, _ in chosen)

    sdc = [(g, r) for g, r in judged if is_sdc(r)]
    if sdc:
        if all(r.verdict is Verdict.ATTRIBUTED for _, r in sdc):
            return C3Result(
                verdict=Verdict.ATTRIBUTED,
                recipe=name,
                step=step,
                ranks=tuple(rank for _, r in sdc for rank in r.ranks),
                digests_by_rank=digests(sdc),
                reason=said(sdc),
                peer_groups=groups(sdc),
            )
        return C3Result(
            verdict=Verdict.INCONCLUSIVE,
            recipe=name,
            step=step,
            digests_by_rank=digests(sdc),
            reason=said(sdc),
            peer_groups=groups(sdc),
        )
    failed = [(g, r) for g, r in judged if not r.preconditions_ok]
    if failed:
        return C3Result(
            verdict=Verdict.INCONCLUSIVE,
            recipe=name,
            step=step,
            digests_by_rank=digests(judged),
            reason=said(failed),
            preconditions_ok=False,
            peer_groups=groups(judged),
        )
    undecided = [(g, r) for g, r in judged if r.verdict is not Verdict.AGREE]
    if undecided:
        return C3Result(
            verdict=Verdict.INCONCLUSIVE, recipe=name, step=step, reason=said(undecided)
        )
    return C3Result(
        verdict=Verdict.AGREE,
        recipe=name,
        step=step,
        digests_by_rank=digests(judged),
        reason="every peer group agrees: " + ", ".join(str(list(g)) for g, _ in judged),
        peer_groups=groups(judged),
    )
