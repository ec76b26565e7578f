"""Where TorchTitan runs for the harness: a separate interpreter (``.venv-tt``), never the one running ``qualify``.

TorchTitan 0.3.0 (about 2.2 GB with its dependencies) lives in its own virtualenv, created by ``make
test-torchtitan``; ``GEMSCOUT_TT_PYTHON`` points at another interpreter. The main virtualenv never imports torchtitan,
so a campaign cell cannot ask for it with a module requirement; it asks for the capability ``torchtitan_cpu``
instead, which :func:`unavailable` checks (``qualification.engine`` skips the cell with the reason). Light on purpose:
no torch import, one short subprocess per probe.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["ENV_VAR", "REQUIREMENT", "VERSION", "python", "unavailable"]

ENV_VAR = "GEMSCOUT_TT_PYTHON"
REQUIREMENT = "torchtitan_cpu"
"""The ``requires`` entry of a campaign cell that runs TorchTitan on CPU ranks."""
VERSION = "0.3.0"
_REPO = Path(__file__).resolve().parents[2]
_PROBE = "import importlib.metadata as m; print(m.version('torchtitan'))"


def python() -> str:
    """The TorchTitan interpreter: ``$GEMSCOUT_TT_PYTHON``, else the checkout's ``.venv-tt/bin/python``."""
    return os.environ.get(ENV_VAR) or str(_REPO / ".venv-tt" / "bin" / "python")


def unavailable(interpreter: str | None = None, *, timeout_s: float = 60.0) -> str | None:
    """Why ``interpreter`` (default :func:`python`) cannot run the TorchTitan CPU layer, or None when it can."""
    exe = interpreter or python()
    fix = f"create it with `make test-torchtitan` or set {ENV_VAR}"
    if not Path(exe).is_file():
        return f"no TorchTitan interpreter at {exe}; {fix}"
    try:
        probe = subprocess.run(
            [exe, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the TorchTitan interpreter {exe} did not answer ({exc}); {fix}"
    found = probe.stdout.strip() if probe.returncode == 0 else None
    if found != VERSION:
        return f"{exe} has torchtitan {found or 'not installed'}, needs {VERSION}; {fix}"
    return None
