"""Which slow tests run only with ``GEMSCOUT_HEAVY_TESTS=1``.

CI runs the suite on 2 cores within 30 minutes. A multi-process test whose property is also checked by a campaign
cell moves out of the default run when CI time needs it; its skip reason names the cell that still checks it, so the
skip tells the reader where the evidence comes from instead.
"""

from __future__ import annotations

import os

import pytest

ENABLED = bool(os.environ.get("GEMSCOUT_HEAVY_TESTS"))


def heavy(cells: str, campaign: str, why: str) -> pytest.MarkDecorator:
    """Skip unless ``GEMSCOUT_HEAVY_TESTS`` is set; ``cells`` (a cell id or pattern of ``qualify run <campaign>``)
    check the same property."""
    return pytest.mark.skipif(
        not ENABLED,
        reason=f"{why}: checked by {cells} (qualify run {campaign}), or set GEMSCOUT_HEAVY_TESTS=1",
    )
