"""Plain values across a process boundary, as JSON with type tags.

Only exact built-in types cross (``type(v) is int``, not a subclass): a value the untrusted program
returns is rebuilt from data in the judge, so an object that overrides ``__eq__`` (the
"AlwaysEqual" hack) or any other method never reaches the test's comparison.

    None, bool, str, int (< 2**53)   as JSON
    ["I", hex]                       a larger int (no int/str digit limit applies to hex)
    ["f", float.hex()]               a float, exactly (nan, inf and -0.0 included)
    ["c", re, im]                    complex (float.hex parts)
    ["l"|"t"|"s"|"F", [items]]       list, tuple, set, frozenset
    ["d", [[k, v], ...]]             dict (insertion order kept)
    ["b"|"B", hex]                   bytes, bytearray
"""

from __future__ import annotations

from typing import Any

__all__ = ["encode", "decode", "Unsupported"]

_SMALL = 2 ** 53
_SEQ = {list: "l", tuple: "t", set: "s", frozenset: "F"}
_SEQ_BACK = {"l": list, "t": tuple, "s": set, "F": frozenset}


class Unsupported(TypeError):
    """The value holds something other than the built-in types above."""


def encode(value: Any) -> Any:
    """``value`` as JSON-ready data; raises :class:`Unsupported` (or RecursionError for a cycle)."""
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if -_SMALL < value < _SMALL else ["I", hex(value)]
    if kind is float:
        return ["f", value.hex()]
    if kind in _SEQ:
        return [_SEQ[kind], [encode(v) for v in value]]
    if kind is dict:
        return ["d", [[encode(k), encode(v)] for k, v in value.items()]]
    if kind is bytes or kind is bytearray:
        return ["b" if kind is bytes else "B", value.hex()]
    if kind is complex:
        return ["c", value.real.hex(), value.imag.hex()]
    raise Unsupported(f"a value of type {kind.__module__}.{kind.__qualname__}")


def decode(data: Any) -> Any:
    """The value :func:`encode` described; raises ValueError/TypeError on malformed data."""
    if data is None or isinstance(data, (bool, str, int)):
        return data
    if not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise ValueError(f"malformed value {str(data)[:80]}")
    tag = data[0]
    if tag == "I":
        return int(data[1], 16)
    if tag == "f":
        return float.fromhex(data[1])
    if tag in _SEQ_BACK:
        return _SEQ_BACK[tag](decode(v) for v in data[1])
    if tag == "d":
        return {decode(k): decode(v) for k, v in data[1]}
    if tag in ("b", "B"):
        return (bytes if tag == "b" else bytearray).fromhex(data[1])
    if tag == "c":
        return complex(float.fromhex(data[1]), float.fromhex(data[2]))
    raise ValueError(f"unknown value tag {tag!r}")
