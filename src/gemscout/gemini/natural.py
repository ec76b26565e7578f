"""HSDP natural replicas: the replicate-group peer already holds this rank's shard and optimizer state.

Under HSDP (a ``(replicate, shard)`` mesh) the ranks of one replicate group hold bit-identical parameter shards and
optimizer state after every step, so sending a full replica to another node duplicates what that node already has.
With ``CheckpointConfig(replication="natural")`` the replica goes to the next rank of the own replicate group (a
ring inside the group) and only what differs is sent:

1. the checkpoints' headers are exchanged (a few KiB); each header carries the BLAKE3 digest of every tensor, so
   comparing them index by index is the identity check, at no extra hashing;
2. the tensors whose digests differ (caller state such as per-rank losses, anything private to the rank) are packed
   and sent; equal ones are taken from the receiver's own slot of the same step;
3. the receiver rebuilds the owner's frame (its own bytes plus what arrived), checks the received tensors' digests,
   and holds it exactly like a ring replica (memory, disk, recovery all unchanged).

A DTensor shard whose digest differs between replicas is a divergence (silent corruption, or a replicate group that
is not one): it is still sent in full — correctness never depends on the identity — and reported in ``stats`` and the
log. A different layout on the two sides (another tensor list) falls back to sending the whole frame.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gemscout import _dist as comm
from gemscout._tensors import is_dtensor
from gemscout.errors import ConfigError, IntegrityError
from gemscout.gemini.replication import Placement
from gemscout.state.digest import digest_bytes, digests_equal
from gemscout.state.layout import Parsed, parse_prefix

log = logging.getLogger("gemscout.gemini")

Frame = tuple[bytes, torch.Tensor]
_EMPTY = torch.empty(0, dtype=torch.uint8)


def replicate_groups(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The replicate groups of a model's DTensor parameters: ranks that differ only along mesh dimensions whose
    placement is ``Replicate``. Raises ConfigError when there are none or the parameters disagree."""
    found: set[tuple[tuple[int, ...], ...]] = set()
    for p in model.parameters():
        if not is_dtensor(p):
            continue
        mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
        rep = [d for d, pl in enumerate(placements) if pl.is_replicate()]
        ranks = mesh.mesh
        if not rep:
            found.add(tuple((int(r),) for r in ranks.reshape(-1).tolist()))
            continue
        keep = [d for d in range(ranks.dim()) if d not in rep]
        moved = ranks.permute(*keep, *rep).reshape(
            -1, int(torch.tensor([ranks.shape[d] for d in rep]).prod())
        )
        found.add(tuple(tuple(int(r) for r in row) for row in moved.tolist()))
    if len(found) != 1:
        raise ConfigError(
            "CheckpointConfig.replication='natural' needs a model whose DTensor parameters share one "
            "mesh (HSDP); "
            + ("none has DTensor parameters" if not found else "they use several")
            + "; use replication='ring'"
        )
    groups = sorted(next(iter(found)))
    if any(len(g) < 2 for g in groups):
        raise ConfigError(
            "CheckpointConfig.replication='natural' needs a replicate mesh dimension of size >= 2 "
            "(HSDP: init_device_mesh(..., (replicas, shards))); this mesh has none; use 'ring'"
        )
    return groups


@dataclass(frozen=True, slots=True)
class NaturalPlacement(Placement):
    """Replicas go to the next rank of the own replicate group (a ring inside the group)."""

    groups: tuple[tuple[int, ...], ...] = ()

    def _ring(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.groups if rank in g)

    def target(self, rank: int) -> int:
        g = self._ring(rank)
        return g[(g.index(rank) + 1) % len(g)]

    def source(self, rank: int) -> int:
        g = self._ring(rank)
        return g[(g.index(rank) - 1) % len(g)]


def natural_placement(base: Placement, model: torch.nn.Module) -> NaturalPlacement:
    """The natural placement for ``model``; a ConfigError when a replica would share its owner's node."""
    groups = replicate_groups(model)
    placement = NaturalPlacement(
        base.world_size, base.ranks_per_node, base.jump, groups=tuple(groups)
    )
    for g in groups:
        for r in g:
            if base.nodes > 1 and placement.node_of(placement.target(r)) == placement.node_of(r):
                raise ConfigError(
                    f"CheckpointConfig.replication='natural': rank {r}'s replicate peer {placement.target(r)} is on "
                    "its own node, so a node loss would take both; put the replicate mesh dimension across nodes "
                    "or use replication='ring'"
                )
    return placement


def _diff(mine: Parsed, theirs: Parsed) -> list[int] | None:
    """Indices of tensors whose digests differ; None when the layouts differ (send everything)."""
    if mine.layout != theirs.layout:
        return None
    return [
        i
        for i, (a, b) in enumerate(zip(mine.digests, theirs.digests, strict=True))
        if not digests_equal(a, b)
    ]


def _pack(data: torch.Tensor, parsed: Parsed, idx: list[int]) -> torch.Tensor:
    parts = [data[e.offset : e.offset + e.nbytes] for e in (parsed.layout.entries[i] for i in idx)]
    return torch.cat(parts) if parts else _EMPTY


def exchange(
    own: Frame,
    *,
    target: int,
    source: int,
    group: dist.ProcessGroup,
    chunk_bytes: int,
    timeout: timedelta,
    recv_buffer: Any,
) -> tuple[Frame, dict[str, int]]:
    """Send ``own`` to ``target`` as a natural replica and rebuild ``source``'s checkpoint from what arrives plus
    ``own``. Collective with both peers. Returns the source's frame (headers verified; the rebuilt data is checked
    digest by digest) and counters: bytes sent, tensors sent, divergent DTensor shards."""
    prefix, data = own
    mine = parse_prefix(prefix)

    def headers(dst: int, src: int) -> tuple[bytes, Parsed]:
        got = comm.exchange(
            (prefix, _EMPTY), dst, src, group=group, chunk_bytes=chunk_bytes, timeout=timeout
        )
        assert got is not None
        return got[0], parse_prefix(got[0])

    source_prefix, from_source = headers(target, source)
    # The target needs my digests (sent above); I need the target's to know what it already holds.
    to_target = from_source if target == source else headers(source, target)[1]
    send_idx = _diff(mine, to_target)
    recv_idx = _diff(mine, from_source)
    packed = data if send_idx is None else _pack(data, mine, send_idx)
    got = comm.exchange(
        (b"", packed), target, source, group=group, chunk_bytes=chunk_bytes, timeout=timeout
    )
    assert got is not None
    received = got[1]
    if recv_idx is None:  # another layout: the whole frame came
        rebuilt, check = received, list(range(len(from_source.layout.entries)))
    else:
        rebuilt = recv_buffer(from_source.layout.data_nbytes, len(source_prefix))
        rebuilt.copy_(data[: from_source.layout.data_nbytes])
        off = 0
        for i in recv_idx:
            e = from_source.layout.entries[i]
            rebuilt[e.offset : e.offset + e.nbytes].copy_(received[off : off + e.nbytes])
            off += e.nbytes
        if off != received.numel():
            raise IntegrityError(
                f"natural replica from rank {source}: {received.numel()} bytes arrived, {off} expected"
            )
        check = recv_idx
    # Equal digests stand for equal bytes (my slot was hashed when it was sealed); what arrived is checked here.
    arr = rebuilt.numpy()
    for i in check:
        e = from_source.layout.entries[i]
        if not digests_equal(
            from_source.digests[i], digest_bytes(arr[e.offset : e.offset + e.nbytes].data)
        ):
            raise IntegrityError(f"natural replica from rank {source}: tensor {i} digest mismatch")
    shards = _shard_indices(mine.skeleton)
    divergent = [i for i in (send_idx or []) if i in shards]
    if divergent:
        log.warning(
            "gemini natural replica: %d DTensor shard(s) differ from rank %d's at step %s (indices %s): "
            "the replicate group diverged; they were sent in full",
            len(divergent),
            target,
            mine.identity.get("step"),
            divergent[:8],
        )
    counters = {
        "sent_bytes": len(prefix) + packed.numel(),
        "sent_tensors": len(mine.layout.entries) if send_idx is None else len(send_idx),
        "divergent_shards": len(divergent),
    }
    return (source_prefix, rebuilt), counters


def _shard_indices(skeleton: Any) -> set[int]:
    out: set[int] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if len(node) == 1 and "__dt__" in node:
                out.add(int(node["__dt__"][0]))
                return
            for v in node.values():
                walk(v)

    walk(skeleton)
    return out
