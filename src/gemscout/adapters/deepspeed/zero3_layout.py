"""DeepSpeed ZeRO-3 state per parameter: the durable tier that any world size can resume from.

Under ZeRO-3 rank ``r`` of ``n`` holds, of every parameter ``p`` (``numel`` elements, padded to a multiple of ``n``),
the slice ``[r * pn, (r + 1) * pn)`` of the flattened parameter, ``pn = p.partition_numel()``: in the module dtype as
``p.ds_tensor``, and (trainable parameters) in fp32 inside the sub-group's master partition at the offset DeepSpeed
records in ``grad_position`` (the sum of the ``partition_numel`` of the sub-group's parameters before it), with the
optimizer's moments at the same offsets. Only the last slice holds padding (DeepSpeed 0.19.8 leaves it
uninitialized and never reads it: every gather is cut to the parameter's size, and its gradient is zero). This module stores all of it per
*parameter*, as ``torch.distributed.checkpoint`` chunks at their offset in the flattened parameter (the
:class:`~gemscout.adapters.deepspeed.layout._Chunk` of ZeRO-1/2), so every element is written once, by its owner,
and nothing is gathered:

- ``z/model/<name>``: the module partition of each parameter (module dtype), ``z/buffer/<name>``: each buffer whole;
- ``z/master/<name>``, ``z/state/<key>/<name>``: the fp32 master and every optimizer state tensor shaped like the
  master partition (AdamW's ``exp_avg``, ``exp_avg_sq``);
- ``r<rank>/...``: what stays per rank (step counts, hyper-parameters, engine counters, lr scheduler, caller state,
  RNG); a new rank ``r`` takes old rank ``r % old_world``'s.

Loading on any world size: each rank asks DCP for its own new slices (DCP reads the overlapping parts of the saved
chunks) into zeroed partitions (the padding is not stored; it comes back as zero), restores them, and checks that its
module partitions equal its masters cast to the module dtype, as ``engine.step()`` leaves them.

Nothing here imports deepspeed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gemscout._modules import unwrap
from gemscout.adapters.deepspeed.layout import _Chunk, _kinds
from gemscout.errors import IntegrityError, RunMismatchError
from gemscout.state import training_state
from gemscout.state.codec import decode, encode
from gemscout.state.layout import Parsed

__all__ = ["CODEC", "Zero3PerParameter", "register"]

CODEC = "deepspeed-zero3.per-parameter.v1"
FORMAT = "gemscout.deepspeed-zero3.v1"
"""The optimizer state format of :class:`gemscout.adapters.deepspeed.zero3.Zero3EngineOptimizer`."""


def _slice(numel: int, partition_numel: int, index: int) -> tuple[int, int]:
    """(start in the flattened parameter, elements that are not padding) of partition ``index``."""
    start = index * partition_numel
    return start, max(0, min(partition_numel, numel - start))


class Zero3PerParameter:
    """The partition codec of :mod:`gemscout.gemini.durable.codecs` for DeepSpeed ZeRO-3 (see the module doc)."""

    name = CODEC

    def accepts(self, skeleton: Any) -> bool:
        opt = skeleton.get("optimizer") if isinstance(skeleton, dict) else None
        return isinstance(opt, dict) and opt.get("format") == FORMAT

    def promotion_items(
        self, parsed: Parsed, data: torch.Tensor, rank: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's DCP items for a promotion of its verified checkpoint, and its sidecar record."""
        from gemscout.gemini.durable.keys import tensor_entries

        state = decode(parsed.skeleton, parsed.layout.views(data))
        opt = state["optimizer"]
        numel: dict[str, int] = opt["numel"]
        items: dict[str, Any] = {}
        for name, part in state["model"].items():
            if name in numel:  # a parameter: this rank's slice
                start, length = _slice(numel[name], part.numel(), opt["module_index"])
                items[f"z/model/{name}"] = _Chunk(part.narrow(0, 0, length), start, numel[name])
            else:
                items[f"z/buffer/{name}"] = part
        elementwise: list[list[str]] = []
        for i, master in enumerate(opt["master"]):
            per = opt["state"].get(i, {})
            keys = [
                k for k, v in per.items() if isinstance(v, torch.Tensor) and v.shape == master.shape
            ]
            elementwise.append(keys)
            offset = 0
            for name, pn in zip(opt["params"][i], opt["slices"][i], strict=True):
                start, length = _slice(numel[name], pn, opt["partition_index"][i])
                for prefix, key in _kinds(keys):
                    flat = master if key is None else per[key]
                    items[prefix + name] = _Chunk(
                        flat.narrow(0, offset, length), start, numel[name]
                    )
                offset += pn
            opt["master"][i] = None
            for key in keys:
                per[key] = None
        names = list(state["model"])
        state["model"] = {name: None for name in names}
        skeleton, tensors = encode(state, path="deepspeed.promotion")
        entries = tensor_entries(skeleton, rank)
        items.update({key: t for (key, _, _), t in zip(entries, tensors, strict=True)})
        record = {
            "skeleton": skeleton,
            "identity": parsed.identity,
            "entries": entries,
            "codec": CODEC,
            "partition": {"params": opt["params"], "elementwise": elementwise, "model": names},
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
        """Load a per-parameter ZeRO-3 promotion into this rank's live engine, on any world size (every rank of
        ``group`` calls). Raises RunMismatchError for another model or grouping, IntegrityError for a broken one."""
        import torch.distributed.checkpoint as dcp

        layout = getattr(sources.optimizer, "layout", None)
        if not callable(layout) or layout().get("zero_stage") != 3:
            raise RunMismatchError(
                f"durable promotion {folder.name} holds DeepSpeed ZeRO-3 state; only a DeepSpeed "
                "ZeRO-3 job can load it"
            )
        live = layout()
        src = saved[rank % len(saved)]
        there = saved[0]["partition"]
        if there["params"] != live["params"]:
            raise RunMismatchError(
                f"durable promotion {folder.name} has sub-groups of "
                f"{[len(g) for g in there['params']]} parameters, this engine "
                f"{[len(g) for g in live['params']]} (or other names); resume with the same model, "
                "param groups and stage3 sub_group_size"
            )
        meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata

        def stored(key: str, numel: int | None = None) -> Any:
            if key not in meta:
                raise IntegrityError(f"durable promotion {folder.name} lacks {key!r}")
            md: Any = meta[key]
            if numel is not None and tuple(md.size) != (numel,):
                raise RunMismatchError(
                    f"durable promotion {folder.name}: {key} has {list(md.size)} elements, "
                    f"the live parameter {numel}; resume with the same model"
                )
            return md

        targets: dict[str, Any] = {
            key: torch.empty(stored(key).size, dtype=stored(key).properties.dtype)
            for key, _, _ in src["entries"]
        }
        model_live = unwrap(sources.model).state_dict()
        if sorted(model_live) != sorted(there["model"]):
            raise RunMismatchError(
                f"durable promotion {folder.name} holds another module's state; resume with the "
                "same model"
            )
        numel: dict[str, int] = live["numel"]
        model: dict[str, torch.Tensor] = {}
        for name, value in model_live.items():
            model[name] = torch.zeros_like(value)  # the padding is not stored: zero
            if name in numel:
                md = stored(f"z/model/{name}", numel[name])
                if md.properties.dtype != value.dtype:
                    raise RunMismatchError(
                        f"durable promotion {folder.name} holds {name} as {md.properties.dtype}, "
                        f"this engine {value.dtype}; resume with the same precision (bf16 on or off)"
                    )
                start, length = _slice(numel[name], value.numel(), live["module_index"])
                targets[f"z/model/{name}"] = _Chunk(
                    model[name].narrow(0, 0, length), start, numel[name]
                )
            else:
                stored(f"z/buffer/{name}")
                targets[f"z/buffer/{name}"] = model[name]
        elementwise: list[list[str]] = saved[0]["partition"]["elementwise"]
        partitions: list[dict[str | None, torch.Tensor]] = []
        for i, (names, slices) in enumerate(zip(live["params"], live["slices"], strict=True)):
            flats: dict[str | None, torch.Tensor] = {}
            for prefix, key in _kinds(elementwise[i]):
                flats[key] = torch.zeros(sum(slices), dtype=torch.float32)
                offset = 0
                for name, pn in zip(names, slices, strict=True):
                    stored(prefix + name, numel[name])
                    start, length = _slice(numel[name], pn, live["partition_index"][i])
                    targets[prefix + name] = _Chunk(
                        flats[key].narrow(0, offset, length), start, numel[name]
                    )
                    offset += pn
            partitions.append(flats)
        dcp.load(targets, checkpoint_id=str(folder), process_group=group)
        state = decode(src["skeleton"], [targets[key] for key, _, _ in src["entries"]])
        state["model"] = model
        opt = state["optimizer"]
        opt.update(live)  # this engine's partitioning now
        for i, flats in enumerate(partitions):
            opt["master"][i] = flats.pop(None)
            opt["state"].setdefault(i, {}).update(flats)
        training_state.restore(sources, state)
        self._check_model(model, opt, folder.name)

    @staticmethod
    def _check_model(model: dict[str, torch.Tensor], opt: dict[str, Any], where: str) -> None:
        """Each module partition must be its fp32 master cast to the module dtype, as ``engine.step()`` leaves it;
        otherwise the promotion's model and masters are of different steps."""
        for i, master in enumerate(opt["master"]):
            offset = 0
            for name, pn in zip(opt["params"][i], opt["slices"][i], strict=True):
                lp = model[name]
                hp = master.narrow(0, offset, pn).to(lp.dtype)
                if not torch.equal(lp.view(torch.uint8), hp.view(torch.uint8)):
                    raise IntegrityError(
                        f"durable promotion {where}: parameter {name} differs from its fp32 master; "
                        "the promotion's model and optimizer state are not of the same step"
                    )
                offset += pn


def register() -> None:
    """Make ZeRO-3 promotions per parameter (idempotent; called when a stage-3 engine is attached)."""
    from gemscout.gemini.durable import codecs

    codecs.register(Zero3PerParameter())
