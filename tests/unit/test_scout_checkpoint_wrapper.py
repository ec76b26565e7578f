"""SCOUT on TorchTitan's block layout, with plain torch and no process group: blocks in an ``nn.ModuleDict``
(``layers: {"0": ..., "1": ...}``), each inside an activation-checkpoint wrapper (TorchTitan's SelectiveAC / full AC).

Found by running a real torchtitan 0.3.0 Trainer (tests/distributed/test_torchtitan_cpu.py, skipped where torchtitan
is absent): the catalog must find the blocks in a ModuleDict, and a block replayed on given (gathered) parameters must
differentiate those, not the live ones a checkpoint wrapper would recompute with during the backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from gemscout.scout import ScoutConfig
from gemscout.scout.capture import CaptureHooks
from gemscout.scout.recipes import build_catalog
from gemscout.scout.replay import ReplayContext, ReplayHooks, replay_forward

STEP = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.ff = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.ff(self.norm(x)))


class TitanLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleDict({str(i): checkpoint_wrapper(Block()) for i in range(3)})
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.lm_head(self.norm(h))


@pytest.mark.timeout(60)
def test_blocks_in_a_module_dict_behind_checkpoint_wrappers_replay_on_the_given_parameters() -> (
    None
):
    torch.manual_seed(0)
    model = TitanLike()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    catalog = build_catalog(
        model, opt, ScoutConfig(hidden_per_cycle=None, optimizer_slices_per_cycle=None)
    )
    hidden = [r for r in catalog.recipes if r.name.startswith("hidden.")]
    assert [(r.name, r.modules) for r in hidden] == [
        (f"hidden.{i}", (f"layers.{i}",)) for i in range(3)
    ]
    modules = {r.name: [model.get_submodule(p) for p in r.modules] for r in catalog.recipes}
    hooks = CaptureHooks(modules, {r.name: r for r in catalog.recipes})
    hooks.arm(STEP, {"hidden.1"})
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    captured = hooks.take("hidden.1", STEP)
    hooks.paused = True
    wrapper = model.layers["1"]
    # As under FSDP: the replay runs on private copies of the (gathered) parameters, named as the wrapper names them.
    # Other values than the live ones, so a backward that recomputes with the live parameters shows.
    given = {n: (p.detach() * 1.5).requires_grad_(True) for n, p in wrapper.named_parameters()}
    ctx = ReplayContext(recipe="hidden.1", kind="hidden", step=STEP, rank=0, source_rank=0)
    outcome = replay_forward([wrapper], ("layers.1",), captured, ctx, ReplayHooks(), params=[given])
    grads = {
        k[len("grad.param.layers.1.") :]: g
        for k, g in outcome.outputs.items()
        if k.startswith("grad.param.")
    }
    reference = (
        Block()
    )  # the same block, unwrapped, on the given values: forward and backward by hand
    reference.load_state_dict({n: t.detach() for n, t in given.items()})
    x = captured.tensors["arg.0"].detach().requires_grad_(True)
    out = reference(x)
    out.backward(captured.tensors["grad_output.output"])
    assert torch.equal(outcome.outputs["output"], out.detach())
    expected = {n: p.grad for n, p in reference.named_parameters()}
    assert set(grads) == set(expected)
    assert all(torch.equal(grads[n], expected[n]) for n in expected), (
        "gradients recomputed with the live parameters"
    )
