"""In-process recovery from GEMINI's own memory slot must not leave the restored state aliasing that slot: after
more steps the slot still verifies and a later recovery restores the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from qualification.launch import launch


def _program(checkpoint: str, body: str) -> str:
    """A 2-rank program: the tiny LM and AdamW under ``enable_resiliency`` with ``CheckpointConfig(directory=argv[1],
    fsync=False, handle_signals=False, <checkpoint>)``, then ``body``."""
    return (
        r"""
import sys, torch, torch.distributed as dist
from datetime import timedelta
import gemscout
from gemscout.config import TrustState
from gemscout.state.layout import parse_prefix, verify_data
from qualification.workloads import build_model, lm_loss, synthetic_batch
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
model = build_model("tiny-causal-lm", seed=0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
s = gemscout.enable_resiliency(model, opt, checkpoint=gemscout.CheckpointConfig(
    directory=sys.argv[1], fsync=False, handle_signals=False, """
        + checkpoint
        + "))\n"
        + body
    )


PROGRAM = _program(
    'run_id="mem", persist=False',
    r"""
def step(i):
    x, y = synthetic_batch(seed=0, step=i, rank=rank)
    loss = lm_loss(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
for i in range(1, 4): step(i)
s.checkpointer.drain()
d = s.recover(failure_kind="test")
assert d.sources[rank] == "memory", d
ref = [t.clone() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
for i in range(4, 6): step(i)   # mutates the live optimizer state
s.checkpointer.drain()
for slot in s.checkpointer.pool.ready_slots():
    verify_data(parse_prefix(slot.prefix), slot.data)   # raises if training wrote into a sealed slot
print("OK", d.step)
s.close(); dist.barrier()
import os; os._exit(0)
""",
)


@pytest.mark.timeout(120)
def test_restore_from_memory_does_not_alias_the_slot(tmp_path: Path) -> None:
    res = launch(
        ["-c", PROGRAM, str(tmp_path / "ckpt")],
        world_size=2,
        timeout_s=90,
        log_dir=tmp_path / "logs",
    )
    log = (tmp_path / "logs" / "rank0.attempt0.log").read_text()
    assert res.ok, log
    assert "OK 3" in log


TRUST_PROGRAM = _program(
    'run_id="trust", persist_every=2',
    r"""
for i in range(1, 6):
    x, y = synthetic_batch(seed=0, step=i, rank=rank)
    loss = lm_loss(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
s.checkpointer.drain()
s.checkpointer.certify(5)
d = s.recover(failure_kind="test", min_trust=TrustState.RECOVERY_VERIFIED)
print("DECISION", d.step, d.sources[rank])
s.close(); dist.barrier()
import os; os._exit(0)
""",
)


@pytest.mark.timeout(120)
def test_a_certified_capture_that_was_never_written_is_trusted_in_memory(tmp_path: Path) -> None:
    """``persist_every=2``: step 5 lives only in memory (and its peer's replica), yet once certified it is
    RECOVERY_VERIFIED like a written step, so a recovery that demands that trust restores step 5 from memory rather
    than falling back to the written step 4."""
    res = launch(
        ["-c", TRUST_PROGRAM, str(tmp_path / "ckpt")],
        world_size=2,
        timeout_s=90,
        log_dir=tmp_path / "logs",
    )
    log = (tmp_path / "logs" / "rank0.attempt0.log").read_text()
    assert res.ok, log
    assert "DECISION 5 memory" in log, log[-2000:]
