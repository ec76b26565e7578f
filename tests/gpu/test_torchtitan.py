"""GPU tier: TorchTitan's real ``Trainer.train()`` under ``enable_resiliency`` (torchtitan==0.3.0, ``[torchtitan]``).

What runs: torchtitan's own entry point (``python -m torchtitan.train --module llama3 --config llama3_debugmodel``)
builds the trainer (FSDP2 over every GPU, its dataloader, tokenizer, LR schedule); gemscout attaches to the trainer
before the loop (``qualification.programs.torchtitan_rank``). A run killed after step 4 and relaunched resumes at
step 4 and ends bitwise equal (model shards and optimizer state) to an uninterrupted run: model parts, the
OptimizersContainer, the lr schedulers, the dataloader position and ``trainer.step`` all came back.

Skipped, with the reason, without CUDA, without torchtitan, or without torchtitan's test assets (the tokenizer and
the c4_test dataset are not in the wheel: set GEMSCOUT_TORCHTITAN_ASSETS to a torchtitan checkout; the run starts
there, so its ``./tests/assets`` paths resolve). On CPU the trainer needs seven monkeypatches (see
../shared/notes/cpu-feasibility.md §7), so the adapter's CPU coverage is tests/unit/test_adapters_megatron_titan.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from qualification.launch import launch

ASSETS = os.environ.get("GEMSCOUT_TORCHTITAN_ASSETS", "")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)"),
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason="torchtitan is not installed (pip install -e '.[torchtitan]')",
    ),
    pytest.mark.skipif(
        not (ASSETS and (Path(ASSETS) / "tests" / "assets" / "tokenizer").is_dir()),
        reason="set GEMSCOUT_TORCHTITAN_ASSETS to a torchtitan checkout (tests/assets/tokenizer)",
    ),
]

STEPS = 6


def _titan(out: Path, extra: list[str], world: int, *, ok: bool, attempt: int = 0) -> None:
    argv = [
        "-m",
        "qualification.programs.torchtitan_rank",
        "--out",
        str(out),
        *extra,
        "--",
        "--module",
        "llama3",
        "--config",
        "llama3_debugmodel",
        "--training.steps",
        str(STEPS),
        "--training.mixed-precision-param",
        "float32",
        "--debug.deterministic",
        "--debug.seed",
        "0",
        "--dump-folder",
        str(out / "dump"),
    ]
    env = {"PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.path.join(str(Path.cwd()), "src")])}
    cwd = Path.cwd()
    os.chdir(ASSETS)  # torchtitan resolves ./tests/assets from the working directory
    try:
        res = launch(
            argv, world_size=world, timeout_s=900, log_dir=out / "logs", env=env, attempt=attempt
        )
    finally:
        os.chdir(cwd)
    assert res.ok == ok, (res, out / "logs")


@pytest.mark.timeout(2400)
def test_trainer_killed_after_step_4_recovers_bitwise(tmp_path: Path) -> None:
    world = min(torch.cuda.device_count(), 2)
    ckpt = tmp_path / "ckpt"
    _titan(tmp_path / "base", [], world, ok=True)
    _titan(
        tmp_path / "run",
        ["--ckpt", str(ckpt), "--kill-rank", "0", "--kill-step", "4"],
        world,
        ok=False,
    )
    _titan(tmp_path / "run", ["--ckpt", str(ckpt)], world, ok=True, attempt=1)
    for r in range(world):
        base = json.loads((tmp_path / "base" / f"rank{r}.json").read_text())
        run = json.loads((tmp_path / "run" / f"rank{r}.json").read_text())
        assert run["resume_step"] == 4 and run["step"] == base["step"] == STEPS
        assert run["state_digest"] == base["state_digest"], f"rank {r} did not recover bitwise"
