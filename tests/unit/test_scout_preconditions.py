"""Preconditions come before verdicts: any disagreement is INCONCLUSIVE, never an attribution."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import pytest

from gemscout.errors import EvidenceError
from gemscout.scout.consensus import Verdict
from gemscout.scout.preconditions import (
    PRECONDITION_FIELDS,
    Precondition,
    check_preconditions,
    find_precondition_mismatch,
    judge,
)

GOOD = "blake3:" + "a" * 64
BAD = "blake3:" + "b" * 64

BASE = Precondition(
    step=10,
    recipe="hidden.1",
    shapes=((4, 16), (4,)),
    input_digest="blake3:" + "1" * 64,
    rng_digest="blake3:" + "2" * 64,
    param_digest="blake3:" + "3" * 64,
)

# A value different from BASE's for every field.
OTHER: dict[str, Any] = {
    "step": 11,
    "recipe": "hidden.2",
    "shapes": ((4, 17), (4,)),
    "input_digest": "blake3:" + "4" * 64,
    "rng_digest": "blake3:" + "5" * 64,
    "param_digest": "blake3:" + "6" * 64,
}


def records(n: int, differing: dict[int, dict[str, Any]] | None = None) -> dict[int, Precondition]:
    differing = differing or {}
    return {rank: dataclasses.replace(BASE, **differing.get(rank, {})) for rank in range(n)}


def test_fields_are_the_ones_the_design_names() -> None:
    assert PRECONDITION_FIELDS == (
        "step",
        "recipe",
        "shapes",
        "input_digest",
        "rng_digest",
        "param_digest",
    )
    assert set(OTHER) == set(PRECONDITION_FIELDS)


def test_agreeing_records_pass_and_c3_decides() -> None:
    assert check_preconditions(records(4)) is None
    result = judge(records(4), {0: GOOD, 1: GOOD, 2: BAD, 3: GOOD}, recipe="hidden.1", step=10)
    assert result.verdict is Verdict.ATTRIBUTED
    assert result.ranks == (2,)
    assert result.preconditions_ok


STARTS_FROM = tuple(
    f for f in PRECONDITION_FIELDS if f != "param_digest"
)  # what the replay starts from


@pytest.mark.parametrize("field", STARTS_FROM)
@pytest.mark.parametrize(("n", "odd_rank"), [(3, 0), (4, 2), (5, 4), (8, 5)])
def test_each_disagreeing_field_is_named_and_blocks_attribution(
    field: str, n: int, odd_rank: int
) -> None:
    peers = records(n, {odd_rank: {field: OTHER[field]}})
    reason = check_preconditions(peers)
    assert reason is not None
    assert f"'{field}'" in reason
    assert f"disagreeing ranks [{odd_rank}]" in reason

    # The same rank also produced a different output: without the precondition check this is a clear attribution.
    digests = {rank: BAD if rank == odd_rank else GOOD for rank in range(n)}
    result = judge(peers, digests, recipe=BASE.recipe, step=BASE.step)
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.ranks == ()
    assert not result.preconditions_ok
    assert f"'{field}'" in result.reason
    assert (
        result.fault_report() is None
    )  # no SDC is claimed on the strength of a broken precondition
    assert dict(result.digests_by_rank) == digests  # the digests are kept as evidence all the same


@pytest.mark.parametrize("field", STARTS_FROM)
def test_disagreeing_preconditions_never_attribute_whatever_the_digests(field: str) -> None:
    n = 4
    for size in range(1, n):
        for odd_ranks in itertools.combinations(range(n), size):
            peers = records(n, {rank: {field: OTHER[field]} for rank in odd_ranks})
            for labels in itertools.product((GOOD, BAD), repeat=n):
                result = judge(peers, dict(enumerate(labels)), recipe=BASE.recipe, step=BASE.step)
                assert result.verdict is Verdict.INCONCLUSIVE, (field, odd_ranks, labels)
                assert result.ranks == ()


@pytest.mark.parametrize(("n", "odd_rank"), [(3, 0), (4, 2), (5, 4), (8, 5)])
def test_diverged_parameters_are_attributed_by_majority_whatever_the_outputs(
    n: int, odd_rank: int
) -> None:
    peers = records(n, {odd_rank: {"param_digest": OTHER["param_digest"]}})
    for outputs in (
        {r: GOOD for r in range(n)},
        {r: BAD if r == odd_rank else GOOD for r in range(n)},
    ):
        result = judge(peers, outputs, recipe=BASE.recipe, step=BASE.step)
        assert result.verdict is Verdict.ATTRIBUTED and result.ranks == (odd_rank,), result
        assert result.preconditions_ok and "parameters diverged" in result.reason
        assert dict(result.digests_by_rank) == {r: p.param_digest for r, p in peers.items()}
        report = result.fault_report()
        assert report is not None and report.scope.value == "rank" and report.ranks == (odd_rank,)


@pytest.mark.parametrize(("n", "odd"), [(2, (1,)), (4, (2, 3))])
def test_diverged_parameters_without_a_majority_are_detected_without_a_culprit(
    n: int, odd: tuple[int, ...]
) -> None:
    peers = records(n, {rank: {"param_digest": OTHER["param_digest"]} for rank in odd})
    result = judge(peers, {r: GOOD for r in range(n)}, recipe=BASE.recipe, step=BASE.step)
    assert result.verdict is Verdict.INCONCLUSIVE and result.ranks == () and result.preconditions_ok
    assert "detection without a culprit" in result.reason
    report = result.fault_report()
    assert (
        report is not None
        and report.scope.value == "peer_group"
        and report.ranks == tuple(range(n))
    )


def test_an_earlier_field_wins_over_diverged_parameters() -> None:
    peers = records(
        4, {1: {"input_digest": OTHER["input_digest"], "param_digest": OTHER["param_digest"]}}
    )
    result = judge(peers, {r: GOOD for r in range(4)}, recipe=BASE.recipe, step=BASE.step)
    assert (
        result.verdict is Verdict.INCONCLUSIVE
        and not result.preconditions_ok
        and "'input_digest'" in result.reason
    )


def test_the_first_disagreeing_field_is_named() -> None:
    peers = records(
        3, {1: {"rng_digest": OTHER["rng_digest"], "param_digest": OTHER["param_digest"]}}
    )
    mismatch = find_precondition_mismatch(peers)
    assert mismatch is not None
    assert mismatch.field == "rng_digest"
    assert mismatch.groups == ((0, 2), (1,))
    assert mismatch.disagreeing_ranks == (1,)


def test_a_tied_split_names_every_rank() -> None:
    peers = records(
        4, {2: {"input_digest": OTHER["input_digest"]}, 3: {"input_digest": OTHER["input_digest"]}}
    )
    mismatch = find_precondition_mismatch(peers)
    assert mismatch is not None
    assert mismatch.groups == ((0, 1), (2, 3))
    assert mismatch.disagreeing_ranks == (0, 1, 2, 3)


def test_records_for_another_step_or_recipe_than_judged_are_inconclusive() -> None:
    digests = {0: GOOD, 1: GOOD, 2: BAD}
    wrong_step = judge(records(3), digests, recipe=BASE.recipe, step=BASE.step + 1)
    assert wrong_step.verdict is Verdict.INCONCLUSIVE and "'step'" in wrong_step.reason
    wrong_recipe = judge(records(3), digests, recipe="output", step=BASE.step)
    assert wrong_recipe.verdict is Verdict.INCONCLUSIVE and "'recipe'" in wrong_recipe.reason


def test_missing_records_or_digests_are_inconclusive_and_named() -> None:
    no_record = judge(
        records(3), {0: GOOD, 1: GOOD, 2: GOOD, 3: BAD}, recipe=BASE.recipe, step=BASE.step
    )
    assert no_record.verdict is Verdict.INCONCLUSIVE
    assert "no precondition record from ranks [3]" in no_record.reason
    no_digest = judge(records(4), {0: GOOD, 1: GOOD, 2: BAD}, recipe=BASE.recipe, step=BASE.step)
    assert no_digest.verdict is Verdict.INCONCLUSIVE
    assert "no output digest from ranks [3]" in no_digest.reason


def test_judge_rejects_malformed_inputs() -> None:
    with pytest.raises(ValueError, match="at least one"):
        judge({}, {}, recipe="r", step=0)
    with pytest.raises(ValueError, match="recipe"):
        judge(records(2), {0: GOOD, 1: GOOD}, recipe="", step=0)
    with pytest.raises(TypeError, match="Precondition"):
        judge({0: BASE, 1: BASE.to_dict()}, {0: GOOD, 1: GOOD}, recipe=BASE.recipe, step=BASE.step)  # type: ignore[dict-item]


def test_json_round_trip() -> None:
    text = BASE.to_json()
    assert Precondition.from_json(text) == BASE
    data = json.loads(text)
    assert data["shapes"] == [[4, 16], [4]]
    assert Precondition.from_dict(data) == BASE
    assert Precondition.from_dict(BASE.to_dict()) == BASE


def test_shapes_given_as_lists_equal_shapes_given_as_tuples() -> None:
    as_lists = dataclasses.replace(BASE, shapes=[[4, 16], [4]])  # type: ignore[arg-type]
    assert as_lists == BASE
    assert check_preconditions({0: BASE, 1: as_lists}) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"step": -1}, "step"),
        ({"step": True}, "step"),
        ({"recipe": ""}, "recipe"),
        ({"input_digest": ""}, "input_digest"),
        ({"rng_digest": None}, "rng_digest"),
        ({"param_digest": 3}, "param_digest"),
        ({"shapes": ((4, -1),)}, "shapes"),
        ({"shapes": ((4, 1.5),)}, "shapes"),
        ({"shapes": 5}, "shapes"),
    ],
)
def test_invalid_records_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **change)
    with pytest.raises(EvidenceError):
        Precondition.from_dict({**BASE.to_dict(), **change})


@pytest.mark.parametrize(
    "data",
    [
        {k: v for k, v in BASE.to_dict().items() if k != "rng_digest"},
        {**BASE.to_dict(), "extra": 1},
        {**BASE.to_dict(), "shapes": "4x16"},
        {**BASE.to_dict(), "shapes": [4, 16]},
        [],
    ],
    ids=["missing-key", "unknown-key", "shapes-string", "shapes-flat", "not-an-object"],
)
def test_malformed_dicts_raise_evidence_error(data: Any) -> None:
    with pytest.raises(EvidenceError):
        Precondition.from_dict(data)


def test_bad_json_raises_evidence_error() -> None:
    with pytest.raises(EvidenceError):
        Precondition.from_json("{not json")
