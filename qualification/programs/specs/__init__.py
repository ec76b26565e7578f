"""Rank specs: each rank program's arguments as one frozen dataclass with a JSON schema.

:mod:`._base` holds the machinery (fields, schema, reading and writing spec files, flags); :mod:`.common` the fields
every rank shares and the lifecycle driver's contract; one module per program family holds its spec. The modules
import nothing heavier than ``pathlib``, so a cell can build a spec without importing torch.
"""

from qualification.programs.specs._base import arg, parse, read, schema, spec_argv, to_dict, write

__all__ = ["arg", "parse", "read", "schema", "spec_argv", "to_dict", "write"]
