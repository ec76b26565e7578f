"""Restoring from a buffer GEMINI reuses (a slot or held replica): the optimizer's state goes straight into its live
tensors, so does a model that loads by copying, and nothing restored aliases the buffer — no process group needed."""

from __future__ import annotations

import pytest
import torch
from frames_support import frame_of
from torch import nn

from gemscout.gemini.restore import _copies_on_load, restore_frame
from gemscout.state import training_state


class KeepsWhatItLoads(nn.Linear):
    """A module whose load keeps the tensor it is given (as ``assign=True`` does): restoring it from a reused
    buffer without a copy first would leave its weight a view of that buffer."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.weight.data = state_dict[prefix + "weight"]
        self.bias.data = state_dict[prefix + "bias"]


MODELS = {
    # BatchNorm overrides _load_from_state_dict (its num_batches_tracked): the model part is cloned first.
    "batchnorm": lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)),
    # torch's own load path everywhere: load_state_dict copies, so the model part is not cloned first.
    "plain": lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)),
    "keeps": lambda: nn.Sequential(nn.Linear(8, 8), KeepsWhatItLoads(8, 2)),
}


def trained(seed: int, kind: str = "batchnorm") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = MODELS[kind]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def flat_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()] + [
        v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("owned", [False, True])
def test_restore_is_bitwise_and_never_aliases_a_reused_buffer(owned: bool, kind: str) -> None:
    model, opt = trained(0, kind)
    sources = training_state.StateSources(model, opt)
    want = flat_state(model, opt)
    prefix, data = frame_of(training_state.collect(sources, 2))
    live_before = {id(v) for st in opt.state.values() for v in st.values()}

    # Diverge the live state (another trajectory), then restore the frame.
    other, other_opt = trained(1, kind)
    model.load_state_dict(other.state_dict())
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        for key, value in other_opt.state[q].items():
            opt.state[p][key].copy_(value)
    restore_frame(sources, (prefix, data), owned=owned)

    got = flat_state(model, opt)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(want, got, strict=True))
    if owned:
        return
    # The optimizer kept its own tensors (restored in place), and scribbling over the slot changes nothing restored.
    assert {id(v) for st in opt.state.values() for v in st.values()} == live_before
    data.fill_(0xFF)
    assert all(torch.equal(a, b) for a, b in zip(want, flat_state(model, opt), strict=True))


@pytest.mark.timeout(30)
def test_only_a_model_that_loads_by_copying_skips_the_clone() -> None:
    plain = MODELS["plain"]()
    assert _copies_on_load(plain)
    assert not _copies_on_load(MODELS["batchnorm"]()) and not _copies_on_load(MODELS["keeps"]())
    hooked = MODELS["plain"]()
    hooked[1].register_load_state_dict_pre_hook(
        lambda *args: None
    )  # a hook sees (and may keep) the tensors
    assert not _copies_on_load(hooked)

    class WithExtra(nn.Linear):  # its extra state goes to set_extra_state, which may keep it
        def get_extra_state(self) -> torch.Tensor:
            return torch.zeros(1)

        def set_extra_state(self, state: torch.Tensor) -> None:
            self.kept = state

    assert not _copies_on_load(nn.Sequential(nn.Linear(2, 2), WithExtra(2, 2)))
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        assert not _copies_on_load(
            plain
        )  # torch then swaps the given tensors in instead of copying
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
