"""Recovery verifies what it loads, not what it merely lists: the inventory reads file headers only, and a source
whose payload fails its digests when fetched is dropped by the rank that holds it, after which the ranks decide again
— the same step from the next source when one exists, else an older step. Real gloo ranks, real files; the damage is
a flipped byte in the peer's in-memory replica buffer and in its replica file on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from qualification.launch import launch

PROGRAM = r"""
import hashlib, shutil, sys, torch, torch.distributed as dist
from datetime import timedelta
import gemscout
from gemscout.gemini import store
from qualification.workloads import build_model, lm_loss, synthetic_batch
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
model = build_model("tiny-causal-lm", seed=0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
s = gemscout.enable_resiliency(model, opt, checkpoint=gemscout.CheckpointConfig(
    directory=sys.argv[1], run_id="src", fsync=False, handle_signals=False,
    persist_every=1))  # every step on disk too: the next source after a damaged in-memory replica
ck = s.checkpointer
def digest():
    h = hashlib.sha256()
    for t in list(model.state_dict().values()) + [v for st in opt.state.values() for v in st.values()]:
        if torch.is_tensor(t):
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
at = {}
for i in range(1, 4):
    x, y = synthetic_batch(seed=0, step=i, rank=rank)
    loss = lm_loss(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
    ck.drain()
    at[i] = digest()
def lose_rank_1():
    if rank == 1:
        for slot in ck.pool.ready_slots():
            slot.ready.clear()
        ck.replicas.clear()
        shutil.rmtree(ck.paths.root, ignore_errors=True)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    dist.barrier()
def flip(t):
    t[5] ^= 0xFF
# 1. The peer's in-memory replica of step 3 is damaged: its file on disk (same step) is used instead.
lose_rank_1()
if rank == 0:
    assert ck.replicas[1].steps() == [3, 2], ck.replicas[1].steps()
    flip(ck.replicas[1].get(3)[1])
d = s.recover(failure_kind="test")
assert d.step == 3 and d.sources[1] == "peer:0", d
assert "in-memory replica of rank 1 step 3" in d.reason and "digest mismatch" in d.reason, d.reason
assert digest() == at[3], "step 3 not restored bitwise"
print("CASE1 OK", flush=True)
# 2. Both copies of step 3 are damaged: step 2 from the peer's memory, every rank on step 2.
lose_rank_1()
if rank == 0:
    path = store.step_file(ck.paths.replicas(1), 3)
    raw = bytearray(path.read_bytes()); raw[store.read_header(path).data_offset + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
d = s.recover(failure_kind="test")
assert d.step == 2 and d.sources == {0: "memory", 1: "peer:0"}, d
assert "replica of rank 1 step 3" in d.reason, d.reason
assert digest() == at[2], "step 2 not restored bitwise"
print("CASE2 OK", flush=True)
s.close(); dist.barrier()
import os; os._exit(0)
"""


@pytest.mark.timeout(180)
def test_a_source_that_fails_its_digests_is_dropped_and_the_next_one_is_used(
    tmp_path: Path,
) -> None:
    res = launch(
        ["-c", PROGRAM, str(tmp_path / "ckpt")],
        world_size=2,
        timeout_s=150,
        log_dir=tmp_path / "logs",
    )
    logs = "".join((tmp_path / "logs" / f"rank{r}.attempt0.log").read_text() for r in range(2))
    assert res.ok, logs
    assert logs.count("CASE1 OK") == 2 and logs.count("CASE2 OK") == 2, logs
