"""Importing gemscout loads no optional framework, no NVML binding, no harness and no adapter (STYLE.md rule 2).

Checked in a fresh interpreter: the test process itself has imported the harness and may have imported frameworks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

FORBIDDEN = ("deepspeed", "megatron", "torchtitan", "pynvml", "qualification")


def _loaded_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=100, check=True)
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
    assert "gemscout.adapters.deepspeed" in loaded and "gemscout.adapters.detect" in loaded
    assert not _roots(loaded) & set(FORBIDDEN), sorted(_roots(loaded) & set(FORBIDDEN))
