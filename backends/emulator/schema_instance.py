"""A minimal valid instance of a JSON schema, for forced tool calls and `response_format`.

Real runtimes constrain decoding with a grammar compiled from the schema, so whatever the model says
validates. The emulator has no model; it answers with the smallest instance it can build from the
schema: required properties only, the first `enum`/`const` value, the first `anyOf`/`oneOf` branch,
numbers clamped into their bounds, strings padded to `minLength` and cut to `maxLength`, arrays of
`minItems` items. `$ref` to `#/$defs/...` and `#/definitions/...` is followed. Not supported (the
instance may then fail validation): `pattern`, `not`, `if/then/else`, `uniqueItems` of more than one
item, `dependentRequired`. The result is deterministic for a given schema.
"""

from __future__ import annotations

from typing import Any

_MAX_DEPTH = 32
_FORMATS = {
    "date-time": "2026-01-01T00:00:00Z", "date": "2026-01-01", "time": "00:00:00Z", "email": "user@example.com",
    "uri": "https://example.com", "url": "https://example.com", "hostname": "example.com", "ipv4": "127.0.0.1",
    "ipv6": "::1", "uuid": "00000000-0000-4000-8000-000000000000",
}
_TYPE_ORDER = ("object", "string", "integer", "number", "boolean", "array", "null")


def instance(schema: Any) -> Any:
    """The minimal instance of `schema` (a JSON schema as parsed JSON)."""
    return _build(schema, schema if isinstance(schema, dict) else {}, 0)


def _resolve(ref: str, root: dict[str, Any]) -> Any:
    if not ref.startswith("#/"):
        return {}
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return {}
        node = node[part]
    return node


def _merge_all_of(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema.get("allOf") or []:
        if isinstance(part, dict) and "$ref" in part:
            part = _resolve(str(part["$ref"]), root)
        if not isinstance(part, dict):
            continue
        for key, value in part.items():
            if key == "properties" and isinstance(value, dict):
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required" and isinstance(value, list):
                merged["required"] = [*merged.get("required", []), *value]
            else:
                merged.setdefault(key, value)
    return merged


def _pick_type(schema: dict[str, Any]) -> str | None:
    t = schema.get("type")
    if isinstance(t, str):
        return t
    if isinstance(t, list) and t:
        non_null = [str(x) for x in t if x != "null"]
        ordered = sorted(non_null, key=lambda x: _TYPE_ORDER.index(x) if x in _TYPE_ORDER else len(_TYPE_ORDER))
        return ordered[0] if ordered else "null"
    if "properties" in schema or "required" in schema or "additionalProperties" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return None


def _build(schema: Any, root: dict[str, Any], depth: int) -> Any:
    if depth > _MAX_DEPTH or schema is True or not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        return _build(_resolve(str(schema["$ref"]), root), root, depth + 1)
    if "allOf" in schema:
        schema = _merge_all_of(schema, root)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            # Prefer a branch that is not just `null` (a nullable field gets a real value).
            real = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]
            return _build((real or options)[0], root, depth + 1)
    kind = _pick_type(schema)
    if kind == "object":
        return _object(schema, root, depth)
    if kind == "array":
        return _array(schema, root, depth)
    if kind == "string":
        return _string(schema)
    if kind == "integer":
        return int(_number(schema, integer=True))
    if kind == "number":
        return _number(schema, integer=False)
    if kind == "boolean":
        return True
    return None


def _object(schema: dict[str, Any], root: dict[str, Any], depth: int) -> dict[str, Any]:
    raw_props = schema.get("properties")
    props: dict[str, Any] = raw_props if isinstance(raw_props, dict) else {}
    required = [str(r) for r in schema.get("required") or [] if isinstance(r, str)]
    out: dict[str, Any] = {}
    for name in required:
        out[name] = _build(props.get(name, {}), root, depth + 1) if name in props else _extra(schema, root, depth)
    minimum = schema.get("minProperties")
    if isinstance(minimum, int):
        for name, sub in props.items():
            if len(out) >= minimum:
                break
            out.setdefault(name, _build(sub, root, depth + 1))
        # Still short (too few declared properties): invent names, unless additional ones are barred.
        if schema.get("additionalProperties") is not False:
            i = 0
            while len(out) < minimum:
                out.setdefault(f"key{i}", _extra(schema, root, depth))
                i += 1
    return out


def _extra(schema: dict[str, Any], root: dict[str, Any], depth: int) -> Any:
    extra = schema.get("additionalProperties")
    return _build(extra, root, depth + 1) if isinstance(extra, dict) else ""


def _array(schema: dict[str, Any], root: dict[str, Any], depth: int) -> list[Any]:
    raw_prefix = schema.get("prefixItems")
    prefix: list[Any] = raw_prefix if isinstance(raw_prefix, list) else []
    items = schema.get("items")
    minimum = schema.get("minItems")
    count = max(len(prefix), minimum if isinstance(minimum, int) else 0)
    out: list[Any] = []
    for i in range(count):
        sub = prefix[i] if i < len(prefix) else items if isinstance(items, dict) else {}
        out.append(_build(sub, root, depth + 1))
    return out


def _string(schema: dict[str, Any]) -> str:
    fmt = schema.get("format")
    text = _FORMATS.get(fmt, "value") if isinstance(fmt, str) else "value"
    minimum, maximum = schema.get("minLength"), schema.get("maxLength")
    if isinstance(minimum, int) and len(text) < minimum:
        text += "x" * (minimum - len(text))
    if isinstance(maximum, int) and len(text) > maximum:
        text = text[: max(0, maximum)]
    return text


def _number(schema: dict[str, Any], *, integer: bool) -> float:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    step = 1.0 if integer else 0.5
    value = 0.0
    if isinstance(lo, int | float):
        value = max(value, float(lo))
    if isinstance(xlo, int | float) and not isinstance(xlo, bool) and value <= xlo:
        value = float(xlo) + step
    if isinstance(hi, int | float):
        value = min(value, float(hi))
    if isinstance(xhi, int | float) and not isinstance(xhi, bool) and value >= xhi:
        value = float(xhi) - step
    multiple = schema.get("multipleOf")
    if isinstance(multiple, int | float) and multiple > 0:
        value = -(-value // multiple) * multiple  # round up to a multiple, staying above the minimum
    return float(int(value)) if integer else value
