"""The exchange half of a SCOUT cycle: the collectives between peers, and nothing else.

A cycle runs three collectives on the peer group in the healthy case, always the same ones in the same order:

1. ``hello``: an all-gather of four int64 per peer (step, catalog fingerprint, header size, payload size). A gather,
   not a broadcast, comes first: peers that disagree on the step would disagree on the source, and a broadcast from
   two different roots never completes. Here every peer sees every step and they stop together.
2. one broadcast from the source of its JSON capture header and flat payload, sent as one byte buffer (header, then
   padding to 64 bytes, then payload), into a receive buffer that is reused from cycle to cycle;
3. the records: an all-gather of one fixed-size uint8 row per peer (:func:`encode_records`): per recipe the output
   digest, the three precondition digests and a digest of the input shapes as raw 32-byte BLAKE3 values, the step,
   and the replay / gather / collective seconds as float64. No JSON, no pickle. Every peer decodes every row back
   into the same record dictionaries :func:`gemscout.scout.cycle.judge_gathered` reads.

A row cannot carry text: when any peer's record holds an error, a digest of another form, or input shapes that
differ from the others', that peer says so in its row, every peer sees it, and all of them run one more collective
— the JSON all-gather of the full records (:func:`gemscout._dist.gather_json`) — so the reasons still name
what went wrong. That costs two collectives more, on the rare cycle that is not healthy anyway.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import blake3
import torch
import torch.distributed as dist

from gemscout._dist import gather_json, wait_all
from gemscout.scout.capture import Captured
from gemscout.scout.capture_wire import pack, unpack
from gemscout.scout.digests import DIGEST_ALGORITHM

__all__ = ["PeerExchange", "decode_records", "encode_records", "record_row_bytes"]

_ALIGN = 64
_DIGEST_PREFIX = f"{DIGEST_ALGORITHM}:"
_DIGEST_FIELDS = ("input_digest", "rng_digest", "param_digest")
# Per recipe: flags (u8) + 7 pad, step (i64), replay_s, gather_s, collective_s (f64), then five 32-byte digests:
# output, input, rng, param, shapes.
_RECIPE = struct.Struct("<B7xq3d32s32s32s32s32s")
# Per row: threads (i64), "needs the JSON path" (u8) + 7 pad, seconds waited in the job's own collectives (f64, NaN
# when they are not timed), the peer's monotonic clock when it sent the row (f64, NaN when not given).
_ROW_HEAD = struct.Struct("<qB7xdd")
_HAS_DIGEST, _HAS_PRECONDITION, _HAS_REPLAY, _HAS_GATHER, _HAS_COLLECTIVE = 1, 2, 4, 8, 16
_NO_TIME = float("nan")


def record_row_bytes(recipes: int) -> int:
    """Bytes of one peer's record row for ``recipes`` due recipes."""
    return _ROW_HEAD.size + recipes * _RECIPE.size


def _raw(digest: Any) -> bytes | None:
    """The 32 raw bytes of a ``"blake3:<64 hex>"`` digest, or None for anything else."""
    if (
        not isinstance(digest, str)
        or not digest.startswith(_DIGEST_PREFIX)
        or len(digest) != len(_DIGEST_PREFIX) + 64
    ):
        return None
    try:
        return bytes.fromhex(digest[len(_DIGEST_PREFIX) :])
    except ValueError:
        return None


def _shapes_digest(shapes: Any) -> bytes:
    hasher = blake3.blake3(b"gemscout.scout.shapes.v1\0")
    for shape in shapes:
        hasher.update(struct.pack(f"<Q{len(shape)}q", len(shape), *shape))
    return hasher.digest()


def encode_records(
    names: Sequence[str],
    threads: int,
    records: Mapping[str, Mapping[str, Any]],
    comm_s: float | None = None,
    clock: float | None = None,
) -> bytes:
    """This peer's fixed-size row for ``records`` (recipe name → record as built by the engine), in ``names`` order,
    with ``comm_s``, the seconds it waited in the job's own collectives since the last cycle (None: not timed), and
    ``clock``, its monotonic time (None: not given).

    The row's "needs JSON" flag is set when some record cannot be carried without text: an error, a missing record,
    a digest that is not ``blake3:<hex>``, or a field other than the known ones. Pure.
    """
    needs_json = False
    parts = []
    empty = bytes(32)
    for name in names:
        rec = records.get(name)
        flags, step, digests = 0, -1, [empty] * 5
        times = [_NO_TIME] * 3
        if rec is None or rec.get("error") is not None or not set(rec) <= _KNOWN_KEYS:
            needs_json = True
        else:
            if rec.get("digest") is not None:
                raw = _raw(rec["digest"])
                needs_json |= raw is None
                flags, digests[0] = flags | _HAS_DIGEST, raw or empty
            pre = rec.get("precondition")
            if pre is not None:
                flags |= _HAS_PRECONDITION
                step = int(pre["step"])
                for i, key in enumerate(_DIGEST_FIELDS, start=1):
                    raw = _raw(pre[key])
                    needs_json |= raw is None
                    digests[i] = raw or empty
                digests[4] = _shapes_digest(pre["shapes"])
                needs_json |= pre["recipe"] != name
            for i, (key, bit) in enumerate(
                (
                    ("replay_s", _HAS_REPLAY),
                    ("gather_s", _HAS_GATHER),
                    ("collective_s", _HAS_COLLECTIVE),
                )
            ):
                if rec.get(key) is not None:
                    flags, times[i] = flags | bit, float(rec[key])
        parts.append(_RECIPE.pack(flags, step, *times, *digests))
    comm = _NO_TIME if comm_s is None else float(comm_s)
    when = _NO_TIME if clock is None else float(clock)
    return _ROW_HEAD.pack(threads, 1 if needs_json else 0, comm, when) + b"".join(parts)


_KNOWN_KEYS = frozenset({"error", "precondition", "digest", "replay_s", "gather_s", "collective_s"})


def _needs_json(rows: Sequence[bytes]) -> bool:
    """True when any row asks for the JSON path, or the rows' input-shape digests differ for some recipe (the
    reason must then name the shapes themselves, which a row does not carry)."""
    if any(_ROW_HEAD.unpack_from(row)[1] for row in rows):
        return True
    recipes = (len(rows[0]) - _ROW_HEAD.size) // _RECIPE.size
    for i in range(recipes):
        shapes = {
            _RECIPE.unpack_from(row, _ROW_HEAD.size + i * _RECIPE.size)[9]
            for row in rows
            if _RECIPE.unpack_from(row, _ROW_HEAD.size + i * _RECIPE.size)[0] & _HAS_PRECONDITION
        }
        if len(shapes) > 1:
            return True
    return False


def decode_records(
    names: Sequence[str], row: bytes, own: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """One peer's gathered entry ``{"threads": n, "records": {...}}`` from its row, equal to what the JSON path
    would have delivered. ``own``: this peer's records, whose input shapes stand in for the peer's (the caller has
    checked that the shape digests agree). Pure."""
    threads, _, comm, clock = _ROW_HEAD.unpack_from(row)
    records: dict[str, Any] = {}
    for i, name in enumerate(names):
        flags, step, replay, gather, collective, out, inp, rng, par, _ = _RECIPE.unpack_from(
            row, _ROW_HEAD.size + i * _RECIPE.size
        )
        rec: dict[str, Any] = {
            "error": None,
            "precondition": None,
            "digest": None,
            "replay_s": None,
        }
        if flags & _HAS_DIGEST:
            rec["digest"] = _DIGEST_PREFIX + out.hex()
        if flags & _HAS_PRECONDITION:
            mine = own[name]["precondition"]
            rec["precondition"] = {
                "step": step,
                "recipe": name,
                "shapes": mine["shapes"],
                "input_digest": _DIGEST_PREFIX + inp.hex(),
                "rng_digest": _DIGEST_PREFIX + rng.hex(),
                "param_digest": _DIGEST_PREFIX + par.hex(),
            }
        if flags & _HAS_REPLAY:
            rec["replay_s"] = replay
        if flags & _HAS_GATHER:
            rec["gather_s"] = gather
        if flags & _HAS_COLLECTIVE:
            rec["collective_s"] = collective
        records[name] = rec
    entry: dict[str, Any] = {"threads": threads, "records": records}
    if comm == comm:  # not NaN
        entry["comm_s"] = comm
    if clock == clock:
        entry["clock"] = clock
    return entry


class PeerExchange:
    """The collectives of SCOUT cycles on one process group. ``ranks``: the group's global ranks, in group order."""

    def __init__(
        self, group: dist.ProcessGroup, ranks: Sequence[int], rank: int, timeout: timedelta
    ) -> None:
        self.group, self.ranks, self.rank, self.timeout = group, tuple(ranks), rank, timeout
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self.json_fallbacks = 0
        """How many record gathers needed the JSON path (a measure of how often cycles were not healthy)."""

    def _reusable(self, nbytes: int) -> torch.Tensor:
        # Grow-only: the captures unpacked from the previous cycle's buffer are views into it, but they are dropped
        # before the next cycle starts, so reusing the memory cannot change what a replay reads.
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(max(nbytes, 2 * self._buffer.numel()), dtype=torch.uint8)
        return self._buffer[:nbytes]

    def send_inputs(
        self, step: int, fingerprint: int, source: int, captures: Mapping[str, Captured] | None
    ) -> tuple[dict[str, Captured], str | None, bool]:
        """Hello, then the source's captures to every peer. ``captures``: what the source sends (None elsewhere).

        Returns ``(captures by recipe, error for all recipes, peers in step)``; peers out of step (or on another
        catalog) return ``({}, reason, False)`` together. Collective on the group; raises ``CollectiveTimeout``.
        """
        header, header_n, payload_n = b"", 0, 0
        if self.rank == source:
            # The payload is packed straight into the send buffer, after the header's place (one copy of the bytes).
            def into_wire(header_bytes: int, payload_bytes: int) -> torch.Tensor:
                start = -(-header_bytes // _ALIGN) * _ALIGN
                return self._reusable(start + payload_bytes)[start:]

            try:
                header, payload = pack(step, captures or {}, out=into_wire)
            except Exception as exc:  # the source still sends: a header that carries the error
                failed = Captured(step=step, error=f"packing failed: {type(exc).__name__}: {exc}")
                header, payload = pack(step, dict.fromkeys(captures or {}, failed), out=into_wire)
            header_n, payload_n = len(header), payload.numel()
        hello = torch.tensor([step, fingerprint, header_n, payload_n], dtype=torch.int64)
        hellos = [torch.empty(4, dtype=torch.int64) for _ in self.ranks]
        wait_all(
            [dist.all_gather(hellos, hello, group=self.group, async_op=True)],
            self.timeout,
            "scout hello",
        )
        steps = {r: int(h[0]) for r, h in zip(self.ranks, hellos, strict=True)}
        if len(set(steps.values())) > 1 or len({int(h[1]) for h in hellos}) > 1:
            what = "step" if len(set(steps.values())) > 1 else "recipe catalog"
            return (
                {},
                f"peers disagree on the {what} (steps by rank {steps}); nothing was replayed",
                False,
            )
        header_n, payload_n = (int(v) for v in hellos[self.ranks.index(source)][2:])
        start = -(-header_n // _ALIGN) * _ALIGN
        # On the source this is the buffer the payload was packed into (same size, so the same memory).
        wire = self._reusable(start + payload_n)
        if self.rank == source:
            wire[:header_n].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
            wire[header_n:start].zero_()
        wait_all(
            [dist.broadcast(wire, source, group=self.group, async_op=True)],
            self.timeout,
            "scout inputs",
        )
        try:
            return unpack(bytes(wire[:header_n].numpy()), wire[start:], step), None, True
        except (ValueError, KeyError, TypeError) as exc:
            return {}, f"the inputs from source rank {source} could not be read: {exc}", True

    def gather_records(
        self,
        names: Sequence[str],
        records: Mapping[str, Mapping[str, Any]],
        *,
        comm_s: float | None = None,
        clock: float | None = None,
        group: dist.ProcessGroup | None = None,
        ranks: Sequence[int] | None = None,
    ) -> dict[int, Mapping[str, Any]]:
        """Every peer's ``{"threads": n, "records": {...}}`` (and ``"comm_s"``, ``"clock"`` when given) by global
        rank, the same on every peer.

        One fixed-size all-gather when every record is healthy; the JSON all-gather besides when a row says it
        cannot carry a record (module docstring). ``group``/``ranks``: gather over another group (a mesh's whole
        domain) instead of the peer group. Collective; raises ``CollectiveTimeout``.
        """
        group = group if group is not None else self.group
        ranks = tuple(ranks) if ranks is not None else self.ranks
        threads = torch.get_num_threads()
        row = encode_records(names, threads, records, comm_s, clock)
        mine = torch.frombuffer(bytearray(row), dtype=torch.uint8)
        out = [torch.empty(len(row), dtype=torch.uint8) for _ in ranks]
        wait_all(
            [dist.all_gather(out, mine, group=group, async_op=True)], self.timeout, "scout records"
        )
        rows = [o.numpy().tobytes() for o in out]
        if _needs_json(rows):
            self.json_fallbacks += 1
            entry: dict[str, Any] = {"threads": threads, "records": records}
            if comm_s is not None:
                entry["comm_s"] = comm_s
            if clock is not None:
                entry["clock"] = clock
            gathered = gather_json(entry, group=group, timeout=self.timeout)
            return dict(zip(ranks, gathered, strict=True))
        return {r: decode_records(names, rw, records) for r, rw in zip(ranks, rows, strict=True)}
