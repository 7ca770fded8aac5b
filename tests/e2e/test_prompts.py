"""End to end: a directory's prompts through the openai SDK on real gunicorn, equal to sentence-transformers.

Two copies of the default model's directory, served side by side, list the
prompts E5 uses: one applies its default prompt to requests that name none,
the other's pooling leaves the prompt out (``include_prompt: false``). Each
answers ``prompt_name`` (the SDK sends it in ``extra_body``) as
``SentenceTransformer.encode(texts, prompt_name=...)`` does, in float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from tests.support.hf_dirs import prompt_dir
from tests.support.server import Server, gunicorn, gunicorn_exit

pytestmark = pytest.mark.e2e

PROMPTS = {"query": "query: ", "document": "passage: "}
TEXTS = [
    "how long do cats sleep",
    "Cats sleep for up to sixteen hours a day, mostly in short naps.",
    "ok",
    "The stock market fell sharply on Tuesday, while bonds rallied and the dollar held steady.",
]
# The served name, and how its directory is made: (default prompt, include_prompt).
MODELS = {"e5": ("query", True), "e5-pooled": (None, False)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prompt-dirs")
    return {
        name: prompt_dir(root / name, PROMPTS, default, include_prompt=include)
        for name, (default, include) in MODELS.items()
    }


@pytest.fixture(scope="module")
def server(dirs: dict[str, Path]) -> Iterator[Server]:
    spec = ",".join(f"{name}={path}" for name, path in dirs.items())
    # float32: in bfloat16 (auto's choice on a processor with AMX) the vectors would not equal the library's.
    with gunicorn({"SERVE_MODEL": spec, "SERVE_WORKERS": "1", "SERVE_PRECISION": "float32"}) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as sdk:
        yield sdk


def library(path: Path, prompt_name: str | None) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    return np.asarray(model.encode(TEXTS, prompt_name=prompt_name))


def served(client: openai.OpenAI, model: str, prompt_name: str | None) -> np.ndarray:
    extra = {"prompt_name": prompt_name} if prompt_name is not None else None
    response = client.embeddings.create(model=model, input=TEXTS, extra_body=extra)
    return np.array([row.embedding for row in response.data], dtype=np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))


@pytest.mark.parametrize("model", list(MODELS))
def test_each_prompt_embeds_as_sentence_transformers_does(
    client: openai.OpenAI, dirs: dict[str, Path], model: str
) -> None:
    for prompt_name in ("query", "document", None):
        got, want = served(client, model, prompt_name), library(dirs[model], prompt_name)
        assert cosines(got, want).min() >= 0.9999, (model, prompt_name)


def test_the_default_prompt_applies_when_a_request_names_none(
    client: openai.OpenAI, dirs: dict[str, Path]
) -> None:
    from sentence_transformers import SentenceTransformer

    named = served(client, "e5", "query")
    assert cosines(served(client, "e5", None), named).min() >= 0.99999
    # And the prompt matters: the texts alone embed otherwise.
    alone = SentenceTransformer(str(dirs["e5"]), device="cpu", local_files_only=True).encode(TEXTS, prompt="")
    assert cosines(named, np.asarray(alone)).min() < 0.999


def test_an_unknown_prompt_name_is_refused_naming_the_known_ones(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="e5", input=TEXTS, extra_body={"prompt_name": "passage"})
    assert "its prompts: 'query', 'document'" in str(refused.value)
    assert refused.value.body["param"] == "prompt_name"  # type: ignore[index]


def test_info_models_and_the_start_log_list_the_prompts(server: Server) -> None:
    listed = {
        name: {"prompts": PROMPTS, "default_prompt_name": default} for name, (default, _) in MODELS.items()
    }
    for row in server.get("/v1/models").json()["data"]:
        assert {key: row[key] for key in ("prompts", "default_prompt_name")} == listed[row["id"]]
    assert server.get("/v1/models/e5-pooled").json()["prompts"] == PROMPTS
    info = server.get("/info").json()
    assert info["model"]["prompts"] == PROMPTS and info["model"]["default_prompt_name"] == "query"
    assert [m["model"]["default_prompt_name"] for m in info["models"]] == ["query", None]
    log = Path(server.log_path).read_text()
    assert "model e5: prompts query ('query: '), document ('passage: '); default prompt 'query'" in log
    assert "model e5-pooled: prompts" in log and "pooling leaves the prompt out" in log


def test_a_malformed_prompt_config_stops_the_service_naming_the_file_and_key(tmp_path: Path) -> None:
    path = prompt_dir(tmp_path / "broken", PROMPTS, "passage")
    code, log = gunicorn_exit({"SERVE_MODEL": str(path), "SERVE_WORKERS": "1"}, timeout=60)
    assert code != 0
    assert "config_sentence_transformers.json" in log and "\"default_prompt_name\" is 'passage'" in log
