"""Hardware health through enable_resiliency: an injected uncorrected ECC error becomes a ``health`` FaultReport on
the rank that saw it; an informational event does not reach the callback. Real gloo ranks; the NVML source is replaced
by the injectable one (no GPU here), which is the point of the HealthSource seam."""

from __future__ import annotations

from pathlib import Path

import pytest

from qualification.launch import launch

PROGRAM = r"""
import json, os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
import gemscout
from gemscout.health import HealthEvent, HealthMonitorConfig, InjectedHealthSource
from qualification.workloads import build_model, lm_loss, synthetic_batch
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
model = build_model("tiny-causal-lm", seed=0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
source = InjectedHealthSource()
reports = []
s = gemscout.enable_resiliency(model, opt, health=HealthMonitorConfig(period=timedelta(seconds=0.05)),
                               health_sources=[source], on_fault_report=lambda r: reports.append(r.to_dict()))
if rank == 1:
    source.inject(HealthEvent(kind="temperature", device=0, value=50.0, host="host-1"))
    source.inject(HealthEvent(kind="ecc_uncorrected", device=0, value=1, total=1, host="host-1"))
for i in range(1, 4):
    x, y = synthetic_batch(seed=0, step=i, rank=rank)
    loss = lm_loss(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
deadline = time.time() + 10
while rank == 1 and not reports and time.time() < deadline:
    time.sleep(0.05)
s.close()
open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w").write(json.dumps(reports))
dist.barrier()
os._exit(0)
"""


@pytest.mark.timeout(120)
def test_health_events_become_reports_on_their_rank(tmp_path: Path) -> None:
    import json

    res = launch(
        ["-c", PROGRAM, str(tmp_path)], world_size=2, timeout_s=90, log_dir=tmp_path / "logs"
    )
    assert res.ok, (tmp_path / "logs" / "rank1.attempt0.log").read_text()
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0 == []
    assert len(r1) == 1, r1
    rep = r1[0]
    assert rep["kind"] == "health" and list(rep["ranks"]) == [1] and rep["host"] == "host-1"
    assert (
        rep["evidence"]["severity"] == "fatal"
        and rep["evidence"]["event"]["kind"] == "ecc_uncorrected"
    )
