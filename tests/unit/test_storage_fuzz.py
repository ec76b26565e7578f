"""Seeded structural fuzzing of everything a checkpoint folder holds, built with gemscout's own writers: checkpoint
headers (rewritten with their header digest recomputed, as a forger would, and byte-level damage), trust ledgers,
durable sidecars and fault logs. Every mutant must end as gemscout's own error or a load that is safe to use — the
header's data identical to what the header declares and decodable, the ledger's fields well typed, only valid
reports — and never hang: each case runs under a 5 s alarm. A few hundred mutants, well under a minute."""

from __future__ import annotations

import json
import random
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from storage_corpus import RUN, build, dumps, header_doc, mutate, rewrite_header, state

from gemscout.config import TrustState
from gemscout.errors import GemscoutError
from gemscout.faultlog import FILE_NAME, read_reports
from gemscout.gemini import store
from gemscout.gemini.durable import SIDECAR, DurableTier
from gemscout.gemini.durable.keys import tensor_entries
from gemscout.gemini.lifecycle import TrustLedger
from gemscout.inventory import inventory
from gemscout.reports import FaultReport
from gemscout.state.codec import decode

SEED = 15


class Hang(Exception):
    pass


@contextmanager
def deadline(seconds: int, what: str) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"{what} ran past {seconds}s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b or (a != a and b != b)


def _check_header_mutant(path: Path, original: dict[str, Any]) -> str:
    try:
        parsed, data = store.read_verified(path)
    except GemscoutError:
        return "refused"
    # Accepted: it is structurally sound, so every consumer can use it without an error that is not gemscout's.
    views = parsed.layout.views(data)
    for view, entry in zip(views, parsed.layout.entries, strict=True):
        assert (
            tuple(view.shape) == entry.shape and view.numel() * view.element_size() == entry.nbytes
        )
    decoded = decode(parsed.skeleton, views)
    try:
        tensor_entries(parsed.skeleton, 0)
    except GemscoutError:
        pass
    return (
        "identical" if _same(decoded, original) else "accepted"
    )  # unkeyed: a forger may change what it declares


@pytest.mark.timeout(120)
def test_structural_mutants_end_as_gemscout_errors_or_safe_loads(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    ckpt = build(tmp_path)
    rank0 = store.RankPaths.of(ckpt, node=0, rank=0)
    target = store.step_file(rank0.own, 2)
    pristine_file = target.read_bytes()
    doc = header_doc(target)
    outcomes: dict[str, int] = {}
    for i in range(220):  # headers: structural mutants with the header digest recomputed
        target.write_bytes(pristine_file)
        with deadline(5, f"header mutant {i}"):
            try:
                rewrite_header(target, mutate(doc, rng))
            except (ValueError, TypeError, RecursionError, OverflowError):
                continue  # the mutant cannot even be serialized: not a file anyone could write
            got = _check_header_mutant(target, state(2, 0))
        outcomes[got] = outcomes.get(got, 0) + 1
    for i in range(
        60
    ):  # byte-level damage without a recomputed digest: always refused or identical
        raw = bytearray(pristine_file)
        op = rng.randrange(3)
        if op == 0:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif op == 1:
            del raw[rng.randrange(len(raw)) :]
        else:
            raw += bytes(rng.randrange(1, 200))
        target.write_bytes(bytes(raw))
        with deadline(5, f"byte mutant {i}"):
            got = _check_header_mutant(target, state(2, 0))
        assert got in ("refused", "identical"), (i, op, got)
    target.write_bytes(pristine_file)
    print("header outcomes", outcomes)
    assert outcomes.get("refused", 0) > 100, outcomes

    ledger_doc = json.loads(rank0.status.read_text())
    for i in range(80):  # trust ledgers: never raises; what loads is well typed
        rank0.status.write_text(dumps(mutate(ledger_doc, rng), rng))
        with deadline(5, f"ledger mutant {i}"):
            ledger = TrustLedger.load(rank0.status)
        assert all(
            type(s) is int and s >= 0 and isinstance(st, TrustState)
            for s, st in ledger.states.items()
        )
        assert all(type(n) is int and n >= 0 for n in ledger.attempts.values())
        assert ledger.last_decision is None or isinstance(ledger.last_decision, dict)

    tier = DurableTier(tmp_path / "durable", run_id="storage-test")
    sidecar_path = tier.path(4) / SIDECAR
    sidecar = json.loads(sidecar_path.read_text())
    refused = 0
    for i in range(80):  # durable sidecars: IntegrityError or a sidecar that verifies
        sidecar_path.write_text(dumps(mutate(sidecar, rng), rng))
        with deadline(5, f"sidecar mutant {i}"):
            try:
                tier.verify(4)
            except GemscoutError:
                refused += 1
    assert refused > 40

    log_path = rank0.root / FILE_NAME
    line = json.loads(log_path.read_text().splitlines()[0])
    for i in range(80):  # fault logs: only valid reports come back
        log_path.write_text(json.dumps(line) + "\n" + dumps(mutate(line, rng), rng) + "\n")
        with deadline(5, f"fault log mutant {i}"):
            reports = read_reports(rank0.root)
        assert 1 <= len(reports) <= 2
        for r in reports:
            FaultReport.from_dict({k: v for k, v in r.items() if k != "reported_by"})

    with deadline(10, "inventory"):  # and the whole folder, as inspect reads it, after all that
        inv = inventory(ckpt, durable_directory=tmp_path / "durable", verify=True)
    assert inv.run_id == RUN and inv.decision.step is not None
