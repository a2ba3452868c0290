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

Decoding takes time linear in the data: a set, frozenset or dict whose elements (keys) share one
hash value more than :data:`MAX_SAME_HASH` times is refused as malformed. (Ints equal modulo
2**61 - 1 all hash alike, as can crafted floats and tuples: 30,000 of them took 20 s to rebuild
as a set, each insertion comparing with all before it.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["encode", "decode", "Unsupported"]

_SMALL = 2 ** 53
_SEQ = {list: "l", tuple: "t", set: "s", frozenset: "F"}
_SEQ_BACK = {"l": list, "t": tuple, "s": set, "F": frozenset}


MAX_SAME_HASH = 64  # elements of one hash value in one set or dict (ordinary data: one or two)


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
        items = [decode(v) for v in data[1]]
        return _SEQ_BACK[tag](_spread(items) if tag in "sF" else items)
    if tag == "d":
        pairs = [(decode(k), decode(v)) for k, v in data[1]]
        _spread([k for k, _ in pairs])
        return dict(pairs)
    if tag in ("b", "B"):
        return (bytes if tag == "b" else bytearray).fromhex(data[1])
    if tag == "c":
        return complex(float.fromhex(data[1]), float.fromhex(data[2]))
    raise ValueError(f"unknown value tag {tag!r}")


def _spread(keys: list) -> list:
    """``keys``, checked to share no hash value more than :data:`MAX_SAME_HASH` times (in linear
    time: the counts are keyed by the hash values, ints that do not collide among themselves)."""
    counts: dict[int, int] = {}
    for key in keys:
        h = hash(key)  # TypeError for an unhashable key: malformed, as set() would say
        counts[h] = counts.get(h, 0) + 1
        if counts[h] > MAX_SAME_HASH:
            raise ValueError(f"more than {MAX_SAME_HASH} elements of one hash value in a set or dict (built to "
                             "make rebuilding it slow)")
    return keys
