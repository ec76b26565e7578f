"""Step pre/post hooks for a framework object whose ``step()`` offers none (a DeepSpeed engine, a MegatronOptimizer).

While a hook is registered, an instance attribute shadows the class's ``step`` for every caller — the training loop and
the framework's own ``train_step`` included — and runs the hooks around the original; the last ``remove()`` puts the
object back as it was (an instance ``step`` it already had included).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["EngineStepView", "Hook", "StepHooks"]

Hook = Callable[[Any, Any, Any], None]
"""``hook(owner, args, kwargs)``: ``owner`` is the optimizer view the hook was registered on."""


class _Handle:
    """Removes one hook; uninstalls the wrapper when it was the last one."""

    _ids = itertools.count()

    def __init__(self, hooks: StepHooks, table: dict[int, Hook], hook: Hook) -> None:
        self.hooks, self.table, self.id = hooks, table, next(self._ids)
        table[self.id] = hook

    def remove(self) -> None:
        self.table.pop(self.id, None)
        self.hooks.maybe_uninstall()


class StepHooks:
    """Hooks around ``target.step()``, called as ``hook(owner, args, kwargs)``; they run only when ``when()`` is true
    before the call (DeepSpeed: at gradient-accumulation boundaries)."""

    def __init__(self, owner: Any, target: Any, *, when: Callable[[], bool] | None = None) -> None:
        self.owner, self.target, self.when = owner, target, when
        self.pre: dict[int, Hook] = {}
        self.post: dict[int, Hook] = {}
        self._original: Callable[..., Any] | None = None
        self._had_instance_step = False
        self._wrapper = self._step  # one bound method, so uninstalling can recognise it

    def add_pre(self, hook: Hook) -> _Handle:
        return self._add(self.pre, hook)

    def add_post(self, hook: Hook) -> _Handle:
        return self._add(self.post, hook)

    def _add(self, table: dict[int, Hook], hook: Hook) -> _Handle:
        handle = _Handle(self, table, hook)
        if self._original is None:
            self._had_instance_step = "step" in vars(self.target)
            self._original = self.target.step
            vars(self.target)["step"] = self._wrapper
        return handle

    def maybe_uninstall(self) -> None:
        if self._original is None or self.pre or self.post:
            return
        if vars(self.target).get("step") is self._wrapper:
            if self._had_instance_step:
                vars(self.target)["step"] = self._original
            else:
                del vars(self.target)["step"]
        self._original = None

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._original is not None
        active = self.when is None or self.when()
        if active:
            for hook in list(self.pre.values()):
                hook(self.owner, args, kwargs)
        result = self._original(*args, **kwargs)
        if active:
            for hook in list(self.post.values()):
                hook(self.owner, args, kwargs)
        return result


class EngineStepView:
    """The part of the ``torch.optim.Optimizer`` interface gemscout uses, over a DeepSpeed engine's optimizer:
    ``param_groups`` / ``state`` / ``defaults`` of the torch optimizer it wraps, and step hooks run around
    ``engine.step()`` at gradient-accumulation boundaries (called as ``hook(self, args, kwargs)``). Subclasses add
    ``state_dict`` / ``load_state_dict`` for their ZeRO stage."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.zero = engine.optimizer
        self.inner: Any = engine.optimizer.optimizer
        self._hooks = StepHooks(self, engine, when=self._boundary)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups  # type: ignore[no-any-return]

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults  # type: ignore[no-any-return]

    def register_step_pre_hook(self, hook: Hook) -> Any:
        """Run ``hook(self, args, kwargs)`` at the start of every ``engine.step()`` that updates the weights."""
        return self._hooks.add_pre(hook)

    def register_step_post_hook(self, hook: Hook) -> Any:
        """Run ``hook(self, args, kwargs)`` when such an ``engine.step()`` has finished (scheduler and counters
        included)."""
        return self._hooks.add_post(hook)

    def _boundary(self) -> bool:
        """Will this ``engine.step()`` update the weights? Asked before it runs, as the engine itself does."""
        if not self.engine.managed_gradient_accumulation():
            return True  # the caller owns accumulation: every step() is a boundary
        return bool(self.engine.is_gradient_accumulation_boundary())

    @staticmethod
    def _restore_entry(live: dict[str, Any], saved: dict[str, Any]) -> None:
        """Put ``saved`` (one parameter's optimizer state) into ``live`` in place: tensors of the same shape and
        dtype are copied into (DeepSpeed may have linked them to its own mappings), others cloned (never aliasing
        the checkpoint's buffer), keys the checkpoint lacks dropped."""
        for key in [k for k in live if k not in saved]:
            del live[key]
        for key, value in saved.items():
            if not hasattr(value, "copy_"):
                live[key] = value
            elif (
                hasattr(live.get(key), "copy_")
                and live[key].shape == value.shape
                and live[key].dtype == value.dtype
            ):
                live[key].copy_(value)
            else:
                live[key] = value.clone()
