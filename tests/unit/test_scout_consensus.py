"""C3 strict-majority verdicts, checked exhaustively against an independent oracle."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping

import pytest
import torch

from gemscout.reports import FaultKind, FaultReport, Scope
from gemscout.scout.consensus import C3Result, Verdict, c3
from gemscout.scout.digests import tensor_digest

GOOD = "blake3:" + "a" * 64
BAD = "blake3:" + "b" * 64


def oracle(digests: Mapping[int, str]) -> tuple[Verdict, tuple[int, ...]]:
    """The rule as stated, written independently of the implementation: count each value by brute force."""
    values = list(digests.values())
    if all(value == values[0] for value in values):
        return (Verdict.AGREE, ()) if len(values) > 1 else (Verdict.INCONCLUSIVE, ())
    for candidate in values:
        if 2 * values.count(candidate) > len(values):
            return Verdict.ATTRIBUTED, tuple(
                sorted(r for r, v in digests.items() if v != candidate)
            )
    return Verdict.INCONCLUSIVE, ()


def set_partitions(n: int) -> Iterator[tuple[int, ...]]:
    """Every partition of n ranks into digest classes, as restricted growth strings (Bell(n) of them)."""

    def grow(prefix: tuple[int, ...], classes: int) -> Iterator[tuple[int, ...]]:
        if len(prefix) == n:
            yield prefix
            return
        for label in range(classes + 1):
            yield from grow((*prefix, label), max(classes, label + 1))

    yield from grow((0,), 1)


def check_against_oracle(labels: tuple[int, ...], ranks: tuple[int, ...] | None = None) -> None:
    ranks = ranks if ranks is not None else tuple(range(len(labels)))
    digests = {rank: f"d{label}" for rank, label in zip(ranks, labels, strict=True)}
    result = c3(digests, recipe="hidden.0", step=7)
    expected_verdict, expected_ranks = oracle(digests)
    assert (result.verdict, result.ranks) == (expected_verdict, expected_ranks), digests
    assert dict(result.digests_by_rank) == digests
    assert (result.recipe, result.step) == ("hidden.0", 7)
    if result.verdict is Verdict.INCONCLUSIVE:
        assert result.ranks == () and result.majority_digest is None and result.reason
    else:
        majority = result.majority_digest
        assert majority is not None
        assert 2 * sum(d == majority for d in digests.values()) > len(digests)
        assert all(digests[rank] != majority for rank in result.ranks)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_digest_assignment_matches_the_oracle(n: int) -> None:
    # Every function from n ranks to n digest values: all set partitions, each under every labelling.
    for labels in itertools.product(range(n), repeat=n):
        check_against_oracle(labels)


@pytest.mark.parametrize("n", [6, 7, 8])
def test_every_set_partition_matches_the_oracle(n: int) -> None:
    partitions = list(set_partitions(n))
    assert (
        len(partitions) == {6: 203, 7: 877, 8: 4140}[n]
    )  # Bell numbers: the enumeration is complete
    for labels in partitions:
        check_against_oracle(labels)


def test_rank_ids_need_not_be_contiguous() -> None:
    # DP peers of a model-parallel mesh are e.g. ranks 1, 5, 9, 13.
    for labels in itertools.product(range(3), repeat=4):
        check_against_oracle(labels, ranks=(1, 5, 9, 13))


@pytest.mark.parametrize("n", range(2, 9))
def test_one_faulty_rank_is_attributed_from_three_peers_on(n: int) -> None:
    for faulty in range(n):
        digests = {rank: BAD if rank == faulty else GOOD for rank in range(n)}
        result = c3(digests, recipe="output", step=3)
        if n == 2:
            assert result.verdict is Verdict.INCONCLUSIVE
            assert result.ranks == ()
            assert "without a culprit" in result.reason
        else:
            assert result.verdict is Verdict.ATTRIBUTED
            assert result.ranks == (faulty,)
            assert result.majority_digest == GOOD


@pytest.mark.parametrize("n", range(2, 9))
def test_all_equal_agrees(n: int) -> None:
    result = c3(dict.fromkeys(range(n), GOOD), recipe="embedding", step=0)
    assert result.verdict is Verdict.AGREE
    assert result.ranks == ()
    assert result.majority_digest == GOOD
    assert not result.outputs_disagree


@pytest.mark.parametrize(
    "labels",
    [
        (0, 0, 1, 1),
        (0, 1, 0, 1),
        (0, 0, 0, 1, 1, 1),
        (0, 0, 0, 0, 1, 1, 1, 1),
        (0, 1, 2),
        (0, 0, 1, 2),
        (0, 1, 2, 3),
    ],
)
def test_ties_and_pluralities_without_majority_are_inconclusive(labels: tuple[int, ...]) -> None:
    result = c3(
        {rank: f"d{label}" for rank, label in enumerate(labels)}, recipe="optimizer", step=1
    )
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.ranks == ()
    assert result.outputs_disagree


def test_several_culprits_sharing_a_wrong_digest_are_all_attributed() -> None:
    result = c3({0: GOOD, 1: BAD, 2: GOOD, 3: BAD, 4: GOOD}, recipe="hidden.2", step=9)
    assert result.verdict is Verdict.ATTRIBUTED
    assert result.ranks == (1, 3)


def test_a_single_peer_is_inconclusive() -> None:
    result = c3({0: GOOD}, recipe="output", step=0)
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.ranks == ()


def test_real_tensor_digests_localize_a_bit_flip() -> None:
    outputs = {rank: torch.linspace(-1, 1, 257) for rank in range(4)}
    outputs[2].view(torch.int32)[100] ^= 1  # one low mantissa bit on rank 2
    result = c3({rank: tensor_digest(t) for rank, t in outputs.items()}, recipe="hidden.0", step=5)
    assert (result.verdict, result.ranks) == (Verdict.ATTRIBUTED, (2,))


@pytest.mark.parametrize(
    ("digests", "recipe", "step", "message"),
    [
        ({}, "r", 0, "at least one"),
        ({-1: GOOD, 0: GOOD}, "r", 0, "non-negative"),
        ({True: GOOD, 0: GOOD}, "r", 0, "non-negative"),
        ({0: "", 1: GOOD}, "r", 0, "non-empty strings"),
        ({0: None, 1: GOOD}, "r", 0, "non-empty strings"),
        ({0: GOOD, 1: GOOD}, "", 0, "recipe"),
        ({0: GOOD, 1: GOOD}, "r", -1, "step"),
    ],
)
def test_malformed_inputs_raise_value_error(
    digests: dict, recipe: str, step: int, message: str
) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        c3(digests, recipe=recipe, step=step)


def test_result_is_frozen_copy_and_rejects_contradictions() -> None:
    source = {2: BAD, 0: GOOD, 1: GOOD}
    result = c3(source, recipe="r", step=0)
    source[0] = BAD  # the caller's dict is not the result's evidence
    assert result.digests_by_rank[0] == GOOD
    assert list(result.digests_by_rank) == [0, 1, 2]
    with pytest.raises(TypeError):
        result.digests_by_rank[0] = BAD  # type: ignore[index]
    with pytest.raises(AttributeError):
        result.verdict = Verdict.AGREE  # type: ignore[misc]
    hash(result)
    with pytest.raises(ValueError, match="ATTRIBUTED"):
        C3Result(verdict=Verdict.ATTRIBUTED, recipe="r", step=0)
    with pytest.raises(ValueError, match="ATTRIBUTED"):
        C3Result(verdict=Verdict.INCONCLUSIVE, recipe="r", step=0, ranks=(1,))
    with pytest.raises(ValueError, match="INCONCLUSIVE"):
        C3Result(verdict=Verdict.AGREE, recipe="r", step=0, preconditions_ok=False)


def test_to_dict_is_json() -> None:
    result = c3({0: GOOD, 1: GOOD, 2: BAD}, recipe="r", step=4)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["verdict"] == "attributed"
    assert data["ranks"] == [2]
    assert data["digests_by_rank"] == {"0": GOOD, "1": GOOD, "2": BAD}


def test_fault_report_for_each_verdict() -> None:
    attributed = c3({0: GOOD, 1: BAD, 2: GOOD}, recipe="output", step=12).fault_report(
        host="node-a"
    )
    assert attributed is not None
    assert (attributed.kind, attributed.scope, attributed.ranks) == (
        FaultKind.SDC,
        Scope.RANK,
        (1,),
    )
    assert (attributed.step, attributed.recipe, attributed.host) == (12, "output", "node-a")
    assert attributed.evidence["digests_by_rank"]["1"] == BAD
    assert FaultReport.from_json(attributed.to_json()) == attributed

    detected = c3({0: GOOD, 1: BAD}, recipe="output", step=12).fault_report()
    assert detected is not None
    assert (detected.kind, detected.scope, detected.ranks) == (
        FaultKind.SDC,
        Scope.PEER_GROUP,
        (0, 1),
    )

    assert c3({0: GOOD, 1: GOOD}, recipe="output", step=12).fault_report() is None
    assert c3({0: GOOD}, recipe="output", step=12).fault_report() is None
