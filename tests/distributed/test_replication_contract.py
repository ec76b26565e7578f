"""The replication contract, run against both strategies on two real gloo ranks: what ``exchange`` returns is byte
for byte the frame its source sent, or it raises (a damaged frame, a frame of another run) — and a refusal on one
side leaves the ranks lined up for the next exchange."""

from __future__ import annotations

from pathlib import Path

import pytest
from two_ranks import run_cases

PROGRAM = r"""
import hashlib, sys, torch, torch.distributed as dist
from datetime import timedelta
from gemscout.errors import IntegrityError, RunMismatchError
from gemscout.gemini.exchange import Identity, replication_for
from gemscout.gemini.replication import ReplicaBuffers
from gemscout.state.codec import encode
from gemscout.state.layout import Layout, build_header, frame_prefix, parse_prefix, tensor_digests

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
peer = 1 - rank
ident = Identity("run-a", "topo-1")


def frame(owner, step, *, run="run-a", flip=False):
    # The same tensor "shared" on both ranks (a replicate group's identical shard), the rest the owner's own.
    g = torch.Generator().manual_seed(1000 * owner + step)
    state = {
        "shared": torch.arange(4096, dtype=torch.float32) * step,
        "own": torch.randn(8192, generator=g),
        "step": torch.tensor([step, owner]),
    }
    skeleton, tensors = encode(state)
    layout = Layout.of(tensors)
    data = torch.empty(layout.data_nbytes, dtype=torch.uint8)
    for view, t in zip(layout.views(data), tensors, strict=True):
        view.copy_(t)
    identity = {"run_id": run, "topology": "topo-1", "owner": owner, "step": step}
    prefix = frame_prefix(build_header(layout, tensor_digests(layout, data), skeleton, identity))
    if flip:
        data[layout.entries[1].offset + 7] ^= 0x10  # after the digests: damaged on its way
    return prefix, data, len(tensors)


def sha(prefix, data):
    # The header and every tensor's bytes (the alignment padding between tensors is no part of the frame's content).
    h = hashlib.sha256(prefix)
    for e in parse_prefix(prefix).layout.entries:
        h.update(data[e.offset : e.offset + e.nbytes].numpy().tobytes())
    return h.hexdigest()


for kind in ("ring", "natural"):
    strategy = replication_for(
        kind, group=dist.group.WORLD, chunk_bytes=8192, timeout=timedelta(seconds=60), identity=ident
    )
    buffers = ReplicaBuffers(keep=2, owner=peer)

    prefix, data, n = frame(rank, 3)
    step, got, sent = strategy.exchange((prefix, data), tensors=n, target=peer, source=peer, buffers=buffers)
    want = frame(peer, 3)
    assert step == 3 and sha(*got) == sha(want[0], want[1]), (kind, step)
    if kind == "natural":  # the shared tensor travelled as its digest only
        assert sent.bytes < len(prefix) + data.numel() and sent.tensors == n - 1, sent
    else:
        assert sent.bytes == len(prefix) + data.numel() and sent.tensors == n, sent
    print(f"CASE {kind}-bytes OK", flush=True)

    prefix, data, n = frame(rank, 4, flip=rank == 0)
    try:
        strategy.exchange((prefix, data), tensors=n, target=peer, source=peer, buffers=buffers)
        refused = None
    except IntegrityError as exc:
        refused = exc
    assert (refused is not None) == (rank == 1), (kind, rank, refused)
    print(f"CASE {kind}-damaged OK", flush=True)

    prefix, data, n = frame(rank, 5, run="run-b" if rank == 1 else "run-a")
    try:
        strategy.exchange((prefix, data), tensors=n, target=peer, source=peer, buffers=buffers)
        refused = None
    except RunMismatchError as exc:
        refused = exc
    assert (refused is not None) == (rank == 0) and "run-b" in str(refused or "run-b"), (kind, refused)
    print(f"CASE {kind}-other-run OK", flush=True)

    # Still lined up after the refusals: a clean exchange goes through.
    prefix, data, n = frame(rank, 6)
    step, got, _ = strategy.exchange((prefix, data), tensors=n, target=peer, source=peer, buffers=buffers)
    want = frame(peer, 6)
    assert step == 6 and sha(*got) == sha(want[0], want[1])
    print(f"CASE {kind}-after OK", flush=True)
dist.destroy_process_group()
"""

CASES = [
    f"{k}-{c}" for k in ("ring", "natural") for c in ("bytes", "damaged", "other-run", "after")
]


@pytest.mark.timeout(120)
def test_both_strategies_deliver_the_sent_frame_or_refuse_it(tmp_path: Path) -> None:
    run_cases(PROGRAM, tmp_path, CASES, timeout_s=90)
