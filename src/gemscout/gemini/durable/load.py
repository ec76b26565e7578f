"""Collective load of a verified durable promotion into the live objects (every rank of the tier's group calls).

On another world size, DTensor shards are resharded by DCP onto the live mesh and per-rank entries come from rank
``r % old_world_size``; a promotion written by a partition codec (:mod:`.codecs`) is loaded by that codec, which
reshards too. State that differs from rank to rank without DTensors (pipeline stages, Megatron TP/PP, ZeRO
partitions without a codec) loads on the world size that wrote it only, and anything else is refused with the
reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gemscout.errors import IntegrityError, RunMismatchError
from gemscout.gemini.durable import codecs
from gemscout.gemini.durable.keys import Entry, as_dtensor, live_shards, shard_like
from gemscout.state import training_state
from gemscout.state.codec import decode


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
    ``reader``: the DCP storage reader of the files that were verified (:mod:`.held_files`); None
    opens ``folder`` by name. A DeepSpeed partition codec still opens its files by name."""
    if group is None:
        raise IntegrityError(
            "this durable promotion holds sharded or rank-local state; only a job whose model is "
            "sharded (FSDP2, HSDP, TP) or a DeepSpeed ZeRO job can load it"
        )
    saved = sidecar["ranks"]
    if saved[0].get("codec") is not None:  # stored per parameter: the codec reshards
        codec = codecs.named(saved[0]["codec"])
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
            like = shard_like(likes, key)
            local_shape = like.to_local().shape  # a state entry shards exactly like its parameter
            targets[key] = as_dtensor(
                torch.empty(local_shape, dtype=dtype), like, shape, stride or []
            )
    dcp.load(targets, storage_reader=reader, process_group=group)
    tensors = [targets[k] if s is None else targets[k].to_local() for k, s, _ in entries]
    training_state.restore(sources, decode(src["skeleton"], tensors))
