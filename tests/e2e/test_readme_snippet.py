"""The README's "Use it in a training loop" block runs as written: extracted from README.md, saved as train.py and
launched the way its first line says (torchrun, 2 gloo ranks). (A restart on the folder it leaves is what
tests/e2e/test_examples.py proves for the examples; running it twice here would double the cost.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def snippet() -> str:
    text = (ROOT / "README.md").read_text()
    found = re.search(r"## Use it in a training loop\n\n```python\n(.*?)\n```\n", text, re.S)
    assert found, "README.md has no python block under 'Use it in a training loop'"
    return found.group(1)


def torchrun(cwd: Path) -> list[str]:
    """Each rank's standard output, from a file of its own: two ranks printing to one pipe can interleave their
    lines mid-line, and a count over the shared stream then misses one."""
    logs = cwd / "logs"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--log-dir",
            str(logs),
            "--redirects",
            "1",
            "train.py",
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=150,
    )
    outs = [p.read_text() for p in sorted(logs.glob("**/stdout.log"), key=lambda p: p.parent.name)]
    assert res.returncode == 0, (
        res.stdout[-4000:] + res.stderr[-4000:] + "".join(o[-2000:] for o in outs)
    )
    return outs


@pytest.mark.timeout(200)
def test_the_readme_training_loop_runs_as_written(tmp_path: Path) -> None:
    code = snippet()
    assert code.splitlines()[0].startswith("# train.py; run: python -m torch.distributed.run")
    (tmp_path / "train.py").write_text(code)
    outs = torchrun(tmp_path)
    assert len(outs) == 2, outs
    for out in (
        outs
    ):  # 20 captures on each rank; SCOUT (every 10th step, one block per cycle) certified step 10
        assert "20 captures; newest verified step: 10" in out, out
    assert (tmp_path / "ckpt" / "run.json").exists()
