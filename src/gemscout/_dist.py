"""Point-to-point and gather helpers over a dedicated gloo group; nothing here pickles.

Every wait has a timeout; a missed deadline raises :class:`~gemscout.errors.CollectiveTimeout`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gemscout.errors import CollectiveTimeout, IntegrityError


def wait_all(works: list[Any], timeout: timedelta, what: str) -> None:
    for w in works:
        try:
            w.wait(timeout)
        except RuntimeError as exc:
            raise CollectiveTimeout(
                f"{what} failed or timed out after {timeout.total_seconds():.0f}s: {exc}"
            ) from exc


_UNSENDABLE = "__gemscout_unsendable__"


def gather_json(obj: Any, *, group: dist.ProcessGroup, timeout: timedelta) -> list[Any]:
    """All-gather one JSON-serializable object per rank (ordered by group rank).

    A rank whose object cannot be serialized still takes part (it sends why instead), and then every rank raises
    IntegrityError naming it: a rank never leaves the collective alone while its peers wait for the timeout."""
    try:
        text = json.dumps(obj, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as exc:
        text = json.dumps({_UNSENDABLE: f"{type(exc).__name__}: {exc}"})
    payload = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    wait_all([dist.all_gather(sizes, size, group=group, async_op=True)], timeout, "size gather")
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    wait_all([dist.all_gather(out, padded, group=group, async_op=True)], timeout, "state gather")
    got = [json.loads(bytes(o[: int(s.item())].numpy())) for o, s in zip(out, sizes, strict=True)]
    bad = [
        (r, g[_UNSENDABLE]) for r, g in enumerate(got) if isinstance(g, dict) and _UNSENDABLE in g
    ]
    if bad:
        raise IntegrityError(f"rank {bad[0][0]} could not send its part of a gather ({bad[0][1]})")
    return got


def all_agree(flag: bool, *, group: dist.ProcessGroup, timeout: timedelta) -> bool:
    """True only if ``flag`` is true on every rank (a MIN all-reduce)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    wait_all(
        [dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True)], timeout, "agreement"
    )
    return bool(t.item())


def exchange(
    send: tuple[bytes, torch.Tensor] | None,
    dst: int | None,
    src: int | None,
    *,
    group: dist.ProcessGroup,
    chunk_bytes: int,
    timeout: timedelta,
    recv_buffer: Any = None,
    on_arrival: Callable[[bytes, torch.Tensor], Arrival] | None = None,
) -> tuple[bytes, torch.Tensor] | None:
    """Send a framed checkpoint ``(prefix, data)`` to ``dst`` while receiving one from ``src``.

    Either side may be None (one-way transfer). ``dst``/``src`` are global ranks. The data moves in chunks of
    ``chunk_bytes``, two chunks in flight, so that memory in flight stays bounded and the link never idles between
    chunks. ``recv_buffer(nbytes, prefix_nbytes)`` may supply a reusable uint8 tensor for the incoming data (the
    incoming prefix's size lets it place the data where the prefix will precede it).
    ``on_arrival(prefix, data)`` is called once the incoming header is in and returns an object whose
    ``received(end)`` is called each time bytes ``[0, end)`` of the data have landed, while the next chunk is still
    in flight (see :class:`gemscout.gemini.arrival.ArrivalCheck`); it must not raise. Returns what was received,
    unverified unless the caller's ``on_arrival`` verified it.
    """
    works = []
    if send is not None:
        prefix, data = send
        works.append(
            dist.isend(
                torch.tensor([len(prefix), data.numel()], dtype=torch.int64), dst, group=group
            )
        )
    sizes = torch.zeros(2, dtype=torch.int64)
    if src is not None:
        works.append(dist.irecv(sizes, src, group=group))
    wait_all(works, timeout, "replica size exchange")
    works = []
    rprefix = torch.zeros(int(sizes[0]), dtype=torch.uint8)
    # An empty prefix (a data-only message) moves no header: both sides know its size from the exchange above.
    if send is not None and send[0]:
        works.append(
            dist.isend(torch.frombuffer(bytearray(send[0]), dtype=torch.uint8), dst, group=group)
        )
    if src is not None and rprefix.numel():
        works.append(dist.irecv(rprefix, src, group=group))
    wait_all(works, timeout, "replica header exchange")
    rdata: torch.Tensor | None = None
    arrival: Arrival | None = None
    received_prefix = bytes(rprefix.numpy()) if src is not None else b""
    if src is not None:
        n = int(sizes[1])
        rdata = (
            recv_buffer(n, len(received_prefix))
            if recv_buffer is not None
            else torch.empty(n, dtype=torch.uint8)
        )
        if on_arrival is not None:
            arrival = on_arrival(received_prefix, rdata)
    send_n = send[1].numel() if send is not None else 0
    recv_n = rdata.numel() if rdata is not None else 0
    in_flight: list[tuple[list[Any], int]] = []  # (works, received end once they complete)
    for off in range(0, max(send_n, recv_n), chunk_bytes):
        works = []
        if send is not None and off < send_n:
            works.append(dist.isend(send[1][off : off + chunk_bytes], dst, group=group))
        if rdata is not None and off < recv_n:
            works.append(dist.irecv(rdata[off : off + chunk_bytes], src, group=group))
        in_flight.append((works, min(off + chunk_bytes, recv_n)))
        if len(in_flight) > 1:
            _land(in_flight.pop(0), arrival, timeout)
    while in_flight:
        _land(in_flight.pop(0), arrival, timeout)
    if src is None or rdata is None:
        return None
    return received_prefix, rdata


class Arrival(Protocol):
    def received(self, end: int) -> None: ...


def _land(chunk: tuple[list[Any], int], arrival: Arrival | None, timeout: timedelta) -> None:
    works, end = chunk
    wait_all(works, timeout, "replica data transfer")
    if arrival is not None:
        arrival.received(end)
