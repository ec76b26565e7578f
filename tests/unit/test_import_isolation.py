"""Importing gemscout loads no optional framework, no NVML binding, no harness and no adapter (STYLE.md rule 2).

Checked in a fresh interpreter: the test process itself has imported the harness and may have imported frameworks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

FORBIDDEN = ("deepspeed", "megatron", "torchtitan", "pynvml", "qualification")


def _loaded_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=100, check=True
    )
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def _roots(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


def test_import_gemscout_loads_no_framework_harness_or_adapter() -> None:
    loaded = _loaded_after("import gemscout")
    assert not _roots(loaded) & set(FORBIDDEN), sorted(_roots(loaded) & set(FORBIDDEN))
    # The adapters are imported by enable_resiliency when it runs, never at package import.
    assert not {m for m in loaded if m.startswith("gemscout.adapters")}


def test_every_gemscout_module_imports_without_frameworks_or_harness() -> None:
    code = (
        "import importlib, pkgutil, gemscout\n"
        "for info in pkgutil.walk_packages(gemscout.__path__, 'gemscout.'):\n"
        "    importlib.import_module(info.name)\n"
    )
    loaded = _loaded_after(code)
    assert "gemscout.adapters.deepspeed.engine" in loaded and "gemscout.adapters.registry" in loaded
    assert not _roots(loaded) & set(FORBIDDEN), sorted(_roots(loaded) & set(FORBIDDEN))


# The qualification harness's dependencies (the `qualify` extra): the runtime imports none of them.
HARNESS_ONLY = ("pandas", "jinja2", "rich", "jsonschema", "cryptography", "psutil")


def test_the_runtime_imports_without_the_harness_dependencies_and_leaves_torch_alone() -> None:
    # sys.modules[name] = None makes `import name` raise ImportError, as if the package were not installed.
    code = (
        f"import sys\nfor name in {HARNESS_ONLY!r}:\n    sys.modules[name] = None\n"
        "import torch.distributed as dist\n"
        "before = dist.destroy_process_group\n"
        "import importlib, pkgutil, gemscout\n"
        "for info in pkgutil.walk_packages(gemscout.__path__, 'gemscout.'):\n"
        "    importlib.import_module(info.name)\n"
        "assert dist.destroy_process_group is before, 'importing gemscout replaced destroy_process_group'\n"
        "from gemscout.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gemscout "), done.stdout


def test_the_runtime_requires_torch_numpy_and_blake3_only() -> None:
    import re
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"
    ]
    names = {
        re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower() for req in project["dependencies"]
    }
    assert names == {"torch", "numpy", "blake3"}, names
    qualify = {
        re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()
        for req in project["optional-dependencies"]["qualify"]
    }
    assert set(HARNESS_ONLY) <= qualify, qualify


@pytest.mark.skipif(
    not os.environ.get("GEMSCOUT_HEAVY_TESTS"),
    reason="resolves against the package index (about 45 s): set GEMSCOUT_HEAVY_TESTS=1",
)
@pytest.mark.timeout(300)
def test_pip_would_install_none_of_the_harness_dependencies(tmp_path: Path) -> None:
    """What ``pip install .`` into a fresh venv would install (``--dry-run --report``). jinja2 is allowed: torch
    itself requires it."""
    import shutil

    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    shutil.copytree(
        root,
        src,
        ignore=shutil.ignore_patterns(".git", ".venv*", "runs", "*.egg-info", "__pycache__"),
    )
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=120)
    report = tmp_path / "report.json"
    subprocess.run(
        [
            str(tmp_path / "venv" / "bin" / "pip"),
            "install",
            "-q",
            "--dry-run",
            "--report",
            str(report),
            str(src),
        ],
        check=True,
        timeout=240,
    )
    names = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert {"gemscout", "torch", "numpy", "blake3"} <= names, names
    assert not names & (set(HARNESS_ONLY) - {"jinja2"}), sorted(names & set(HARNESS_ONLY))
