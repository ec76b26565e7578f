"""Collective promotion to the durable tier: sharded FSDP2 / HSDP / TP DTensors, rank-local partitions (DeepSpeed
ZeRO, through their :mod:`.codecs`), and DDP's replicated state with every rank's own RNG and caller state.

A sharded checkpoint is only whole when every rank's shards of the same step are in it, so promotion is a
collective on a dedicated gloo group (its own timeout; never the replication group, never the training thread):

1. every rank reads and verifies its own checkpoint of the step; all ranks agree that every rank could;
2. every rank writes its tensors into one ``torch.distributed.checkpoint`` directory under a temporary name, keyed
   as :mod:`.keys` says (a DTensor shard as part of its global tensor, DDP's replicated state once for all ranks,
   everything else per rank);
3. all ranks agree that every write succeeded; rank 0 hashes every file into the sidecar (with each rank's JSON
   skeleton and keys), renames the directory into place and fsyncs; all ranks agree that the commit happened.

Any failure on any rank is recorded and voted on, so a rank never leaves a collective alone and a half-written
promotion never gets its final name.
"""

from __future__ import annotations

import json
import logging
import shutil
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gemscout import _dist as comm
from gemscout.errors import ConfigError, IntegrityError
from gemscout.gemini import store
from gemscout.gemini.durable import codecs
from gemscout.gemini.durable.keys import (
    Entry,
    as_dtensor,
    check_unique_keys,
    shard_like,
    tensor_entries,
)
from gemscout.gemini.durable.sidecar import SIDECAR, canonical, sha256_file
from gemscout.gemini.store import _fsync_dir, atomic_writer
from gemscout.state import integrity
from gemscout.state.layout import Parsed

if TYPE_CHECKING:
    from gemscout.gemini.durable.tier import DurableTier

log = logging.getLogger("gemscout.gemini")


def promote_own_file(
    tier: DurableTier,
    step: int,
    path: Path,
    likes: dict[str, Any],
    *,
    check: Any,
    group: dist.ProcessGroup,
    rank: int,
    timeout: timedelta,
    replicated: tuple[str, ...] = (),
) -> Path:
    """:func:`promote` with this rank's own checkpoint file of ``step``, read and verified here (``check(identity,
    where=...)`` raises RunMismatchError for another run's file). A rank whose file is missing or bad still joins
    the collective, which then fails on every rank."""
    frame = None
    try:
        frame = store.read_verified(path)
        check(frame[0].identity, where=f"own checkpoint of step {step}")
    except (
        Exception
    ) as exc:  # any failure: this rank still joins the collective, which then fails everywhere
        log.warning("gemini: cannot promote step %d: %s", step, exc)
        frame = None
    return promote(
        tier, step, frame, likes, group=group, rank=rank, timeout=timeout, replicated=replicated
    )


def promote(
    tier: DurableTier,
    step: int,
    frame: tuple[Parsed, torch.Tensor] | None,
    likes: dict[str, Any],
    *,
    group: dist.ProcessGroup,
    rank: int,
    timeout: timedelta,
    replicated: tuple[str, ...] = (),
) -> Path:
    """Collectively promote ``step`` (all ranks of ``group`` call, each with its own verified checkpoint, or None
    when it has none; ``likes`` from :func:`live_shards`; ``replicated``: see :func:`tensor_entries`). Returns the
    promotion's path; raises IntegrityError on every rank if any rank failed."""
    import torch.distributed.checkpoint as dcp  # here, not at import: it imports DTensor (see tier.py)

    final, tmp = tier.path(step), tier.directory / f".tmp-collective-step-{step:09d}"
    if comm.all_agree(final.exists(), group=group, timeout=timeout):
        return final  # promoted before (e.g. a resumed job certified the same step again)
    state: dict[str, Any] = {}
    mine: dict[str, Any] = {}
    err = "" if frame is not None else "no verified checkpoint of this step on disk"
    entries: list[Entry] | None = None
    if frame is not None:
        try:
            codec = codecs.for_skeleton(frame[0].skeleton)
            if codec is not None:
                state, mine = codec.promotion_items(frame[0], frame[1], rank)
            else:
                entries = tensor_entries(frame[0].skeleton, rank, replicated)
        except Exception as exc:  # recorded and voted on below: a rank never skips the collective
            err = f"{type(exc).__name__}: {exc}"
    if replicated:  # collective: every rank takes part, whatever happened above
        ok = frame is not None and entries is not None and not err
        shared = _agree_on_shared(
            entries or [],
            frame[0].digests if ok and frame is not None else (),
            rank,
            group=group,
            timeout=timeout,
        )
        if entries is not None:  # a codec's items (entries None) are the codec's own to key
            entries = shared
    if frame is not None and entries is not None and not err:
        try:
            parsed, data = frame
            check_unique_keys(entries)  # again after _agree_on_shared renamed some keys
            for (key, shape, stride), view in zip(entries, parsed.layout.views(data), strict=True):
                state[key] = (
                    view
                    if shape is None
                    else as_dtensor(view, shard_like(likes, key), shape, stride or [])
                )
            own = [
                k
                for k, _, _ in entries
                if k.startswith(f"r{rank}/") and k.split("/")[1] in replicated
            ]
            mine = {
                "skeleton": parsed.skeleton,
                "identity": parsed.identity,
                "entries": entries,
                "rank_specific": len(own),
            }
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        shutil.rmtree(
            tmp, ignore_errors=True
        )  # a stale attempt's files would be mixed into this one
    # Every rank learns every rank's reason (doubles as the barrier after the cleanup): a key collision is the
    # caller's to fix and raises ConfigError on every rank, anything else IntegrityError.
    reasons = comm.gather_json(err, group=group, timeout=timeout)
    failed = [(r, why) for r, why in enumerate(reasons) if why]
    if failed:
        r, why = failed[0]
        cls = (
            ConfigError
            if any(str(w).startswith("ConfigError:") for _, w in failed)
            else IntegrityError
        )
        raise cls(f"durable step {step}: rank {r} could not prepare its shards ({why})")
    from torch.distributed.checkpoint.api import (
        CheckpointException,
    )  # a BaseException, not an Exception

    try:
        dcp.save(state, checkpoint_id=str(tmp), process_group=group)
    except (
        Exception,
        CheckpointException,
    ) as exc:  # recorded and voted on: every rank raises IntegrityError below
        err = f"DCP save failed: {exc}"
    if not comm.all_agree(not err, group=group, timeout=timeout):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise IntegrityError(
            f"durable step {step}: a rank could not write its shards ({err or 'on a peer'})"
        )
    ranks = comm.gather_json(mine, group=group, timeout=timeout)
    committed = True
    if rank == 0:
        try:
            _commit(tier, step, tmp, final, ranks)
        except Exception as exc:
            err, committed = f"commit failed: {exc}", False
            shutil.rmtree(tmp, ignore_errors=True)
    if not comm.all_agree(committed, group=group, timeout=timeout):
        raise IntegrityError(
            f"durable step {step}: {err or 'rank 0 could not commit the promotion'}"
        )
    log.info("gemini: promoted step %d (sharded, %d ranks) to %s", step, len(ranks), final)
    return final


def _agree_on_shared(
    entries: list[Entry], digests: Any, rank: int, *, group: dist.ProcessGroup, timeout: timedelta
) -> list[Entry]:
    """Keep a ``g/`` key shared only where every rank holds that key with the same digest; any other becomes this
    rank's own ``r<rank>/`` key. DDP's model and optimizer are the same on every rank, but model parallelism without
    DTensors (Megatron TP/PP, pipeline stages, experts held as plain tensors) gives ranks different tensors under the
    same name, which DCP would otherwise store once for all. Collective on ``group``."""
    offered = {
        key: d for (key, _, _), d in zip(entries, digests, strict=False) if key.startswith("g/")
    }
    everyone = comm.gather_json(offered, group=group, timeout=timeout)
    common = {k for k, d in offered.items() if all(o.get(k) == d for o in everyone)}
    return [
        (k if not k.startswith("g/") or k in common else f"r{rank}{k[1:]}", shape, stride)
        for k, shape, stride in entries
    ]


def _commit(
    tier: DurableTier, step: int, tmp: Path, final: Path, ranks: list[dict[str, Any]]
) -> None:
    files = {
        p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(tmp.iterdir())
        if p.is_file()
    }
    doc = {
        "format": 3,
        "sharded": True,
        "run_id": tier.run_id,
        "step": step,
        "world_size": len(ranks),
        "identity": ranks[0]["identity"],
        "ranks": ranks,
        "files": files,
    }
    key = integrity.current_key()
    if (
        key is not None
    ):  # authenticated: the sidecar names every file's SHA-256, so its MAC covers the promotion
        doc["mac"] = integrity.sidecar_mac(canonical(doc), key)
    # Not sorted: a skeleton's dict order is the caller's (format 2 sorted it, so caller dicts came back reordered).
    with atomic_writer(tmp / SIDECAR, fsync=tier.fsync) as fh:
        fh.write(json.dumps(doc, indent=1).encode())
    tmp.rename(final)
    if tier.fsync:
        _fsync_dir(tier.directory)
