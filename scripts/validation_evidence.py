#!/usr/bin/env python3
"""Verify or seal a qualification evidence bundle from a checkout, installed or not.

Same as the ``validation-evidence`` console script, e.g.::

    python scripts/validation_evidence.py verify BUNDLE --expected-commit <40-hex sha>
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qualification.evidence.cli import main  # noqa: E402  (the path above must come first)

if __name__ == "__main__":
    raise SystemExit(main())
