"""Open Inference Protocol v2 tensors to model items, and outputs to tensors. Pure: no Flask.

A request body is a JSON header, optionally followed by the binary tensor data
extension's raw bytes: the header's length is then in the
``Inference-Header-Content-Length`` request header, and each input that has a
``binary_data_size`` parameter takes that many bytes, in input order. FP32
data is little-endian float32 in row-major order; BYTES data is each element
as a little-endian uint32 length followed by its bytes. Responses mirror this.

The served model has one input and one output. A text model takes BYTES of
shape [-1]; a rerank model BYTES of shape [-1, 2], a (query, document) row per
item; a vector or tensor model FP32 of shape [-1, *item_shape]; an image
model BYTES of shape [-1], each element an encoded file (as binary data) or
its base64 (as JSON, whose BYTES elements are strings). Every item
still passes ``model.prepare`` (service.http.payload.prepare_items), so the
checks and limits are those of /predict. A classifier's or a fill-mask
model's outputs are structured (labels and scores, fills): each comes back as
one BYTES element holding the JSON that /predict gives for it.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from service.errors import BadRequest, ModelError, json_type
from service.http.payload import check_count, load_json, prepare_items
from service.models.base import CLASSIFICATION, FILL_MASK, Model, Outputs, task_of

HEADER_LENGTH = "Inference-Header-Content-Length"
INPUT_NAME = "input"
OUTPUT_NAME = "output"
# The one version of the one model; the protocol names versions by strings.
VERSION = "1"
EXTENSIONS = ("binary_tensor_data",)

_LENGTH = re.compile(r"[0-9]{1,12}", re.ASCII)
_UINT32 = struct.Struct("<I")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    # -1 for a dimension of any size; None: any rank of at least two.
    shape: tuple[int, ...] | None

    def describe(self) -> dict[str, Any]:
        shape = list(self.shape) if self.shape is not None else [-1, -1]
        return {"name": self.name, "datatype": self.datatype, "shape": shape}


def input_spec(model: Model) -> TensorSpec | None:
    """The model's input tensor, or None for items of a kind the protocol cannot carry."""
    if model.item_kind in ("text", "image"):
        return TensorSpec(INPUT_NAME, "BYTES", (-1,))
    if model.item_kind == "text-pair":
        return TensorSpec(INPUT_NAME, "BYTES", (-1, 2))
    if model.item_kind in ("vector", "tensor"):
        shape = (-1, *model.item_shape) if model.item_shape is not None else None
        return TensorSpec(INPUT_NAME, "FP32", shape)
    return None


# Tasks whose outputs are JSON documents rather than numbers: one BYTES element each.
STRUCTURED_TASKS = (CLASSIFICATION, FILL_MASK)


def output_spec(model: Model) -> TensorSpec:
    if task_of(model) in STRUCTURED_TASKS:
        return TensorSpec(OUTPUT_NAME, "BYTES", (-1,))
    declared = getattr(model, "output_shape", None)
    if declared is not None:
        return TensorSpec(OUTPUT_NAME, "FP32", (-1, *declared))
    if model.item_kind == "text" and model.item_shape is not None:
        # A text model's item_shape describes what it returns (minilm: 384 floats).
        return TensorSpec(OUTPUT_NAME, "FP32", (-1, *model.item_shape))
    return TensorSpec(OUTPUT_NAME, "FP32", None)


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    # The one input's header entry, and its binary bytes if it came as binary data.
    tensor: dict[str, Any]
    binary: memoryview | None
    # Whether the output goes back as binary data.
    binary_output: bool


def parse_request(body: bytes, header_length: str | None, spec: TensorSpec) -> InferRequest:
    """The request's header and its input's bytes; raises BadRequest naming the problem."""
    view = memoryview(body)
    if header_length is None:
        header, rest = view, view[len(view) :]
    else:
        if not _LENGTH.fullmatch(header_length.strip()) or int(header_length) > len(body):
            raise BadRequest(
                f"{HEADER_LENGTH} must be the JSON header's length in bytes, at most the body's "
                f"{len(body)} bytes, got {header_length[:40]!r}"
            )
        header, rest = view[: int(header_length)], view[int(header_length) :]
    try:
        document = load_json(header, '{"inputs": [{"name", "datatype", "shape", "data"}]}')
    except BadRequest as exc:
        if header_length is None and body:
            raise BadRequest(
                f"{exc.message}; a body with binary data needs the {HEADER_LENGTH} header"
            ) from None
        raise
    if not isinstance(document, dict):
        raise BadRequest(f"the inference request must be a JSON object, got {json_type(document)}")
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest(f'"id" must be a string, got {json_type(request_id)}')
    tensor, binary = _the_input(document.get("inputs"), rest, spec)
    return InferRequest(
        request_id, tensor, binary, _binary_output(document, _parameters(document, "request"))
    )


def _the_input(inputs: Any, rest: memoryview, spec: TensorSpec) -> tuple[dict[str, Any], memoryview | None]:
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest(f'"inputs" must be a list of input tensors; the model takes one, "{spec.name}"')
    for tensor in inputs:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise BadRequest('each of "inputs" must be an object with a "name"')
    names = [tensor["name"] for tensor in inputs]
    if names != [spec.name]:
        raise BadRequest(f'the model takes one input, "{spec.name}"; got {", ".join(map(repr, names))}')
    tensor = inputs[0]
    size = _parameters(tensor, f'input "{spec.name}"').get("binary_data_size")
    if size is None:
        if len(rest):
            raise BadRequest(
                f"the body holds {len(rest)} bytes of binary data, but no input has binary_data_size"
            )
        if "data" not in tensor:
            raise BadRequest(f'input "{spec.name}" has neither "data" nor a binary_data_size parameter')
        return tensor, None
    if isinstance(size, bool) or not isinstance(size, int) or size != len(rest):
        raise BadRequest(
            f'input "{spec.name}": binary_data_size is {size!r}, but the body holds {len(rest)} bytes '
            f"after the {HEADER_LENGTH} bytes of JSON"
        )
    if "data" in tensor:
        raise BadRequest(f'input "{spec.name}" has both "data" and binary data')
    return tensor, rest


def _parameters(entry: dict[str, Any], where: str) -> dict[str, Any]:
    parameters = entry.get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest(f'{where}: "parameters" must be an object, got {json_type(parameters)}')
    return parameters


def _binary_output(document: dict[str, Any], parameters: dict[str, Any]) -> bool:
    binary = parameters.get("binary_data_output", False)
    outputs = document.get("outputs")
    if outputs is None:
        return bool(binary)
    if not isinstance(outputs, list):
        raise BadRequest(f'"outputs" must be a list, got {json_type(outputs)}')
    for output in outputs:
        if not isinstance(output, dict) or output.get("name") != OUTPUT_NAME:
            name = output.get("name") if isinstance(output, dict) else output
            raise BadRequest(f'unknown output {name!r}; the model has one output, "{OUTPUT_NAME}"')
        binary = _parameters(output, f'output "{OUTPUT_NAME}"').get("binary_data", binary)
    return bool(binary)


def items(request: InferRequest, spec: TensorSpec, model: Model, max_items: int) -> list[Any]:
    """The request's input as the model's prepared items, one per row of the batch axis."""
    tensor, where = request.tensor, f'input "{spec.name}"'
    datatype = tensor.get("datatype")
    if datatype != spec.datatype:
        raise BadRequest(f"{where}: datatype must be {spec.datatype}, got {datatype!r}")
    shape = _shape(tensor.get("shape"), spec, where)
    check_count(shape[0], max_items, spec.name)
    count = math.prod(shape)
    if spec.datatype == "BYTES" and model.item_kind == "image" and request.binary is not None:
        # Encoded files, not text: prepare decodes each.
        values: list[Any] = list(_unpack_bytes(request.binary, count, where))
    elif spec.datatype == "BYTES":
        values = _texts(request, count, where)
        if len(shape) == 2:  # rows of texts: a rerank model's (query, document) pairs
            values = [values[row * shape[1] : (row + 1) * shape[1]] for row in range(shape[0])]
    else:
        rows = _numbers(request, shape, count, where)
        values = [row.tolist() for row in rows]
    return prepare_items(values, model, max_items, spec.name)


def _shape(shape: Any, spec: TensorSpec, where: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise BadRequest(f'{where}: "shape" must be a list of whole numbers, got {shape!r:.80}')
    wanted = spec.describe()["shape"]
    fits = (
        len(shape) >= 2
        if spec.shape is None
        else len(shape) == len(spec.shape)
        and all(want in (-1, got) for want, got in zip(spec.shape, shape, strict=True))
    )
    if not fits:
        raise BadRequest(f"{where}: shape must be {wanted} (-1: any size), got {shape}")
    return tuple(shape)


def _texts(request: InferRequest, count: int, where: str) -> list[str]:
    if request.binary is not None:
        raw = _unpack_bytes(request.binary, count, where)
    else:
        data = _flat(request.tensor["data"])
        if len(data) != count:
            raise BadRequest(f"{where}: its shape holds {count} elements, its data {len(data)}")
        if not all(isinstance(value, str) for value in data):
            raise BadRequest(f"{where}: BYTES data must be strings")
        return data
    texts = []
    for index, value in enumerate(raw):
        try:
            texts.append(value.decode("utf-8"))
        except UnicodeDecodeError:
            raise BadRequest(f"{where}[{index}] is not valid UTF-8 text") from None
    return texts


def _unpack_bytes(buffer: memoryview, count: int, where: str) -> list[bytes]:
    values, offset = [], 0
    while offset < len(buffer):
        if offset + 4 > len(buffer):
            raise BadRequest(f"{where}: its binary data ends inside an element's 4-byte length")
        (length,) = _UINT32.unpack_from(buffer, offset)
        offset += 4
        if offset + length > len(buffer):
            raise BadRequest(f"{where}: an element of {length} bytes runs past the end of its binary data")
        values.append(bytes(buffer[offset : offset + length]))
        offset += length
        if len(values) > count:
            break
    if len(values) != count:
        raise BadRequest(f"{where}: its shape holds {count} elements, its binary data more or fewer")
    return values


def _flat(data: Any) -> list[Any]:
    """Row-major data, given flat or nested, as one flat list."""
    if not isinstance(data, list):
        raise BadRequest(f'"data" must be a list, got {json_type(data)}')
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:  # iterative: nesting is bounded by the JSON parser, but recursion need not be
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


def _numbers(request: InferRequest, shape: tuple[int, ...], count: int, where: str) -> np.ndarray:
    if request.binary is not None:
        if len(request.binary) != count * 4:
            raise BadRequest(
                f"{where}: shape {list(shape)} of FP32 takes {count * 4} bytes, its binary data holds "
                f"{len(request.binary)}"
            )
        return np.frombuffer(request.binary, dtype="<f4").reshape(shape)
    data = _flat(request.tensor["data"])
    if len(data) != count:
        raise BadRequest(f"{where}: its shape holds {count} elements, its data {len(data)}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in data):
        raise BadRequest(f"{where}: FP32 data must be numbers")
    try:
        # float64 first: a number too large for float32 becomes inf, which prepare refuses.
        return np.asarray(data, dtype=np.float64).reshape(shape)
    except OverflowError:
        raise BadRequest(f"{where}: numbers must fit in float32") from None


def tensor_outputs(model: Model, outputs: Outputs) -> Outputs:
    """The outputs as the output tensor carries them: structured ones as their JSON text."""
    if task_of(model) in STRUCTURED_TASKS:
        return [orjson.dumps(output, option=orjson.OPT_SERIALIZE_NUMPY).decode() for output in outputs]
    return outputs


def encode_response(model_name: str, request: InferRequest, outputs: Outputs) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary data follows it."""
    tensor, raw = _output_tensor(model_name, outputs, request.binary_output)
    document: dict[str, Any] = {"model_name": model_name, "model_version": VERSION}
    if request.id is not None:
        document["id"] = request.id
    document["outputs"] = [tensor]
    header = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    if raw is None:
        return header, None
    return header + raw, len(header)


def _output_tensor(model_name: str, outputs: Outputs, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    try:
        array = np.asarray(outputs)
    except (TypeError, ValueError) as exc:
        raise _not_a_tensor(model_name) from exc
    shape = list(array.shape)
    if array.dtype.kind in "biuf":
        values = np.ascontiguousarray(array, dtype="<f4")
        tensor: dict[str, Any] = {"name": OUTPUT_NAME, "datatype": "FP32", "shape": shape}
        if binary:
            raw = values.tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            return tensor, raw
        tensor["data"] = values.ravel()
        return tensor, None
    if array.dtype.kind in "U" or (array.dtype.kind == "O" and all(isinstance(v, str) for v in array.flat)):
        texts = [str(v).encode() for v in array.flat]
        tensor = {"name": OUTPUT_NAME, "datatype": "BYTES", "shape": shape}
        if binary:
            raw = b"".join(_UINT32.pack(len(t)) + t for t in texts)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            return tensor, raw
        tensor["data"] = [str(v) for v in array.flat]
        return tensor, None
    raise _not_a_tensor(model_name)


def _not_a_tensor(model_name: str) -> ModelError:
    return ModelError(
        f"model {model_name!r} returned outputs that are not one tensor of numbers or strings, "
        "which the Open Inference Protocol cannot carry; POST /predict serves them"
    )
