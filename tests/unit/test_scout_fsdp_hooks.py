"""A replay on an FSDP2 model runs none of FSDP's hooks: no unshard (all-gather) into the live module, so no collective
with the data-parallel partners inside the replay (a late partner would otherwise show up as this rank's slow compute).

Real ``fully_shard`` on a one-rank gloo group, in process; FSDP's ``FSDPParamGroup.unshard`` is wrapped by a counter
(a spy that calls the real method) because with one rank there is nothing to see on the wire."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.func import functional_call

from gemscout.scout.materialize import CollectiveTimer, _owned_by_fsdp, without_wrapper_hooks


def _fsdp_hooks(module: nn.Module) -> int:
    return sum(
        _owned_by_fsdp(h)
        for sub in module.modules()
        for registry in (sub._forward_pre_hooks, sub._forward_hooks)
        for h in registry.values()
    )


@pytest.mark.timeout(60)
def test_replay_under_fsdp2_runs_no_fsdp_collective(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    unshards: list[int] = []
    real_unshard = FSDPParamGroup.unshard

    def counted(self: FSDPParamGroup, *args: object, **kwargs: object) -> None:
        unshards.append(1)
        return real_unshard(self, *args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "unshard", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(3, 8)
    model(x).sum().backward()  # FSDP's lazy init and one real step's hooks
    assert _fsdp_hooks(model) == 4  # pre- and post-forward on the root and on the inner block

    unshards.clear()
    model(x).sum().backward()  # back to sharded after the backward
    assert unshards  # the live module's forward unshards (all-gathers): what the replay must not do
    unshards.clear()

    # A replay's forward: the gathered (here: full) parameters, bound functionally, with FSDP's hooks detached.
    params = {
        name: p.full_tensor().detach().clone().requires_grad_()
        for name, p in model.named_parameters()
    }
    grads_before = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
    with without_wrapper_hooks([model]), CollectiveTimer() as timer:
        assert _fsdp_hooks(model) == 0
        out = functional_call(model, params, (x,))
        out.sum().backward()
    assert timer.count == 0 and not unshards, "a replay ran FSDP's unshard"
    assert all(p.grad is not None for p in params.values())
    for name, p in model.named_parameters():  # training's gradients are untouched
        assert torch.equal(p.grad.full_tensor(), grads_before[name]), name
    assert _fsdp_hooks(model) == 4  # put back, in order


@pytest.mark.timeout(30)
def test_fsdp_hook_recognized_through_a_wraps_wrapper() -> None:
    class FakeState:  # a stand-in owner whose module path is FSDP's: only the path is what is checked
        def hook(self) -> None:
            pass

    FakeState.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"
    bound = FakeState().hook

    @functools.wraps(bound)
    def grouped(*args: object) -> None:  # what grouped fully_shard([a, b]) registers
        bound()

    assert _owned_by_fsdp(bound) and _owned_by_fsdp(grouped)
    assert not _owned_by_fsdp(lambda *a: None)
