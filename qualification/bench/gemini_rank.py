"""One rank of the GEMINI benchmark; :mod:`qualification.bench.gemini` runs two of them through
:mod:`qualification.launch`.

``--role off`` runs the same training steps as ``--role on`` (the calibration's micro-batches, then the loops of
steps 1 and 2 below, with ``--overlap-micro`` from the on run), without GEMINI, and records peak RSS: the baseline needs
a process of its own, because ``ru_maxrss`` only ever grows, and the same number of steps, because training alone
keeps growing glibc's heap over its first few dozen steps (measured: 0-16 MiB over 30 more steps of the 60 MiB
model, its 4 MiB optimizer temporaries fragmenting the heap). ``--role on`` measures, in one process and in this
order:

1. calibration: the references once each (memcpy, BLAKE3, file write + fsync, raw gloo pair exchange of the state's
   bytes) to estimate one capture's pipeline; then two loops without GEMINI: ``tight`` (one micro-batch per step)
   and ``overlap`` (enough micro-batches that forward/backward outlasts that pipeline ``--overlap-factor`` times);
2. ``enable_resiliency`` (interval 1, product defaults otherwise), the same two loops with GEMINI, then the tight
   loop again with ``when_busy="skip"`` (captures coalesced while the io is busy), then peak RSS;
3. the side-by-side window: ``--quiet-captures`` rounds of one quiet capture (``optimizer.step()`` with no
   gradients, so no compute competes with its io) followed by each reference and by ``comm.exchange`` of the real
   frame just captured; both sides of every ratio come from the same rounds, under the same machine load;
4. recovery from peer memory: the last rank loses its slots, the replicas it holds and its checkpoint folder (a node
   loss) and its live state is zeroed; ``session.recover()`` restores it from the replica in its peer's memory, and
   the restored state must equal the survivor's bit for bit. Then the same data path timed by itself: the peer sends
   the held frame, the owner verifies every digest as chunks land and restores; then the floor of any peer recovery,
   a raw one-way gloo transfer of the same bytes; then, on the survivor, its checkpoint files read whole and verified
   (what an inventory that hashes every file would cost) and read by header (what recover()'s inventory reads)
   (see :mod:`qualification.bench._gemini_recovery`);
5. DCP save, async_save and load (page cache warm and evicted) of the same model and optimizer.

The stall per capture is the time the training thread spends in GEMINI's two optimizer hooks, bracketed by hooks
of our own (see :class:`~qualification.bench._training.HookClock`). Writes ``<out>/<role>.rank<r>.json``.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from qualification.bench._gemini_recovery import recover_from_peer, restart_from_memory
from qualification.bench._model import shape_for
from qualification.bench._training import HookClock, Trainer, peak_rss_bytes, run_loop
from qualification.programs.specs import parse
from qualification.programs.specs.bench import GeminiBenchSpec

if TYPE_CHECKING:
    # Imported where used: _references imports gemscout, whose memory the off role's baseline must not hold.
    from qualification.bench import _references


class IoRecorder:
    """Per-capture ``persist_s`` and ``replicate_s`` from GEMINI's phase hook (its stats keep only the latest).

    GEMINI updates each stat when that phase ends and then calls the hook with "persisted" / "replicated" (the
    own file is written concurrently with the replication, so no other phase orders them).
    """

    def __init__(self, checkpointer: Any) -> None:
        self.ckpt = checkpointer
        self.persist_s: dict[int, float] = {}
        self.replicate_s: dict[int, float] = {}

    def __call__(self, phase: str, step: int) -> None:
        if phase == "persisted":
            self.persist_s[step] = self.ckpt.stats["persist_s"]
        elif phase == "replicated":
            self.replicate_s[step] = self.ckpt.stats["replicate_s"]

    def between(self, first: int, last: int) -> dict[str, list[float]]:
        steps = range(first, last + 1)
        return {
            "persist_s": [self.persist_s[s] for s in steps if s in self.persist_s],
            "replicate_s": [self.replicate_s[s] for s in steps if s in self.replicate_s],
        }


def calibrate(
    args: GeminiBenchSpec, trainer: Trainer, group: dist.ProcessGroup
) -> tuple[dict[str, float], int]:
    """Estimate one capture's pipeline (copy, digest, persist, exchange, verify, persist the replica) from the
    references, and size the overlap loop to outlast it ``--overlap-factor`` times: the factor covers the CPU that
    training takes from the io threads. The references' buffers are freed before GEMINI allocates its own.
    Returns (figures, micro-batches of the overlap loop)."""
    refs = references(args, trainer, group)
    try:
        refs.memcpy(), refs.gloo_pair()  # warm-up: first touch, first connection use
        cal = {
            f"{name}_s": statistics.median(getattr(refs, name)() for _ in range(3))
            for name in ("memcpy", "digest", "write", "gloo_pair")
        }
    finally:
        refs.close()
    cal["pipeline_estimate_s"] = (
        cal["memcpy_s"] + 2 * cal["digest_s"] + 2 * cal["write_s"] + cal["gloo_pair_s"]
    )
    micro, cal["micro_fwd_bwd_s"] = trainer.micro_batches_for(
        args.overlap_factor * cal["pipeline_estimate_s"], group
    )
    return cal, micro


def references(
    args: GeminiBenchSpec, trainer: Trainer, group: dist.ProcessGroup, recv_nbytes: int = 0
) -> _references.References:
    from qualification.bench import _references

    peer = (dist.get_rank() + 1) % dist.get_world_size()
    return _references.References(
        trainer.tensors(),
        args.ckpt.parent / "references",
        peer=peer,
        group=group,
        chunk_bytes=args.chunk_bytes,
        fsync=not args.no_fsync,
        recv_nbytes=recv_nbytes,
    )


def loops_without_gemini(
    args: GeminiBenchSpec, trainer: Trainer, micro: int, overlap_steps: int
) -> dict[str, Any]:
    return {
        "tight_off": run_loop(trainer, 1, args.steps),
        "overlap_off": run_loop(trainer, micro, overlap_steps),
    }


def gemini_phases(
    args: GeminiBenchSpec, trainer: Trainer, group: dist.ProcessGroup
) -> dict[str, Any]:
    import gemscout
    from gemscout.gemini.store import list_steps, read_header, read_verified, step_file

    timeout = timedelta(seconds=args.timeout_s)
    out: dict[str, Any] = {}
    out["calibration"], micro = calibrate(args, trainer, group)
    loops = out["loops"] = loops_without_gemini(args, trainer, micro, args.steps)

    cfg = gemscout.CheckpointConfig(
        directory=args.ckpt,
        run_id="bench",
        chunk_bytes=args.chunk_bytes,
        fsync=not args.no_fsync,
        timeout=timeout,
        handle_signals=False,
        persist_every=args.persist_every,
    )
    clock = HookClock()
    session = clock.attach_around(
        trainer.opt,
        lambda: gemscout.enable_resiliency(trainer.ddp, trainer.opt, interval=1, checkpoint=cfg),
    )
    ckpt = session.checkpointer
    clock.stall_probe = lambda: float(ckpt.stats["capture_stall_s"])
    io = IoRecorder(ckpt)
    ckpt.phase_hook = io
    for name, m in (("tight_on", 1), ("overlap_on", micro)):
        first = session.step + 1
        loops[name] = run_loop(trainer, m, args.steps, clock)
        t0 = time.perf_counter()
        ckpt.drain()
        loops[name]["drain_s"] = time.perf_counter() - t0
        loops[name].update(io.between(first, session.step))
    # The same tight loop with when_busy="skip": a capture that would wait for a slot is skipped on every rank.
    ckpt.set_when_busy("skip")
    first, skipped0 = session.step + 1, len(ckpt.skipped_steps)
    loops["tight_skip_on"] = run_loop(trainer, 1, args.steps, clock)
    ckpt.drain()
    ckpt.set_when_busy("wait")
    loops["tight_skip_on"]["skipped_steps"] = ckpt.skipped_steps[skipped0:]
    loops["tight_skip_on"]["steps"] = list(range(first, session.step + 1))
    # Every buffer GEMINI keeps (two slots, two replica buffers) exists after the first two captures.
    out["peak_rss_bytes"] = peak_rss_bytes()
    out["gemini_buffer_bytes"] = ckpt.pool.nbytes + sum(
        e[2].numel() for b in ckpt.replicas.values() for e in b.entries
    )

    out.update(side_by_side(args, trainer, group, session, clock, io))
    out.update(restart_from_memory(trainer, session, group, timeout))

    out.update(recover_from_peer(args, trainer, session, group, timeout))
    files = [
        step_file(folder, s)
        for folder in (ckpt.paths.own, *[ckpt.paths.replicas(o) for o in ckpt.paths.held_owners()])
        for s in list_steps(folder)
    ]
    t0 = time.perf_counter()
    for path in files:
        read_verified(path)
    out["disk_files_verified"], out["disk_files_verify_s"] = len(files), time.perf_counter() - t0
    t0 = time.perf_counter()
    for path in files:
        read_header(path)  # what recover()'s inventory reads of each file
    out["disk_files_inventory_s"] = time.perf_counter() - t0
    out["errors"] = list(ckpt.errors)
    session.close()
    return out


def side_by_side(
    args: GeminiBenchSpec,
    trainer: Trainer,
    group: dist.ProcessGroup,
    session: Any,
    clock: HookClock,
    io: IoRecorder,
) -> dict[str, Any]:
    """``--quiet-captures`` rounds of one quiet capture followed by each reference on the same bytes and by
    ``comm.exchange`` of the frame just captured (GEMINI's transport alone). Returns the rounds and the
    references' medians."""
    from gemscout import _dist as comm

    ckpt = session.checkpointer
    peer = (dist.get_rank() + 1) % dist.get_world_size()
    timeout = timedelta(seconds=args.timeout_s)
    window: dict[str, list[float]] = {
        k: []
        for k in (
            "capture_return_s",
            "pipeline_s",
            "memcpy_s",
            "digest_s",
            "write_s",
            "gloo_pair_s",
            "exchange_s",
            "persisted",
        )
    }
    newest = ckpt.pool.newest_ready()
    assert newest is not None, "no sealed capture after the loops"
    refs = references(args, trainer, group, recv_nbytes=newest.data.numel())
    refs.memcpy(), refs.gloo_pair()  # warm-up: first touch of the buffers
    first = session.step + 1
    try:
        for _ in range(args.quiet_captures):
            dist.barrier(group=group)
            clock.reset()
            t0 = time.perf_counter()
            trainer.opt.step()  # no gradients: no update, but GEMINI's hooks capture as after any step
            window["capture_return_s"].append(clock.post[0])
            ckpt.drain()
            window["pipeline_s"].append(time.perf_counter() - t0)
            window["persisted"].append(
                float(session.step in io.persist_s)
            )  # a disk capture (persist_every)
            for name in ("memcpy", "digest", "write", "gloo_pair"):
                window[f"{name}_s"].append(getattr(refs, name)())
            slot = ckpt.pool.newest_ready()
            assert slot is not None, "no sealed capture after drain"
            dist.barrier(group=group)
            t0 = time.perf_counter()
            comm.exchange(
                slot.frame(),
                peer,
                peer,
                group=group,
                chunk_bytes=args.chunk_bytes,
                timeout=timeout,
                recv_buffer=lambda n, _prefix=0: refs.recv[:n],
            )
            window["exchange_s"].append(time.perf_counter() - t0)
    finally:
        refs.close()
    medians = {
        k: statistics.median(v)
        for k, v in window.items()
        if k not in ("capture_return_s", "pipeline_s", "persisted")
    }
    return {
        "window": {**window, **io.between(first, session.step)},
        **medians,
        "frame_bytes": len(slot.prefix) + slot.data.numel(),
    }


def main() -> None:
    args = parse(GeminiBenchSpec)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("gemini_rank: the benchmark pairs exactly 2 ranks (WORLD_SIZE=2)")
    group = dist.new_group(
        backend="gloo", timeout=timeout
    )  # references and barriers; GEMINI makes its own
    trainer = Trainer(args.state_mib, args.batch, rank)
    width, depth = shape_for(args.state_mib)
    result: dict[str, Any] = {
        "rank": rank,
        "role": args.role,
        "width": width,
        "depth": depth,
        "batch": args.batch,
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "state_bytes": trainer.state_bytes(),
    }
    if args.role == "off":
        # Training alone, step for step what the on role trains up to its peak-RSS reading (see the docstring).
        trainer.micro_batches_for(0.0, group)  # the calibration's micro-batches
        result["loops"] = loops_without_gemini(args, trainer, args.overlap_micro, args.steps)
        result["loops"].update(
            {
                f"{k}_again": v
                for k, v in loops_without_gemini(
                    args, trainer, args.overlap_micro, args.steps
                ).items()
            }
        )
        result["loops"]["tight_third"] = run_loop(trainer, 1, args.steps)
        result["peak_rss_bytes"] = peak_rss_bytes()
    else:
        if args.dcp is None:
            raise SystemExit("gemini_rank: --role on needs --dcp")
        result.update(gemini_phases(args, trainer, group))
        gc.collect()  # GEMINI's buffers (held in reference cycles through its threads' callbacks) go before DCP's
        dist.barrier(group=group)
        from qualification.bench import _references

        result.update(
            _references.dcp_times(trainer.ddp, trainer.opt, args.dcp, reps=args.reps, group=group)
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.role}.rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
