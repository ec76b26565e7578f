"""Run a rank program on two real gloo ranks and check that both printed every ``CASE <name> OK`` line."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from qualification.launch import launch


def prelude(timeout_s: int) -> str:
    """The start of a rank program: imports, a gloo group with a ``timeout_s`` collective timeout, ``rank``, a
    small seeded ``model`` with an SGD-momentum ``opt``, ``train(i)`` (one seeded step) and ``digest()``."""
    return (
        f"""
import hashlib, json, os, sys, torch, torch.distributed as dist
from datetime import timedelta
import gemscout
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds={timeout_s}))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
def train(i):
    torch.manual_seed(100 + i)
    model(torch.randn(4, 8)).square().mean().backward(); opt.step(); opt.zero_grad()
"""
        + _STATE_DIGEST
    )


_STATE_DIGEST = r"""
def digest():
    # SHA-256 of every parameter, buffer and optimizer-state tensor's bytes: equal means bitwise equal.
    h = hashlib.sha256()
    for t in list(model.state_dict().values()) + [v for st in opt.state.values() for v in st.values()]:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
"""


def run_cases(program: str, tmp_path: Path, cases: Iterable[str], *, timeout_s: float = 120) -> str:
    """Launch ``program`` (``sys.argv[1]`` is a checkpoint folder under ``tmp_path``) on two ranks; assert both
    exited 0 and both printed ``CASE <c> OK`` for every case. Returns both ranks' logs."""
    res = launch(
        ["-c", program, str(tmp_path / "ckpt")],
        world_size=2,
        timeout_s=timeout_s,
        log_dir=tmp_path / "logs",
    )
    logs = "".join((tmp_path / "logs" / f"rank{r}.attempt0.log").read_text() for r in range(2))
    assert res.ok, logs
    for case in cases:
        assert logs.count(f"CASE {case} OK") == 2, logs
    return logs
