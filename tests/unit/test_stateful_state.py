"""Caller state as objects users already have (``enable_resiliency(stateful={...})``): a torchdata
``StatefulDataLoader`` and a user class travel through the checkpoint codec (no pickle) and come back at the same
position; bad input is refused with the fix. In one process: the SIGKILL path is tests/e2e/test_examples.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gemscout.api import _check_stateful
from gemscout.errors import ConfigError
from gemscout.state.codec import decode, encode
from gemscout.state.training_state import StateSources, collect, restore

torchdata = pytest.importorskip("torchdata.stateful_dataloader")


def loader() -> object:
    data = list(range(40))
    return torchdata.StatefulDataLoader(
        data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5)
    )


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_a_loader_and_a_user_object_resume_at_the_captured_position() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    live, counter = loader(), Counter()
    it = iter(live)
    seen = [next(it).tolist() for _ in range(4)]
    counter.n = 4
    skeleton, tensors = encode(
        collect(StateSources(model, opt, stateful={"loader": live, "count": counter}), 4)
    )
    rest = [b.tolist() for b in it]  # what an uninterrupted run trains on next
    fresh, fresh_counter = loader(), Counter()
    restore(
        StateSources(model, opt, stateful={"loader": fresh, "count": fresh_counter}),
        decode(skeleton, tensors),
    )
    assert [b.tolist() for b in fresh] == rest  # nothing skipped, nothing repeated
    assert fresh_counter.n == 4 and len({i for b in seen + rest for i in b}) == 40


def test_a_checkpoint_without_the_named_state_is_refused_not_half_loaded() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = collect(StateSources(model, opt), 3)
    with pytest.raises(ConfigError, match=r"holds no state for \['loader'\]"):
        restore(StateSources(model, opt, stateful={"loader": loader()}), state)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([loader()], "pass a dict of name -> object"),
        ({"": Counter()}, "names must be non-empty strings"),
        (
            {"loader": object()},
            r"stateful\['loader'\]: a object has no state_dict\(\) and load_state_dict\(\)",
        ),
    ],
)
def test_bad_stateful_arguments_name_the_fix(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _check_stateful(value)  # type: ignore[arg-type]
