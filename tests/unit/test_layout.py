"""An image program's layout on a CPU: channels_last where it measures faster, the same answers either way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from flask.testing import FlaskClient

from service.config.settings import Settings
from service.errors import SettingsError
from service.models.image import ImageModel
from service.models.layout import CHANNELS_LAST, CONTIGUOUS, MIN_GAIN, ROUNDS, decide, measure
from tests.support import images

pytestmark = pytest.mark.filterwarnings(images.JIT_DEPRECATED)

FILES = [images.photo(1), images.photo(2, (50, 70), "PNG")]


# -- the choice, from timings -------------------------------------------------------------


def test_channels_last_is_kept_only_when_faster_by_the_gain() -> None:
    faster = decide("auto", [1.0, 1.0, 1.1], [0.8, 0.9, 0.9], outputs_match=True)
    assert faster.in_use == CHANNELS_LAST and faster.speedup == pytest.approx(1.0 / 0.9)
    barely = decide("auto", [1.0] * 3, [1.0 / (MIN_GAIN - 0.01)] * 3, outputs_match=True)
    assert barely.in_use == CONTIGUOUS and "not faster" in barely.reason
    slower = decide("auto", [1.0] * 3, [1.5] * 3, outputs_match=True)
    assert slower.in_use == CONTIGUOUS and slower.speedup == pytest.approx(1 / 1.5)


def test_asked_for_it_runs_channels_last_even_when_slower_unless_its_answers_differ() -> None:
    asked = decide("channels_last", [1.0] * 3, [2.0] * 3, outputs_match=True)
    assert asked.in_use == CHANNELS_LAST and asked.reason == "as asked"
    wrong = decide("channels_last", [1.0] * 3, [0.5] * 3, outputs_match=False)
    assert wrong.in_use == CONTIGUOUS and "outputs differ" in wrong.reason


def test_measure_takes_turns_and_leaves_the_program_in_the_layout_chosen() -> None:
    # A fake program that runs 2 s contiguous and 1 s channels_last on a fake clock.
    now = [0.0]
    layouts: list[bool] = []
    runs: list[bool] = []

    def switch(channels_last: bool) -> None:
        layouts.append(channels_last)

    def run(channels_last: bool) -> torch.Tensor:
        assert layouts[-1] == channels_last  # each run in the layout just switched to
        runs.append(channels_last)
        now[0] += 1.0 if channels_last else 2.0
        return torch.ones(2, 3)

    chosen = measure("auto", run, switch, clock=lambda: now[0])
    assert chosen.in_use == CHANNELS_LAST and chosen.speedup == pytest.approx(2.0)
    assert runs == [False, True] * (ROUNDS + 1)  # a warm-up each, then in turns
    assert layouts[-1] is True


def test_measure_falls_back_when_the_outputs_differ() -> None:
    layouts: list[bool] = []
    chosen = measure(
        "auto",
        lambda cl: torch.full((2, 3), 2.0 if cl else 1.0),
        layouts.append,
        clock=iter(range(100)).__next__,
    )
    assert chosen.in_use == CONTIGUOUS and layouts[-1] is False


# -- a real program ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["model.pt", "model.pt2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return images.image_model_dir(tmp_path_factory.mktemp("layout"), program=request.param)


@pytest.mark.parametrize("layout", ["auto", "contiguous", "channels_last"])
def test_every_layout_answers_as_the_program_does(model_dir: Path, layout: str) -> None:
    model = ImageModel(model_dir, "cpu", 4096 * 4096, layout)
    if layout != "auto":
        assert model.layout.in_use == layout
    if layout != "contiguous":
        assert model.layout.speedup is not None and model.layout.speedup > 0  # measured
    # The batches go in the layout chosen, whichever layout the measurement ran last.
    assert model._channels_last == (model.layout.in_use == "channels_last")
    got = model.predict([model.prepare(data) for data in FILES])
    want = images.top_k(images.reference(model_dir, FILES), 3)
    assert [[e["label"] for e in row] for row in got] == [[e["label"] for e in row] for row in want]
    scores = np.array([[e["score"] for e in row] for row in got])
    assert np.abs(scores - np.array([[e["score"] for e in row] for row in want])).max() <= 1e-5


def test_a_program_that_cannot_change_layout_keeps_the_contiguous_one(model_dir: Path) -> None:
    model = ImageModel(model_dir, "cpu", 4096 * 4096, "contiguous")
    program = model._program

    class Stubborn:
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return program(x)

        def to(self, **_: object) -> None:
            raise RuntimeError("no such layout here")

    model._program = Stubborn()
    chosen = model._settle_layout("auto")
    assert (
        chosen.in_use == CONTIGUOUS
        and "channels_last failed: RuntimeError: no such layout here" in chosen.reason
    )
    assert not model._channels_last
    assert len(model.predict([model.prepare(FILES[0])])) == 1


def test_a_contiguous_choice_sends_contiguous_batches(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The measurement's last run is in channels_last; a program found slower in it must not keep it.
    monkeypatch.setattr("service.models.layout.MIN_GAIN", 1e9)
    model = ImageModel(model_dir, "cpu", 4096 * 4096, "auto")
    assert model.layout.in_use == CONTIGUOUS and not model._channels_last


def test_a_gpu_keeps_the_contiguous_layout_without_measuring(model_dir: Path) -> None:
    # No GPU here: the device string is all this path reads, so the model is built on the CPU.
    model = ImageModel(model_dir, "cpu", 4096 * 4096, "contiguous")
    model.device = "cuda:0"
    chosen = model._settle_layout("auto")
    assert chosen.in_use == CONTIGUOUS and chosen.speedup is None and "GPU" in chosen.reason


def test_info_names_the_layout_and_the_setting_refuses_others(
    make_client: Callable[[Settings], FlaskClient], model_dir: Path
) -> None:
    client = make_client(Settings(model=str(model_dir), torch_threads=1, image_layout="channels_last"))
    info = client.get("/info").json
    assert info is not None
    layout = info["model"]["layout"]
    assert layout["requested"] == "channels_last" and layout["in_use"] == "channels_last"
    assert isinstance(layout["speedup"], float)
    with pytest.raises(
        SettingsError, match="SERVE_IMAGE_LAYOUT must be one of auto, contiguous, channels_last"
    ):
        Settings.from_env({"SERVE_IMAGE_LAYOUT": "sideways"})
