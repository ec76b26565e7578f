"""How one capture travels to the peer that holds its replica: the replication strategies, and the identity check
every frame that arrives (by replication or at recovery) must pass.

A strategy sends this rank's frame to its target and receives its source's frame in the same collective step, on
the io thread, in capture order on every rank. It returns the received frame verified (digests and identity) and
what it sent. Two implementations:

- :class:`RingReplication` sends the whole frame; its digests are checked chunk by chunk while the next chunk is in
  flight (:class:`~gemscout.gemini.arrival.VerifyOnArrival`).
- :class:`NaturalReplication` sends only the tensors the target does not already hold bit for bit (a replicate
  group's identical shards travel as digests) and rebuilds the source's frame from what arrived plus this rank's
  own (:func:`gemscout.gemini.natural.exchange`).

Both satisfy the same contract (``tests/distributed/test_replication_contract.py``): what ``exchange`` returns is
byte for byte the frame the source sent, or it raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gemscout import _dist as comm
from gemscout.errors import IntegrityError, RunMismatchError
from gemscout.gemini import natural
from gemscout.gemini.arrival import VerifyOnArrival
from gemscout.gemini.replication import ReplicaBuffers
from gemscout.state.layout import Parsed, parse_prefix, verify_data

Frame = tuple[bytes, torch.Tensor]


@dataclass(frozen=True)
class Identity:
    """What every frame of this run names: its run and its topology. A frame of another run or topology is refused
    with the fix, wherever it comes from (a peer, a memory slot, a file)."""

    run_id: str
    topology_digest: str

    def check(self, ident: dict[str, Any], *, where: str) -> None:
        if ident.get("run_id") != self.run_id:
            raise RunMismatchError(
                f"{where} belongs to run {ident.get('run_id')!r}, not {self.run_id!r}; set run_id (or "
                "GEMSCOUT_RUN_ID) to the run you resume, or point CheckpointConfig.directory at a fresh folder"
            )
        if ident.get("topology") != self.topology_digest:
            raise RunMismatchError(
                f"{where} was written for another topology (world size, nodes or model); resume with the same "
                "topology, or restore from the durable tier, which accepts a new world size"
            )

    def verify_frame(
        self, frame: Frame, *, owner: int, step: int | None, verified: Parsed | None = None
    ) -> int:
        """Check ``frame``'s digests (unless ``verified``, the header its data was already checked against as it
        arrived) and its identity. Returns its step; raises IntegrityError or RunMismatchError."""
        parsed = verified if verified is not None else parse_prefix(frame[0])
        if verified is None:
            verify_data(parsed, frame[1])
        ident = parsed.identity
        if ident.get("owner") != owner or (step is not None and ident.get("step") != step):
            raise IntegrityError(
                f"replica identity mismatch: expected owner {owner} step {step}, got {ident}"
            )
        self.check(ident, where=f"replica of rank {owner}")
        return int(ident["step"])


@dataclass
class Sent:
    """What one exchange put on the wire."""

    bytes: int
    tensors: int
    divergent_shards: int = 0


class Replication(Protocol):
    def exchange(
        self, own: Frame, *, tensors: int, target: int, source: int, buffers: ReplicaBuffers
    ) -> tuple[int, Frame, Sent]:
        """Send ``own`` (``tensors`` tensors: the sender knows its layout, parsing it again would cost a header
        pass) to ``target`` and receive ``source``'s frame into ``buffers``' storage (collective with both).
        Returns the received frame's step, the frame (verified), and what was sent."""
        ...


@dataclass(frozen=True)
class _Wire:
    group: dist.ProcessGroup
    chunk_bytes: int
    timeout: timedelta
    identity: Identity


class RingReplication(_Wire):
    """The whole frame to the target; digests verified as the chunks land."""

    def exchange(
        self, own: Frame, *, tensors: int, target: int, source: int, buffers: ReplicaBuffers
    ) -> tuple[int, Frame, Sent]:
        check = VerifyOnArrival()
        received = comm.exchange(
            own,
            target,
            source,
            group=self.group,
            chunk_bytes=self.chunk_bytes,
            timeout=self.timeout,
            recv_buffer=buffers.buffer_for,
            on_arrival=check,
        )
        assert received is not None
        step = self.identity.verify_frame(
            received, owner=source, step=None, verified=check.result()
        )
        return step, received, Sent(bytes=len(own[0]) + own[1].numel(), tensors=tensors)


class NaturalReplication(_Wire):
    """Only what the target does not hold already; the rest rebuilt from this rank's own frame."""

    def exchange(
        self, own: Frame, *, tensors: int, target: int, source: int, buffers: ReplicaBuffers
    ) -> tuple[int, Frame, Sent]:
        received, counters = natural.exchange(
            own,
            target=target,
            source=source,
            group=self.group,
            chunk_bytes=self.chunk_bytes,
            timeout=self.timeout,
            recv_buffer=buffers.buffer_for,
        )
        # The natural exchange checked the data digest by digest; the identity is checked here.
        ident = parse_prefix(received[0]).identity
        if ident.get("owner") != source:
            raise IntegrityError(f"replica identity mismatch: expected owner {source}, got {ident}")
        self.identity.check(ident, where=f"replica of rank {source}")
        sent = Sent(
            bytes=counters["sent_bytes"],
            tensors=counters["sent_tensors"],
            divergent_shards=counters["divergent_shards"],
        )
        return int(ident["step"]), received, sent


def replication_for(
    kind: str,
    *,
    group: dist.ProcessGroup,
    chunk_bytes: int,
    timeout: timedelta,
    identity: Identity,
) -> Replication:
    """The strategy ``CheckpointConfig.replication`` names (``"ring"`` or ``"natural"``)."""
    cls = NaturalReplication if kind == "natural" else RingReplication
    return cls(group=group, chunk_bytes=chunk_bytes, timeout=timeout, identity=identity)
