"""GPU tier: Megatron Core's own training path under gemscout — ``DistributedDataParallel``, the
``DistributedOptimizer`` through ``get_megatron_optimizer`` (a MegatronOptimizer, not a torch optimizer: gemscout's
``MegatronOptimizerView``) and the ``get_forward_backward_func()`` schedule (``qualification.programs.megatron_gpu_rank``).

A run killed after step 4 and relaunched resumes at step 4 and ends bitwise equal to the uninterrupted run: model,
this rank's optimizer shard (fp32 main parameters and Adam state) and Megatron's RNG tracker streams.

Skipped, with the reason, without CUDA or megatron-core. One rank per GPU (NCCL), up to 2. The same path runs on CPU
under a test-only shim of Megatron's CUDA calls in tests/distributed/test_megatron_loop.py (with SCOUT, DP=3 and PP=2).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from qualification.launch import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)"),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None,
        reason="megatron-core is not installed (pip install -e '.[megatron]')",
    ),
]


@pytest.mark.timeout(900)
def test_distributed_optimizer_killed_after_step_4_recovers_bitwise(tmp_path: Path) -> None:
    world = min(torch.cuda.device_count(), 2)
    argv = ["-m", "qualification.programs.megatron_gpu_rank", "--steps", "6"]
    ckpt = ["--ckpt", str(tmp_path / "ckpt")]
    kill = ["--kill-rank", str(world - 1), "--kill-step", "4"]
    for attempt, (out, extra, ok) in enumerate(
        [("base", [], True), ("run", ckpt + kill, False), ("run", ckpt, True)]
    ):
        res = launch(
            argv + ["--out", str(tmp_path / out)] + extra,
            world_size=world,
            timeout_s=400,
            log_dir=tmp_path / "logs" / out,
            attempt=attempt,
        )
        assert res.ok == ok, res
    for r in range(world):
        base = json.loads((tmp_path / "base" / f"rank{r}.json").read_text())
        run = json.loads((tmp_path / "run" / f"rank{r}.json").read_text())
        assert run["resume_step"] == 4 and run["decision"]["mode"] == "restore", run["decision"]
        assert (run["state_digest"], run["losses"]) == (base["state_digest"], base["losses"])
