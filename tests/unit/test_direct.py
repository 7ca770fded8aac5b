"""The inference routes answered without Flask give exactly the answers Flask's views give.

Each request is sent twice to the same app: once as served (service.http.direct
answers it) and once with the direct routes turned off, so that Flask's view
for the route answers it. Status line, headers (all but the random request id)
and body must match, byte for byte, for answers and for every kind of error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from flask import Flask

from service import create_app
from service.config.settings import Settings
from service.errors import NotReady
from service.http import direct as direct_module
from service.http import routes
from service.http.access import REQUEST_ID_HEADER
from service.http.arrival import HOLD_ENVIRON_KEY
from service.http.direct import Direct
from service.runtime import EXTENSION
from tests.conftest import wait_until_ready

TOKEN = "s3cret"
JSON = {"Content-Type": "application/json"}
AUTHORIZED = {**JSON, "Authorization": f"Bearer {TOKEN}"}
SETTINGS = Settings(model="tests.support.models:quirky", max_items_per_request=4, max_body_bytes=2048)
# A text model with vectors for outputs: what /v1/embeddings and v2's tensors need.
VECTORS = SETTINGS.replace(model="tests.support.models:vectors")
V2_LENGTH = "Inference-Header-Content-Length"
VIEWS = (
    "serve.predict_batched",
    "serve.predict_naive",
    "openai.embeddings",
    "v2.infer",
    "rerank.rerank_v1",
    "rerank.rerank_v2",
    "rerank.rerank_naive",
    "tei.embed",
    "tei.rerank",
    "tei.root",
)
# A rerank answer carries its request's id: both ways are sent the same one.
RERANK_JSON = {**JSON, REQUEST_ID_HEADER: "rerank-1"}
QUERY = "which animal purrs"
DOCUMENTS = ["a cat purrs when content", "the stock market fell", "dogs bark at night"]

Case = tuple[str, dict[str, str], bytes]


def _body(document: Any) -> bytes:
    return orjson.dumps(document)


def _tensor(values: list[Any], datatype: str = "BYTES", **extra: Any) -> bytes:
    tensor = {"name": "input", "datatype": datatype, "shape": [len(values)], "data": values}
    return _body({"inputs": [tensor], **extra})


def _binary_tensor(words: list[bytes]) -> tuple[dict[str, str], bytes]:
    raw = b"".join(len(w).to_bytes(4, "little") + w for w in words)
    tensor = {
        "name": "input",
        "datatype": "BYTES",
        "shape": [len(words)],
        "parameters": {"binary_data_size": len(raw)},
    }
    header = _body({"inputs": [tensor], "parameters": {"binary_data_output": True}})
    return {V2_LENGTH: str(len(header))}, header + raw


CASES: dict[str, Case] = {
    "one text, batched": ("/predict/batched", JSON, _body({"inputs": ["hello"]})),
    "three texts, /predict": ("/predict", JSON, _body({"inputs": ["a", "bb", "ccc"]})),
    "two texts, naive": ("/predict/naive", JSON, _body({"inputs": ["a", "bb"]})),
    "json with a charset": (
        "/predict",
        {"Content-Type": "application/json; charset=utf-8"},
        _body({"inputs": ["x"]}),
    ),
    "a deadline asked for": ("/predict", {**JSON, "X-Request-Timeout-Ms": "5000"}, _body({"inputs": ["x"]})),
    "not json": ("/predict/batched", JSON, b"{not json"),
    "empty body": ("/predict/batched", JSON, b""),
    "no content type": ("/predict/batched", {}, _body({"inputs": ["x"]})),
    "text/plain": ("/predict/naive", {"Content-Type": "text/plain"}, b"hello"),
    "a list, not an object": ("/predict", JSON, _body(["x"])),
    "no inputs field": ("/predict", JSON, _body({"input": ["x"]})),
    "inputs not a list": ("/predict", JSON, _body({"inputs": "x"})),
    "no items": ("/predict", JSON, _body({"inputs": []})),
    "too many items": ("/predict/naive", JSON, _body({"inputs": ["x"] * 5})),
    "a bad item": ("/predict/batched", JSON, _body({"inputs": ["x", 5]})),
    "a body over the limit": ("/predict/batched", JSON, _body({"inputs": ["x" * 3000]})),
    "a deadline that is not a number": (
        "/predict",
        {**JSON, "X-Request-Timeout-Ms": "soon"},
        _body({"inputs": ["x"]}),
    ),
    "a deadline of zero": ("/predict", {**JSON, "X-Request-Timeout-Ms": "0"}, _body({"inputs": ["x"]})),
    "outputs holding NaN, batched": ("/predict/batched", JSON, _body({"inputs": ["nested-nan"]})),
    "outputs holding NaN, naive": ("/predict/naive", JSON, _body({"inputs": ["scalar-inf"]})),
    "out of memory": ("/predict/batched", JSON, _body({"inputs": ["oom"]})),
}

# Sent to the vectors model.
PROTOCOL_CASES: dict[str, Case] = {
    "embeddings, one text": ("/v1/embeddings", JSON, _body({"input": "hello there", "model": "vectors"})),
    "embeddings, texts in base64": (
        "/v1/embeddings",
        JSON,
        _body({"input": ["a", "b c"], "model": "vectors", "encoding_format": "base64"}),
    ),
    "embeddings, another model": ("/v1/embeddings", JSON, _body({"input": "x", "model": "gpt"})),
    "embeddings, no input": ("/v1/embeddings", JSON, _body({"model": "vectors"})),
    "embeddings, an unknown encoding": (
        "/v1/embeddings",
        JSON,
        _body({"input": "x", "model": "vectors", "encoding_format": "int8"}),
    ),
    "embeddings, too many texts": ("/v1/embeddings", JSON, _body({"input": ["x"] * 5, "model": "vectors"})),
    "embeddings, not json": ("/v1/embeddings", JSON, b"[1,"),
    "embeddings, text/plain": ("/v1/embeddings", {"Content-Type": "text/plain"}, b"x"),
    "v2, json tensors": ("/v2/models/vectors/infer", JSON, _tensor(["a", "b c"], id="req-1")),
    "v2, a version": ("/v2/models/vectors/versions/1/infer", JSON, _tensor(["a"])),
    "v2, binary tensors": ("/v2/models/vectors/infer", *_binary_tensor([b"hello", b""])),
    "v2, another model": ("/v2/models/resnet/infer", JSON, _tensor(["a"])),
    "v2, another version": ("/v2/models/vectors/versions/9/infer", JSON, _tensor(["a"])),
    "v2, a wrong datatype": ("/v2/models/vectors/infer", JSON, _tensor([1.0], "FP32")),
    "v2, a bad item": ("/v2/models/vectors/infer", JSON, _tensor([5])),
    "v2, too many items": ("/v2/models/vectors/infer", JSON, _tensor(["x"] * 5)),
    "v2, a body over the limit": ("/v2/models/vectors/infer", JSON, _tensor(["x" * 3000])),
    "v2, a header length past the body": ("/v2/models/vectors/infer", {V2_LENGTH: "9999"}, _tensor(["x"])),
    "TEI, embed": ("/embed", JSON, _body({"inputs": ["a", "b c"], "dimensions": 2})),
    "TEI, the root embeds": ("/", JSON, _body({"inputs": "hello", "normalize": False})),
    "TEI, a model named": ("/embed?model=vectors", JSON, _body({"inputs": "x"})),
    "TEI, another model": ("/embed?model=gpt", JSON, _body({"inputs": "x"})),
    "TEI, no inputs": ("/embed", JSON, _body({"inputs": []})),
    "TEI, a bad field": ("/", JSON, _body({"inputs": "x", "truncation_direction": "up"})),
    "TEI, too many texts": ("/embed", JSON, _body({"inputs": ["x"] * 5})),
    "TEI, not json": ("/embed", JSON, b"[1,"),
    "TEI, rerank on an embedder": ("/rerank", JSON, _body({"query": QUERY, "texts": DOCUMENTS})),
}


def _direct(app: Flask) -> Direct:
    """The Direct in the app's middleware chain (door, access, direct)."""
    layer: Any = app.wsgi_app
    while not isinstance(layer, Direct):
        layer = layer._app
    return layer


# Sent to a cross-encoder directory.
RERANK_CASES: dict[str, Case] = {
    "Cohere v1": ("/v1/rerank", RERANK_JSON, _body({"query": QUERY, "documents": DOCUMENTS, "top_n": 2})),
    "Cohere v2, documents returned": (
        "/v2/rerank",
        RERANK_JSON,
        _body({"query": QUERY, "documents": DOCUMENTS, "return_documents": True}),
    ),
    "batched": ("/rerank/batched", RERANK_JSON, _body({"query": QUERY, "documents": DOCUMENTS})),
    "naive": ("/rerank/naive", RERANK_JSON, _body({"query": QUERY, "documents": DOCUMENTS})),
    "Cohere, no query": ("/v2/rerank", RERANK_JSON, _body({"documents": DOCUMENTS})),
    "Cohere, no documents": ("/v1/rerank", RERANK_JSON, _body({"query": QUERY, "documents": []})),
    "Cohere, a bad top_n": (
        "/v2/rerank",
        RERANK_JSON,
        _body({"query": QUERY, "documents": DOCUMENTS, "top_n": 0}),
    ),
    "Cohere, too many documents": (
        "/v2/rerank",
        RERANK_JSON,
        _body({"query": QUERY, "documents": ["d"] * 5}),
    ),
    "Cohere, not json": ("/v2/rerank", RERANK_JSON, b"{"),
    "naive, text/plain": ("/rerank/naive", {"Content-Type": "text/plain"}, b"x"),
    "TEI": ("/rerank", JSON, _body({"query": QUERY, "texts": DOCUMENTS, "return_text": True})),
    "TEI, the root reranks": ("/", JSON, _body({"query": QUERY, "texts": DOCUMENTS})),
    "TEI, raw scores": ("/rerank", JSON, _body({"query": QUERY, "texts": DOCUMENTS, "raw_scores": True})),
    "TEI, embed on a reranker": ("/embed", JSON, _body({"inputs": "x"})),
}


@pytest.fixture(scope="module")
def reranker(model_dirs: dict[str, Path]) -> Iterator[Flask]:
    app = create_app(SETTINGS.replace(model=str(model_dirs["rerank"]), torch_threads=1))
    wait_until_ready(app)
    yield app
    app.extensions[EXTENSION].stop(timeout=10)


@pytest.fixture(scope="module")
def apps() -> Iterator[dict[str, Flask]]:
    built = {
        "open": create_app(SETTINGS),
        "guarded": create_app(SETTINGS.replace(api_token=TOKEN)),
        "vectors": create_app(VECTORS),
    }
    for app in built.values():
        wait_until_ready(app)
    yield built
    for app in built.values():
        app.extensions[EXTENSION].stop(timeout=10)


def _answer(
    app: Flask, path: str, headers: dict[str, str], body: bytes, *, direct: bool, path_info: str | None = None
) -> tuple[Any, ...]:
    """The answer as the client sees it, the hold asked of the worker, how many times Flask's views ran."""
    views = {name: app.view_functions[name] for name in VIEWS}
    calls = []

    def counted(view: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(view.__name__)
            return view(*args, **kwargs)

        return call

    layer = _direct(app)
    handlers, chain = layer._handlers, app.wsgi_app
    seen: list[dict[str, Any]] = []

    def recorded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        seen.append(environ)  # the dict the worker reads after the answer
        return chain(environ, start_response)

    app.view_functions.update({name: counted(view) for name, view in views.items()})
    app.wsgi_app = recorded  # type: ignore[method-assign]
    if not direct:
        layer._handlers = {}
    try:
        overrides = {"PATH_INFO": path_info} if path_info is not None else {}
        response = app.test_client().post(path, data=body, headers=headers, environ_overrides=overrides)
    finally:
        layer._handlers = handlers
        app.wsgi_app = chain  # type: ignore[method-assign]
        app.view_functions.update(views)
    shown = [(name, value) for name, value in response.headers if name != REQUEST_ID_HEADER]
    held = seen[0].get(HOLD_ENVIRON_KEY)
    return response.status, shown, response.data, held, len(calls)


def _both_ways(
    app: Flask,
    path: str,
    headers: dict[str, str],
    body: bytes,
    *,
    viewed: bool = True,
    model_ulps: bool = False,
    **options: Any,
) -> tuple[Any, ...]:
    """The answer, sent once each way; the two must be the same, and each way must really be taken.

    ``viewed``: whether Flask's way reaches the view (not when its token hook refuses).
    ``model_ulps``: a real model's scores may differ in their last float32 digits
    between the two calls, and nothing else may: the batcher cuts a batch by a cost
    line it fits to timed calls, so the second call can run in other sub-batch
    shapes, and a shape changes the order of a sum.
    """
    *direct, direct_views = _answer(app, path, headers, body, direct=True, **options)
    *flask, flask_views = _answer(app, path, headers, body, direct=False, **options)
    assert (direct_views, flask_views) == (0, int(viewed))
    if model_ulps and direct != flask:
        (status, shown, data, held), (f_status, f_shown, f_data, f_held) = direct, flask
        assert (status, held) == (f_status, f_held)
        # The length of the body follows its digits.
        assert [h for h in shown if h[0] != "Content-Length"] == [
            h for h in f_shown if h[0] != "Content-Length"
        ]
        _assert_close(orjson.loads(data), orjson.loads(f_data))
    else:
        assert direct == flask
    return tuple(direct)


def _assert_close(got: Any, expected: Any) -> None:
    """Equal JSON, floats to float32's precision."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys()
        for key in expected:
            _assert_close(got[key], expected[key])
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected)
        for one, other in zip(got, expected, strict=True):
            _assert_close(one, other)
    else:
        assert got == expected


@pytest.mark.parametrize("case", CASES)
def test_the_direct_answer_is_flask_s_answer(apps: dict[str, Flask], case: str) -> None:
    path, headers, body = CASES[case]
    _both_ways(apps["open"], path, headers, body)


@pytest.mark.parametrize("case", PROTOCOL_CASES)
def test_the_direct_answer_is_flask_s_answer_on_every_protocol(apps: dict[str, Flask], case: str) -> None:
    path, headers, body = PROTOCOL_CASES[case]
    _both_ways(apps["vectors"], path, headers, body)


@pytest.mark.parametrize("case", RERANK_CASES)
def test_the_direct_answer_is_flask_s_answer_on_rerank(reranker: Flask, case: str) -> None:
    path, headers, body = RERANK_CASES[case]
    _both_ways(reranker, path, headers, body, model_ulps=True)


def test_a_model_that_does_not_rerank_answers_the_rerank_routes_as_flask_does(apps: dict[str, Flask]) -> None:
    body = _body({"query": QUERY, "documents": DOCUMENTS})
    direct = _both_ways(apps["open"], "/v2/rerank", RERANK_JSON, body)
    assert direct[0] == "404 NOT FOUND"


@pytest.mark.parametrize(
    "headers",
    [
        AUTHORIZED,
        JSON,
        {**JSON, "Authorization": "Bearer wrong"},
        {**JSON, "Authorization": f"Basic {TOKEN}"},
    ],
    ids=["the token", "no token", "a wrong token", "another scheme"],
)
def test_the_token_check_answers_as_flask_s_does(apps: dict[str, Flask], headers: dict[str, str]) -> None:
    body = _body({"inputs": ["x"]})
    direct = _both_ways(apps["guarded"], "/predict/batched", headers, body, viewed=headers is AUTHORIZED)
    assert direct[0] == ("200 OK" if headers is AUTHORIZED else "401 UNAUTHORIZED")


def test_an_unexpected_fault_is_a_500_that_names_nothing_of_it(
    apps: dict[str, Flask], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret detail")

    # The one function both ways call: the views call it by name, the direct
    # routes through their table.
    monkeypatch.setattr(routes, "serve_batched", broken)
    body = _body({"inputs": ["x"]})
    direct = _both_ways(apps["open"], "/predict", JSON, body)
    assert direct[0] == "500 INTERNAL SERVER ERROR"
    assert b"secret detail" not in direct[2]
    assert sum("secret detail" in (r.exc_text or "") for r in caplog.records) == 2  # logged both ways


@pytest.mark.parametrize(
    "path_info",
    [
        "//v1/embeddings",  # OpenAI's wording, though the raw path does not start with /v1/
        "//v2/models/vectors/infer",  # v2's 400 for a bad item, not /predict's 422
        "/v2/models/caf\xc3\xa9/infer",  # the WSGI string of /v2/models/café/infer
    ],
)
def test_a_path_flask_cleans_up_is_read_as_flask_reads_it(apps: dict[str, Flask], path_info: str) -> None:
    body = _body(
        {"model": "vectors", "inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": [5]}]}
    )
    direct = _both_ways(apps["vectors"], "/", JSON, body, path_info=path_info)
    assert direct[0].startswith(("400", "404"))


def test_a_refusal_is_held_as_flask_holds_it(apps: dict[str, Flask], monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = apps["open"].extensions[EXTENSION]

    def loading() -> Any:
        raise NotReady("the model is still loading", retry_after_s=2)

    monkeypatch.setattr(runtime.default, "require_ready", loading)  # the lone model's
    body = _body({"inputs": ["x"]})
    direct = _both_ways(apps["open"], "/predict/batched", JSON, body)
    status, headers, _, held = direct
    assert status == "503 SERVICE UNAVAILABLE"
    assert ("Retry-After", "2") in headers
    assert held is not None  # the worker is asked to hold the connection, both ways


def test_a_fault_while_answering_an_error_is_still_a_json_500(
    apps: dict[str, Flask], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no space left on device")

    monkeypatch.setattr(direct_module, "answer_error", broken)
    response = apps["open"].test_client().post("/predict", json={"inputs": []})  # a 422, then the fault
    assert response.status_code == 500
    assert response.json == {"error": "internal server error; see the service log"}
    assert REQUEST_ID_HEADER in response.headers  # through the access middleware, as any answer
    assert any("no space left" in (r.exc_text or "") for r in caplog.records)


@pytest.mark.parametrize("method", ["GET", "PUT", "HEAD"])
def test_other_methods_are_left_to_flask(apps: dict[str, Flask], method: str) -> None:
    response = apps["open"].test_client().open("/predict/batched", method=method)
    assert response.status_code == 405
    assert set(response.headers["Allow"].split(", ")) == {"OPTIONS", "POST"}


@pytest.mark.parametrize(
    "path",
    [
        "/predict/batched/",
        "/predict//batched",
        "/v1/embeddings/",
        "/v2/models/quirky/infer/",
        "/healthz",
        "/nowhere",
    ],
)
def test_a_path_of_no_direct_route_is_flask_s(apps: dict[str, Flask], path: str) -> None:
    # A near miss is Flask's to answer (a 404, a 405 or its redirect), never a prediction.
    app = apps["open"]
    direct = app.test_client().post(path, json={"inputs": ["x"]})
    layer = _direct(app)
    handlers, layer._handlers = layer._handlers, {}
    try:
        flask = app.test_client().post(path, json={"inputs": ["x"]})
    finally:
        layer._handlers = handlers
    assert direct.status_code in (308, 404, 405)
    assert (direct.status, direct.data) == (flask.status, flask.data)


def test_a_paths_match_is_remembered_and_each_path_keeps_its_own(
    apps: dict[str, Flask], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = apps["vectors"]
    layer = _direct(app)
    layer._matches.clear()
    matched: list[str] = []
    werkzeug_match = layer._urls.match

    def counted(path_info: str, **options: Any) -> Any:
        matched.append(path_info)
        return werkzeug_match(path_info, **options)

    monkeypatch.setattr(layer._urls, "match", counted)
    client = app.test_client()
    body = _tensor(["hello"])
    first = client.post("/v2/models/vectors/infer", data=body, headers=JSON)
    again = client.post("/v2/models/vectors/infer", data=body, headers=JSON)
    other = client.post("/v2/models/someone-else/infer", data=body, headers=JSON)
    missing = [client.post("/nowhere", data=body, headers=JSON) for _ in range(2)]
    assert (first.status_code, again.status_code, other.status_code) == (200, 200, 404)
    assert first.get_json() == again.get_json()
    assert "someone-else" in other.get_json()["error"]  # its own name, not the remembered one's
    assert [r.status_code for r in missing] == [404, 404]
    assert matched == ["/v2/models/vectors/infer", "/v2/models/someone-else/infer", "/nowhere"]


def test_distinct_paths_do_not_grow_the_remembered_matches_without_bound(
    apps: dict[str, Flask], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct_module, "MAX_REMEMBERED_PATHS", 8)
    app = apps["open"]
    layer = _direct(app)
    layer._matches.clear()
    client = app.test_client()
    sizes = []
    for k in range(20):
        assert client.post(f"/v2/models/m{k}/infer", data=_tensor(["x"]), headers=JSON).status_code == 404
        sizes.append(len(layer._matches))
    assert max(sizes) == 8
    assert client.post("/predict/batched", json={"inputs": ["hello"]}).status_code == 200
