"""A rank program's arguments as one frozen dataclass: its rank spec.

A cell builds the spec, writes it to a JSON file (:func:`spec_argv`) and starts each rank with ``--spec FILE``. The
rank reads it back with :func:`parse`, which checks the file against the JSON schema derived from the dataclass
(:func:`schema`): an unknown key, a wrong type, a value outside a field's choices or a missing required field ends
the rank with one line naming it and exit code 2, before any process group exists. The same fields are also flags
(``kill_rank`` is ``--kill-rank``), so a test or a person can start a rank by hand; the dataclass is the one
definition of both, and of the defaults.

Field types: ``str``, ``int``, ``float``, ``bool`` (a flag that is off by default), ``Path``, ``tuple[str, ...]`` (a
repeatable flag, a JSON array) and any of them ``| None``. Declare fields with :func:`arg`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

S = TypeVar("S")

SPEC_FLAG = "--spec"
_SCALARS: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def arg(default: Any = dataclasses.MISSING, *, help: str = "", choices: Sequence[Any] = ()) -> Any:
    """A spec field: its default (none: required), a line of help, and the values it may take (empty: any)."""
    metadata = {"help": help, "choices": tuple(choices)}
    return dataclasses.field(default=default, metadata=metadata)


def _kind(annotation: Any) -> tuple[type, bool, bool]:
    """``(base type, optional, repeated)`` of a field's resolved annotation."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            raise TypeError(f"a spec field is one type or that type | None, not {annotation!r}")
        optional, annotation = True, members[0]
        origin = typing.get_origin(annotation)
    if origin is tuple:
        item, ellipsis = typing.get_args(annotation)
        if ellipsis is not Ellipsis or item is not str:
            raise TypeError(f"a repeated spec field is tuple[str, ...], not {annotation!r}")
        return str, optional, True
    if annotation not in (*_SCALARS, Path):
        raise TypeError(f"unsupported spec field type {annotation!r}")
    return annotation, optional, False


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], type, bool, bool]]:
    hints = typing.get_type_hints(cls)
    return [(f, *_kind(hints[f.name])) for f in dataclasses.fields(cls)]


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def schema(cls: type) -> dict[str, Any]:
    """The JSON schema (draft 2020-12) a rank spec file of ``cls`` must match."""
    properties: dict[str, Any] = {}
    for f, base, optional, repeated in _fields(cls):
        item: dict[str, Any] = {"type": "string" if base is Path else _SCALARS[base]}
        if f.metadata.get("choices"):
            item["enum"] = list(f.metadata["choices"])
        prop: dict[str, Any] = {"type": "array", "items": item} if repeated else dict(item)
        if optional:
            prop = {"anyOf": [prop, {"type": "null"}]}
        if f.metadata.get("help"):
            prop["description"] = f.metadata["help"]
        if not _required(f):
            prop["default"] = _plain(f.default)
        properties[f.name] = prop
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": cls.__name__,
        "description": (cls.__doc__ or "").strip().split("\n")[0],
        "type": "object",
        "properties": properties,
        "required": [f.name for f, *_ in _fields(cls) if _required(f)],
        "additionalProperties": False,
    }


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def to_dict(spec: Any) -> dict[str, Any]:
    """The spec as JSON values (paths as strings, tuples as lists)."""
    return {f.name: _plain(getattr(spec, f.name)) for f in dataclasses.fields(spec)}


def write(spec: Any, path: Path) -> Path:
    """Write ``spec`` to ``path`` as JSON; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(spec), indent=1, sort_keys=True))
    return path


def spec_argv(spec: Any, path: Path) -> list[str]:
    """Write ``spec`` to ``path`` and return the rank's arguments that name it."""
    return [SPEC_FLAG, str(write(spec, path))]


def _from_json(cls: type[S], data: dict[str, Any]) -> S:
    values: dict[str, Any] = {}
    for f, base, _optional, repeated in _fields(cls):
        if f.name not in data:
            continue
        v = data[f.name]
        if v is not None and repeated:
            v = tuple(v)
        elif v is not None and base is Path:
            v = Path(v)
        elif v is not None and base is float:
            v = float(v)
        values[f.name] = v
    return cls(**values)


def _refuse(prog: str, message: str) -> typing.NoReturn:
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def read(cls: type[S], path: Path, prog: str = "rank") -> S:
    """The spec in ``path``, checked against :func:`schema`; a bad file ends the process with exit code 2."""
    import jsonschema

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        _refuse(prog, f"cannot read the rank spec {path}: {exc}")
    errors = sorted(
        jsonschema.Draft202012Validator(schema(cls)).iter_errors(data), key=lambda e: list(e.path)
    )
    if errors:
        where = ".".join(str(p) for p in errors[0].absolute_path) or "top level"
        _refuse(prog, f"rank spec {path} ({cls.__name__}), at {where}: {errors[0].message}")
    return _from_json(cls, data)


def _parser(cls: type, prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().split("\n")[0])
    ap.add_argument(SPEC_FLAG, type=Path, help="the rank spec file (JSON); no other flag with it")
    for f, base, _optional, repeated in _fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help", "")}
        if base is bool:
            if f.default is not False:
                raise TypeError(f"{cls.__name__}.{f.name}: a bool spec field defaults to False")
            ap.add_argument(flag, action="store_true", **kw)
            continue
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if repeated:
            ap.add_argument(flag, action="append", default=None, **kw)
            continue
        kw["type"] = base
        if not _required(f):
            kw["default"] = f.default
        ap.add_argument(flag, **kw)
    return ap


def parse(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None) -> S:
    """The rank's spec: from ``--spec FILE`` (alone), or from the flags the fields define."""
    args = list(sys.argv[1:] if argv is None else argv)
    prog = prog or Path(sys.argv[0]).stem
    if SPEC_FLAG in args or any(a.startswith(SPEC_FLAG + "=") for a in args):
        only = argparse.ArgumentParser(prog=prog)
        only.add_argument(SPEC_FLAG, type=Path, required=True)
        known, rest = only.parse_known_args(args)
        if rest:
            _refuse(
                prog, f"give the rank spec file or flags, not both (also given: {' '.join(rest)})"
            )
        return read(cls, known.spec, prog)
    ns = _parser(cls, prog).parse_args(args)
    missing = [f.name for f, *_ in _fields(cls) if _required(f) and getattr(ns, f.name) is None]
    if missing:
        _refuse(prog, "missing " + ", ".join("--" + m.replace("_", "-") for m in missing))
    values = {f.name: getattr(ns, f.name) for f, *_ in _fields(cls)}
    for f, _base, _optional, repeated in _fields(cls):
        if repeated:
            values[f.name] = tuple(values[f.name]) if values[f.name] else f.default
    return cls(**values)
