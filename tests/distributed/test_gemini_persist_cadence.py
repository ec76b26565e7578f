"""The disk is a cadence: with the default ``persist_every`` (10) only the step-0 capture and every 10th capture are
written, yet a real SIGKILL of the whole job plus the loss of one node's folder (its memory tier goes with its anchor)
restores the newest step — the killed survivor from its memory tier, the lost node's rank from its peer's memory.

Two real gloo ranks, one per node; two launches (the kill, the relaunch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qualification.launch import launch

PROGRAM = r"""
import hashlib, json, os, signal, sys, torch, torch.distributed as dist
from datetime import timedelta
from pathlib import Path
import gemscout
from gemscout.gemini import store
torch.set_num_threads(1)
directory, phase = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
s = gemscout.enable_resiliency(model, opt, checkpoint=gemscout.CheckpointConfig(
    directory=directory, run_id="cadence", fsync=False, handle_signals=False))
def digest():
    h = hashlib.sha256()
    for t in list(model.state_dict().values()) + [v for st in opt.state.values() for v in st.values()]:
        if torch.is_tensor(t):
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
if phase == "first":
    for i in range(1, 14):
        torch.manual_seed(100 + i)
        model(torch.randn(4, 64)).square().mean().backward(); opt.step(); opt.zero_grad()
    ck = s.checkpointer
    ck.drain()
    held = [st for o in ck.paths.held_owners() for st in store.list_steps(ck.paths.replicas(o))]
    (directory / f"first-{rank}.json").write_text(json.dumps({
        "digest": digest(), "persist_every": ck.config.persist_every,
        "own_on_disk": store.list_steps(ck.paths.own), "held_on_disk": held,
        "in_memory": [sl.step for sl in ck.pool.ready_slots()], "frontier": ck.pool.frontier}))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)
print("RESULT", json.dumps({"step": s.resume_step,
                            "sources": {str(k): v for k, v in s.last_decision.sources.items()},
                            "equal": digest() == json.loads((directory / f"first-{rank}.json").read_text())["digest"]}),
      flush=True)
s.close(); dist.barrier()
os._exit(0)
"""


@pytest.mark.timeout(240)
def test_default_cadence_writes_every_tenth_capture_and_a_kill_with_node_loss_restores_the_newest(
    tmp_path: Path,
) -> None:
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    first = launch(
        ["-c", PROGRAM, str(ckpt), "first"],
        world_size=2,
        local_world_size=1,
        timeout_s=120,
        log_dir=logs,
    )
    assert first.returncodes == [-9, -9], (logs / "rank0.attempt0.log").read_text()
    for rank in (0, 1):
        got = json.loads((ckpt / f"first-{rank}.json").read_text())
        assert got["persist_every"] == 10
        # Step 0 (always written) and step 10; 11-13 only in memory (and the peer's memory).
        assert got["own_on_disk"] == [10, 0] and got["held_on_disk"] == [10, 0], got
        assert got["in_memory"] == [13, 12] and got["frontier"] == 13, got
    shutil.rmtree(ckpt / "node-1")  # rank 1's node: its folder, and with its anchor its memory tier
    again = launch(
        ["-c", PROGRAM, str(ckpt), "relaunch"],
        world_size=2,
        local_world_size=1,
        timeout_s=120,
        log_dir=logs,
        attempt=1,
    )
    log = [(logs / f"rank{r}.attempt1.log").read_text() for r in (0, 1)]
    assert again.ok, log
    for r, text in enumerate(log):
        res = json.loads(next(line for line in text.splitlines() if line.startswith("RESULT"))[7:])
        assert res["step"] == 13 and res["sources"] == {"0": "memory", "1": "peer:0"}, (r, res)
        assert res["equal"], (r, "restored state is not the state before the kill")
