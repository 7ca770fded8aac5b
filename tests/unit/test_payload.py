from __future__ import annotations

import numpy as np
import orjson
import pytest

from service.errors import BadRequest, InvalidInput, PayloadTooLarge, UnsupportedMediaType
from service.http.payload import parse_inputs, render_outputs
from service.models.mlp import MLPModel

MODEL = MLPModel(width=3, depth=1, seed=0, device="cpu")
JSON = "application/json"


def parse(body: object, content_type: str | None = JSON, max_items: int = 4) -> list[object]:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_inputs(raw, content_type, lambda name: MODEL, max_items)


def test_valid_items_are_prepared_as_float_arrays() -> None:
    items = parse({"inputs": [[1, 2, 3], [0.5, -1, 2e3]]}, "application/json; charset=utf-8")
    assert [item.tolist() for item in items] == [[1, 2, 3], [0.5, -1, 2000]]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "content_type", "error", "message"),
    [
        (
            {"inputs": [[1, 2, 3]]},
            "text/plain",
            UnsupportedMediaType,
            "Content-Type must be application/json",
        ),
        ({"inputs": [[1, 2, 3]]}, None, UnsupportedMediaType, "got none"),
        (b"", JSON, BadRequest, "body is empty"),
        (b'{"inputs": [', JSON, BadRequest, "not valid JSON"),
        ([1, 2], JSON, InvalidInput, "must be a JSON object"),
        ({"input": []}, JSON, InvalidInput, 'no "inputs" field'),
        ({"inputs": "abc"}, JSON, InvalidInput, '"inputs" must be a list, got string'),
        ({"inputs": []}, JSON, InvalidInput, '"inputs" is empty'),
        ({"inputs": [[1, 2, 3]] * 5}, JSON, PayloadTooLarge, "holds 5 items; the limit is 4"),
        (
            {"inputs": [[1, 2, 3], [1, 2]]},
            JSON,
            InvalidInput,
            r"inputs\[1\]: expected shape \[3\], got \[2\]",
        ),
        (
            {"inputs": [[1, 2, 3], "x"]},
            JSON,
            InvalidInput,
            r"inputs\[1\]: expected a list of numbers, got string",
        ),
        ({"inputs": [[1, "a", 3]]}, JSON, InvalidInput, r"inputs\[0\]: expected a rectangular list"),
        ({"inputs": [[1, 2, 1e300]]}, JSON, InvalidInput, r"inputs\[0\]: numbers must be finite"),
        ({"inputs": [None]}, JSON, InvalidInput, r"inputs\[0\]: expected a list of numbers, got null"),
    ],
)
def test_bad_bodies_raise_errors_that_name_the_problem(
    body: object, content_type: str | None, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        parse(body, content_type)


def test_deep_nesting_is_a_parse_error_not_a_crash() -> None:
    with pytest.raises(BadRequest):
        parse(b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}")


def test_outputs_render_numpy_rows_as_lists() -> None:
    body = orjson.loads(render_outputs("m", np.array([[1.5, 2.0]], dtype=np.float32)))
    assert body == {"model": "m", "outputs": [[1.5, 2.0]]}
