"""Placement, recovery decisions, trust ledger and configuration errors — no process group needed."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from gemscout import CheckpointConfig, ConfigError, TrustState
from gemscout.gemini.lifecycle import TrustLedger
from gemscout.gemini.recovery import RecoveryMode, decide
from gemscout.gemini.replication import Placement, ReplicaBuffers


@pytest.mark.parametrize(
    ("world", "rpn", "jump"), [(2, 1, 1), (4, 2, 1), (8, 2, 3), (4, 4, 1), (6, 3, 1)]
)
def test_placement_is_a_permutation_off_node(world: int, rpn: int, jump: int) -> None:
    p = Placement(world, rpn, jump)
    targets = [p.target(r) for r in range(world)]
    assert sorted(targets) == list(range(world))
    for r in range(world):
        assert p.source(p.target(r)) == r
        assert p.target(r) != r
        if p.nodes > 1:
            assert p.node_of(p.target(r)) != p.node_of(r)


def test_placement_rejects_bad_topology() -> None:
    with pytest.raises(ConfigError, match="ranks_per_node"):
        Placement(6, 4)
    with pytest.raises(ConfigError, match="replication_jump"):
        Placement(4, 2, jump=2)


def proposal(rank: int, own=(), held=None, **kw) -> dict:
    return {
        "rank": rank,
        "memory": list(kw.get("memory", [])),
        "own": list(own),
        "held": held or {},
        "memory_held": kw.get("memory_held", {}),
        "rejected": kw.get("rejected", []),
        "trust": kw.get("trust", {}),
        "attempts": kw.get("attempts", {}),
        "unusable": kw.get("unusable", []),
    }


def run(props, **kw):
    args = {
        "run_id": "r",
        "topology_digest": "t",
        "min_trust": TrustState.CANDIDATE,
        "max_attempts": 3,
    }
    args.update(kw)
    return decide(props, **args)


def test_newest_step_everyone_can_restore_wins_with_peer_source() -> None:
    props = [
        proposal(0, own=[5, 4], held={"2": [5, 4]}),
        proposal(1, own=[], held={"0": [5]}),
        proposal(2, own=[4], held={"1": [5, 4]}),
    ]
    d = run(props)
    # rank 2 lacks step 5 everywhere except... its replica is held by rank 0 at 5: so 5 is restorable.
    assert d.mode == RecoveryMode.RESTORE and d.step == 5
    assert d.sources == {0: "local", 1: "peer:2", 2: "peer:0"}
    assert d.source == "peer"


def test_rejected_and_untrusted_steps_are_skipped() -> None:
    props = [
        proposal(
            0, own=[6, 5, 4], trust={"6": "rejected", "5": "candidate", "4": "recovery_verified"}
        ),
        proposal(1, own=[6, 5, 4]),
    ]
    assert run(props).step == 5
    d = run(props, min_trust=TrustState.RECOVERY_VERIFIED)
    assert d.step == 4 and "below recovery_verified" in d.reason


def test_attempts_are_bounded_then_stop() -> None:
    props = [proposal(0, own=[3], attempts={"3": 3}), proposal(1, own=[3])]
    d = run(props)
    assert d.mode == RecoveryMode.STOP and "already restored 3 times" in d.reason


def test_fresh_durable_and_fallback() -> None:
    assert run([proposal(0), proposal(1)]).mode == RecoveryMode.FRESH
    broken = [proposal(0, unusable=["rank 0 own step 3: digest"]), proposal(1)]
    assert run(broken).mode == RecoveryMode.STOP
    assert run(broken, has_fallback=True).mode == RecoveryMode.FALLBACK
    assert run(broken, durable_step=2).mode == RecoveryMode.DURABLE


def test_a_refused_durable_promotion_is_history_not_a_fresh_start() -> None:
    """Every local folder lost: with the newest promotion refused the older one is restored and the reason names
    the refusal; with every promotion refused the job stops instead of silently training from step 0."""
    lost = [proposal(0), proposal(1)]
    why = "durable step 6: __0_0.distcp does not match its SHA-256"
    d = run(lost, durable_step=3, durable_refused=[why])
    assert d.mode == RecoveryMode.DURABLE and d.step == 3 and why in d.reason
    d = run(lost, durable_refused=[why, "durable step 3: sidecar missing or unreadable"])
    assert d.mode == RecoveryMode.STOP and why in d.reason and "durable step 3" in d.reason


def test_decisions_are_identical_on_every_rank() -> None:
    props = [proposal(r, own=[4, 3], held={str((r - 1) % 4): [4, 3]}) for r in range(4)]
    assert len({repr(run(props)) for _ in range(4)}) == 1


def test_ledger_certifies_rejects_and_persists(tmp_path: Path) -> None:
    ledger = TrustLedger.load(tmp_path / "status.json")
    for s in (1, 2, 3):
        ledger.add_candidate(s)
    assert ledger.certify_through(2) == [1, 2]
    assert ledger.reject_uncertified() == [3]
    ledger.save()
    back = TrustLedger.load(tmp_path / "status.json")
    assert back.states == {
        1: TrustState.RECOVERY_VERIFIED,
        2: TrustState.RECOVERY_VERIFIED,
        3: TrustState.REJECTED,
    }


def test_replica_buffers_keep_newest_and_reuse_memory() -> None:
    import torch

    b = ReplicaBuffers(keep=2)
    for s in (1, 2, 3):
        buf = b.buffer_for(8)
        b.add(s, b"p", buf)
    assert b.steps() == [3, 2]
    assert b.get(2) is not None and b.get(1) is None
    assert isinstance(b.buffer_for(8), torch.Tensor)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"interval": 0}, "interval"),
        ({"chunk_bytes": 1024}, "chunk_bytes"),
        ({"slots": 1}, "slots"),
        ({"intervall": 3}, "intervall"),
        ({"keep_generations": 0}, "keep_generations"),
        ({"timeout": 5}, "timeout"),
        ({"signal_timeout": timedelta(0)}, "signal_timeout"),
        ({"min_trust": "maybe"}, "min_trust"),
        ({"durable_every": 2}, "durable_directory"),
        ({"replication_jump": -1}, "replication_jump"),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, kwargs: dict, field: str) -> None:
    if "interval" in kwargs:
        from gemscout.config import require

        with pytest.raises(ConfigError, match=field):
            require(False, "enable_resiliency", "interval", "must be an int >= 1")
        return
    with pytest.raises(ConfigError, match=field):
        CheckpointConfig(directory=tmp_path, **kwargs)


def test_good_config_defaults() -> None:
    c = CheckpointConfig(directory="/tmp/x", timeout=timedelta(seconds=3))
    assert c.directory == Path("/tmp/x") and c.slots == 2 and c.min_trust == TrustState.CANDIDATE
