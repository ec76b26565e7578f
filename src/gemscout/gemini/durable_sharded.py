"""Collective promotion to the durable tier (sharded FSDP2 / HSDP / TP DTensors, DeepSpeed ZeRO partitions, and
DDP's replicated state with every rank's own RNG and caller state), and its collective load.

A sharded checkpoint is only whole when every rank's shards of the same step are in it, so promotion is a
collective on a dedicated gloo group (its own timeout; never the replication group, never the training thread):

1. every rank reads and verifies its own checkpoint of the step; all ranks agree that every rank could;
2. every rank writes its shards into one ``torch.distributed.checkpoint`` directory under a temporary name. DTensor
   shards are saved as the global tensor they belong to (key ``s/<path>``), so DCP stores each element once (HSDP's
   replicate dimension is deduplicated) and can reshard on load; everything else (caller state, RNG, step counters)
   is the rank's own (key ``r<rank>/<path>``). Replicated state (DDP) is promoted the same way, so each rank's own
   caller state and RNG streams are kept: its model, optimizer and scheduler tensors are keyed ``g/<path>`` on every
   rank and DCP writes each once; caller state and RNG are the rank's own;
3. all ranks agree that every write succeeded; rank 0 hashes every file into the sidecar (with each rank's JSON
   skeleton and keys), renames the directory into place and fsyncs; all ranks agree that the commit happened.

Any failure on any rank is recorded and voted on, so a rank never leaves a collective alone and a half-written
promotion never gets its final name. Loading verifies the sidecar first (see :class:`DurableTier.verify`), then
every rank loads collectively; on another world size, shards are resharded by DCP onto the live mesh and per-rank
entries come from rank ``r % old_world_size``. Rank-local partitions (DeepSpeed ZeRO) are stored per parameter by
the codec their adapter registers in :data:`PARTITION_CODECS`, and reshard on load too.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gemscout import _dist as comm
from gemscout import record_mac
from gemscout._modules import unwrap
from gemscout._tensors import is_dtensor
from gemscout.errors import ConfigError, IntegrityError, RunMismatchError
from gemscout.gemini import store
from gemscout.gemini.store import _fsync_dir, atomic_writer
from gemscout.state import integrity, training_state
from gemscout.state.codec import decode
from gemscout.state.layout import Parsed

log = logging.getLogger("gemscout.gemini")

Entry = tuple[str, list[int] | None, list[int] | None]
"""(DCP key, global shape, global stride) per tensor index; shape and stride only for DTensor shards."""

PARTITION_CODECS: dict[str, Any] = {}
"""Codecs that store a rank-local partition per parameter, by the name the sidecar records. An adapter registers
its own (DeepSpeed ZeRO: :class:`gemscout.adapters.deepspeed.layout.ZeroPerParameter`): ``accepts(skeleton)``,
``promotion_items(parsed, data, rank) -> (DCP items, sidecar record)`` and ``load(folder, records, sources, group=,
rank=)``. Such a promotion loads on any world size; one without a codec only on the world size that wrote it."""


def key_component(key: Any) -> str:
    """One path component of a DCP key, unique by construction: ``/`` and ``%`` in a string key are escaped
    (``%2F``, ``%25``), a string that reads as an integer is marked ``%s`` (an ``int`` key of a non-string dict,
    e.g. an optimizer's parameter index, stays bare), and bool / float keys are marked ``%b`` / ``%f``. Caller state
    ``{"a/b": t1, "a": {"b": t2}}`` so gives ``a%2Fb`` and ``a/b``, never the same key twice. Model and optimizer
    names contain neither ``/`` nor ``%`` and are unchanged, so their keys are the same as format 2's."""
    if isinstance(key, bool):
        return f"%b{key}"
    if isinstance(key, int):
        return str(key)
    if isinstance(key, float):
        return f"%f{key!r}"
    if not isinstance(key, str):
        raise IntegrityError(f"checkpoint skeleton has a dict key of type {type(key).__name__}")
    escaped = key.replace("%", "%25").replace("/", "%2F")
    return f"%s{escaped}" if _INTEGER.fullmatch(escaped) else escaped


_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: str(int) never yields another digit


def tensor_entries(skeleton: Any, rank: int, replicated: tuple[str, ...] = ()) -> list[Entry]:
    """A DCP key per tensor of a codec skeleton, in tensor-index order (see the module docstring). A plain tensor
    under a top-level key in ``replicated`` is the same on every rank (DDP's model, optimizer and schedulers): its
    key ``g/<path>`` is shared by every rank, so DCP stores it once. Keys are built from :func:`key_component`;
    raises ConfigError if two tensors still share a key (a float-NaN dict key twice), IntegrityError for a
    skeleton that is not the codec's."""
    found: dict[int, Entry] = {}

    def walk(node: Any, path: str, depth: int) -> None:
        if depth > MAX_SKELETON_DEPTH:
            raise IntegrityError(
                f"checkpoint skeleton is nested deeper than {MAX_SKELETON_DEPTH} levels"
            )
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}", depth + 1)
            return
        if not isinstance(node, dict):
            return
        if len(node) == 1:
            ((key, value),) = node.items()
            if key == "__dt__":
                index, shape, stride = value
                _claim(found, index, (f"s{path}", list(shape), list(stride)))
                return
            if key in ("__t__", "__np__"):
                shared = path.split("/")[1] in replicated
                _claim(found, value, (f"g{path}" if shared else f"r{rank}{path}", None, None))
                return
            if key == "__tuple__":
                walk(value, path, depth + 1)
                return
            if key == "__dict__":
                for k, v in value:
                    walk(v, f"{path}/{key_component(k)}", depth + 1)
                return
        for k, v in node.items():
            walk(v, f"{path}/{key_component(k)}", depth + 1)

    try:
        walk(skeleton, "", 0)
    except (TypeError, ValueError, IndexError) as exc:
        raise IntegrityError(f"checkpoint skeleton is malformed: {exc}") from None
    if sorted(found) != list(range(len(found))):
        raise IntegrityError(
            "checkpoint skeleton does not reference its tensors 0..n-1 exactly once"
        )
    entries = [found[i] for i in range(len(found))]
    check_unique_keys(entries)
    return entries


MAX_SKELETON_DEPTH = 64
"""Deeper than any training state (a model's state dict is flat; optimizer state three levels); a crafted skeleton
nested thousands deep would otherwise end in RecursionError."""


def _claim(found: dict[int, Entry], index: Any, entry: Entry) -> None:
    if type(index) is not int or index < 0 or index in found:
        raise IntegrityError(
            f"checkpoint skeleton references tensor {index!r} twice or not as an index"
        )
    found[index] = entry


def check_unique_keys(entries: list[Entry]) -> None:
    """Refuse a promotion in which two tensors share a DCP key: DCP would store one and load it into both (the
    other's values silently lost). Raises ConfigError naming the key."""
    seen: set[str] = set()
    for key, _, _ in entries:
        if key in seen:
            raise ConfigError(
                f"durable promotion: two tensors of the state map to the DCP key {key!r}; rename one "
                "of the caller state's keys (e.g. a dict holding two float NaN keys)"
            )
        seen.add(key)


def live_shards(sources: training_state.StateSources) -> dict[str, Any]:
    """The live DTensors a stored shard is rebuilt like, by key prefix: ``/model/<name>`` and
    ``/optimizer/state/<index>`` (an optimizer state entry shards like its parameter).

    Call on the training thread between steps: ``state_dict()`` runs FSDP's hooks, and during a forward FSDP
    registers unsharded parameters; the io thread only reads the mesh, placements and local shape of what this
    returns."""
    likes: dict[str, Any] = {}
    for name, value in unwrap(sources.model).state_dict().items():
        if is_dtensor(value):
            likes[f"/model/{key_component(name)}"] = value
    flat = [p for g in sources.optimizer.param_groups for p in g["params"]]
    for idx, p in enumerate(flat):
        if is_dtensor(p):
            likes[f"/optimizer/state/{idx}"] = p
    return likes


def _like(likes: dict[str, Any], key: str) -> Any:
    path = key[1:]  # drop the "s"
    parts = path.split("/")
    like = likes.get(path) if parts[1] == "model" else likes.get("/".join(parts[:4]))
    if like is None:
        raise IntegrityError(
            f"durable checkpoint has a sharded entry {key!r} with no live DTensor to shard it like"
        )
    return like


def _dtensor(local: torch.Tensor, like: Any, shape: list[int], stride: list[int]) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(stride),
    )


def promote_own_file(
    tier: Any,
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
    tier: Any,
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
    import torch.distributed.checkpoint as dcp  # here, not at import: it imports DTensor (see durable.py)

    final, tmp = tier.path(step), tier.directory / f".tmp-collective-step-{step:09d}"
    if comm.all_agree(final.exists(), group=group, timeout=timeout):
        return final  # promoted before (e.g. a resumed job certified the same step again)
    state: dict[str, Any] = {}
    mine: dict[str, Any] = {}
    err = "" if frame is not None else "no verified checkpoint of this step on disk"
    entries: list[Entry] | None = None
    if frame is not None:
        try:
            codec = next(
                (c for c in PARTITION_CODECS.values() if c.accepts(frame[0].skeleton)), None
            )
            if codec is not None:
                state, mine = codec.promotion_items(frame[0], frame[1], rank)
            else:
                entries = tensor_entries(frame[0].skeleton, rank, replicated)
        except Exception as exc:  # recorded and voted on below: a rank never skips the collective
            err = f"{type(exc).__name__}: {exc}"
    if replicated:  # collective: every rank takes part, whatever happened above
        ok = frame is not None and entries is not None and not err
        entries = _agree_on_shared(
            entries or [],
            frame[0].digests if ok and frame is not None else (),
            rank,
            group=group,
            timeout=timeout,
        )
    if frame is not None and entries is not None and not err:
        try:
            parsed, data = frame
            check_unique_keys(entries)  # again after _agree_on_shared renamed some keys
            for (key, shape, stride), view in zip(entries, parsed.layout.views(data), strict=True):
                state[key] = (
                    view
                    if shape is None
                    else _dtensor(view, _like(likes, key), shape, stride or [])
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


def _commit(tier: Any, step: int, tmp: Path, final: Path, ranks: list[dict[str, Any]]) -> None:
    from gemscout.gemini.durable import SIDECAR, _sha256

    files = {
        p.name: {"sha256": _sha256(p), "size": p.stat().st_size}
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
        doc["mac"] = integrity.sidecar_mac(sidecar_canonical(doc), key)
    # Not sorted: a skeleton's dict order is the caller's (format 2 sorted it, so caller dicts came back reordered).
    with atomic_writer(tmp / SIDECAR, fsync=tier.fsync) as fh:
        fh.write(json.dumps(doc, indent=1).encode())
    tmp.rename(final)
    if tier.fsync:
        _fsync_dir(tier.directory)


def sidecar_canonical(doc: dict[str, Any]) -> bytes:
    """The bytes a sidecar's MAC covers: every field but ``mac``, as sorted, compact JSON."""
    return record_mac.canonical(doc)


def load(
    folder: Path,
    sidecar: dict[str, Any],
    sources: training_state.StateSources,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    reader: Any = None,
) -> None:
    """Collectively load a verified sharded promotion into the live objects (every rank of ``group`` calls).
    ``reader``: the DCP storage reader of the files that were verified (:mod:`gemscout.gemini.held_files`); None
    opens ``folder`` by name. A DeepSpeed partition codec still opens its files by name."""
    if group is None:
        raise IntegrityError(
            "this durable promotion holds sharded or rank-local state; only a job whose model is "
            "sharded (FSDP2, HSDP, TP) or a DeepSpeed ZeRO job can load it"
        )
    saved = sidecar["ranks"]
    if saved[0].get("codec") is not None:  # stored per parameter: the codec reshards
        codec = PARTITION_CODECS.get(saved[0]["codec"])
        if codec is None:
            raise RunMismatchError(
                f"durable promotion {folder.name} holds {saved[0]['codec']} state; only a job of that kind can load it"
            )
        codec.load(folder, saved, sources, group=group, rank=rank)
        return
    world = dist.get_world_size(group)
    if len(saved) != world and any(r.get("rank_specific") for r in saved):
        raise RunMismatchError(
            f"durable promotion {folder.name} holds model or optimizer state that differs from "
            f"rank to rank without DTensors (model parallelism: pipeline stages, Megatron TP/PP); "
            f"it restores on {len(saved)} ranks only, not {world}"
        )
    if sources.rank_local and len(saved) != world:
        raise RunMismatchError(
            f"durable promotion {folder.name} holds {len(saved)} ranks' own partitions "
            f"(DeepSpeed ZeRO); it restores on {len(saved)} ranks only, not {world}"
        )
    src = saved[
        rank % len(saved)
    ]  # per-rank entries (caller state, RNG) on another world size: rank r % old
    import torch.distributed.checkpoint as dcp

    if reader is None:
        reader = dcp.FileSystemReader(str(folder))
    meta = reader.read_metadata().state_dict_metadata
    targets: dict[str, Any] = {}
    likes = live_shards(sources)
    entries: list[Entry] = [(k, s, st) for k, s, st in src["entries"]]
    for key, shape, stride in entries:
        if key not in meta:
            raise IntegrityError(f"durable promotion lacks {key!r}")
        md: Any = meta[key]
        dtype = md.properties.dtype
        if shape is None:
            targets[key] = torch.empty(md.size, dtype=dtype)
        else:
            like = _like(likes, key)
            local_shape = like.to_local().shape  # a state entry shards exactly like its parameter
            targets[key] = _dtensor(
                torch.empty(local_shape, dtype=dtype), like, shape, stride or []
            )
    dcp.load(targets, storage_reader=reader, process_group=group)
    tensors = [targets[k] if s is None else targets[k].to_local() for k, s, _ in entries]
    training_state.restore(sources, decode(src["skeleton"], tensors))
