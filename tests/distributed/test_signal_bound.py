"""SIGTERM on a rank whose peer froze mid-replication ends at once, without waiting for that exchange, with its
newest capture on disk.

The case the goodput benchmark found: torchrun SIGTERMs the survivors of a dead rank and SIGKILLs them 30 s later.
A survivor's io thread sits in a replication exchange that never completes (gloo does not notice a peer that is
gone without a reset, and a frozen peer resets nothing), and its main thread waits for a free slot. Before the
bound, the handler waited out ``flush_timeout`` (60 s) for that exchange and was SIGKILLed first; with the bound it
waited ``signal_timeout`` (2 s) on every failure, which was a third of the benchmark's wasted time per failure.
Now the handler stops waiting once the io has been in one peer exchange for twice as long as the last capture's
exchange took (at least 0.1 s). The capture is sealed in memory, so the handler writes it itself.

Two real processes in one gloo group: rank 1 freezes itself with SIGSTOP after step 3; rank 0 trains on until
back-pressure stops it; the test SIGTERMs rank 0 and times its exit. ``signal_timeout`` is 20 s here, so an exit
within a few seconds shows that the handler did not wait out the bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemscout.gemini import store
from qualification.launch import free_port

PROGRAM = r"""
import json, os, signal, sys, torch, torch.distributed as dist
from datetime import timedelta
from pathlib import Path
import gemscout
from gemscout.gemini import store
torch.set_num_threads(1)
directory = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
s = gemscout.enable_resiliency(model, opt, checkpoint=gemscout.CheckpointConfig(
    directory=directory, run_id="sigbound", fsync=False, persist_every=100,
    signal_timeout=timedelta(seconds=20), timeout=timedelta(seconds=120)))
def train(i):
    torch.manual_seed(100 + i)
    model(torch.randn(4, 64)).square().mean().backward(); opt.step(); opt.zero_grad()
for i in range(1, 4):
    train(i)
s.checkpointer.drain()
dist.barrier()
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)   # frozen: its sockets stay open, it answers nothing
train(4)   # its capture seals in memory; replicating it to rank 1 never completes
(directory / "ready").write_text(json.dumps({"own": str(s.checkpointer.paths.own),
                                             "own_on_disk": store.list_steps(s.checkpointer.paths.own)}))
for i in range(5, 50):
    train(i)   # blocks in the slot pool once every slot waits on that exchange
"""


@pytest.mark.timeout(120)
def test_sigterm_with_a_frozen_peer_ends_within_signal_timeout_and_flushes(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROGRAM, str(tmp_path)],
            env={**env, "RANK": str(r), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline, "rank 0 never reached step 4"
            assert procs[0].poll() is None, procs[0].communicate()[0]
            time.sleep(0.1)
        ready = json.loads((tmp_path / "ready").read_text())
        time.sleep(2.0)  # rank 0 is now blocked: io in the exchange, main thread waiting for a slot
        assert procs[0].poll() is None, procs[0].communicate()[0]
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        out, _ = procs[0].communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    # The handler chains to the default action: the process ends by SIGTERM, as torchrun expects.
    assert procs[0].returncode == -signal.SIGTERM, out
    # signal_timeout is 20 s: the handler gave the stuck exchange up instead of waiting out the bound. 5 s covers
    # writing the capture and the interpreter's exit on a loaded 2-core machine.
    assert took < 5.0, (took, out)
    assert "stuck in an exchange with a peer" in out, out
    # persist_every=100: only step 0 was due, so only the signal's flush can have written a later step.
    assert ready["own_on_disk"] == [0], ready
    assert "flushed step" in out, out
    assert max(store.list_steps(Path(ready["own"]))) >= 4, out
