"""Watching must not change the training numbers: DDP on 3 real gloo ranks with gemscout's out-of-band watch (its DDP
comm hook fingerprints every gradient all-reduce) trains bit for bit like DDP without it — and so does DDP with SCOUT's
job-collective timer (``ScoutConfig(job_collectives=True)``), which then holds DDP's one comm hook while the watch
rides it (every all-reduce still fingerprinted out of band, every wait timed).

Three ranks, because with two ``x / 2`` and ``x * 0.5`` agree bit for bit and a wrong scaling would go unseen. Both
models train in the same processes, on the same batches, so the comparison is exact.
"""

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

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 48))

plain, watched = DDP(build()), DDP(build())
opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, watched)]
both = sys.argv[2] == "both"
scout = gemscout.ScoutConfig(interval=1, job_collectives=True, recipes=("optimizer",)) if both else None
session = gemscout.enable_resiliency(watched, opts[1], interval=1, scout=scout,
                                     watch=gemscout.WatchConfig(insecure_dev=True, stall_threshold=timedelta(seconds=30)))
assert session.watch is not None
timer = session.scout._job_timer if both else None
for step in range(6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 48, generator=g)
    for model, opt in zip((plain, watched), opts):
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), watched.parameters()))
fingerprinted = session.watch.publisher._group_seqs.get("world", 0)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"same": same, "timed": timer is not None, "fingerprinted": fingerprinted}, f)
session.close()
dist.barrier()
os._exit(0)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["watch", "both"])
def test_watched_ddp_trains_bitwise_like_plain_ddp(tmp_path: Path, mode: str) -> None:
    program = tmp_path / "rank.py"
    program.write_text(RANK_PROGRAM)
    res = launch(
        [str(program), str(tmp_path), mode], world_size=3, timeout_s=120, log_dir=tmp_path / "logs"
    )
    assert res.ok, res
    for r in range(3):
        doc = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert doc["same"], f"rank {r}: the watched DDP model diverged from plain DDP"
        assert doc["timed"] == (mode == "both")
        # 6 steps, at least one gradient bucket each: every all-reduce was fingerprinted either way.
        assert doc["fingerprinted"] >= 6, doc
