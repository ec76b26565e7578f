"""Capture: what a recipe needs to be replayed, taken from the live step, and how it travels to the peers.

Forward recipes are captured by module hooks that do nothing unless the recipe is *armed* for the step now running
on this rank (only the step's source peer arms anything, and only the recipes due at that step, so the hot path of
every other forward is one dictionary lookup):

* a forward pre-hook on the recipe's first module copies its inputs (tensors nested in tuples, lists and dicts,
  plain values, a transformers ``Cache``: :mod:`~gemscout.scout.call_args`; an input it cannot reproduce makes the
  capture an error that names it), the CPU (and CUDA) RNG state, the autocast context and the train/eval mode — the RNG state is taken *before* the module runs, so replay draws the same
  dropout masks;
* a forward hook on the recipe's last module registers a tensor hook on each output that requires grad; the real
  backward hands that hook the output gradient, which is copied. Tensor hooks, not module backward hooks: they see
  exactly the gradient of the tensor the module returned and do not change how autograd runs the module.

The optimizer recipe is captured at the optimizer step pre-hook (:func:`capture_optimizer`): parameters before the
update, effective gradients (after DDP's all-reduce and any clipping), optimizer state and hyper-parameters.

On the wire (:mod:`~gemscout.scout.capture_wire`) a capture is a JSON header (names, dtypes, shapes, offsets,
metadata) and one flat byte payload. Nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors
from torch.utils.hooks import RemovableHandle

from gemscout.scout.call_args import Unreplayable, encode
from gemscout.scout.recipes import Recipe

__all__ = [
    "CaptureHooks",
    "Captured",
    "capture_optimizer",
    "flatten_slice",
]


@dataclass(slots=True)
class Captured:
    """The inputs of one recipe at one step: tensors by key, JSON metadata, or the reason there are none."""

    step: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    received_digest: str | None = None
    """Set by :func:`~gemscout.scout.capture_wire.unpack`: digest of the inputs (not the RNG state) exactly as
    received, bytes and layout."""


def to_json_value(value: Any, what: str) -> Any:
    """A JSON form of a hyper-parameter or argument; tuples are tagged so they come back as tuples."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list) and all(
        v is None or isinstance(v, bool | int | float | str) for v in value
    ):
        return {"tuple": list(value)} if isinstance(value, tuple) else list(value)
    raise TypeError(f"{what} is a {type(value).__name__}, which SCOUT cannot send to its peers")


def from_json_value(value: Any) -> Any:
    """Inverse of :func:`to_json_value`."""
    if isinstance(value, dict) and set(value) == {"tuple"}:
        return tuple(value["tuple"])
    return value


def _autocast_state(device_type: str) -> dict[str, Any]:
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": str(torch.get_autocast_dtype(device_type)),
    }


class CaptureHooks:
    """Module hooks that capture armed forward recipes of one model. Not thread-safe: one training thread."""

    def __init__(
        self, modules: Mapping[str, list[nn.Module]], recipes: Mapping[str, Recipe]
    ) -> None:
        self.paused = False
        """While True (during replay) every hook does nothing, so a replay never overwrites a capture."""
        self._armed: dict[str, int] = {}
        self._captures: dict[str, Captured] = {}
        self._handles: list[RemovableHandle] = []
        for name, recipe in recipes.items():
            if not recipe.has_module:
                continue
            first, last = modules[name][0], modules[name][-1]
            self._handles.append(
                first.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True)
            )
            self._handles.append(last.register_forward_hook(self._post_hook(name)))

    def arm(self, step: int, names: set[str]) -> None:
        """Capture ``names`` during the forward of ``step`` (and nothing else); drops captures of earlier steps."""
        self._armed = dict.fromkeys(names, step)
        self._captures = {}

    def take(self, name: str, step: int) -> Captured:
        """The capture of ``name`` at ``step``, or a :class:`Captured` whose ``error`` says why there is none."""
        captured = self._captures.get(name)
        if captured is None:
            why = "armed" if self._armed.get(name) == step else "not armed"
            return Captured(
                step=step, error=f"no forward of step {step} reached {name!r} on this rank ({why})"
            )
        if captured.step != step:
            return Captured(
                step=step, error=f"{name!r} was captured for step {captured.step}, not {step}"
            )
        if captured.error is not None:
            return captured  # the capture's own reason (an input SCOUT cannot replay), never "did not return"
        if "grad_outputs" not in captured.meta:
            return Captured(
                step=step, error=f"the forward of {name!r} at step {step} did not return"
            )
        missing = [
            k for k in captured.meta["grad_outputs"] if f"grad_output.{k}" not in captured.tensors
        ]
        if missing:
            # Forward-only replay would silently drop half of the check; say so instead.
            return Captured(
                step=step,
                error=f"backward of step {step} never reached the outputs {missing} of {name!r}",
            )
        return captured

    def remove(self) -> None:
        """Remove every hook; idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captures.clear()

    def _pre_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            step = self._armed.get(name)
            if self.paused or step is None or not torch.is_grad_enabled():
                return  # eval forwards run under no_grad and have no backward to check
            captured = Captured(step=step)
            try:
                specs, kw = encode(module, args, kwargs, captured.tensors)
                device = next((t.device for t in captured.tensors.values()), torch.device("cpu"))
                captured.tensors["rng.cpu"] = torch.get_rng_state()
                if device.type == "cuda":
                    captured.tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
                captured.meta.update(
                    args=specs,
                    kwargs=kw,
                    training=module.training,
                    autocast=_autocast_state(device.type),
                )
            except Unreplayable as exc:
                captured = Captured(step=step, error=str(exc), meta={"unreplayable": True})
            except (
                Exception
            ) as exc:  # the live forward must never fail because of SCOUT; the cycle reports it
                captured = Captured(
                    step=step, error=f"capturing the inputs failed: {type(exc).__name__}: {exc}"
                )
            self._captures[name] = (
                captured  # a later micro-batch replaces an earlier one: last forward wins
            )

        return hook

    def _post_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            captured = self._captures.get(name)
            if (
                self.paused
                or captured is None
                or captured.error
                or self._armed.get(name) != captured.step
            ):
                return
            grads: list[str] = []
            for key, tensor in output_tensors(output).items():
                if tensor.requires_grad:
                    tensor.register_hook(_GradCopier(captured, key))
                    grads.append(key)
            captured.meta["grad_outputs"] = grads

        return hook


class _GradCopier:
    """Tensor hook: keep a copy of the output gradient; returns None so the real backward is unchanged."""

    def __init__(self, captured: Captured, key: str) -> None:
        self.captured, self.key = captured, key

    def __call__(self, grad: torch.Tensor) -> None:
        self.captured.tensors[f"grad_output.{self.key}"] = grad.detach().clone()


def output_tensors(output: Any) -> dict[str, torch.Tensor]:
    """The tensors a module returned, by key: ``output`` for one tensor, ``output.<i>[.<j>...]`` for the tensors
    inside tuples, lists and dicts (a ``ModelOutput`` is a dict), in order; other values are not compared."""
    if isinstance(output, torch.Tensor):
        return {"output": output}
    found: dict[str, torch.Tensor] = {}
    _collect(output, "output", found)
    return found


def _collect(value: Any, key: str, found: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found[key] = value
    elif isinstance(value, tuple | list):
        for i, item in enumerate(value):
            _collect(item, f"{key}.{i}", found)
    elif isinstance(value, dict):
        for i, item in enumerate(value.values()):
            _collect(item, f"{key}.{i}", found)


def capture_optimizer(
    recipe: Recipe,
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    step: int,
    *,
    flat: bool = False,
) -> Captured:
    """The optimizer recipe's inputs, read from the live optimizer before its update (no copy:
    :func:`~gemscout.scout.capture_wire.pack` copies).

    Keys: ``param.<name>``, ``grad.<name>`` (absent when the gradient is None), ``state.<name>#<key>`` and
    ``hyper.<key>`` for tensor hyper-parameters; JSON metadata holds the other hyper-parameters and state values.
    ``flat``: each kind of per-parameter tensor (parameters, gradients, each state key) is copied into one flat tensor
    ``flat.<kind>`` where it can be (:func:`flatten_slice`), so the cycle packs, sends, receives and digests a few
    tensors instead of several per parameter; :func:`~gemscout.scout.replay.replay_optimizer` reads both forms.
    Raises ``TypeError`` for a hyper-parameter or state value that is neither a tensor nor plain JSON.
    """
    group = optimizer.param_groups[recipe.group_index]
    captured = Captured(step=step)
    hyper: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            captured.tensors[f"hyper.{key}"] = value.detach()
        else:
            hyper[key] = to_json_value(value, f"hyper-parameter {key!r}")
    state_values: dict[str, dict[str, Any]] = {}
    for name in recipe.params:
        param = params[name]
        captured.tensors[f"param.{name}"] = param.detach()
        if param.grad is not None:
            captured.tensors[f"grad.{name}"] = param.grad.detach()
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                captured.tensors[f"state.{name}#{key}"] = value.detach()
            else:
                state_values.setdefault(name, {})[key] = to_json_value(
                    value, f"optimizer state {name}.{key}"
                )
    if flat:
        flatten_slice(captured, recipe.params)
    # Replay runs where the live update ran (a faulty accelerator is only exercised on itself); keys listed here
    # go back to the peer's own accelerator, the rest (e.g. AdamW's CPU ``step`` counter) stay on the CPU.
    on_device = sorted(k for k, t in captured.tensors.items() if t.device.type != "cpu")
    captured.meta.update(
        optimizer=type(optimizer).__qualname__,
        hyper=hyper,
        state_values=state_values,
        params=list(recipe.params),
        on_device=on_device,
    )
    return captured


def flatten_slice(captured: Captured, names: Sequence[str]) -> None:
    """Replace, in ``captured``, each kind of per-parameter tensor of the slice ``names`` by one flat copy.

    Kinds: ``param``, ``grad`` and ``state#<key>`` for each state key; ``flat.<kind>`` holds the members' values in
    ``names`` order and ``meta["flat"][f"flat.{kind}"]`` their keys and shapes. A kind whose members cannot share one
    flat tensor (one missing, another dtype, off the CPU) stays per parameter. Why: every tensor costs the cycle a
    few microseconds of Python in pack, unpack and digests, and an optimizer slice holds several per parameter.
    """
    tensors = captured.tensors
    kinds = {"param": [f"param.{n}" for n in names], "grad": [f"grad.{n}" for n in names]}
    for key in sorted({k.partition("#")[2] for k in tensors if k.startswith("state.")}):
        kinds[f"state#{key}"] = [f"state.{n}#{key}" for n in names]
    layout: dict[str, list[list[Any]]] = {}
    for kind, keys in kinds.items():
        members = [tensors.get(k) for k in keys]
        present = [t for t in members if t is not None]
        if (
            len(present) != len(keys)
            or len({t.dtype for t in present}) != 1
            or not all(t.is_cpu for t in present)
        ):
            continue
        # One C++ call for the whole kind; it returns a view for a single member, which is copied: the flat tensor
        # must never alias the live one (the engine's replay updates what it received in place).
        with torch.no_grad():
            joined = _flatten_dense_tensors(present)
        tensors[f"flat.{kind}"] = joined.clone() if len(present) == 1 else joined
        layout[f"flat.{kind}"] = [[k, list(t.shape)] for k, t in zip(keys, present, strict=True)]
        for k in keys:
            del tensors[k]
    if layout:
        captured.meta["flat"] = layout
