"""The GPU capture benchmark's program, dry-run on the CPU (the same code paths with pageable slots and the host copy
thread): it writes its JSON atomically with every measurement and ratio, and refuses bad input with exit 2. The GPU
figures themselves come from a run on a GPU machine (campaigns/gpu-qualification.toml)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qualification.bench import gemini_cuda


@pytest.mark.timeout(120)
def test_dry_run_writes_every_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cuda.json"
    assert (
        gemini_cuda.main(["--device", "cpu", "--sizes-mib", "2", "--reps", "1", "--out", str(out)])
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["dry_run"] is True and [s["state_mib"] for s in doc["sizes"]] == [2.0]
    size = doc["sizes"][0]
    assert set(size["ratios"]) == set(size["met"]) == set(gemini_cuda.TARGETS)
    m = size["measurements"]
    assert m["nbytes"] >= 2 * 2**20 - 64 and m["copy_s"] > 0 and 0 <= m["hidden_fraction"] <= 1
    assert "MiB: raw pinned" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.timeout(60)
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    with pytest.raises(SystemExit) as bad:
        gemini_cuda.main(["--device", "cpu", "--sizes-mib", "abc", "--out", str(out)])
    assert bad.value.code == 2
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as no_gpu:
            gemini_cuda.main(["--out", str(out)])
        assert no_gpu.value.code == 2
    out.write_text("{}")
    assert (
        gemini_cuda.main(["--device", "cpu", "--sizes-mib", "1", "--out", str(out)]) == 2
    )  # never overwrites
    assert out.read_text() == "{}"
