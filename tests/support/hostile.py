"""Hypothesis strategies for hostile requests, shared by the in-process and end-to-end suites.

A request is (body, content type, extra headers). Bodies range from random
bytes to near-valid ``{"inputs": ...}`` documents for a 16-wide vector model,
with wrong types, odd unicode (lone surrogates included), huge numbers, NaN
tokens and nesting far past any parser's limit.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
from hypothesis import strategies as st

WIDTH = 16  # the item width of the mlp model the suites serve
LATIN1 = st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f")

leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    # Every code point, lone surrogates included: json.dumps escapes them as \\udXXX.
    | st.text(st.characters(exclude_categories=()), max_size=20)
)
json_values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=30,
)
near_valid_items = st.one_of(
    st.lists(st.floats(-1e30, 1e30) | st.integers(-(2**63), 2**64 - 1), min_size=WIDTH, max_size=WIDTH),
    st.lists(
        st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(10**40), 10**40) | leaves,
        min_size=WIDTH - 2,
        max_size=WIDTH + 2,
    ),
)


def _dumps(document: Any) -> bytes:
    # The stdlib writes NaN, Infinity and integers of any size, which a strict parser must refuse.
    return json.dumps(document, allow_nan=True).encode()


def _nested(depth: int) -> bytes:
    return b'{"inputs": [' + b"[" * depth + b"1" + b"]" * depth + b"]}"


def _long_number(digits: int) -> bytes:
    return b'{"inputs": [[' + b"9" * digits + b"]]}"


bodies = st.one_of(
    st.binary(max_size=512),
    st.builds(_dumps, json_values),
    st.builds(_dumps, st.fixed_dictionaries({"inputs": json_values})),
    st.builds(_dumps, st.fixed_dictionaries({"inputs": st.lists(json_values, max_size=10)})),
    st.builds(_dumps, st.fixed_dictionaries({"inputs": st.lists(near_valid_items, min_size=1, max_size=3)})),
    st.builds(_nested, st.integers(min_value=0, max_value=3000)),
    st.builds(_long_number, st.integers(min_value=1, max_value=6000)),
    st.sampled_from([b"", b" ", b"null", b"{}", b'{"inputs": null}', b'{"inputs": [[]]}', b"\xef\xbb\xbf{}"]),
)


def mostly(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``common`` three times in four: a header that is mostly right lets the body be tested."""
    return st.integers(0, 3).flatmap(lambda n: rare if n == 3 else common)


content_types = mostly(
    st.sampled_from(["application/json", "application/json; charset=utf-8", "APPLICATION/JSON"]),
    st.one_of(
        st.sampled_from(
            ["application/json; charset=latin-1", "text/plain", "multipart/form-data", "", "json"]
        ),
        st.text(LATIN1, max_size=40),
        st.none(),
    ),
)
# Deadlines that are either invalid (400) or too long to expire here, so a 504 never hides a bug.
timeouts = mostly(
    st.none() | st.integers(min_value=60_000, max_value=10**30).map(str),
    st.one_of(
        st.text(LATIN1, max_size=12).filter(lambda raw: not raw.strip().isdigit()),
        st.integers(max_value=0).map(str),
    ),
)
requests = st.tuples(bodies, content_types, timeouts)


def headers(content_type: str | None, timeout: str | None) -> dict[str, str]:
    found = {}
    if content_type is not None:
        found["Content-Type"] = content_type
    if timeout is not None:
        found["X-Request-Timeout-Ms"] = timeout
    return found


def is_valid(body: bytes, content_type: str | None, timeout: str | None, max_items: int) -> bool:
    """Whether the service must answer 200: a well-formed request for WIDTH-wide vectors."""
    if (content_type or "").split(";")[0].strip().lower() != "application/json":
        return False
    if timeout is not None and not (timeout.strip().isdigit() and int(timeout) > 0):
        return False
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    inputs = document.get("inputs") if isinstance(document, dict) else None
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= max_items:
        return False
    return all(_is_vector(item) for item in inputs)


def _is_vector(item: Any) -> bool:
    if not isinstance(item, list) or len(item) != WIDTH:
        return False
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in item):
        return False
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.asarray(item, dtype=np.float64).astype(np.float32)).all())


# -- image bodies, for an image model ---------------------------------------------------

IMAGE_CONTENT_TYPES = ("image/jpeg", "image/png", "image/webp")


def _image_seeds() -> list[bytes]:
    from tests.support.images import animated, bomb, photo

    return [
        photo(1, (24, 18)),
        photo(2, (20, 30), "PNG"),
        photo(3, (16, 16), "WEBP"),
        animated("PNG"),
        animated("GIF"),
        bomb(),
    ]


def _mutate(seed: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
    """``seed`` cut short at ``cut`` (a fraction in thousandths) with bytes overwritten at ``flips``."""
    data = bytearray(seed[: max(0, len(seed) * cut // 1000)])
    for position, value in flips:
        if data:
            data[position % len(data)] = value
    return bytes(data)


image_files = st.builds(
    _mutate,
    # Deferred: the seeds are made with Pillow (and the image module imports torch) on first use only.
    st.deferred(lambda: st.sampled_from(_image_seeds())),
    st.integers(0, 1000) | st.just(1000),
    st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=8),
)
image_content_types = mostly(
    st.sampled_from(IMAGE_CONTENT_TYPES),
    st.sampled_from(["image/gif", "application/octet-stream", "text/plain", "", "image/jpeg; q=1"]),
)
