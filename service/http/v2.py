"""Open Inference Protocol v2 (REST), as Triton, KServe and MLServer speak it.

Thin: metadata comes from the served model, and ``infer`` is the shared
batched path (service.http.inference) with the tensors of service.http.v2_codec
around it. Errors are ``{"error": message}``; a bad tensor, datatype or shape
is a 400 that names the input (service.http.shapes maps the 422 that /predict
answers for a bad item).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import Blueprint, Response, request

from service import __version__
from service.errors import ServeError
from service.http import v2_codec
from service.http.arrival import MODEL_ENVIRON_KEY
from service.http.inference import (
    Answer,
    Choose,
    Handler,
    batch_size_header,
    json_response,
    runtime,
    serve_batched,
)
from service.model_set import ModelSet
from service.models import Model

bp = Blueprint("v2", __name__, url_prefix="/v2")

SERVER_NAME = "torch-serve-batched"
PLATFORM = "pytorch"
_HEADER_LENGTH_ENVIRON_KEY = "HTTP_" + v2_codec.HEADER_LENGTH.upper().replace("-", "_")


class NotFound(ServeError):
    status = 404


@bp.get("")
def server_metadata() -> Response:
    return json_response(
        {"name": SERVER_NAME, "version": __version__, "extensions": list(v2_codec.EXTENSIONS)}
    )


@bp.get("/health/live")
def live() -> Response:
    # tritonclient reads the status alone, KServe's client the body's "live".
    return json_response({"live": True})


@bp.get("/health/ready")
def ready() -> Response:
    reason = runtime().readiness()
    if reason is not None:
        return json_response({"ready": False, "error": reason}, 503)
    return json_response({"ready": True})


@bp.get("/models/<name>")
@bp.get("/models/<name>/versions/<version>")
def model_metadata(name: str, version: str | None = None) -> Response:
    model = _served(name, version)
    spec = _input_spec(model)
    return json_response(
        {
            "name": model.name,
            "versions": [v2_codec.VERSION],
            "platform": PLATFORM,
            "inputs": [spec.describe()],
            "outputs": [v2_codec.output_spec(model).describe()],
        }
    )


@bp.get("/models/<name>/ready")
@bp.get("/models/<name>/versions/<version>/ready")
def model_ready(name: str, version: str | None = None) -> Response:
    model = _served(name, version)
    _input_spec(model)
    return json_response({"name": model.name, "ready": True})


def answer_infer(rt: ModelSet, environ: dict[str, Any], args: Mapping[str, Any]) -> Answer:
    name, version = args["name"], args.get("version")
    parsed: list[v2_codec.InferRequest] = []

    def parse(body: bytes, choose: Choose) -> list[object]:
        model = choose(name)  # the URL names the model, as in Triton: unknown is 404
        _check_version(name, version)
        spec = _input_spec(model)
        infer_request = v2_codec.parse_request(body, environ.get(_HEADER_LENGTH_ENVIRON_KEY), spec)
        parsed.append(infer_request)
        return v2_codec.items(infer_request, spec, model, rt.settings.max_items_per_request)

    done = serve_batched(rt, environ, parse)
    outputs = v2_codec.tensor_outputs(done.model, done.outputs)
    body, header_length = v2_codec.encode_response(done.model.name, parsed[0], outputs)
    if header_length is None:
        return Answer(body, "application/json", (batch_size_header(done.batch_size),))
    headers = ((v2_codec.HEADER_LENGTH, str(header_length)), batch_size_header(done.batch_size))
    return Answer(body, "application/octet-stream", headers)


# Answered by service.http.direct in a served app; see service.http.routes.DIRECT.
DIRECT: dict[str, Handler] = {"v2.infer": answer_infer}


@bp.post("/models/<name>/infer")
@bp.post("/models/<name>/versions/<version>/infer")
def infer(name: str, version: str | None = None) -> Response:
    return answer_infer(runtime(), request.environ, {"name": name, "version": version}).response()


def _served(name: str, version: str | None) -> Model:
    """The model ``name`` (and ``version``) names, once loaded; 404 if none, 503 while it loads."""
    models = runtime()
    models.require_ready()  # 503 while loading: an unnamed model's name is known once loaded
    served = models.pick(name)
    model, _ = served.require_ready()
    request.environ[MODEL_ENVIRON_KEY] = served.label
    _check_version(name, version)
    return model


def _check_version(name: str, version: str | None) -> None:
    if version is not None and version != v2_codec.VERSION:
        raise NotFound(f"model {name!r} has no version {version!r}; it serves version {v2_codec.VERSION}")


def _input_spec(model: Model) -> v2_codec.TensorSpec:
    spec = v2_codec.input_spec(model)
    if spec is None:
        raise NotFound(
            f"model {model.name!r} takes items of kind {model.item_kind!r}, which the Open Inference "
            "Protocol cannot describe; POST /predict serves it"
        )
    return spec
