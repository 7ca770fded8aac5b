"""The reference for scripts/bench/overhead.py: the least a Flask handler can do to serve the free model.

    python -m gunicorn -k gthread -w 2 --threads 4 scripts.bench.bare_flask:app

Every POST parses its JSON body with orjson, takes its texts and answers each
with the free model's 384 floats (scripts/fixtures/free_model.py) as orjson writes
them: no admission, no batching, no metrics, no logging, no request ids.
"""

from __future__ import annotations

import orjson
from flask import Flask, Response, request

from scripts.fixtures.free_model import VECTOR

app = Flask("bare")


@app.post("/<path:route>")
def predict(route: str) -> Response:
    document = orjson.loads(request.get_data())
    texts = document.get("inputs") or document.get("input")
    count = len(texts) if isinstance(texts, list) else 1
    body = orjson.dumps({"outputs": [VECTOR] * count}, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, mimetype="application/json")
