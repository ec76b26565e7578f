"""Replay: run one captured recipe again on this peer, without touching live training state.

What "without touching" means, and how each part is kept:

* **Parameters and gradients.** Forward recipes run through :func:`torch.func.functional_call` with private leaves
  (``param.detach().requires_grad_()``: same storage, no copy, no hooks and no ``.grad`` of their own) and
  gradients come from :func:`torch.autograd.grad` with explicit inputs, so no ``.grad`` is written and the
  autograd hooks DDP put on the live parameters never fire. The optimizer recipe updates private tensors (clones,
  or the received copies the engine hands over with ``consume=True``) in a private optimizer of the same class.
* **The training RNG stream.** Replay runs inside :func:`torch.random.fork_rng` after setting the captured state,
  so dropout draws the captured masks and the training stream continues afterwards as if nothing happened.
* **Module mode.** The captured train/eval mode is set for the replay and every submodule's flag restored after.

Module hooks a user registered on the recipe's modules do run (functional_call calls the module): a persistent fault
injected that way shows up in replay like it did in training. The replay-only seams are :class:`ReplayHooks`: input
hooks see the recipe inputs after the peers' precondition digests were taken, output hooks see everything that will
be digested; both run inside the timed section.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors
from torch.func import functional_call
from torch.utils.hooks import RemovableHandle

from gemscout.scout.call_args import decode
from gemscout.scout.capture import Captured, from_json_value, output_tensors
from gemscout.scout.capture_wire import expand_flat

__all__ = [
    "ReplayContext",
    "ReplayHook",
    "ReplayHooks",
    "ReplayOutcome",
    "replay_forward",
    "replay_optimizer",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayContext:
    """The replay now running on this rank (see ``Scout.current_replay``)."""

    recipe: str
    """Recipe id, e.g. ``"hidden.1"``."""
    kind: str
    """Recipe kind: embedding, hidden, output or optimizer."""
    step: int
    """Training step the inputs were captured at."""
    rank: int
    """This rank (global)."""
    source_rank: int
    """The peer whose captured inputs everyone replays (global rank)."""

    @property
    def role(self) -> str:
        """``"source"`` on the peer that captured and broadcast the inputs, ``"peer"`` elsewhere."""
        return "source" if self.rank == self.source_rank else "peer"


ReplayHook = Callable[[ReplayContext, dict[str, torch.Tensor]], Mapping[str, torch.Tensor] | None]
"""``hook(context, tensors) -> replacement or None``. May return a new mapping; must not modify live state."""


class ReplayHooks:
    """Registries of replay input and output hooks, called in registration order."""

    def __init__(self) -> None:
        self.inputs: OrderedDict[int, ReplayHook] = OrderedDict()
        self.outputs: OrderedDict[int, ReplayHook] = OrderedDict()

    @staticmethod
    def add(registry: OrderedDict[int, ReplayHook], hook: ReplayHook) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"a replay hook must be callable, got {type(hook).__name__}")
        handle = RemovableHandle(registry)
        registry[handle.id] = hook
        return handle

    @staticmethod
    def run(
        registry: OrderedDict[int, ReplayHook], ctx: ReplayContext, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        for hook in list(registry.values()):
            replaced = hook(ctx, dict(tensors))
            if replaced is not None:
                tensors = dict(replaced)
        return tensors


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    """What one replay produced: every tensor that is digested, and how long the replay took on this rank."""

    outputs: dict[str, torch.Tensor]
    seconds: float


@contextmanager
def _replay_rng(tensors: Mapping[str, torch.Tensor], device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(tensors["rng.cpu"].clone())
        if "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"].clone(), device)
        yield


@contextmanager
def _train_mode(modules: Sequence[nn.Module], training: bool) -> Iterator[None]:
    saved = [(m, m.training) for module in modules for m in module.modules()]
    if all(flag == training for _, flag in saved):
        yield  # the usual case (replay in the step that trained); Module.train() is not free, so skip it
        return
    try:
        for module in modules:
            module.train(training)
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def _private(module: nn.Module) -> dict[str, torch.Tensor]:
    tensors = {
        name: p.detach().requires_grad_(p.requires_grad) for name, p in module.named_parameters()
    }
    tensors.update(dict(module.named_buffers()))
    return tensors


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor's bytes are its local part; digests and fault hooks work on plain tensors.
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor  # type: ignore[no-any-return]


def _tensor_specs(spec: Any) -> Iterator[Mapping[str, Any]]:
    """Every tensor spec inside a (nested) recipe-input spec."""
    if isinstance(spec, dict):
        if "tensor" in spec:
            yield spec
        for nested in spec.get("tuple") or spec.get("list") or [s for _, s in spec.get("dict", ())]:
            yield from _tensor_specs(nested)


def replay_forward(
    modules: Sequence[nn.Module],
    paths: Sequence[str],
    captured: Captured,
    ctx: ReplayContext,
    hooks: ReplayHooks,
    *,
    params: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> ReplayOutcome:
    """Run ``modules`` in sequence on the captured inputs, then backward from the captured output gradients.

    Outputs: ``output[.i]`` (forward), ``grad.input.<key>`` for floating inputs that required grad at capture,
    ``grad.param.<path>.<name>`` for parameters (unused ones are absent on every peer alike); a DTensor among them
    (the gradient of a TP-sharded weight) is given as this rank's local part. ``params``: one name→tensor dict per
    module to run on instead of the live parameters (the gathered copies of a sharded model); buffers are always the
    module's own. Raises whatever the model raises; the caller records it.
    """
    start = time.perf_counter()
    meta, tensors = captured.meta, captured.tensors
    device = next((p.device for p in modules[0].parameters()), torch.device("cpu"))
    inputs = {k: t for k, t in tensors.items() if k.startswith(("arg.", "kwarg."))}
    inputs = ReplayHooks.run(hooks.inputs, ctx, inputs)
    wants_grad = {
        spec["tensor"]: spec["grad"]
        for top in [*meta["args"], *meta["kwargs"].values()]
        for spec in _tensor_specs(top)
    }
    leaves = {
        k: t.detach().to(device).requires_grad_(wants_grad.get(k, False) and t.is_floating_point())
        for k, t in inputs.items()
    }
    # An activation-checkpoint wrapper (TorchTitan's SelectiveAC / full AC) would recompute the forward during the
    # backward below, after functional_call has put the live (sharded) parameters back: replay what it wraps. Its
    # parameter names are the wrapped module's already (the wrapper strips its prefix).
    modules = [getattr(module, "_checkpoint_wrapped_module", module) for module in modules]
    if params is None:
        private = [_private(module) for module in modules]
    else:
        private = [
            {
                **{n: t.detach().requires_grad_(t.requires_grad) for n, t in given.items()},
                **dict(module.named_buffers()),
            }
            for given, module in zip(params, modules, strict=True)
        ]
    autocast = meta["autocast"]
    with (
        _replay_rng(tensors, device),
        _train_mode(modules, bool(meta["training"])),
        torch.autocast(
            autocast["device_type"],
            dtype=getattr(torch, autocast["dtype"].split(".")[-1]),
            enabled=bool(autocast["enabled"]),
        ),
        torch.enable_grad(),
    ):
        # A cache argument is rebuilt fresh and empty here (call_args): the live one is never handed to the replay.
        args = tuple(decode(spec, leaves) for spec in meta["args"])
        kwargs = {key: decode(spec, leaves) for key, spec in meta["kwargs"].items()}
        out = functional_call(modules[0], private[0], args, kwargs)
        for module, named in zip(modules[1:], private[1:], strict=True):
            out = functional_call(module, named, (out,))
    outs = output_tensors(out)
    results = {key: _local(tensor.detach()) for key, tensor in outs.items()}
    pairs = [
        (outs[k], tensors[f"grad_output.{k}"].to(device))
        for k in meta["grad_outputs"]
        if k in outs and outs[k].requires_grad and f"grad_output.{k}" in tensors
    ]
    if pairs:
        wrt = [
            (f"grad.input.{k}", leaf) for k, leaf in sorted(leaves.items()) if leaf.requires_grad
        ]
        for path, named in zip(paths, private, strict=True):
            wrt += [(f"grad.param.{path}.{n}", t) for n, t in named.items() if t.requires_grad]
        grads = torch.autograd.grad(
            [o for o, _ in pairs],
            [t for _, t in wrt],
            grad_outputs=[g for _, g in pairs],
            allow_unused=True,
        )
        results.update(
            {name: _local(g) for (name, _), g in zip(wrt, grads, strict=True) if g is not None}
        )
    results = ReplayHooks.run(hooks.outputs, ctx, results)
    return ReplayOutcome(results, time.perf_counter() - start)


def replay_optimizer(
    optimizer_cls: type[torch.optim.Optimizer],
    defaults: Mapping[str, Any],
    captured: Captured,
    ctx: ReplayContext,
    hooks: ReplayHooks,
    device: torch.device | None = None,
    *,
    consume: bool = False,
) -> ReplayOutcome:
    """Run one update of ``optimizer_cls`` on private copies of the captured slice.

    Outputs: ``param.<name>`` (updated values) and ``state.<name>#<key>`` (tensor state after the update).
    ``defaults`` (this peer's ``optimizer.defaults``) are passed only to a constructor that insists on them; the
    captured hyper-parameters of the param group always win. ``device``: this peer's device for the tensors that
    were on an accelerator at capture (default: the CPU). ``consume``: ``captured`` is private to this call and read
    by no one afterwards (the engine's received inputs, views of its receive buffer): its parameter, gradient and
    state tensors are updated in place instead of cloned. An input a hook replaced is still cloned: the hook may keep it.
    """
    start = time.perf_counter()
    meta = captured.meta
    inputs = ReplayHooks.run(hooks.inputs, ctx, dict(captured.tensors))
    if device is not None:
        on_device = set(meta.get("on_device", ()))
        inputs = {k: t.to(device) if k in on_device else t for k, t in inputs.items()}
    # A received tensor nobody reads again is already private; anything else (a live tensor, or what a hook
    # returned) is copied so the update cannot reach it.
    owned = {k for k, t in inputs.items() if consume and captured.tensors.get(k) is t}
    flat = meta.get("flat") or {}
    updated_in_place = {
        k: inputs[k] for k in flat if k in owned
    }  # received flat tensors the update writes into
    if (
        flat
    ):  # a flattened slice (capture_optimizer(flat=True)): per-parameter views of its flat tensors
        owned |= {
            key for flat_key, members in flat.items() if flat_key in owned for key, _ in members
        }
        inputs = expand_flat(inputs, flat)

    def private(key: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if key in owned else tensor.detach().clone()

    # One pass over the inputs, grouped by parameter: a slice holds hundreds of tensors, and a scan per parameter
    # was quadratic.
    states: dict[str, dict[str, Any]] = {}
    hyper_tensors: dict[str, torch.Tensor] = {}
    for key, tensor in inputs.items():
        if key.startswith("state."):
            name, _, field = key[len("state.") :].partition("#")
            states.setdefault(name, {})[field] = private(key, tensor)
        elif key.startswith("hyper."):
            hyper_tensors[key[len("hyper.") :]] = tensor.clone()
    copies: dict[str, torch.Tensor] = {}
    for name in meta["params"]:
        key = f"param.{name}"
        copy = private(key, inputs[key])
        grad = inputs.get(f"grad.{name}")
        copy.grad = None if grad is None else private(f"grad.{name}", grad)
        copies[name] = copy
    group: dict[str, Any] = {key: from_json_value(value) for key, value in meta["hyper"].items()}
    group.update(hyper_tensors)
    group["params"] = list(copies.values())
    try:
        optimizer = optimizer_cls([group])  # type: ignore[call-arg]  # concrete optimizers default their arguments
    except TypeError:
        optimizer = optimizer_cls([group], **{k: v for k, v in defaults.items() if k not in group})
    state_values = meta["state_values"]
    for name, copy in copies.items():
        state = states.get(name, {})
        state.update({k: from_json_value(v) for k, v in state_values.get(name, {}).items()})
        if state:
            optimizer.state[copy] = state
    optimizer.step()
    results = {f"param.{name}": copy.detach() for name, copy in copies.items()}
    for name, copy in copies.items():
        for key, value in optimizer.state.get(copy, {}).items():
            if isinstance(value, torch.Tensor):
                results[f"state.{name}#{key}"] = value.detach()
    if flat:  # outputs as flat as the inputs came: a few tensors to digest instead of several per parameter
        results = _flatten_outputs(results, list(meta["params"]), updated_in_place)
    results = ReplayHooks.run(hooks.outputs, ctx, results)
    return ReplayOutcome(results, time.perf_counter() - start)


def _flatten_outputs(
    results: dict[str, torch.Tensor], names: list[str], updated_in_place: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``param.<name>`` → ``flat.param`` and ``state.<name>#<key>`` → ``flat.state#<key>`` (values in ``names``
    order), for each kind every parameter has in one dtype; other outputs stay as they are. When the members are
    still, in order, the received flat tensor the update wrote into (``updated_in_place``), that tensor is the
    output and nothing is copied."""
    kinds = {"param": [f"param.{n}" for n in names]}
    for key in sorted({k.partition("#")[2] for k in results if k.startswith("state.")}):
        kinds[f"state#{key}"] = [f"state.{n}#{key}" for n in names]
    out = dict(results)
    for kind, keys in kinds.items():
        members = [results.get(k) for k in keys]
        present = [t for t in members if t is not None]
        if len(present) != len(keys) or len({(t.dtype, t.device) for t in present}) != 1:
            continue
        target = updated_in_place.get(f"flat.{kind}")
        out[f"flat.{kind}"] = (
            target
            if target is not None and _tiles(present, target)
            else _flatten_dense_tensors(present)
        )
        for k in keys:
            del out[k]
    return out


def _tiles(members: list[torch.Tensor], flat: torch.Tensor) -> bool:
    """True when ``members`` are contiguous and lie back to back, in order, exactly over ``flat``'s elements (an
    optimizer that swapped a state tensor for a new one breaks this, and its outputs are copied instead)."""
    size, ptr = flat.element_size(), flat.data_ptr()
    for t in members:
        if t.dtype != flat.dtype or t.data_ptr() != ptr or not t.is_contiguous():
            return False
        ptr += t.numel() * size
    return ptr == flat.data_ptr() + flat.numel() * size
