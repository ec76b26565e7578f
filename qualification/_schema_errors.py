"""Turn a jsonschema ``ValidationError`` into one line that names the offending key, and find that key in the TOML.

jsonschema's own messages name values, not keys ("'x' was unexpected"); a person fixing a campaign file needs
``matrix[1].wrld_size: unknown key (did you mean 'world_size'?)``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

from jsonschema.exceptions import ValidationError

_JSON_TYPES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "table",
    type(None): "null",
}


def key_path(parts: Iterable[Any]) -> str:
    """``["matrix", 0, "fault"]`` → ``matrix[0].fault``."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def describe_schema_error(
    error: ValidationError, root: dict[str, Any] | None = None
) -> tuple[str, str]:
    """Return ``(anchor, message)``: a one-line message that starts by naming the offending key, and the dotted key
    whose line in the source best shows the problem (the key itself; for a missing key, the table that lacks it).

    ``root`` is the whole schema, used to name the forms a ``$ref`` alternative accepts.
    """
    where = key_path(error.absolute_path)
    kind = error.validator
    if "propertyNames" in error.relative_schema_path:
        bad = key_path([*error.absolute_path, error.instance])
        return bad, f"'{bad}': key name not allowed (must match {error.validator_value})"
    if kind == "additionalProperties" and isinstance(error.instance, dict):
        allowed = sorted(error.schema.get("properties", {}))
        extras = [k for k in error.instance if k not in allowed]
        bad = key_path([*error.absolute_path, extras[0]]) if extras else where
        hint = difflib.get_close_matches(extras[0], allowed, n=1) if extras else []
        suffix = (
            f" (did you mean '{hint[0]}'?)"
            if hint
            else (f" (allowed: {', '.join(allowed)})" if allowed else "")
        )
        return bad, f"'{bad}': unknown key{suffix}"
    if kind == "required" and isinstance(error.instance, dict):
        missing = [k for k in error.validator_value if k not in error.instance]
        bad = key_path([*error.absolute_path, missing[0]]) if missing else where
        return where, f"'{bad}': missing required key"
    label = where or "(top level)"
    got = f"{_json_type(error.instance)} {_short(error.instance)}"
    if kind == "type":
        wanted = error.validator_value
        wanted_text = " or ".join(wanted) if isinstance(wanted, list) else wanted
        return where, f"'{label}': must be {wanted_text}, got {got}"
    if kind == "enum":
        choices = ", ".join(repr(c) for c in error.validator_value)
        return where, f"'{label}': must be one of {choices}, got {got}"
    if kind == "pattern":
        return where, f"'{label}': {_short(error.instance)} does not match {error.validator_value}"
    if kind in ("anyOf", "oneOf"):
        return where, f"'{label}': must be {_alternatives(error, root or {})}, got {got}"
    return where, f"'{label}': {error.message}"


def _alternatives(error: ValidationError, root: dict[str, Any]) -> str:
    """Name the accepted forms: ``integer or a list of them`` for a campaign axis, else each form's type."""
    forms = [_form(sub, root) for sub in error.validator_value]
    if len(forms) == 2 and forms[1].startswith("array of "):
        return f"{forms[0]} or a list of them"
    return " or ".join(forms)


def _form(schema: dict[str, Any], root: dict[str, Any]) -> str:
    if "$ref" in schema and schema["$ref"].startswith("#/"):
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        schema = target or schema
    kind = schema.get("type", "value")
    if kind == "array" and "items" in schema:
        return "array of " + _form(schema["items"], root)
    names = kind if isinstance(kind, list) else [kind]
    return " or ".join("table" if n == "object" else n for n in names)


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= 60 else text[:57] + "..."


def toml_line_of(text: str, json_path: Iterable[Any], where: str) -> int | None:
    """Best-effort line number of a key in the TOML source: search from the start of its table for ``key =``.

    ``where`` is the dotted key (an anchor from :func:`describe_schema_error`); its last name is searched for. The table start is
    the n-th ``[[matrix]]`` header for ``matrix[n]``, the ``[defaults]`` / ``[boundaries]`` header otherwise.
    """
    if not text or not where:
        return None
    lines = text.splitlines()
    parts = list(json_path)
    start = 0
    if parts and parts[0] == "matrix" and len(parts) > 1 and isinstance(parts[1], int):
        headers = [i for i, ln in enumerate(lines) if re.match(r"\s*\[\[\s*matrix\s*\]\]", ln)]
        if parts[1] < len(headers):
            start = headers[parts[1]]
    elif parts and isinstance(parts[0], str):
        for i, ln in enumerate(lines):
            if re.match(rf"\s*\[\s*{re.escape(parts[0])}\s*\]", ln):
                start = i
                break
    names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", where)
    if not names:
        return None
    key = names[-1]
    pattern = re.compile(rf"(^|[\s{{,])\"?{re.escape(key)}\"?\s*=|^\s*\[+\s*{re.escape(key)}\s*\]+")
    for i in range(start, len(lines)):
        if pattern.search(lines[i]):
            return i + 1
    return None
