"""Where a model's recipe boundaries are: its repeated blocks, its token embedding, its final norm and its head.

Found from the module tree alone (types, names and parameter shapes), so every peer finds the same paths; a path
named in :class:`~gemscout.scout.config.ScoutConfig` (``blocks``, ``embedding``, ``norm``, ``head``) wins over the
search. :func:`~gemscout.scout.recipes.build_catalog` turns these paths into recipes.
"""

from __future__ import annotations

from torch import nn

from gemscout.errors import ConfigError
from gemscout.scout.config import ScoutConfig

__all__ = [
    "NORM_TYPES",
    "find_blocks",
    "find_first",
    "find_last",
    "find_last_norm",
    "holds",
    "inside",
    "is_norm",
    "resolve",
]

NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
"""The norm classes torch brings; a model's own are known by their class name (:func:`is_norm`)."""


def holds(model: nn.Module, path: str | None) -> bool:
    if path is None:
        return False
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def resolve(model: nn.Module, path: str, field: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ConfigError(f"ScoutConfig.{field}: the model has no submodule {path!r}") from None


def inside(name: str, container: str | None) -> bool:
    return container is not None and (name == container or name.startswith(container + "."))


def find_blocks(model: nn.Module, config: ScoutConfig) -> str | None:
    if config.blocks is not None:
        if not isinstance(resolve(model, config.blocks, "blocks"), nn.ModuleList | nn.ModuleDict):
            raise ConfigError(
                f"ScoutConfig.blocks: {config.blocks!r} is not an nn.ModuleList (or ModuleDict) of blocks"
            )
        return config.blocks
    best: tuple[int, str] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.ModuleDict) or len(module) == 0:
            continue  # a ModuleDict: TorchTitan keeps its blocks in one ("layers": {"0": ..., "1": ...})
        # Repeated identical blocks: one type, and the same parameter shapes in each (not a list of assorted heads).
        children = list(module.children())
        shapes = {
            tuple((n, tuple(p.shape)) for n, p in child.named_parameters()) for child in children
        }
        if (
            len({type(child) for child in children}) != 1
            or len(shapes) != 1
            or not next(iter(shapes))
        ):
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name)
    return None if best is None else best[1]


def find_last(
    model: nn.Module, types: tuple[type[nn.Module], ...], exclude: str | None
) -> str | None:
    found = None
    for name, module in model.named_modules():
        if isinstance(module, types) and not inside(name, exclude):
            found = name
    return found


def is_norm(module: nn.Module) -> bool:
    # Model code often brings its own norm class (transformers' LlamaRMSNorm, Qwen2RMSNorm, T5LayerNorm): known by
    # its name, so the output recipe covers the final norm of those models too, not the head alone.
    return isinstance(module, NORM_TYPES) or type(module).__name__.endswith(
        ("LayerNorm", "RMSNorm")
    )


def find_last_norm(model: nn.Module, exclude: str | None) -> str | None:
    found = None
    for name, module in model.named_modules():
        if is_norm(module) and not inside(name, exclude):
            found = name
    return found


def find_first(
    model: nn.Module, types: tuple[type[nn.Module], ...], exclude: str | None
) -> str | None:
    for name, module in model.named_modules():
        if isinstance(module, types) and not inside(name, exclude):
            return name
    return None
