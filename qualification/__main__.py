"""``python -m qualification`` is ``qualify``."""

from qualification.cli import app

if __name__ == "__main__":
    app(prog_name="qualify")
