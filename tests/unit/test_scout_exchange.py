"""The fixed-size record rows of a SCOUT cycle (scout/exchange.py), without a process group.

What matters: a row decodes to exactly the record the JSON path would have delivered (so the verdicts cannot depend
on which path ran), and every record a row cannot carry (errors, odd digests, differing shapes) sends the cycle down
the JSON path instead of being silently simplified.
"""

from __future__ import annotations

import json

import pytest
import torch

from gemscout.scout.cycle import judge_gathered
from gemscout.scout.digests import tensor_digest
from gemscout.scout.exchange import _needs_json, decode_records, encode_records, record_row_bytes

NAMES = ["embedding", "hidden.0", "optimizer.0"]


def _digest(i: int) -> str:
    return tensor_digest(torch.tensor([float(i)]))


def _record(
    name: str, seed: int, *, shapes: list[list[int]] | None = None, **extra: object
) -> dict[str, object]:
    return {
        "error": None,
        "digest": _digest(seed),
        "replay_s": 0.001 * (seed + 1) / 3,
        "precondition": {
            "step": 7,
            "recipe": name,
            "shapes": shapes or [[2, 3], [4]],
            "input_digest": _digest(100),
            "rng_digest": _digest(101),
            "param_digest": _digest(102),
        },
        **extra,
    }


def _records(seed: int = 0, **extra: object) -> dict[str, dict[str, object]]:
    return {name: _record(name, seed + i, **extra) for i, name in enumerate(NAMES)}


@pytest.mark.timeout(30)
def test_row_decodes_to_what_json_would_deliver() -> None:
    records = _records(gather_s=0.25, collective_s=1e-9)
    row = encode_records(NAMES, 3, records, comm_s=0.125, clock=12345.678)
    assert len(row) == record_row_bytes(len(NAMES))
    decoded = decode_records(NAMES, row, records)
    via_json = json.loads(
        json.dumps(
            {"threads": 3, "records": records, "comm_s": 0.125, "clock": 12345.678},
            sort_keys=True,
        )
    )
    assert decoded == via_json
    assert not _needs_json([row, row])


@pytest.mark.timeout(30)
def test_verdicts_are_the_same_on_both_paths() -> None:
    peers = [0, 1, 2]
    by_peer = [_records(0), _records(0), _records(5)]  # rank 2 computes other numbers
    rows = [encode_records(NAMES, 1, r) for r in by_peer]
    assert not _needs_json(rows)
    binary = [decode_records(NAMES, row, by_peer[0]) for row in rows]
    textual = [json.loads(json.dumps({"threads": 1, "records": r})) for r in by_peer]
    for name in NAMES:
        fast, _ = judge_gathered(name, 7, peers, binary)
        slow, _ = judge_gathered(name, 7, peers, textual)
        assert fast == slow and fast.ranks == (2,), (name, fast)


@pytest.mark.timeout(30)
def test_what_a_row_cannot_carry_takes_the_json_path() -> None:
    healthy = encode_records(NAMES, 1, _records())
    failed = _records()
    failed["hidden.0"] = {
        "error": "RuntimeError: boom",
        "precondition": None,
        "digest": None,
        "replay_s": None,
    }
    odd = _records()
    odd["embedding"]["digest"] = "sha256:" + "0" * 64
    unknown = _records(extra_field=1)
    missing = {k: v for k, v in _records().items() if k != "optimizer.0"}
    for records in (failed, odd, unknown, missing):
        assert _needs_json([healthy, encode_records(NAMES, 1, records)])
    # Shapes are carried as a digest: equal digests decode to this peer's shapes, different ones need the text.
    other_shapes = {name: _record(name, i, shapes=[[9, 9]]) for i, name in enumerate(NAMES)}
    assert _needs_json([healthy, encode_records(NAMES, 1, other_shapes)])


@pytest.mark.timeout(30)
def test_no_comm_time_means_no_key() -> None:
    records = _records()
    decoded = decode_records(NAMES, encode_records(NAMES, 2, records), records)
    assert "comm_s" not in decoded and "clock" not in decoded
