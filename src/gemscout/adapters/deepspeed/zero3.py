"""DeepSpeed ZeRO-3: what GEMINI captures from a stage-3 ``DeepSpeedEngine`` (deepspeed==0.19.8).

Stage 3 partitions the parameters themselves. Outside a gathered context a module parameter is an empty placeholder
(``param.data`` has no elements); its elements live in ``param.ds_tensor``, this rank's slice of the flattened,
world-size-padded parameter (``partition_numel()`` elements; the last rank's slice carries the padding). Parameters
smaller than ``stage3_param_persistence_threshold`` are *persistent*: DeepSpeed all-gathers them after every
``engine.step()`` and keeps them whole, but their truth is still their ``ds_tensor`` (the gather rebuilds them
from every rank's slice). The ZeRO-3 optimizer (``DeepSpeedZeroOptimizer_Stage3``) keeps, per sub-group:

- ``fp16_partitioned_groups_flat[i]``: one flat buffer of the sub-group's ``ds_tensor`` slices (the module dtype:
  fp32, or bf16 with ``bf16.enabled``); every trainable ``ds_tensor`` is a view into it;
- ``fp32_partitioned_groups_flat[i]``: the fp32 master of that flat, which the client torch optimizer updates; the
  torch optimizer's state (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``) is keyed by it. DeepSpeed puts it into the
  torch optimizer's ``param_groups`` only for the duration of its own step: outside it the groups' ``params`` are
  empty, so the masters are read from the ZeRO optimizer itself.

What one rank's checkpoint holds, without pickle and without gathering anything:

- ``model`` (:class:`Zero3ModuleState`): for every module parameter its ``ds_tensor`` (trainable or not, persistent
  or not), for every buffer the buffer — everything this rank owns of the module; the gathered copies of persistent
  parameters are not stored (they are derived);
- ``optimizer`` (:class:`Zero3EngineOptimizer`): per sub-group the fp32 master partition and the torch optimizer's
  state for it, the group hyper-parameters, and the partitioning it was taken with (stage, partition count and
  index, per-parameter slice sizes) so that a checkpoint taken on another world size or model is refused;
- ``extra``: the engine's counters and lr scheduler (as for ZeRO-1/2), and the caller's state.

That is complete: ``engine.step()`` derives everything else from it (the module partitions are the masters cast to
the module dtype; the persistent gathers and every forward's gathers come from the partitions). Restoring copies
into the live buffers in place — DeepSpeed's views into its flat buffers stay linked — and releases the gathered
copies of persistent parameters, so the next forward gathers them from the restored partitions (a fresh engine
starts the same way). No collective runs during a restore.

The padding at the end of the last rank's slices is captured as it is: DeepSpeed 0.19.8 allocates it uninitialized
and never reads it (every gather is cut to the parameter's size; its gradient is zero).

The local tier restores on the rank and world size that took it (an in-process ``session.recover()`` included). The
durable tier stores every partition per parameter (:mod:`gemscout.adapters.deepspeed.zero3_layout`), so a job
resumes from it on any world size. SCOUT's forward recipes replay on the gathered blocks
(:mod:`gemscout.adapters.deepspeed.zero3_scout`); its optimizer recipe is refused with ConfigError.

Nothing here imports deepspeed: the adapter reads the live engine the caller built.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemscout.adapters._step_hooks import EngineStepView
from gemscout.adapters.deepspeed.zero3_layout import FORMAT
from gemscout.errors import ConfigError, RunMismatchError

__all__ = ["FORMAT", "Zero3EngineOptimizer", "Zero3ModuleState", "check_zero3"]

_UNSUPPORTED = (
    "DeepSpeed ZeRO-3 under gemscout needs the stage-3 optimizer as deepspeed.initialize builds it "
    "(deepspeed==0.19.8) with every partition in memory"
)


def check_zero3(engine: Any) -> None:
    """Refuse a stage-3 engine whose state does not live where this adapter reads it, naming the setting."""
    zero = engine.optimizer
    names = {cls.__name__ for cls in type(zero).__mro__}
    if "DeepSpeedZeroOptimizer_Stage3" not in names or not isinstance(
        getattr(zero, "optimizer", None), torch.optim.Optimizer
    ):
        raise ConfigError(
            f"the engine's optimizer is a {type(zero).__name__}, not a DeepSpeedZeroOptimizer_Stage3 "
            f"around a torch optimizer; {_UNSUPPORTED}"
        )
    for attr in (
        "fp16_groups",
        "fp16_partitioned_groups_flat",
        "fp32_partitioned_groups_flat",
        "sub_group_to_group_id",
        "sub_group_process_groups",
    ):
        if not hasattr(zero, attr):
            raise ConfigError(f"the ZeRO-3 optimizer has no {attr}; {_UNSUPPORTED}")
    if any(t is None for t in zero.fp16_partitioned_groups_flat) or getattr(
        zero, "swap_optimizer", False
    ):
        raise ConfigError(
            "DeepSpeed ZeRO-3 with NVMe offload (offload_param / offload_optimizer device nvme) is "
            "not supported; keep the partitions in memory"
        )
    if getattr(zero, "use_muon", False) or getattr(zero, "zenflow", False):
        raise ConfigError(
            "DeepSpeed ZeRO-3 with Muon or ZenFlow is not supported; use a torch optimizer such as "
            "AdamW as the client optimizer"
        )
    hpz = getattr(engine, "zero_hpz_partition_size", lambda: 1)()
    quantized = [
        getattr(engine, f, lambda: False)()
        for f in ("zero_quantized_weights", "zero_quantized_nontrainable_weights")
    ]
    if (hpz or 1) > 1 or any(quantized):
        raise ConfigError(
            "DeepSpeed ZeRO-3 with zero_hpz_partition_size > 1 (ZeRO++ hpZ) or quantized weights is "
            "not supported; leave zero_hpz_partition_size at 1 and weight quantization off"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    for p in engine.module.parameters():
        group = getattr(p, "ds_process_group", None)
        if dist.is_initialized() and dist.get_world_size(group=group) != world:
            raise ConfigError(
                "a ZeRO-3 parameter is partitioned over a group smaller than the job (MiCS, expert "
                "groups); gemscout supports ZeRO-3 partitioned over every rank"
            )
        if not hasattr(p, "ds_tensor") or p.ds_tensor is None:
            raise ConfigError(
                "a module parameter of the ZeRO-3 engine is not partitioned (no ds_tensor); build the "
                "model before deepspeed.initialize, or inside deepspeed.zero.Init, and register no "
                "parameter afterwards"
            )
    extra = [
        k
        for k, v in engine.module.state_dict(keep_vars=True).items()
        if not isinstance(v, torch.Tensor)
    ]
    if extra:
        raise ConfigError(
            f"the module's state_dict holds non-tensor entries {extra[:3]} (get_extra_state); they are "
            "not captured under DeepSpeed ZeRO-3 yet"
        )


class Zero3ModuleState(nn.Module):
    """The engine's module as GEMINI captures it under ZeRO-3: ``state_dict()`` maps each parameter's name to this
    rank's ``ds_tensor`` and each buffer's name to the buffer; ``load_state_dict`` copies them back in place.

    It holds the engine's module without registering it (no ``.module``: gemscout would unwrap to the placeholders),
    so it has no parameters of its own; forward hooks and SCOUT never see it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_zero3_module", module)

    @property
    def zero3_module(self) -> nn.Module:
        return object.__getattribute__(self, "_zero3_module")  # type: ignore[no-any-return]

    def forward(
        self, *args: Any, **kwargs: Any
    ) -> Any:  # not used by gemscout; the engine runs the module
        return self.zero3_module(*args, **kwargs)

    def _live(self) -> dict[str, tuple[torch.Tensor, nn.Parameter | None]]:
        """name → (the tensor stored for it, the parameter when it is one)."""
        out: dict[str, tuple[torch.Tensor, nn.Parameter | None]] = {}
        for name, value in self.zero3_module.state_dict(keep_vars=True).items():
            if isinstance(value, nn.Parameter):
                out[name] = (value.ds_tensor.detach(), value)  # type: ignore[attr-defined]
            else:
                out[name] = (value.detach(), None)
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This rank's partition of every parameter and every buffer (live tensors: GEMINI copies them)."""
        return {name: tensor for name, (tensor, _) in self._live().items()}

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Copy a :meth:`state_dict` back, bitwise. Raises RunMismatchError for other names or partition sizes."""
        live = self._live()
        if set(state) != set(live):
            missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
            raise RunMismatchError(
                f"the ZeRO-3 checkpoint's module state differs from this engine's (missing "
                f"{missing[:3]}, unexpected {unexpected[:3]}); resume with the same model"
            )
        for name, (tensor, _) in live.items():
            saved = state[name]
            if tuple(saved.shape) != tuple(tensor.shape) or saved.dtype != tensor.dtype:
                raise RunMismatchError(
                    f"the ZeRO-3 checkpoint holds {name} as {saved.dtype} {list(saved.shape)}, "
                    f"this rank {tensor.dtype} {list(tensor.shape)}; a local checkpoint resumes "
                    "with the same model, precision and world size"
                )
        gathered: list[nn.Parameter] = []
        with torch.no_grad():
            for name, (tensor, param) in live.items():
                tensor.copy_(state[name])
                if param is not None and param.numel() > 0:
                    gathered.append(param)
        if gathered:
            # A gathered copy (persistent parameters after engine.step()) is of the old state: release it, so the
            # next forward gathers the restored partitions, as a fresh engine's first forward does.
            gathered[0].partition(gathered)  # type: ignore[attr-defined]
        return None


class Zero3EngineOptimizer(EngineStepView):
    """A ZeRO-3 engine's optimizer as gemscout's session and GEMINI see it (the ZeRO-1/2 ``EngineOptimizer``
    interface): step hooks around ``engine.step()`` and this rank's fp32 master partitions with their optimizer
    state (see the module doc). ``param_groups`` are the torch optimizer's (their ``params`` are empty outside
    DeepSpeed's own step)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.inner: torch.optim.Optimizer = engine.optimizer.optimizer
        names = getattr(self.zero, "param_names", None) or {}
        by_id = {id(p): n for n, p in engine.module.named_parameters()}
        self._params = [
            [str(names.get(p, by_id.get(id(p), "?"))) for p in group]
            for group in self.zero.fp16_groups
        ]
        self._slices = [
            [int(p.partition_numel()) for p in group] for group in self.zero.fp16_groups
        ]
        self._numel = {name: int(p.ds_numel) for name, p in engine.module.named_parameters()}
        first = next(iter(engine.module.parameters()))
        self._module_group = getattr(first, "ds_process_group", None)

    def masters(self) -> list[torch.Tensor]:
        """The fp32 master partition of every sub-group (what the torch optimizer steps)."""
        return list(self.zero.fp32_partitioned_groups_flat)

    def layout(self) -> dict[str, Any]:
        groups = self.zero.sub_group_process_groups
        return {
            "zero_stage": 3,
            "partition_count": [int(dist.get_world_size(group=g)) for g in groups],
            "partition_index": [int(dist.get_rank(group=g)) for g in groups],
            "sub_groups": [int(self.zero.sub_group_to_group_id[i]) for i in range(len(groups))],
            "module_index": int(dist.get_rank(group=self._module_group)),
            "params": self._params,
            "slices": self._slices,
            "numel": self._numel,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's fp32 master partitions and their optimizer state (live tensors; nothing needs pickle)."""
        masters = self.masters()
        return {
            "format": FORMAT,
            **self.layout(),
            "master": masters,
            "state": {
                i: dict(self.inner.state[m])
                for i, m in enumerate(masters)
                if self.inner.state.get(m)
            },
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a :meth:`state_dict` into the live optimizer, bitwise. Raises RunMismatchError when it was taken
        with another ZeRO stage, partitioning or model."""
        if state.get("format") != FORMAT:
            raise RunMismatchError(
                f"the optimizer state is not a DeepSpeed ZeRO-3 partition ({state.get('format')!r});"
                " it was taken from another kind of job (a ZeRO-1/2 checkpoint does not resume "
                "under ZeRO-3)"
            )
        here = self.layout()
        there = {k: state.get(k) for k in here}
        if there != here:
            diff = sorted(k for k in here if there[k] != here[k])
            small = [k for k in diff if k not in ("params", "slices", "numel")]
            raise RunMismatchError(
                f"the DeepSpeed ZeRO-3 checkpoint's partition differs from this engine's in {diff} "
                f"(taken with { ({k: there[k] for k in small}) }, here "
                f"{ ({k: here[k] for k in small}) }); a local checkpoint resumes with the same "
                "model, param groups and world size, each rank from its own partition"
            )
        masters = self.masters()
        if len(state["param_groups"]) != len(self.inner.param_groups):
            raise RunMismatchError(
                "the DeepSpeed ZeRO-3 checkpoint has another number of param groups"
            )
        with torch.no_grad():
            for group, saved in zip(self.inner.param_groups, state["param_groups"], strict=True):
                for key, value in saved.items():
                    group[key] = value.clone() if isinstance(value, torch.Tensor) else value
            for i, master in enumerate(masters):
                master.copy_(state["master"][i])
                saved = state["state"].get(i, {})
                if not saved:
                    self.inner.state.pop(master, None)
                    continue
                self._restore_entry(self.inner.state[master], saved)
