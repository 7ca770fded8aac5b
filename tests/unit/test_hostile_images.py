"""Hostile image files, in process: truncated, overwritten, animated or bomb files, raw or base64.

Every answer is 200 (a mutation can leave a file that still decodes) or a JSON
4xx naming the problem: never a 5xx, and the worker answers the next request.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings

from service import create_app
from service.config.settings import Settings
from tests.conftest import wait_until_ready
from tests.support import hostile, images
from tests.unit.test_hostile_input import ROUTES, check

pytestmark = pytest.mark.filterwarnings(images.JIT_DEPRECATED)


@pytest.fixture(scope="module")
def image_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlaskClient]:
    directory = images.image_model_dir(Path(tmp_path_factory.mktemp("hostile-images")))
    app = create_app(Settings(model=str(directory), max_items_per_request=4, torch_threads=1))
    runtime = wait_until_ready(app)
    yield app.test_client()
    runtime.stop(timeout=10)


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=hostile.image_files, content_type=hostile.image_content_types)
def test_hostile_image_bodies_get_a_4xx_json_error_never_a_5xx(
    image_client: FlaskClient, route: str, data: bytes, content_type: str
) -> None:
    response = image_client.post(route, data=data, headers={"Content-Type": content_type})
    check(response.status_code, response.get_data(), response.is_json, valid=False)


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=hostile.image_files)
def test_hostile_base64_images_get_a_4xx_json_error_never_a_5xx(
    image_client: FlaskClient, route: str, data: bytes
) -> None:
    response = image_client.post(route, json={"inputs": [base64.b64encode(data).decode()]})
    check(response.status_code, response.get_data(), response.is_json, valid=False)
