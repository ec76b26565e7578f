"""``python -m qualification`` is ``qualify``."""

import sys

from qualification.cli import main

if __name__ == "__main__":
    sys.exit(main())
