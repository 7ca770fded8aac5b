from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient

from service import create_app
from service.config.settings import Settings
from service.model_set import ModelSet
from service.runtime import EXTENSION

SMALL_MLP = Settings(model="mlp", mlp_width=16, mlp_depth=2, max_items_per_request=8, torch_threads=1)


def wait_until_ready(app: Flask, timeout: float = 60) -> ModelSet:
    runtime: ModelSet = app.extensions[EXTENSION]
    runtime.wait_loaded(timeout)
    return runtime


@pytest.fixture
def make_client() -> Iterator[Callable[[Settings], FlaskClient]]:
    runtimes: list[ModelSet] = []

    def make(settings: Settings) -> FlaskClient:
        app = create_app(settings)
        runtimes.append(wait_until_ready(app))
        return app.test_client()

    yield make
    for runtime in runtimes:
        runtime.stop(timeout=10)


@pytest.fixture
def client(make_client: Callable[[Settings], FlaskClient]) -> FlaskClient:
    return make_client(SMALL_MLP)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Hugging Face model directories of every kind (tests.support.hf_dirs), built once per run."""
    from tests.support.hf_dirs import build

    return build(tmp_path_factory.mktemp("model-dirs"))
