"""The AllToAll check's pure pieces (plan, payload, judgement, reports) without a process group, the recording hook on
a real one-rank gloo group, and the EP / CP mesh peer rule (peers vary along dp, keep ep / cp / tp)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gemscout.errors import ConfigError
from gemscout.scout.alltoall import (
    AllToAllCheck,
    AllToAllConfig,
    judge,
    payload,
    plan_cases,
    reports_for,
)
from gemscout.topology import derive

G = (4, 5)


def rec(
    ins: list[int],
    outs: list[int],
    *,
    group: tuple[int, ...] = G,
    dtype: str = "float32",
    row: tuple[int, ...] = (8,),
) -> list:
    return [list(group), dtype, list(row), ins, outs]


@pytest.mark.timeout(30)
def test_plan_has_recorded_balanced_and_cyclic_cases() -> None:
    gathered = [
        [rec([1, 1], [1, 1]), rec([3, 5], [3, 2])],
        [rec([1, 1], [1, 1]), rec([2, 6], [5, 6])],
    ]
    plan = plan_cases(G, gathered, ("recorded", "balanced", "cyclic"), max_rows=4096)
    assert not isinstance(plan, str)
    matrices, dtype, row = plan
    assert (dtype, row) == ("float32", [8])
    assert matrices["recorded"] == [[3, 5], [2, 6]]  # the larger call, with its own uneven splits
    assert matrices["balanced"] == [[4, 4], [4, 4]]  # (3+5+2+6) rows over 2 ranks, per destination
    assert matrices["cyclic"] == [[0, 8], [8, 0]]  # each rank sends everything to the next one


@pytest.mark.timeout(30)
def test_plan_caps_rows_per_sender() -> None:
    gathered = [[rec([900, 100], [900, 50])], [rec([50, 30], [100, 30])]]
    matrices, _, _ = plan_cases(G, gathered, ("recorded", "balanced", "cyclic"), max_rows=64)  # type: ignore[misc]
    assert all(sum(row) <= 64 for m in matrices.values() for row in m)
    assert matrices["balanced"] == [[32, 32], [32, 32]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("gathered", "why"),
    [
        ([[], []], "no AllToAll was recorded"),
        ([[rec([1, 1], [1, 1])], []], "different numbers"),
        ([[rec([1, 1], [1, 1])], [rec([1, 1], [1, 1], dtype="int64")]], "dtypes or row shapes"),
        (
            [[rec([1, 2], [1, 1])], [rec([1, 1], [1, 1])]],
            "group rank 0 recorded sending 2 rows to group rank 1",
        ),
        ([[rec([1, 1], [1, 1])], [rec([1, 1], [1, 1], group=(4, 6))]], "different groups"),
    ],
)
def test_plan_refuses_records_that_do_not_line_up(gathered: list, why: str) -> None:
    reason = plan_cases(G, gathered, ("balanced",), max_rows=16)
    assert isinstance(reason, str) and why in reason


@pytest.mark.timeout(30)
def test_payload_is_deterministic_and_pair_specific() -> None:
    a = payload(step=3, case="balanced", src=0, dst=1, rows=4, row_shape=[8], dtype=torch.bfloat16)
    assert a.shape == (4, 8) and a.dtype == torch.bfloat16
    same = payload(
        step=3, case="balanced", src=0, dst=1, rows=4, row_shape=[8], dtype=torch.bfloat16
    )
    assert torch.equal(a.view(torch.int16), same.view(torch.int16))
    other = payload(
        step=3, case="balanced", src=1, dst=0, rows=4, row_shape=[8], dtype=torch.bfloat16
    )
    assert not torch.equal(a.view(torch.int16), other.view(torch.int16))


def digests(matrix: list[list[int]], *, flip: tuple[int, int, str] | None = None) -> list[dict]:
    """What each group rank would gather for one case, optionally with chunk (src, dst) wrong on one side."""
    out = []
    for me in range(2):
        sent = [f"d{me}{j}" for j in range(2)]
        expected = [f"d{i}{me}" for i in range(2)]
        received = list(expected)
        if flip is not None and flip[2] == "sender" and flip[0] == me:
            sent[flip[1]] = "bad"
        if flip is not None and flip[2] in ("sender", "transit") and flip[1] == me:
            received[flip[0]] = "bad"
        out.append({"c": {"sent": sent, "expected_in": expected, "received": received}})
    return out


@pytest.mark.timeout(30)
def test_judge_clean_sender_and_transit() -> None:
    m = {"c": [[2, 2], [2, 2]]}
    assert judge(G, m, digests(m["c"])) == []
    transit = judge(G, m, digests(m["c"], flip=(1, 0, "transit")))
    assert [(x["src"], x["dst"], x["kind"]) for x in transit] == [(5, 4, "transit")]
    (report,) = reports_for(7, G, transit)
    assert (report.scope.value, report.ranks, report.step, report.recipe) == (
        "peer_group",
        (4, 5),
        7,
        "alltoall",
    )
    assert "sent by rank 5 arrived changed at rank 4" in report.reason
    sender = judge(G, m, digests(m["c"], flip=(0, 1, "sender")))
    assert [(x["src"], x["dst"], x["kind"]) for x in sender] == [(4, 5, "sender")]
    (report,) = reports_for(7, G, sender)
    assert (report.scope.value, report.ranks) == ("rank", (4,))
    assert (
        judge(G, {"c": [[2, 0], [2, 2]]}, digests(m["c"], flip=(0, 1, "sender"))) == []
    )  # no rows, no claim


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("field", "value"), [("interval", 0), ("cases", ("ring",)), ("max_rows", -1), ("timeout", 5)]
)
def test_config_names_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        AllToAllConfig(**{field: value})  # type: ignore[arg-type]


class Dispatch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, [x.shape[0]], [x.shape[0]])
        return out


@pytest.mark.timeout(60)
def test_install_records_forward_alltoalls_and_replays_clean(one_rank: None) -> None:
    check = AllToAllCheck(AllToAllConfig(interval=2))
    module = Dispatch()
    handle = check.install(module)
    x = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(module(x), x)  # the wrapped call passes through unchanged
    original = dist.all_to_all_single
    assert [r.to_json() for r, _ in check.records] == [[[0], "float32", [4], [3], [3]]]
    assert check.before_step(1) is None  # not due
    (result,) = check.before_step(2) or []
    assert result.verdict == "clean" and set(result.cases) == {"recorded", "balanced", "cyclic"}
    assert not check.job_mismatch
    assert check.records == []
    assert check.before_step(4) == []  # nothing recorded since: no group to check, no collective
    handle.remove()
    module(x)
    assert check.records == [] and dist.all_to_all_single is original


@pytest.mark.timeout(60)
def test_a_corrupted_send_is_named(one_rank: None) -> None:
    check = AllToAllCheck(AllToAllConfig(cases=("balanced",)))
    module = Dispatch()
    check.install(module)
    module(torch.ones(4, 2))

    def flip(case: str, step: int, buffer: torch.Tensor) -> torch.Tensor:
        bad = buffer.clone()
        bad.view(-1).view(torch.uint8)[0] ^= 1
        return bad

    check.register_send_hook(flip)
    seen = []
    check.on_report = seen.append
    (result,) = check.before_step(1) or []
    assert result.verdict == "mismatch" and [r.ranks for r in seen] == [(0,)]
    assert check.job_mismatch  # the job-wide flag every rank gates trust on


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("dims", "shape", "model", "peers"),
    [
        (("dp", "ep"), (2, 2), ("ep",), ((0, 2), (1, 3))),
        (("dp", "cp"), (2, 2), ("cp",), ((0, 2), (1, 3))),
        (("dp", "ep", "tp"), (2, 2, 2), ("ep", "tp"), ((0, 4), (1, 5), (2, 6), (3, 7))),
        (("dp", "ep"), (3, 2), ("ep",), ((0, 2, 4), (1, 3, 5))),
    ],
)
def test_expert_and_context_peers_keep_their_model_coordinates(dims, shape, model, peers) -> None:
    n = 1
    for size in shape:
        n *= size
    for rank in range(n):
        t = derive(
            dims=dims, shape=shape, ranks=range(n), data_dims=("dp",), shard_dims=(), rank=rank
        )
        assert t.model_dims == model and t.peer_dims == ("dp",) and t.peer_groups == peers
        assert rank in t.peers and not t.materializes
        coords = [
            (r // (n // shape[0])) for r in t.peers
        ]  # the dp coordinate differs across peers...
        assert len(set(coords)) == len(t.peers)
        assert (
            len({r % (n // shape[0]) for r in t.peers}) == 1
        )  # ...every model-parallel coordinate is kept
        assert t.kind == "dp+" + "+".join(model)
        assert f"keeping this rank's {list(model)} coordinate" in t.reason


@pytest.mark.timeout(60)
def test_records_are_bounded_per_group_and_the_step_hook_counts_from_first_step(
    one_rank: None,
) -> None:
    check = AllToAllCheck(AllToAllConfig(max_records=3, interval=5))
    module = Dispatch()
    check.install(module)
    for rows in range(1, 6):
        module(torch.ones(rows, 2))
    assert [r.input_splits for r, _ in check.records] == [(3,), (4,), (5,)]  # the newest three
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    check.register_step_hook(opt, first_step=4)
    param.grad = torch.zeros(1)
    opt.step()  # step 4: not due
    assert check.last_results == [] and len(check.records) == 3
    opt.step()  # step 5: due
    assert [r.verdict for r in check.last_results] == ["clean"] and check.records == []
