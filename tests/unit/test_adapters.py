"""Framework detection and the DeepSpeed adapter's rules and state, without any framework installed.

Stand-in classes carry the module and class names the frameworks use (detection reads nothing else); the stand-in
engine steps a real torch AdamW over one flat partition the way ZeRO-1/2 does, so the adapter's hooks and its
capture / restore run on real tensors. The real engine is exercised in tests/dist/test_deepspeed.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from gemscout import ConfigError, RunMismatchError, ScoutConfig
from gemscout.adapters.deepspeed.engine import (
    EngineOptimizer,
    capture_engine,
    resolve_engine,
    restore_engine,
)
from gemscout.adapters.registry import detect, resolve
from gemscout.state.codec import decode, encode

pytestmark = pytest.mark.timeout(60)


class DeepSpeedZeroOptimizer:
    __module__ = "deepspeed.runtime.zero.stage_1_and_2"

    def __init__(self, numel: int) -> None:
        self.master = torch.linspace(-1.0, 1.0, numel)
        self.single_partition_of_fp32_groups = [self.master]
        self.partition_count = [2]
        self.optimizer = torch.optim.AdamW([self.master], lr=0.1, weight_decay=0.01)


class DeepSpeedEngine(nn.Module):
    """Steps like deepspeed.runtime.engine.DeepSpeedEngine at the boundaries the hooks depend on."""

    __module__ = "deepspeed.runtime.engine"

    def __init__(
        self, *, stage: int = 1, accumulation: int = 1, fp16: bool = False, offload: Any = None
    ) -> None:
        super().__init__()
        self.module = nn.Linear(3, 2)
        self.optimizer = DeepSpeedZeroOptimizer(8)
        # DeepSpeed's fragment mapping (param._hp_mapping): this partition holds the whole weight, then the bias.
        self.optimizer.param_names = {p: n for n, p in self.module.named_parameters()}
        self.optimizer.bit16_groups = [list(self.module.parameters())]
        at = 0
        for p in self.optimizer.bit16_groups[0]:
            p._hp_mapping = SimpleNamespace(
                lp_fragment_address=SimpleNamespace(start=0, numel=p.numel()),
                hp_fragment_address=SimpleNamespace(start=at, numel=p.numel()),
            )
            at += p.numel()
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer.optimizer, lambda s: 1 / (1 + s)
        )
        self.stage, self.accumulation, self.fp16, self.offload = stage, accumulation, fp16, offload
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self.updates = 0

    def zero_optimization_stage(self) -> int:
        return self.stage

    def fp16_enabled(self) -> bool:
        return self.fp16

    def zero_offload_optimizer(self) -> Any:
        return self.offload

    def zero_offload_param(self) -> Any:
        return None

    def managed_gradient_accumulation(self) -> bool:
        return True

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.accumulation == 0

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            master = self.optimizer.master
            master.grad = torch.sin(master * (self.global_steps + 1))
            self.optimizer.optimizer.step()
            master.grad = None
            self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += 4
            self.updates += 1
        self.micro_steps += 1


class Trainer:
    __module__ = "torchtitan.train"


class GPTModel(nn.Module):
    __module__ = "megatron.core.models.gpt.gpt_model"


class DistributedOptimizer:
    __module__ = "megatron.core.optimizer.distrib_optimizer"


def _resolve_ds(engine: DeepSpeedEngine, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "extra_state_fn": None,
        "load_extra_state_fn": None,
        "schedulers": (),
        "scout": None,
    }
    args.update(kw)
    return resolve_engine(engine, engine.optimizer, **args)


# -- detection -----------------------------------------------------------------------------------------------------


def test_detect_by_class_module_and_name() -> None:
    torch_model = nn.Linear(2, 2)
    opt = torch.optim.SGD(torch_model.parameters(), lr=0.1)
    assert detect(DeepSpeedEngine()).name == "deepspeed"
    assert detect(Trainer()).name == "torchtitan"
    assert detect([GPTModel(), GPTModel()]).name == "megatron"
    assert detect(GPTModel(), opt).name == "megatron"
    assert detect(torch_model, DistributedOptimizer()).name == "megatron"
    assert detect(torch_model, opt).name == "torch"
    assert detect([torch_model]).name == "torch"  # a list, but not Megatron's: resolve refuses it


def test_torch_passes_through_unchanged() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = resolve(model, opt)
    assert target.framework == "torch" and target.model is model and target.optimizer is opt


@pytest.mark.parametrize(
    ("model", "optimizer", "match"),
    [
        (Trainer(), None, r"enable_resiliency.model: a TorchTitan Trainer .* has no model_parts"),
        (
            [GPTModel(), GPTModel()],
            None,
            r"with Megatron Core pass a torch.optim.Optimizer or the MegatronOptimizer",
        ),
        (
            nn.Linear(2, 2),
            DistributedOptimizer(),
            r"with Megatron Core pass a torch.optim.Optimizer or the MegatronOpt",
        ),
        ([nn.Linear(2, 2)], None, r"expected one torch.nn.Module, got a list of 1"),
        ("model", None, r"enable_resiliency.model: expected a torch.nn.Module, got str"),
        (
            nn.Linear(2, 2),
            object(),
            r"enable_resiliency.optimizer: expected a torch.optim.Optimizer, got object$",
        ),
        (
            nn.Linear(2, 2),
            DeepSpeedZeroOptimizer(4),
            r"pass the DeepSpeedEngine as model, not engine.module",
        ),
    ],
)
def test_unsupported_objects_are_config_errors(model: Any, optimizer: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve(model, optimizer)


# -- the DeepSpeed adapter's argument rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "match"),
    [
        (
            DeepSpeedEngine(stage=3),
            r"not a DeepSpeedZeroOptimizer_Stage3 around a torch optimizer",
        ),  # a 1/2 optimizer
        (DeepSpeedEngine(stage=0), r"zero_optimization.stage=0"),
        (DeepSpeedEngine(fp16=True), r"fp16 is not supported"),
        (
            DeepSpeedEngine(offload={"device": "cpu"}),
            r"offload_optimizer / offload_param is not supported",
        ),
    ],
)
def test_engine_settings_the_adapter_cannot_take(engine: DeepSpeedEngine, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve(engine, engine.optimizer)


def test_deepspeed_argument_rules() -> None:
    engine = DeepSpeedEngine()
    other = torch.optim.SGD(engine.module.parameters(), lr=0.1)
    with pytest.raises(
        ConfigError,
        match=r"enable_resiliency.optimizer: with a DeepSpeedEngine pass engine.optimizer",
    ):
        resolve(engine, other)
    with pytest.raises(
        ConfigError, match=r"enable_resiliency.schedulers: engine.lr_scheduler is stepped by"
    ):
        resolve(engine, engine.optimizer, schedulers=[engine.lr_scheduler])
    # The optimizer recipe replays the partition owner's update (ZeroScout); forward recipes alone use Scout.
    assert (
        resolve(engine, engine.optimizer, scout=ScoutConfig()).scout_factory.__name__ == "ZeroScout"
    )
    assert (
        resolve(engine, engine.optimizer, scout=ScoutConfig(recipes=("hidden",))).scout_factory
        is None
    )
    for accepted in (engine.optimizer, engine.optimizer.optimizer, None):
        target = resolve(
            engine, accepted, scout=ScoutConfig(recipes=("embedding", "hidden", "output"))
        )
        assert target.framework == "deepspeed" and target.model is engine.module
        assert isinstance(target.optimizer, EngineOptimizer)


def test_a_scheduler_state_that_needs_pickle_is_refused_at_attach() -> None:
    engine = DeepSpeedEngine()

    class Opaque:
        pass

    engine.lr_scheduler.extra = Opaque()  # type: ignore[attr-defined]  # LambdaLR.state_dict() returns __dict__
    with pytest.raises(ConfigError, match=r"deepspeed.engine.lr_scheduler.extra is a Opaque"):
        resolve(engine, engine.optimizer)


# -- hooks around engine.step() ------------------------------------------------------------------------------------


def test_hooks_run_around_weight_updates_only_and_uninstall() -> None:
    engine = DeepSpeedEngine(accumulation=2)
    view = _resolve_ds(engine).optimizer
    seen: list[tuple[str, int]] = []
    pre = view.register_step_pre_hook(lambda o, a, k: seen.append(("pre", engine.global_steps)))
    post = view.register_step_post_hook(lambda o, a, k: seen.append(("post", engine.global_steps)))
    assert "step" in vars(engine)
    for _ in range(4):
        engine.step()
    # Two updates in four micro-steps; the post-hook sees the engine after its step (counters advanced).
    assert seen == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2)]
    pre.remove()
    assert "step" in vars(engine)  # the post-hook still needs the wrapper
    post.remove()
    assert "step" not in vars(engine)
    engine.step()
    engine.step()
    assert len(seen) == 4 and engine.updates == 3


# -- this rank's partition through the codec ----------------------------------------------------------------------


def _roundtrip(obj: Any) -> Any:
    skeleton, tensors = encode(obj)
    return decode(skeleton, [t.clone() for t in tensors])


def _snapshot(engine: DeepSpeedEngine) -> dict[str, Any]:
    view = EngineOptimizer(engine)
    return _roundtrip({"opt": view.state_dict(), "engine": capture_engine(engine)})


def _live(engine: DeepSpeedEngine) -> list[torch.Tensor]:
    master = engine.optimizer.master
    state = engine.optimizer.optimizer.state[master]
    return [
        master.clone(),
        state["exp_avg"].clone(),
        state["exp_avg_sq"].clone(),
        state["step"].clone(),
    ]


def test_partition_state_restores_bitwise_into_a_fresh_engine() -> None:
    engine = DeepSpeedEngine()
    for _ in range(3):
        engine.step()
    taken = _snapshot(engine)
    engine.step()
    expected = _live(engine)
    expected_lr = engine.optimizer.optimizer.param_groups[0]["lr"]

    fresh = DeepSpeedEngine()  # a relaunched rank: no optimizer state yet, counters at zero
    EngineOptimizer(fresh).load_state_dict(taken["opt"])
    restore_engine(fresh, taken["engine"])
    assert (fresh.global_steps, fresh.global_samples, fresh.micro_steps) == (3, 12, 3)
    taken["opt"]["master"][0].add_(
        1.0
    )  # the restored state must not alias the checkpoint's buffers
    taken["opt"]["state"][0]["exp_avg"].add_(1.0)
    fresh.step()
    got = _live(fresh)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert fresh.optimizer.optimizer.param_groups[0]["lr"] == expected_lr
    assert fresh.global_steps == 4


def test_partition_state_refuses_another_layout() -> None:
    engine = DeepSpeedEngine()
    engine.step()
    taken = _snapshot(engine)
    other = DeepSpeedEngine(stage=2)
    with pytest.raises(RunMismatchError, match=r"zero_stage"):
        EngineOptimizer(other).load_state_dict(taken["opt"])
    other = DeepSpeedEngine()
    other.optimizer.partition_count = [4]
    with pytest.raises(RunMismatchError, match=r"same ZeRO stage, world size"):
        EngineOptimizer(other).load_state_dict(taken["opt"])
    other = DeepSpeedEngine()
    taken["opt"]["partition_index"] = [1]  # rank 1's partition offered to rank 0
    with pytest.raises(RunMismatchError, match=r"each rank from its own partition"):
        EngineOptimizer(other).load_state_dict(taken["opt"])
    other = DeepSpeedEngine()
    other.optimizer.param_names = {
        p: f"renamed.{n}" for p, n in other.optimizer.param_names.items()
    }
    with pytest.raises(
        RunMismatchError, match=r"differs from this engine's in \['fragments', 'params'"
    ):
        EngineOptimizer(other).load_state_dict(taken["opt"])
    with pytest.raises(RunMismatchError, match=r"not a DeepSpeed ZeRO partition"):
        EngineOptimizer(engine).load_state_dict({"state": {}, "param_groups": []})
