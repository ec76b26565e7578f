"""Recovery timed in the GEMINI benchmark's on role, after the side-by-side window (step 4 of
:mod:`qualification.bench.gemini_rank`): a rank restarted on the same node restoring from its own shared memory,
and a rank that lost its node recovering from the replica in its peer's memory, with that data path timed on its
own and against the floor of a raw one-way gloo transfer. Each restored state must equal the state it should be,
bit for bit.

gemscout is imported where used, as in :mod:`qualification.bench.gemini_rank`: the off role's baseline must not
hold its memory.
"""

from __future__ import annotations

import shutil
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from qualification.bench._training import Trainer, state_digest
from qualification.programs.specs.bench import GeminiBenchSpec


def restart_from_memory(
    trainer: Trainer, session: Any, group: dist.ProcessGroup, timeout: timedelta
) -> dict[str, Any]:
    """What a rank restarted on the same node after a SIGKILL does with the memory tier, timed on every rank: claim
    its shared-memory folder (owner record, anchor check), map the newest sealed slot its previous process left,
    verify every digest and restore it into the live objects. Process start and process-group setup are not
    timed: every way of recovering pays them. The restored state must be the state it was taken from, bit for
    bit (the quiet captures did not change it)."""
    from gemscout import _dist as comm
    from gemscout.gemini import shm
    from gemscout.gemini.restore import restore_frame

    ck = session.checkpointer
    rank = dist.get_rank()
    before = state_digest(trainer.tensors())
    dist.barrier(group=group)
    t0 = time.perf_counter()
    assert ck.memory is not None, "the benchmark measures the memory tier: /dev/shm is needed"
    tier = shm.MemoryTier.open(
        ck.config.memory_directory,
        run_id=ck.run_id,
        directory=ck.config.directory,
        node=ck.placement.node_of(rank),
        rank=rank,
        disk_root=ck.paths.root,
        stale_after_s=ck.config.stale_memory_after.total_seconds(),
        fsync=False,
    )
    newest = tier.adopt(tier.paths.own, ck.config.slots)[0]
    frame = (newest.prefix, newest.file.data)
    ck.verify_frame(frame, owner=rank, step=None)
    t1 = time.perf_counter()
    restore_frame(ck.sources, frame, owned=False)
    t2 = time.perf_counter()
    equal = state_digest(trainer.tensors()) == before
    agree = comm.all_agree(equal, group=group, timeout=timeout)
    return {
        "restart_memory_s": t2 - t0,
        "restart_memory_verify_s": t1 - t0,
        "restart_memory_restore_s": t2 - t1,
        "restart_memory_bitwise_equal": agree,
    }


def recover_from_peer(
    args: GeminiBenchSpec,
    trainer: Trainer,
    session: Any,
    group: dist.ProcessGroup,
    timeout: timedelta,
) -> dict[str, Any]:
    from gemscout import _dist as comm
    from gemscout.gemini.arrival import VerifyOnArrival
    from gemscout.gemini.restore import restore_frame

    rank, world = dist.get_rank(), dist.get_world_size()
    victim, survivor = world - 1, 0
    ckpt = session.checkpointer
    before = state_digest(trainer.tensors())
    if rank == victim:
        for slot in ckpt.pool.ready_slots():
            slot.ready.clear()  # its own in-memory checkpoints are gone ...
        ckpt.replicas.clear()  # ... and the replicas it held for its peer ...
        shutil.rmtree(ckpt.paths.root)  # ... and its local checkpoint files
        with torch.no_grad():
            for t in trainer.tensors():
                t.zero_()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    decision = session.recover()
    out: dict[str, Any] = {
        "recover_s": time.perf_counter() - t0,
        "recover_decision": decision.to_dict(),
    }
    after = state_digest(trainer.tensors())
    digests = comm.gather_json([before, after], group=group, timeout=timeout)
    out["recovered_bitwise_equal"] = all(a == digests[survivor][0] for _, a in digests)

    # The data path of that recovery on its own, as recover() runs it: the peer sends the held frame, the owner
    # verifies each chunk as it lands (VerifyOnArrival), checks what is left, and restores without copying.
    held = ckpt.replicas[victim].entries[0] if rank == survivor else None
    dist.barrier(group=group)
    t0 = time.perf_counter()
    if rank == survivor:
        assert held is not None
        comm.exchange(
            (held[1], held[2]),
            victim,
            None,
            group=group,
            chunk_bytes=args.chunk_bytes,
            timeout=timeout,
        )
    if rank == victim:
        check = VerifyOnArrival()
        frame = comm.exchange(
            None,
            None,
            survivor,
            group=group,
            chunk_bytes=args.chunk_bytes,
            timeout=timeout,
            on_arrival=check,
        )
        assert frame is not None
        t1 = time.perf_counter()
        ckpt.verify_frame(frame, owner=victim, step=None, verified=check.result())
        t2 = time.perf_counter()
        restore_frame(ckpt.sources, frame, owned=True)
        t3 = time.perf_counter()
        out.update(
            {
                "recover_transfer_s": t3 - t0,
                "recover_transfer_recv_s": t1 - t0,
                "recover_transfer_verify_s": t2 - t1,
                "recover_transfer_restore_s": t3 - t2,
            }
        )
    out["recovered_again_bitwise_equal"] = state_digest(trainer.tensors()) == digests[survivor][0]
    # The floor of any recovery from a peer: moving the same bytes one way on a gloo group, nothing else.
    nbytes = len(held[1]) + held[2].numel() if held is not None else 0
    size = torch.tensor([nbytes], dtype=torch.int64)
    dist.broadcast(size, src=survivor, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if rank == survivor:
        buf.fill_(1)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for off in range(0, buf.numel(), args.chunk_bytes):
        piece = buf[off : off + args.chunk_bytes]
        if rank == survivor:
            dist.send(piece, victim, group=group)
        elif rank == victim:
            dist.recv(piece, survivor, group=group)
    if rank == victim:
        out["recover_raw_recv_s"] = time.perf_counter() - t0
    return out
