"""Prompts: read from a directory's sentence-transformers config, chosen by name, applied as it does."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient

from service.config.model_spec import check_spec, read_prompts
from service.config.prompt_spec import PROMPTS_FILE, Prompts
from service.config.settings import Settings
from service.errors import InvalidInput, SettingsError
from service.models.base import truncating
from service.models.prompts import Prompted, prompt_text, prompts_of, with_prompt
from tests.support.hf_dirs import prompt_dir

PROMPTS = {"query": "query: ", "document": "passage: ", "empty": ""}
# A longer prompt, so that a batch mixes prompts of different token counts.
LONG = "Represent this sentence for searching relevant passages: "
# Far past the directory's 256 tokens.
LONG_TEXT = " ".join(f"word{i}" for i in range(400))
TEXTS = [
    "how do cats sleep",
    "Cats sleep for up to sixteen hours a day, mostly in short naps.",
    "ok",
    "The stock market fell sharply on Tuesday, while bonds rallied and the dollar held steady.",
]


def config_dir(tmp_path: Path, config: Any) -> Path:
    (tmp_path / PROMPTS_FILE).write_text(config if isinstance(config, str) else json.dumps(config))
    return tmp_path


# -- reading the config --------------------------------------------------------------------------


def test_prompts_and_the_default_are_read(tmp_path: Path) -> None:
    prompts = read_prompts(config_dir(tmp_path, {"prompts": PROMPTS, "default_prompt_name": "query"}))
    assert prompts == Prompts(PROMPTS, "query")
    assert prompts.default == "query: "
    assert prompts.describe() == {"prompts": PROMPTS, "default_prompt_name": "query"}
    assert "query ('query: ')" in prompts.summary() and "default prompt 'query'" in prompts.summary()


@pytest.mark.parametrize(
    "config",
    [None, {}, {"__version__": {"sentence_transformers": "2.0.0"}}, {"prompts": {}}, {"prompts": None}],
)
def test_a_directory_without_prompts_has_none(tmp_path: Path, config: Any) -> None:
    if config is not None:
        config_dir(tmp_path, config)
    assert read_prompts(tmp_path) is None


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ("{not json", "cannot be read as JSON"),
        ([1, 2], "is not a JSON object"),
        ({"prompts": ["query: "]}, '"prompts" must be an object of prompt names to texts'),
        ({"prompts": {"query": 3}}, "\"prompts\" 'query' must be a string"),
        ({"prompts": {"query": None}}, "\"prompts\" 'query' must be a string"),
        ({"prompts": PROMPTS, "default_prompt_name": 1}, '"default_prompt_name" must be null or a name'),
        (
            {"prompts": PROMPTS, "default_prompt_name": "passage"},
            '"default_prompt_name" is \'passage\', which "prompts" does not name; '
            "its prompts: 'query', 'document', 'empty'",
        ),
        ({"default_prompt_name": "query"}, "its prompts: none"),
    ],
)
def test_a_malformed_config_is_refused_naming_the_file_and_the_key(
    tmp_path: Path, config: Any, named: str
) -> None:
    with pytest.raises(SettingsError) as refused:
        read_prompts(config_dir(tmp_path, config))
    assert PROMPTS_FILE in str(refused.value) and str(tmp_path) in str(refused.value)
    assert named in str(refused.value)


def test_the_masters_check_refuses_a_directory_whose_prompts_are_malformed(tmp_path: Path) -> None:
    path = prompt_dir(tmp_path / "bad", {"query": ["query: "]})
    with pytest.raises(SettingsError, match="'query' must be a string"):
        check_spec(str(path))
    assert check_spec(str(prompt_dir(tmp_path / "good", PROMPTS))) == "directory"


# -- choosing a request's prompt -----------------------------------------------------------------


class Plain:
    """A model of no prompts (the built-in MiniLM, a factory's model)."""

    name, item_kind, item_shape, device = "plain", "text", None, "cpu"

    def prepare(self, item: Any) -> Any:
        return item

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch


class WithPrompts(Plain):
    name = "e5"
    prompts = Prompts(PROMPTS, "query")


def test_a_named_prompt_travels_with_each_text() -> None:
    assert with_prompt(WithPrompts(), ["a", "b"], "document") == [
        Prompted("a", "document"),
        Prompted("b", "document"),
    ]
    # The default prompt is the model's prepare's to apply: a request naming none sends texts as they are.
    assert with_prompt(WithPrompts(), ["a"], None) == ["a"]
    assert with_prompt(Plain(), ["a"], None) == ["a"]
    with_names = prompts_of(WithPrompts())
    assert with_names is not None and with_names.by_name == PROMPTS
    assert prompts_of(Plain()) is None
    # What a route that shows tokens puts before the text.
    assert prompt_text(WithPrompts(), "document") == "passage: "
    assert prompt_text(WithPrompts(), None) == "query: "
    assert prompt_text(Plain(), None) == ""
    with pytest.raises(InvalidInput, match="its prompts"):
        prompt_text(WithPrompts(), "passage")


def test_an_unknown_prompt_name_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(InvalidInput) as refused:
        with_prompt(WithPrompts(), ["a"], "passage")
    assert str(refused.value) == (
        "\"prompt_name\" 'passage' is not a prompt of model 'e5'; its prompts: 'query', 'document', 'empty'"
    )
    with pytest.raises(InvalidInput, match="model 'plain' has no prompts"):
        with_prompt(Plain(), ["a"], "query")
    with pytest.raises(InvalidInput, match='"prompt_name" must be a string naming a prompt, got number'):
        with_prompt(WithPrompts(), ["a"], 1)


# -- applied as sentence-transformers applies them -----------------------------------------------


def embed(model: Any, groups: list[tuple[list[str], str | None]], *, bounded: bool) -> np.ndarray:
    """One predict on every group's texts with its prompt, as a batch of the batcher's would run them."""
    from service.models.shapes import steps_for

    model.shapes = steps_for(8, model._max_length) if bounded else None
    items = [model.prepare(item) for texts, name in groups for item in with_prompt(model, texts, name)]
    return np.asarray(model.predict(items))


@pytest.mark.parametrize(
    ("include_prompt", "pooling"),
    [(True, None), (False, None), (False, "cls"), (False, "weightedmean"), (False, "max")],
)
def test_embeddings_equal_sentence_transformers_with_each_prompt(
    tmp_path: Path, include_prompt: bool, pooling: str | None
) -> None:
    from sentence_transformers import SentenceTransformer

    from service.models.embeddings import SentenceEmbeddingModel

    prompts = {**PROMPTS, "long": LONG}
    path = prompt_dir(tmp_path / "e5", prompts, "document", include_prompt=include_prompt, pooling=pooling)
    reference = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    model = SentenceEmbeddingModel(path, "cpu")
    for bounded in (False, True):  # the batch's own shape, and the padded call shapes of a oneDNN cache
        for name in ("query", "long", "empty", None):
            got = embed(model, [(TEXTS, name)], bounded=bounded)
            np.testing.assert_allclose(got, reference.encode(TEXTS, prompt_name=name), atol=1e-5)
        # One batch that mixes a query's prompt, a long one and the default: each pooled apart.
        got = embed(model, [(TEXTS[:1], "query"), (TEXTS[1:3], "long"), (TEXTS[3:], None)], bounded=bounded)
        want = [
            reference.encode(TEXTS[:1], prompt_name="query"),
            reference.encode(TEXTS[1:3], prompt_name="long"),
            reference.encode(TEXTS[3:]),
        ]
        np.testing.assert_allclose(got, np.concatenate(want), atol=1e-5)


def test_the_prompt_counts_its_leading_special_token_and_not_its_trailing_one(tmp_path: Path) -> None:
    from service.models.embeddings import SentenceEmbeddingModel

    model = SentenceEmbeddingModel(prompt_dir(tmp_path / "e5", PROMPTS, include_prompt=False), "cpu")
    # [CLS] query : -- sentence-transformers' prompt_length, as its Transformer counts it.
    assert model._prompt_lengths == {"query": 3, "document": 3, "empty": 0}
    tokens = model.prepare(Prompted("ok", "query"))
    assert tokens.prompt_length == 3 and len(tokens.ids) == 5  # [CLS] query : ok [SEP]
    assert model.prepare("ok").prompt_length == 0  # no default prompt


@pytest.mark.parametrize("include_prompt", [True, False])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_long_text_is_cut_in_its_own_tokens_and_keeps_its_prompt(
    tmp_path: Path, include_prompt: bool, side: str
) -> None:
    from service.models.embeddings import SentenceEmbeddingModel

    path = prompt_dir(tmp_path / "e5", PROMPTS, include_prompt=include_prompt)
    model = SentenceEmbeddingModel(path, "cpu")
    tokenizer = model._tokenizer
    prompt = tokenizer(PROMPTS["query"], add_special_tokens=False)["input_ids"]
    text = tokenizer(LONG_TEXT, add_special_tokens=False)["input_ids"]
    room = model._max_length - 2 - len(prompt)  # [CLS] and [SEP] take two
    kept = text[-room:] if side == "left" else text[:room]
    with truncating(side):
        tokens = model.prepare(Prompted(LONG_TEXT, "query"))
    assert tokens.ids == [tokenizer.cls_token_id, *prompt, *kept, tokenizer.sep_token_id]
    # Left out of the pooling: [CLS] and the prompt, and nothing of the text.
    assert tokens.prompt_length == (0 if include_prompt else 1 + len(prompt))
    assert tokens.ids[1 + len(prompt) : -1] == kept
    if side == "right":  # sentence-transformers' own cut
        from sentence_transformers import SentenceTransformer

        reference = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        with truncating(side):
            got = embed(model, [([LONG_TEXT], "query")], bounded=False)
        np.testing.assert_allclose(got, reference.encode([LONG_TEXT], prompt_name="query"), atol=1e-5)


# -- the routes -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prompt_dir(tmp_path_factory.mktemp("prompts") / "e5", PROMPTS, "query")


def serve(make_client: Callable[[Settings], FlaskClient], model: str) -> FlaskClient:
    # float32: the default on a processor with bfloat16 would not equal sentence-transformers run alone.
    return make_client(Settings(model=model, torch_threads=1, max_items_per_request=16, precision="float32"))


def test_v1_embeddings_takes_prompt_name_and_info_lists_the_prompts(
    make_client: Callable[[Settings], FlaskClient], e5_dir: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(e5_dir), device="cpu", local_files_only=True)
    client = serve(make_client, str(e5_dir))

    def embeddings(**fields: Any) -> Any:
        response = client.post("/v1/embeddings", json={"model": "e5", "input": TEXTS, **fields})
        return response

    for fields, name in (
        ({"prompt_name": "document"}, "document"),
        ({}, None),
        ({"prompt_name": None}, None),
    ):
        response = embeddings(encoding_format="float", **fields)
        assert response.status_code == 200, response.text
        got = np.array([row["embedding"] for row in response.get_json()["data"]])
        np.testing.assert_allclose(got, reference.encode(TEXTS, prompt_name=name), atol=1e-4)

    refused = embeddings(prompt_name="passage")
    assert refused.status_code == 400
    error = refused.get_json()["error"]
    assert error["param"] == "prompt_name"
    assert "its prompts: 'query', 'document', 'empty'" in error["message"]

    listed = {"prompts": PROMPTS, "default_prompt_name": "query"}
    info = client.get("/info").get_json()
    assert info["model"].items() >= listed.items() and info["model"]["task"] == "embeddings"
    assert info["models"][0]["model"].items() >= listed.items()
    assert client.get("/v1/models").get_json()["data"][0].items() >= listed.items()
    assert client.get("/v1/models/e5").get_json().items() >= listed.items()


def test_a_prompt_name_for_a_model_without_prompts_is_refused(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = serve(make_client, "minilm")
    response = client.post(
        "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x", "prompt_name": "query"}
    )
    assert response.status_code == 400
    assert "model 'all-MiniLM-L6-v2' has no prompts" in response.get_json()["error"]["message"]
    assert "prompts" not in client.get("/info").get_json()["model"]
    assert "prompts" not in client.get("/v1/models").get_json()["data"][0]


def test_tei_routes_apply_the_default_prompt_to_a_request_that_names_none(
    make_client: Callable[[Settings], FlaskClient], e5_dir: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(e5_dir), device="cpu", local_files_only=True)
    client = serve(make_client, str(e5_dir))
    unnamed = client.post("/embed", json={"inputs": TEXTS})
    assert unnamed.status_code == 200, unnamed.json
    np.testing.assert_allclose(unnamed.json, reference.encode(TEXTS, prompt_name="query"), atol=1e-4)
    # And the default is what made them: the texts with an empty prompt embed otherwise.
    bare = client.post("/embed", json={"inputs": TEXTS, "prompt_name": "empty"}).json
    assert not np.allclose(unnamed.json, bare, atol=1e-3)
    np.testing.assert_allclose(client.post("/", json={"inputs": TEXTS}).json, unnamed.json, atol=1e-6)
    [tokens] = client.post("/tokenize", json={"inputs": "ok"}).json
    assert [t["text"] for t in tokens] == ["[CLS]", "query", ":", "ok", "[SEP]"]
    # The client's text is held to the length limit, not the text with the service's prompt.
    assert client.post("/tokenize", json={"inputs": "x" * 20_000}).status_code == 200
    too_long = client.post("/tokenize", json={"inputs": "x" * 20_001})
    assert too_long.status_code == 422 and "inputs[0]" in too_long.json["error"]
    # An unknown name: TEI's status and type, naming the prompts.
    for path in ("/embed", "/tokenize"):
        refused = client.post(path, json={"inputs": "x", "prompt_name": "passage"})
        assert (refused.status_code, refused.json["error_type"]) == (422, "Validation")
        assert "its prompts: 'query', 'document', 'empty'" in refused.json["error"]
