"""SERVE_MODEL's list of models: names, aliases, escapes and what is refused (service.config.model_list)."""

from __future__ import annotations

import pytest

from service.config.model_list import ModelEntry, parse_models
from service.config.settings import Settings
from service.errors import SettingsError


def test_a_lone_spec_is_one_unnamed_model_as_before() -> None:
    assert parse_models("minilm") == (ModelEntry("minilm"),)
    assert parse_models("mypkg.models:build") == (ModelEntry("mypkg.models:build"),)
    assert parse_models("/models/my-embedder") == (ModelEntry("/models/my-embedder"),)


def test_names_aliases_and_the_default_first() -> None:
    entries = parse_models("embed|text-embedding-3-small=/m/e, rerank|rerank-v3.5=/m/ce ,mlp")
    assert entries == (
        ModelEntry("/m/e", ("embed", "text-embedding-3-small")),
        ModelEntry("/m/ce", ("rerank", "rerank-v3.5")),
        ModelEntry("mlp"),
    )
    assert [e.name for e in entries] == ["embed", "rerank", None]
    # Names as clients send them: organisation paths, versions, tags.
    assert parse_models("sentence-transformers/all-MiniLM-L6-v2=minilm")[0].name == (
        "sentence-transformers/all-MiniLM-L6-v2"
    )
    assert parse_models("BAAI/bge-m3:latest=minilm")[0].name == "BAAI/bge-m3:latest"


def test_a_spec_writes_its_commas_and_equals_signs_escaped() -> None:
    assert parse_models(r"odd=/m/a\,b\=c\\d") == (ModelEntry("/m/a,b=c\\d", ("odd",)),)
    assert parse_models(r"/m/x\=y") == (ModelEntry("/m/x=y"),)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("a=minilm,,mlp", "an entry names no model"),
        ("a=", "an entry names no model"),
        ("x y=minilm", "is not a model name"),
        ("a|=minilm", "is not a model name"),
        ("/m/x=y", "is not a model name"),  # an unescaped = in a path reads as a name
        ("a=minilm,a=mlp", "the name 'a' is given to both 'minilm' and 'mlp'"),
        ("a|b=minilm,c|b=mlp", "the name 'b' is given to both"),
    ],
)
def test_what_is_refused_names_the_problem(value: str, says: str) -> None:
    with pytest.raises(SettingsError, match="SERVE_MODEL=") as refused:
        parse_models(value)
    assert says in str(refused.value)


def test_settings_refuse_a_broken_list_at_start_and_split_per_model() -> None:
    with pytest.raises(SettingsError, match="is not a model name"):
        Settings.from_env({"SERVE_MODEL": "bad name=minilm", "SERVE_MAX_BODY_BYTES": "1000000"})
    settings = Settings.from_env({"SERVE_MODEL": "embed=minilm,small=mlp"})
    assert [settings.for_model(e).model for e in settings.models] == ["minilm", "mlp"]
