"""The Megatron Core and TorchTitan adapters' rules and state, without a process group.

Stand-ins, and why: a ``MegatronOptimizer`` allocates on CUDA when built and a TorchTitan ``Trainer`` needs a GPU
(and a 2 GB install), so both are stood in by classes carrying the frameworks' module and class names (detection
reads nothing else) around real torch optimizers, so the adapters' hooks and their capture / restore run on real
tensors through gemscout's pickle-free codec. Megatron's real ``CudaRNGStatesTracker`` is used where megatron-core is
installed. The real objects run in tests/distributed/test_megatron.py (GPTModel on gloo) and tests/gpu/.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

from gemscout import ConfigError, RunMismatchError, ScoutConfig
from gemscout.adapters.megatron.optimizer_view import MegatronOptimizerView
from gemscout.adapters.megatron.rng_tracker import capture_rng_tracker, restore_rng_tracker
from gemscout.adapters.registry import resolve
from gemscout.adapters.torchtitan.optimizers import OptimizersView
from gemscout.state.codec import decode, encode
from gemscout.state.training_state import StateSources, collect, restore

pytestmark = pytest.mark.timeout(60)


def _roundtrip(obj: Any) -> Any:
    skeleton, tensors = encode(obj)
    return decode(skeleton, [t.clone() for t in tensors])


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# -- Megatron stand-ins ------------------------------------------------------------------------------------------
class GPTModel(nn.Module):
    __module__ = "megatron.core.models.gpt.gpt_model"

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)


class Scaler:
    def __init__(self) -> None:
        self.scale = torch.tensor([1024.0])

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = state["scale"].clone()


class MegatronOptimizer:
    """Steps like megatron.core.optimizer's optimizers: fp32 main params updated by a torch optimizer inside."""

    __module__ = "megatron.core.optimizer.optimizer"

    def __init__(self, numel: int = 6) -> None:
        self.main = torch.linspace(-1.0, 1.0, numel)
        self.optimizer = torch.optim.AdamW([self.main], lr=0.1)
        self.grad_scaler = Scaler()
        self.steps = 0

    def step(self) -> tuple[bool, float, None]:
        self.main.grad = torch.cos(self.main * 3)
        self.optimizer.step()
        self.steps += 1
        return True, 1.0, None

    def state_dict(self) -> dict[str, Any]:
        raise AssertionError("the adapter must not use Megatron's own state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("the adapter must not use Megatron's own load_state_dict")


def test_megatron_is_resolved_and_its_argument_rules_name_the_fix() -> None:
    model = GPTModel()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    target = resolve([model], opt)
    assert target.framework == "megatron" and target.model is model and target.optimizer is opt
    chunks = resolve([GPTModel(), GPTModel()], torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(chunks.model, nn.ModuleList) and len(chunks.model) == 2
    assert isinstance(resolve(model, MegatronOptimizer()).optimizer, MegatronOptimizerView)
    with pytest.raises(
        ConfigError, match=r"enable_resiliency.group: with Megatron Core SCOUT's peers come from"
    ):
        resolve(model, opt, group=object())
    with pytest.raises(
        ConfigError, match=r"ScoutConfig.data_parallel_dims: Megatron's data-parallel peers"
    ):
        resolve(model, opt, scout=ScoutConfig(data_parallel_dims=("dp",)))
    with pytest.raises(
        ConfigError,
        match=r"2 model chunks on this rank, but parallel_state has pipeline_model_para",
    ):
        resolve([GPTModel(), GPTModel()], opt, scout=ScoutConfig())
    with pytest.raises(
        ConfigError, match=r"'optimizer' recipe is not supported with a MegatronOptimizer"
    ):
        resolve(model, MegatronOptimizer(), scout=ScoutConfig())
    with pytest.raises(ConfigError, match=r"pass a torch.optim.Optimizer or the MegatronOptimizer"):
        resolve(model, object())


def test_megatron_optimizer_view_hooks_and_bitwise_state() -> None:
    live = MegatronOptimizer()
    view = MegatronOptimizerView(live)
    calls: list[tuple[str, int]] = []
    pre = view.register_step_pre_hook(lambda o, a, k: calls.append(("pre", live.steps)))
    post = view.register_step_post_hook(lambda o, a, k: calls.append(("post", live.steps)))
    assert live.step() == (
        True,
        1.0,
        None,
    )  # the loop's own call goes through the hooks, result unchanged
    live.step()
    assert calls == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2)]
    saved = _roundtrip(view.state_dict())
    expected = (
        live.main.clone(),
        {
            k: v.clone() if torch.is_tensor(v) else v
            for k, v in live.optimizer.state[live.main].items()
        },
    )
    pre.remove()
    post.remove()
    assert "step" not in vars(live)  # the wrapper is gone once its last hook is
    fresh = MegatronOptimizer()
    MegatronOptimizerView(fresh).load_state_dict(saved)
    assert torch.equal(fresh.main, expected[0]) and _equal(
        dict(fresh.optimizer.state[fresh.main]), expected[1]
    )
    assert torch.equal(fresh.grad_scaler.scale, live.grad_scaler.scale)
    live.step()
    fresh.step()
    assert torch.equal(fresh.main, live.main)  # the next update is bitwise the same
    with pytest.raises(RunMismatchError, match=r"taken with .* this optimizer has"):
        MegatronOptimizerView(MegatronOptimizer(numel=5)).load_state_dict(saved)
    with pytest.raises(RunMismatchError, match=r"not a Megatron optimizer's"):
        view.load_state_dict({"format": "other"})


def test_megatron_optimizer_view_restores_through_the_training_state() -> None:
    # The path a recovery takes (collect -> codec -> restore), not only the view's own load_state_dict: the view's
    # state has "parts", no torch "state", which restore's DTensor pass once indexed blindly (KeyError: 'state').
    live, fresh = MegatronOptimizer(), MegatronOptimizer()
    live.step()
    saved = _roundtrip(
        collect(StateSources(model=GPTModel(), optimizer=MegatronOptimizerView(live)), step=1)
    )
    restore(StateSources(model=GPTModel(), optimizer=MegatronOptimizerView(fresh)), saved)
    assert torch.equal(fresh.main, live.main)
    live.step()
    fresh.step()
    assert torch.equal(fresh.main, live.main) and _equal(
        fresh.optimizer.state_dict(), live.optimizer.state_dict()
    )


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)
def test_rng_tracker_streams_are_captured_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    gen = torch.Generator().manual_seed(7)
    tracker.set_states(
        {"model-parallel-rng": gen.get_state(), "data-parallel-rng": gen.manual_seed(9).get_state()}
    )
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", tracker)
    saved = _roundtrip(capture_rng_tracker())
    before = {k: v.clone() for k, v in tracker.get_states().items()}
    tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(1).get_state()})
    restore_rng_tracker(saved)
    assert _equal(tracker.get_states(), before)
    assert all(
        tracker.get_states()[k] is not saved[k] for k in saved
    )  # never aliases the checkpoint's buffers


# -- TorchTitan stand-ins -----------------------------------------------------------------------------------------
class OptimizersContainer(torch.optim.Optimizer):
    """Like torchtitan.components.optimizer.OptimizersContainer: one torch optimizer per model part, one step()."""

    __module__ = "torchtitan.components.optimizer"

    def __init__(self, parts: list[nn.Module]) -> None:
        self.optimizers = [
            torch.optim.AdamW(p.parameters(), lr=0.05, weight_decay=0.01) for p in parts
        ]
        torch.optim.Optimizer.__init__(
            self, [p for m in parts for p in m.parameters()], {"lr": 0.05}
        )

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for opt in self.optimizers:
            opt.step()


class Loader:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"dp_rank_0": f"pickled-{self.position}".encode(), "world_size": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["dp_rank_0"].decode().split("-")[1])


class Dims:
    def __init__(self, **sizes: int) -> None:
        self.dp_replicate, self.dp_shard, self.tp, self.pp, self.ep = 1, 2, 1, 1, 1
        vars(self).update(sizes)


class Trainer:
    __module__ = "torchtitan.trainer"

    def __init__(self, parts: int = 1, **dims: int) -> None:
        torch.manual_seed(0)
        self.model_parts = [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)) for _ in range(parts)]
        self.optimizers = OptimizersContainer(self.model_parts)
        self.lr_schedulers = torch.optim.lr_scheduler.LambdaLR(
            self.optimizers.optimizers[0], lambda s: 1 / (1 + s)
        )
        self.dataloader = Loader()
        self.parallel_dims = Dims(**dims)
        self.step = self.ntokens_seen = 0

    def train_step(self) -> None:
        self.step += 1
        for m in self.model_parts:
            m(torch.ones(3, 4) * self.step).square().sum().backward()
        self.ntokens_seen += 12
        self.dataloader.position += 1
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()


def test_torchtitan_trainer_state_roundtrips_bitwise() -> None:
    trainer = Trainer(parts=1)
    target = resolve(trainer, None)
    assert target.framework == "torchtitan" and target.model is trainer.model_parts[0]
    assert target.schedulers == (trainer.lr_schedulers,)
    seen: list[int] = []
    handle = target.optimizer.register_step_post_hook(lambda o, a, k: seen.append(trainer.step))
    for _ in range(3):
        trainer.train_step()
    handle.remove()
    assert seen == [1, 2, 3]  # once per train_step, with trainer.step already the step taken
    assert target.extra_state_fn is not None
    saved = _roundtrip(
        {
            "optimizer": target.optimizer.state_dict(),
            "extra": target.extra_state_fn(),
            "model": trainer.model_parts[0].state_dict(),
            "sched": trainer.lr_schedulers.state_dict(),
        }
    )
    other = Trainer(parts=1)
    again = resolve(other, other.optimizers)
    other.model_parts[0].load_state_dict(saved["model"])
    again.optimizer.load_state_dict(saved["optimizer"])
    assert again.load_extra_state_fn is not None
    again.load_extra_state_fn(saved["extra"])
    assert (other.step, other.ntokens_seen, other.dataloader.position) == (3, 36, 3)
    other.lr_schedulers.load_state_dict(
        saved["sched"]
    )  # the session does this (and replays the step) on restore
    trainer.train_step()
    other.train_step()
    for a, b in zip(
        trainer.model_parts[0].parameters(), other.model_parts[0].parameters(), strict=True
    ):
        assert torch.equal(a, b)


def test_torchtitan_views_every_inner_optimizer() -> None:
    trainer = Trainer(parts=2)
    view = OptimizersView(trainer.optimizers)
    trainer.train_step()
    sd = view.state_dict()
    assert sorted(sd["state"]) == list(range(8)) and len(sd["param_groups"]) == 2
    fresh = Trainer(parts=2)
    OptimizersView(fresh.optimizers).load_state_dict(_roundtrip(sd))
    for a, b in zip(trainer.optimizers.optimizers, fresh.optimizers.optimizers, strict=True):
        assert _equal(a.state_dict(), b.state_dict())


def test_torchtitan_argument_rules_name_the_fix() -> None:
    trainer = Trainer()
    with pytest.raises(
        ConfigError, match=r"with a TorchTitan Trainer pass None \(or trainer.optimizers\)"
    ):
        resolve(trainer, torch.optim.SGD(trainer.model_parts[0].parameters(), lr=0.1))
    with pytest.raises(
        ConfigError, match=r"enable_resiliency.schedulers: trainer.lr_schedulers is stepped"
    ):
        resolve(trainer, None, schedulers=[trainer.lr_schedulers])
    with pytest.raises(ConfigError, match=r"enable_resiliency.group: with a TorchTitan Trainer"):
        resolve(trainer, None, group=object())
    with pytest.raises(ConfigError, match=r"SCOUT under TorchTitan pipeline parallelism"):
        resolve(Trainer(parts=1, pp=2), None, scout=ScoutConfig())
    with pytest.raises(ConfigError, match=r"SCOUT under TorchTitan expert parallelism"):
        resolve(Trainer(ep=2), None, scout=ScoutConfig())
    ddp_tp = resolve(Trainer(dp_replicate=2, dp_shard=1, tp=2), None, scout=ScoutConfig())
    assert ddp_tp.scout is not None and ddp_tp.scout.data_parallel_dims == ("dp_replicate",)
    empty = Trainer()
    empty.model_parts = []
    with pytest.raises(ConfigError, match=r"has no model_parts"):
        resolve(empty, None)


def test_torchtitan_scout_replays_the_inner_class_and_skips_a_chunked_head() -> None:
    """What a real torchtitan 0.3.0 Trainer showed (tests/distributed/test_torchtitan_cpu.py): SCOUT's optimizer recipe
    replays in the inner optimizers' class, and under ChunkedLossWrapper (the model stops before lm_head) the output
    recipe is off, every other recipe kept."""
    trainer = Trainer()
    assert OptimizersView(trainer.optimizers).replay_class is torch.optim.AdamW
    plain = resolve(trainer, None, scout=ScoutConfig())
    assert plain.scout is not None and "output" in plain.scout.recipes
    trainer.model_parts[0]._skip_lm_head = True  # type: ignore[assignment]  # set by Trainer for ChunkedLossWrapper
    chunked = resolve(trainer, None, scout=ScoutConfig())
    assert chunked.scout is not None and chunked.scout.recipes == (
        "embedding",
        "hidden",
        "optimizer",
    )


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)
def test_optimizer_param_scheduler_is_captured_and_its_step_replayed() -> None:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from gemscout.adapters.megatron.scheduler import ParamSchedulerReplay

    def build() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model = GPTModel()
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        sched = OptimizerParamScheduler(
            opt,
            init_lr=0.0,
            max_lr=1e-2,
            min_lr=1e-3,
            lr_warmup_steps=16,
            lr_decay_steps=64,
            lr_decay_style="cosine",
            start_wd=0.01,
            end_wd=0.01,
            wd_incr_steps=64,
            wd_incr_style="constant",
        )
        return model, opt, sched

    model, opt, sched = build()
    target = resolve(model, opt, schedulers=[sched])
    replay = target.schedulers[0]
    assert isinstance(replay, ParamSchedulerReplay) and target.install_hooks is not None
    handles = target.install_hooks()
    saved = None
    for it in range(1, 4):
        if it == 3:
            saved = _roundtrip(
                replay.state_dict()
            )  # taken inside optimizer.step(), before the loop's sched.step
        sched.step(
            increment=8
        )  # the loop's own call, with Megatron's increment (the global batch size)
    assert (sched.num_steps, replay.increment) == (24, 8)
    for h in handles:
        h.remove()
    assert "step" not in vars(sched)
    for warm in (0, 5):  # a fresh scheduler, and one that already counted steps (a mid-run recover)
        _, opt2, sched2 = build()
        sched2.step(increment=warm)
        again = resolve(GPTModel(), opt2, schedulers=[sched2]).schedulers[0]
        again.load_state_dict(saved)
        again.step()  # what restore does: replay the step the capture was taken before
        assert sched2.num_steps == sched.num_steps == 24
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
