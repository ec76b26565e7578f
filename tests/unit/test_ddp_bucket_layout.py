"""DDP's rebuilt bucket layout (gemscout.adapters.ddp_buckets) on a real one-rank gloo group: the layout gemscout
derives from the first backward is the one DDP's reducer rebuilds into, and a reducer rebuilt on a recorded layout
reduces in it. The multi-rank, SIGKILL and node-loss proof is tests/distributed/test_ddp_buckets.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gemscout.adapters import ddp_buckets


class Shuffled(nn.Module):
    """Registered a, b, c, d; used c, a, d, b: the gradient-ready order is not the reverse registration order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.d(self.a(self.c(x)))))


def _step(model: nn.Module, seed: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()


def _bucket_order(ddp: DDP) -> list[list[int]]:
    """The reducer's layout as it is now, read from its buckets' parameters."""
    index = {id(p): i for i, p in enumerate(ddp._build_params_for_reducer()[0])}
    return [
        [index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"bucket_cap_mb": 0.002},
        {"bucket_cap_mb_list": [0.001, 0.003]},
        {"static_graph": True, "bucket_cap_mb": 0.002},
    ],
    ids=str,
)
def test_the_recorded_layout_is_the_one_ddp_rebuilds_into(one_rank: None, kwargs: dict) -> None:
    ddp = DDP(Shuffled(), **kwargs)
    buckets = ddp_buckets.attach(ddp)
    assert buckets is not None
    initial = _bucket_order(ddp)
    buckets.start(restored=False, group=dist.group.WORLD, timeout=timedelta(seconds=10))
    # DDP rebuilds at the second forward (static graph: the third) and reports it at the one after.
    for seed in range(4 if kwargs.get("static_graph") else 3):
        _step(ddp, seed)
    state = buckets.wrap_state(None, None)[0]()[ddp_buckets.STATE_KEY][""]
    logged = ddp_buckets.logged_layout(ddp)
    assert logged is not None and state["buckets"] == logged == _bucket_order(ddp)
    assert logged != initial
    if not kwargs.get("static_graph"):
        flat = [i for b in logged for i in b]
        assert flat != list(reversed(range(8))), (
            "the test model must not be ready in reverse registration order"
        )
    buckets.remove()


@pytest.mark.timeout(60)
def test_a_reducer_rebuilt_on_a_recorded_layout_reduces_in_it(one_rank: None) -> None:
    reference = DDP(Shuffled(), bucket_cap_mb=0.002)
    for seed in range(3):
        _step(reference, seed)
    layout = ddp_buckets.logged_layout(reference)
    assert layout is not None and len(layout) > 1
    _, limits = ddp_buckets.rebuilt_layout(reference, [i for b in layout for i in b])

    hooked: list[int] = []

    def count(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations, which are strings here
        hooked.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    fresh = DDP(Shuffled(), bucket_cap_mb=0.002)
    fresh.register_comm_hook(None, count)  # a caller's comm hook survives the new reducer
    buckets = ddp_buckets.attach(fresh)
    assert buckets is not None
    buckets.wrap_state(None, None)[1](
        {ddp_buckets.STATE_KEY: {"": {"buckets": layout, "limits": limits}}, "caller": None}
    )
    assert buckets.start(restored=True, group=dist.group.WORLD, timeout=timedelta(seconds=10)) == [
        ""
    ]
    assert _bucket_order(fresh) == layout  # before its first forward
    _step(fresh, 0)
    assert sorted(hooked) == list(range(len(layout)))
    # One reducer reduces each gradient once: the old one's hooks are gone (world 1: the mean is the gradient).
    plain = Shuffled()
    _step(plain, 0)
    for p, q in zip(fresh.module.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    _step(fresh, 1)
    _step(fresh, 2)  # it rebuilt once more after its first backward, into the same layout
    assert _bucket_order(fresh) == layout == ddp_buckets.logged_layout(fresh)
    buckets.remove()


@pytest.mark.timeout(60)
def test_caller_state_round_trips_and_old_checkpoints_still_load(one_rank: None) -> None:
    buckets = ddp_buckets.attach(DDP(Shuffled()))
    assert buckets is not None
    seen: list[object] = []
    extra, load = buckets.wrap_state(lambda: {"epoch": 3}, seen.append)
    state = extra()
    assert state == {
        ddp_buckets.STATE_KEY: {},
        "caller": {"epoch": 3},
    }  # no backward yet: nothing recorded
    load(state)
    load(
        {"epoch": 2}
    )  # a checkpoint written before gemscout kept DDP's layout: the caller's state unchanged
    assert seen == [{"epoch": 3}, {"epoch": 2}]
    buckets.remove()


@pytest.mark.timeout(60)
def test_nothing_is_recorded_where_ddp_never_rebuilds_or_when_switched_off(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ddp_buckets.attach(DDP(Shuffled(), find_unused_parameters=True)) is None
    assert ddp_buckets.attach(Shuffled()) is None
    monkeypatch.setenv(ddp_buckets.DISABLE_ENV, "0")
    ddp = DDP(Shuffled())
    off = ddp_buckets.attach(ddp)
    assert (
        off is not None
    )  # the caller state keeps its wrapper, so checkpoints load with the switch on or off
    assert off.start(restored=False, group=dist.group.WORLD, timeout=timedelta(seconds=10)) == []
    for seed in range(2):
        _step(ddp, seed)
    assert off.wrap_state(None, None)[0]() == {
        ddp_buckets.STATE_KEY: {},
        "caller": None,
    }  # nothing recorded
