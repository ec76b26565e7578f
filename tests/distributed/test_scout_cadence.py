"""SCOUT's default cadence: with GEMINI capturing at every step (the default ``interval=1``), a default
``ScoutConfig()`` replays at every 10th step only — each of those a capture step — and an explicit
``ScoutConfig(interval=k)`` every k steps. Certification names a capture that the rotation started from, cycles ago;
GEMINI keeps only ``keep_generations`` (2) captures by default, so the steps a later certification can still name
are retained past it, and the newest certified capture stays on disk (own file and held replica) as the state a
rejection falls back to. Two real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qualification.launch import launch

RANK_PROGRAM = """
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import gemscout
from gemscout.gemini import store
from qualification.workloads import build_model, lm_loss, synthetic_batch

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
out, asked = sys.argv[1], (None if sys.argv[2] == "default" else int(sys.argv[2]))
model = DDP(build_model("tiny-causal-lm", seed=0))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
session = gemscout.enable_resiliency(
    # SCOUT's default cadence (10) meets the default disk cadence (persist_every=10) on the same captures; at
    # cadence 3 every capture is written, so the newest certified one is on disk whichever step it is.
    model, opt, checkpoint=gemscout.CheckpointConfig(directory=os.path.join(out, "ckpt"), fsync=False,
                                                     persist_every=10 if asked is None else 1),
    scout=gemscout.ScoutConfig(interval=asked))
replayed, verified = [], set()
for step in range(1, 22):
    x, y = synthetic_batch(seed=0, step=step, rank=rank)
    opt.zero_grad(set_to_none=True)
    lm_loss(model(x), y).backward()
    opt.step()
    cycle = session.scout.last_result
    if cycle is not None and cycle.step == step:
        replayed.append(step)
    verified |= {s for s, st in session.checkpointer.ledger.states.items() if st.name == "RECOVERY_VERIFIED"}
session.flush()
paths = session.checkpointer.paths
on_disk = {"own": store.list_steps(paths.own),
           "replica": [s for owner in paths.held_owners() for s in store.list_steps(paths.replicas(owner))]}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"cadence": session.scout.config.interval, "replayed": replayed,
               "verified": sorted(verified), "on_disk": on_disk, "metrics": session.metrics()}, f)
session.close()
dist.barrier()
os._exit(0)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("asked", "cadence"), [("default", 10), ("3", 3)])
def test_scout_replays_at_its_cadence_and_certifies_the_captures_before_it(
    tmp_path: Path, asked: str, cadence: int
) -> None:
    prog = tmp_path / "rank.py"
    prog.write_text(RANK_PROGRAM)
    res = launch(
        [str(prog), str(tmp_path), asked], world_size=2, timeout_s=120, log_dir=tmp_path / "logs"
    )
    assert res.ok, (tmp_path / "logs").as_posix()
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["cadence"] == cadence
        assert got["replayed"] == list(range(cadence, 22, cadence))
        # A certification names a cycle step (every recipe's last clean pass); that capture was kept on disk past
        # keep_generations=2 until then, and the newest certified capture is still there, own file and held replica:
        # it is what a rejection of the candidates would restore.
        newest = max(got["verified"])
        assert newest > 0 and newest % cadence == 0 and newest <= max(got["replayed"]), got
        assert got["on_disk"]["own"] and newest in got["on_disk"]["own"], got
        assert newest in got["on_disk"]["replica"], got
        # What the loop's logger would see: the same facts, from session.metrics().
        m = got["metrics"]
        assert (m["step"], m["gemini.captures"], m["gemini.newest_in_memory_step"]) == (
            21,
            21,
            21,
        ), m
        assert (
            m["scout.cycles"] == len(got["replayed"])
            and m["scout.last_cycle_step"] == got["replayed"][-1]
        ), m
        assert (
            m["scout.cycle_s_total"] >= m["scout.last_cycle_s"] > 0
            and m["scout.last_cycle_clean"] == 1
        ), m
        assert m["gemini.newest_verified_step"] == newest and m["gemini.rejected"] == 0, m
        assert m["gemini.newest_persisted_step"] == 21 and m["gemini.io_errors"] == 0, m
        assert m["gemini.buffer_bytes"] > 0 and m["gemini.replicated_bytes"] > 0, m
        reports = {
            k: v for k, v in m.items() if k.startswith("reports.")
        }  # one counter per FaultKind, all zero
        assert {
            f"reports.{k}"
            for k in ("sdc", "straggler", "hang", "data_stall", "checkpoint_stall", "health")
        } <= set(reports) and set(reports.values()) == {0}, m
        json.dumps(m)  # plain values, ready for any logger
