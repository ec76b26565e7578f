"""DeepSpeed ZeRO-1/2 state per parameter: the durable tier that any world size can resume from.

A ZeRO-1/2 rank holds one flat fp32 partition per param group (and the optimizer moments of that partition). Where a
parameter lands in that flat depends on the world size (the partition boundaries, DeepSpeed's round-robin reorder,
its alignment padding), so a promotion stored per rank only loads on the same world size. This module stores the
partition state per *parameter* instead, in the same ``torch.distributed.checkpoint`` directory as the rest:

- ``z/master/<param>`` and ``z/state/<key>/<param>`` (``exp_avg``, ``exp_avg_sq``: every optimizer state tensor
  shaped like the partition): a 1-D fp32 tensor of the parameter's full numel. Each rank writes only the fragment
  its partition holds, as a DCP chunk at the fragment's offset, so every element is written once, by its owner, and
  nothing is gathered (the full fp32 state is 6x a bf16 model: too much to gather on one rank). DCP checks at save
  that the chunks of every parameter tile it exactly.
- ``z/model/<name>``: the module's state (every rank holds all of it under ZeRO-1/2; DCP writes it once).
- ``r<rank>/...``: what stays per rank (the optimizer's step counts and hyper-parameters, engine counters, lr
  scheduler, caller state, RNG), as for any sharded promotion; a new rank ``r`` takes old rank ``r % old_world``'s.

Where each fragment lies is DeepSpeed's own mapping (``lp._hp_mapping``, the one its universal checkpoint uses):
the offset in the parameter and in the partition, taken once per engine. Loading on any world size: each rank asks
DCP for the fragments of its own new partition (DCP reads the overlapping parts of the saved chunks), writes them
into zeroed partitions (the padding is zero, as DeepSpeed builds it), loads the module, and checks that its own
fragments of the module equal its masters cast to the module dtype — exactly what ``engine.step()`` leaves behind,
so a promotion whose model and masters disagree is refused rather than resumed.

Nothing here imports deepspeed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gemscout._modules import unwrap
from gemscout.errors import ConfigError, IntegrityError, RunMismatchError
from gemscout.state import training_state
from gemscout.state.codec import decode, encode
from gemscout.state.layout import Parsed

__all__ = ["CODEC", "ZeroPerParameter", "partition_table", "register"]

CODEC = "deepspeed-zero.per-parameter.v1"
FORMAT = "gemscout.deepspeed-zero.v1"
"""The optimizer state format of :class:`gemscout.adapters.deepspeed.EngineOptimizer`."""

Row = list[Any]
"""One fragment: ``[param name, param numel, start in the flattened param, start in the partition, length]``."""


def partition_table(zero: Any) -> dict[str, Any]:
    """Which parameters each param group holds and where this rank's partition holds a piece of them (JSON).

    ``params``: per group, the parameter names in DeepSpeed's group order (the same on every world size);
    ``fragments``: per group, a :data:`Row` per parameter this rank's partition overlaps. Raises ConfigError when
    the engine lacks DeepSpeed's fragment mapping (a version this adapter was not built for)."""
    names = getattr(zero, "param_names", None)
    groups = getattr(zero, "bit16_groups", None)
    if not isinstance(names, dict) or groups is None:
        raise ConfigError(
            "the ZeRO optimizer has no param_names / bit16_groups; this DeepSpeed version is not "
            "supported (tested: deepspeed==0.19.8)"
        )
    params: list[list[str]] = []
    fragments: list[list[Row]] = []
    for group in groups:
        params.append([str(names[p]) for p in group])
        rows: list[Row] = []
        for p in group:
            if not hasattr(p, "_hp_mapping"):
                raise ConfigError(
                    "DeepSpeed parameters carry no _hp_mapping (the fp32 fragment link); this DeepSpeed "
                    "version is not supported (tested: deepspeed==0.19.8)"
                )
            m = p._hp_mapping
            if m is None:
                continue  # no element of this parameter in this rank's partition
            rows.append(
                [
                    str(names[p]),
                    int(p.numel()),
                    int(m.lp_fragment_address.start),
                    int(m.hp_fragment_address.start),
                    int(m.hp_fragment_address.numel),
                ]
            )
        fragments.append(rows)
    return {"params": params, "fragments": fragments}


class _Chunk(torch.Tensor):
    """``length`` elements of a flattened parameter, at ``start``, as DCP sees them: a 1-D tensor of the whole
    parameter's numel of which this rank holds one chunk (DCP's ``_Checkpointable`` protocol, as DTensor does it).

    It is only a save source / load target: it has no storage of its own, and any tensor operation on it raises."""

    _local: torch.Tensor
    _start: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, start: int, numel: int) -> _Chunk:
        obj = torch.Tensor._make_wrapper_subclass(
            cls, (numel,), dtype=local.dtype, device=local.device
        )
        obj._local, obj._start = local, start
        return obj

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise TypeError(
            f"a ZeRO parameter fragment is only a DCP save/load target; {func} is not supported"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"_Chunk(start={self._start}, length={self._local.numel()}, numel={self.shape[0]})"

    # torch.distributed.checkpoint is imported where it is used (it imports DTensor; see gemini/durable.py).
    def _chunk(self) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(
            offsets=torch.Size([self._start]), sizes=torch.Size([self._local.numel()])
        )

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([self._start])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(),
                    properties=TensorProperties.create_from_tensor(self._local),
                    size=self.shape,
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[Any]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self._local


def _kinds(elementwise: list[str]) -> list[tuple[str, str | None]]:
    """(DCP key prefix, optimizer state key or None for the master) of one group."""
    return [("z/master/", None), *((f"z/state/{k}/", k) for k in elementwise)]


class ZeroPerParameter:
    """The partition codec of :mod:`gemscout.gemini.durable.codecs` for DeepSpeed ZeRO-1/2 (see the module doc)."""

    name = CODEC

    def accepts(self, skeleton: Any) -> bool:
        opt = skeleton.get("optimizer") if isinstance(skeleton, dict) else None
        return isinstance(opt, dict) and opt.get("format") == FORMAT and "fragments" in opt

    def promotion_items(
        self, parsed: Parsed, data: torch.Tensor, rank: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's DCP items for a promotion of its verified checkpoint, and its sidecar record."""
        from gemscout.gemini.durable.keys import tensor_entries

        state = decode(parsed.skeleton, parsed.layout.views(data))
        opt = state["optimizer"]
        fragments, params = (
            opt.pop("fragments"),
            opt.pop("params"),
        )  # kept in the record; a load uses its own
        items: dict[str, Any] = {}
        elementwise: list[list[str]] = []
        for i, master in enumerate(opt["master"]):
            per = opt["state"].get(i, {})
            keys = [
                k for k, v in per.items() if isinstance(v, torch.Tensor) and v.shape == master.shape
            ]
            elementwise.append(keys)
            for name, numel, param_start, start, length in fragments[i]:
                for prefix, key in _kinds(keys):
                    flat = master if key is None else per[key]
                    items[prefix + name] = _Chunk(flat.narrow(0, start, length), param_start, numel)
            opt["master"][i] = None
            for key in keys:
                per[key] = None
        for name, value in state["model"].items():
            items[f"z/model/{name}"] = value
        state["model"] = {name: None for name in state["model"]}
        skeleton, tensors = encode(state, path="deepspeed.promotion")
        entries = tensor_entries(skeleton, rank)
        items.update({key: t for (key, _, _), t in zip(entries, tensors, strict=True)})
        record = {
            "skeleton": skeleton,
            "identity": parsed.identity,
            "entries": entries,
            "codec": CODEC,
            "partition": {"params": params, "elementwise": elementwise, "fragments": fragments},
        }
        return items, record

    def load(
        self,
        folder: Path,
        saved: list[dict[str, Any]],
        sources: training_state.StateSources,
        *,
        group: dist.ProcessGroup,
        rank: int,
    ) -> None:
        """Load a per-parameter promotion into this rank's live engine, on any world size (every rank of ``group``
        calls). Raises RunMismatchError for another model or param grouping, IntegrityError for a broken one."""
        import torch.distributed.checkpoint as dcp

        table = getattr(sources.optimizer, "partition_table", None)
        if not callable(table):
            raise RunMismatchError(
                f"durable promotion {folder.name} holds DeepSpeed ZeRO state; only a DeepSpeed "
                "ZeRO-1/2 job can load it"
            )
        live = table()
        src = saved[rank % len(saved)]  # per-rank entries on another world size: rank r % old
        there = saved[0]["partition"]["params"]
        if there != live["params"]:
            raise RunMismatchError(
                f"durable promotion {folder.name} has param groups of {[len(g) for g in there]} "
                f"parameters, this engine {[len(g) for g in live['params']]} (or other names); "
                "resume with the same model and optimizer param groups"
            )
        meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        targets: dict[str, Any] = {}

        def stored(key: str) -> Any:
            if key not in meta:
                raise IntegrityError(f"durable promotion {folder.name} lacks {key!r}")
            return meta[key]

        for key, _, _ in src["entries"]:
            md = stored(key)
            targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
        model_live = unwrap(sources.model).state_dict()
        for name, value in model_live.items():
            md = stored(f"z/model/{name}")
            if md.properties.dtype != value.dtype or tuple(md.size) != tuple(value.shape):
                raise RunMismatchError(
                    f"durable promotion {folder.name} holds {name} as {md.properties.dtype} "
                    f"{list(md.size)}, this engine {value.dtype} {list(value.shape)}; resume with "
                    "the same model and precision (bf16 on or off)"
                )
            targets[f"z/model/{name}"] = torch.empty(md.size, dtype=md.properties.dtype)
        elementwise: list[list[str]] = src["partition"]["elementwise"]
        sizes = [int(n) for n in sources.optimizer.partition_numel()]  # type: ignore[attr-defined]
        partitions: list[dict[str | None, torch.Tensor]] = []
        for i, rows in enumerate(live["fragments"]):
            flats: dict[str | None, torch.Tensor] = {}
            for prefix, key in _kinds(elementwise[i]):
                flats[key] = torch.zeros(
                    sizes[i], dtype=torch.float32
                )  # padding stays zero, as DeepSpeed builds it
                for name, numel, param_start, start, length in rows:
                    md = stored(prefix + name)
                    if tuple(md.size) != (numel,):
                        raise IntegrityError(
                            f"durable promotion {folder.name}: {prefix + name} has {list(md.size)} "
                            f"elements, the live parameter {numel}"
                        )
                    targets[prefix + name] = _Chunk(
                        flats[key].narrow(0, start, length), param_start, numel
                    )
            partitions.append(flats)
        dcp.load(targets, checkpoint_id=str(folder), process_group=group)
        state = decode(src["skeleton"], [targets[key] for key, _, _ in src["entries"]])
        state["model"] = {name: targets[f"z/model/{name}"] for name in model_live}
        opt = state["optimizer"]
        opt.update(sources.optimizer.layout())  # type: ignore[attr-defined]  # this engine's partitioning now
        opt.update(live)
        for i, flats in enumerate(partitions):
            opt["master"][i] = flats.pop(None)
            opt["state"].setdefault(i, {}).update(flats)
        training_state.restore(sources, state)
        self._check_model(sources, live["fragments"], folder.name)

    @staticmethod
    def _check_model(
        sources: training_state.StateSources, fragments: list[list[Row]], where: str
    ) -> None:
        """Each rank's module fragments must be its masters cast to the module dtype, as ``engine.step()`` leaves
        them; otherwise the promotion's model and masters are of different steps."""
        model = dict(unwrap(sources.model).named_parameters())
        masters = [g["params"][0] for g in sources.optimizer.param_groups]
        for i, rows in enumerate(fragments):
            for name, _, param_start, start, length in rows:
                lp = model[name].detach().reshape(-1).narrow(0, param_start, length)
                hp = masters[i].detach().narrow(0, start, length).to(lp.dtype)
                if not torch.equal(lp.view(torch.uint8), hp.view(torch.uint8)):
                    raise IntegrityError(
                        f"durable promotion {where}: parameter {name} differs from its fp32 master; "
                        "the promotion's model and optimizer state are not of the same step"
                    )


def register() -> None:
    """Make ZeRO promotions per parameter (idempotent; called when a DeepSpeed engine is attached)."""
    from gemscout.gemini.durable import codecs

    codecs.register(ZeroPerParameter())
