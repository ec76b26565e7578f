"""FaultReport: valid from construction, frozen, and an exact JSON round trip."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from gemscout.errors import EvidenceError
from gemscout.reports import FaultKind, FaultReport, Scope


def make(**overrides: Any) -> FaultReport:
    fields: dict[str, Any] = {
        "kind": FaultKind.SDC,
        "scope": Scope.RANK,
        "ranks": (2,),
        "step": 40,
        "recipe": "hidden.3",
        "evidence": {
            "digests_by_rank": {"0": "blake3:aa", "2": "blake3:bb"},
            "timings_s": [0.01, 0.02],
        },
        "confirmations": 1,
        "reason": "rank 2 disagrees with the majority",
        "host": "node-b",
        "timestamp": 1_700_000_000.123456,
    }
    fields.update(overrides)
    return FaultReport(**fields)


def test_enums_hold_the_documented_values() -> None:
    assert [k.value for k in FaultKind] == [
        "sdc",
        "straggler",
        "hang",
        "data_stall",
        "checkpoint_stall",
        "health",
        "tamper",
    ]
    assert [s.value for s in Scope] == ["rank", "peer_group", "node"]


@pytest.mark.parametrize("kind", list(FaultKind))
@pytest.mark.parametrize("scope", list(Scope))
def test_json_round_trip_for_every_kind_and_scope(kind: FaultKind, scope: Scope) -> None:
    report = make(kind=kind, scope=scope, ranks=(3, 1, 3))
    text = report.to_json()
    again = FaultReport.from_json(text)
    assert again == report
    assert again.to_json() == text
    assert FaultReport.from_dict(json.loads(text)) == report
    assert again.ranks == (1, 3)  # normalized: sorted, no duplicates


def test_to_json_is_canonical_plain_json() -> None:
    report = make()
    data = json.loads(report.to_json())
    assert list(data) == sorted(data)
    assert data["kind"] == "sdc" and data["scope"] == "rank" and data["ranks"] == [2]
    assert data["version"] == 1
    assert data["evidence"]["timings_s"] == [0.01, 0.02]
    assert report.to_dict()["timestamp"] == 1_700_000_000.123456


def test_optional_fields_default_and_round_trip() -> None:
    report = FaultReport(
        kind="hang", scope="peer_group", ranks=(), step=0, reason="no progress for 60 s"
    )
    assert report.kind is FaultKind.HANG and report.scope is Scope.PEER_GROUP
    assert report.recipe is None and report.host is None and report.confirmations == 1
    assert dict(report.evidence) == {}
    assert report.timestamp > 1_600_000_000
    assert FaultReport.from_json(report.to_json()) == report


def test_report_is_frozen_and_its_evidence_is_a_private_copy() -> None:
    evidence: dict[str, Any] = {"times_s": {"1": 0.5}, "ranks": [1]}
    report = make(evidence=evidence)
    evidence["times_s"]["1"] = 99.0
    evidence["ranks"].append(7)
    assert report.evidence["times_s"]["1"] == 0.5
    assert report.evidence["ranks"] == (1,)
    with pytest.raises(TypeError):
        report.evidence["new"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        report.evidence["times_s"]["1"] = 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.step = 41  # type: ignore[misc]
    assert hash(report) == hash(
        make(evidence={"other": True})
    )  # evidence takes no part in the hash


def test_integer_evidence_keys_become_strings_at_construction() -> None:
    report = make(evidence={"times_s": {3: 0.25}})
    assert dict(report.evidence["times_s"]) == {"3": 0.25}
    assert FaultReport.from_json(report.to_json()) == report


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"kind": "meltdown"}, "kind"),
        ({"scope": "galaxy"}, "scope"),
        ({"ranks": (-1,)}, "ranks"),
        ({"ranks": (1.0,)}, "ranks"),
        ({"scope": Scope.RANK, "ranks": ()}, "ranks"),
        ({"step": -1}, "step"),
        ({"step": True}, "step"),
        ({"confirmations": 0}, "confirmations"),
        ({"reason": ""}, "reason"),
        ({"recipe": ""}, "recipe"),
        ({"host": ""}, "host"),
        ({"scope": Scope.NODE, "host": None}, "host"),
        ({"timestamp": float("nan")}, "timestamp"),
        ({"timestamp": "now"}, "timestamp"),
        ({"evidence": {"x": float("nan")}}, "evidence"),
        ({"evidence": {"x": object()}}, "evidence"),
        ({"evidence": [1, 2]}, "evidence"),
    ],
)
def test_invalid_reports_are_refused_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=f"FaultReport.{field}"):
        make(**overrides)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("ranks"),
        lambda d: d.update(extra=1),
        lambda d: d.update(version=2),
        lambda d: d.update(kind="meltdown"),
        lambda d: d.update(ranks="2"),
        lambda d: d.update(step=-4),
        lambda d: d.update(evidence={"x": float("inf")}),
    ],
    ids=["missing", "unknown", "version", "kind", "ranks-type", "step", "evidence-inf"],
)
def test_malformed_dicts_raise_evidence_error(mutate: Any) -> None:
    data = make().to_dict()
    mutate(data)
    with pytest.raises(EvidenceError):
        FaultReport.from_dict(data)


@pytest.mark.parametrize("text", ["{broken", "[]", '{"kind": "sdc"}', b"\xff\xfe"])
def test_bad_json_raises_evidence_error(text: str | bytes) -> None:
    with pytest.raises(EvidenceError):
        FaultReport.from_json(text)


def test_nan_in_json_text_is_refused() -> None:
    text = make().to_json().replace('"timestamp":1700000000.123456', '"timestamp":NaN')
    assert "NaN" in text
    with pytest.raises(EvidenceError, match="timestamp"):
        FaultReport.from_json(text)
