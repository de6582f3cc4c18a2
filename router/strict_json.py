"""Request bodies parsed strictly: a JSON object in UTF-8, refusing what `json.loads` would choke on
(invalid UTF-8, nesting deep enough to recurse out, integers past Python's int() digit limit) or
accept while this API must not (duplicate keys, NaN and Infinity, floats overflowing to inf, lone
UTF-16 surrogates the tokenizer cannot encode) — each refusal naming the field, as a dotted path.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from typing import Any

# The deepest body this API defines nests 5 levels (body, messages, message, content, part); the
# limit leaves room for that and keeps json.loads, which recurses, far from Python's recursion limit.
MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 20  # every integer field fits in 64 bits (19 digits): longer ones never reach int()
JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


class BodyRefused(ValueError):
    """A body this API will not read; `param` is the dotted path of the field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, refusing what json.loads would choke on (invalid UTF-8, nesting
    deep enough to recurse out) or accept while this API must not (see `StrictJson`)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyRefused(f"the body is not valid UTF-8 (byte {exc.start}): send UTF-8 encoded JSON") from None
    if _nests_deeper(text, MAX_JSON_DEPTH):
        raise BodyRefused(f"the body nests JSON arrays and objects deeper than {MAX_JSON_DEPTH} levels: flatten it")
    strict = StrictJson()
    try:
        data = strict.loads(text)
    except json.JSONDecodeError as exc:
        raise BodyRefused(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        kind = JSON_KINDS.get(type(data), "value")
        raise BodyRefused(f"the body must be a JSON object ({{...}}), got a JSON {kind}")
    fault = strict.fault(data, check_strings=_SURROGATE_ESCAPE.search(text) is not None)
    if fault is not None:
        where, reason = fault
        raise BodyRefused(f"{where}: {reason}", where)
    return data


# A JSON string, closing quote optional so that the match never fails and backtracks: one pass, linear.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
# A \uD800-\uDFFF escape: only escapes can put a surrogate in a string decoded from valid UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _nests_deeper(text: str, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit`, by counting brackets outside strings:
    no recursion, so a body nested thousands deep costs one linear scan (json.loads would raise
    RecursionError)."""
    depth = 0
    for bracket in _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > limit:
            return True
    return False


class Refused:
    """A JSON value left in place of one this API refuses, so `StrictJson.fault` can say where it was."""

    def __init__(self, reason: str):
        self.reason = reason


class StrictJson:
    """json.loads with hooks that mark what this API refuses — duplicate keys, NaN and Infinity,
    integers too long for any field (Python's int() raises past 4300 digits), floats that overflow
    to inf — instead of raising, since json gives hooks no position and the error should name the
    field. `fault` then finds the first mark, and any lone UTF-16 surrogate (the tokenizer cannot
    encode one), with its dotted path."""

    def __init__(self) -> None:
        self.duplicates: dict[int, str] = {}  # id of an object parsed with a repeated key -> that key
        self.refused = False

    def loads(self, text: str) -> Any:
        return json.loads(
            text,
            object_pairs_hook=self._object,
            parse_int=self._int,
            parse_float=self._float,
            parse_constant=self._constant,
        )

    def _object(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        value = dict(pairs)
        if len(value) < len(pairs):
            counts = Counter(key for key, _ in pairs)
            self.duplicates[id(value)] = next(key for key, count in counts.items() if count > 1)
        return value

    def _int(self, literal: str) -> int | Refused:
        digits = len(literal.lstrip("-"))
        if digits > MAX_INT_DIGITS:
            return self._refuse(f"an integer of {digits} digits is out of range: integers here fit in 64 bits")
        return int(literal)

    def _float(self, literal: str) -> float | Refused:
        value = float(literal)
        if math.isinf(value):
            return self._refuse(f"{clip(literal)} is too large for a 64-bit float: send a finite number")
        return value

    def _constant(self, literal: str) -> Refused:
        return self._refuse(f"{literal} is not a number JSON allows: send a finite number")

    def _refuse(self, reason: str) -> Refused:
        self.refused = True
        return Refused(reason)

    def fault(self, data: Any, check_strings: bool) -> tuple[str, str] | None:
        """(dotted path, what is wrong) of the first refused value, or None."""
        if not (self.refused or self.duplicates or check_strings):
            return None
        found = self._find(data, (), check_strings)
        return (dotted(found[0]), found[1]) if found else None

    def _find(self, node: Any, path: tuple[Any, ...], check_strings: bool) -> tuple[tuple[Any, ...], str] | None:
        if isinstance(node, Refused):
            return path, node.reason
        if isinstance(node, str):
            return (path, _LONE_SURROGATE) if check_strings and _has_lone_surrogate(node) else None
        if isinstance(node, dict):
            if id(node) in self.duplicates:
                key = self.duplicates[id(node)]
                return (*path, key), f"the key {clip(key)!r} appears more than once in one object: send it once"
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            return None
        for key, value in items:
            if check_strings and isinstance(key, str) and _has_lone_surrogate(key):
                return (*path, key), _LONE_SURROGATE
            found = self._find(value, (*path, key), check_strings)
            if found:
                return found
        return None


_LONE_SURROGATE = "the string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): send valid Unicode"


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def clip(text: str, width: int = 64) -> str:
    """Text safe to echo in an error: at most `width` characters, lone surrogates escaped."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= width else text[: width - 1] + "…"


def dotted(loc: tuple[Any, ...]) -> str:
    """A field's path as `param` gives it: `messages.0.content`."""
    return ".".join(clip(str(part)) for part in loc)
