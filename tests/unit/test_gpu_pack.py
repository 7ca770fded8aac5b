"""scripts/bench/gpu_pack.py's choices and its float16 weights, and the BERT-large-shaped fixture.

Nothing here downloads, and no model is built at its real size: the weights are a
two-layer BERT of MiniLM's vocabulary, written by scripts/fixtures/make_bert_base.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from scripts.bench.gpu_pack import (
    HOST_HAS,
    ROOT,
    TRAVEL_LIMIT_BYTES,
    convert_weights,
    lacking,
    over_limit,
    read_pins,
    to_install,
    wheel_project,
)
from scripts.fixtures.make_bert_base import SHAPES, Shape, config, write
from service.config.settings import Settings
from service.models import load_model

TINY = Shape(layers=2, hidden=32, heads=2, intermediate=64)
# What `pip download` brought for flask, gunicorn, gevent and orjson, at requirements.lock's pins.
DOWNLOADED = [
    "blinker-1.9.0-py3-none-any.whl",
    "click-8.5.1-py3-none-any.whl",
    "flask-3.1.3-py3-none-any.whl",
    "gevent-26.9.0-cp312-cp312-manylinux_2_28_x86_64.whl",
    "greenlet-3.5.6-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "gunicorn-27.0.1-py3-none-any.whl",
    "itsdangerous-2.2.0-py3-none-any.whl",
    "jinja2-3.1.6-py3-none-any.whl",
    "markupsafe-3.0.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
    "orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "werkzeug-3.1.9-py3-none-any.whl",
    "zope_event-6.2-py3-none-any.whl",
    "zope_interface-8.7-cp312-cp312-manylinux1_x86_64.manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
]


# -- which wheels ---------------------------------------------------------------------------


def test_the_host_lacks_flask_gunicorn_gevent_and_orjson_of_the_direct_requirements() -> None:
    requirements = read_pins((ROOT / "requirements.txt").read_text())
    assert lacking(requirements) == ["flask==3.1.3", "gevent==26.9.0", "gunicorn==27.0.1", "orjson==3.13.0"]


def test_only_what_the_host_lacks_is_installed_at_the_locks_versions() -> None:
    pins = read_pins((ROOT / "requirements.lock").read_text())
    assert to_install(DOWNLOADED, pins) == [
        "blinker==1.9.0",
        "flask==3.1.3",
        "gevent==26.9.0",
        "greenlet==3.5.6",
        "gunicorn==27.0.1",
        "itsdangerous==2.2.0",
        "orjson==3.13.0",
        "zope-event==6.2",
        "zope-interface==8.7",
    ]
    assert {"werkzeug", "jinja2", "markupsafe", "click"} <= HOST_HAS  # Flask's others: the host's own


def test_a_wheel_the_lock_does_not_pin_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"leftpad-1\.0-py3-none-any\.whl is not pinned"):
        to_install(["leftpad-1.0-py3-none-any.whl"], {"flask": "3.1.3"})


def test_names_compare_as_pypi_compares_them() -> None:
    assert wheel_project("zope_interface-8.7-cp312-cp312-manylinux_2_17_x86_64.whl") == "zope-interface"
    assert read_pins("Flask==3.1.3  # the web tier\nzope.event==6.2\n") == {
        "flask": "3.1.3",
        "zope-event": "6.2",
    }
    with pytest.raises(ValueError, match="not pinned"):
        read_pins("flask>=3")
    with pytest.raises(ValueError, match="not a wheel"):
        wheel_project("flask-3.1.3.tar.gz")


# -- the size budget ------------------------------------------------------------------------------


def test_what_travels_fits_in_64_mib_or_the_reason_names_each_part() -> None:
    mib = 1 << 20
    assert 64 * mib == TRAVEL_LIMIT_BYTES
    assert over_limit({"working tree": 3 * mib, "wheels": 4 * mib, "MiniLM in float16": 44 * mib}) is None
    assert over_limit({"everything": 64 * mib}) is None
    problem = over_limit({"working tree": 3 * mib, "MiniLM in float32": 87 * mib})
    assert problem == (
        "90.0 MiB would travel (working tree 3.0 MiB, MiniLM in float32 87.0 MiB), over the 64 MiB allowed"
    )


# -- float16 weights, and back --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("tiny") / "bert", seed=0, shape=TINY)


def network_weights(directory: Path, expect: str) -> tuple[object, dict[str, np.ndarray]]:
    model = load_model(Settings(model=str(directory)), "cpu")
    network = model.network()  # type: ignore[attr-defined]
    weights = {name: tensor.detach().float().numpy() for name, tensor in network.state_dict().items()}
    assert {str(t.dtype) for t in network.state_dict().values() if t.is_floating_point()} == {expect}
    return model, weights


def test_float16_weights_round_trip_and_load_through_the_services_loader(tiny: Path, tmp_path: Path) -> None:
    half = convert_weights(tiny, tmp_path / "half", "float16")
    back = convert_weights(half, tmp_path / "back", "float32")
    original = tiny / "model.safetensors"
    assert (half / "model.safetensors").stat().st_size < 0.6 * original.stat().st_size

    _, source = network_weights(tiny, "torch.float32")
    _, halved = network_weights(half, "torch.float32")  # stored in float16, served in float32
    model, restored = network_weights(back, "torch.float32")
    for name, values in source.items():
        rounded = values.astype(np.float16).astype(np.float32)
        assert np.array_equal(halved[name], rounded), name
        assert np.array_equal(restored[name], rounded), name  # float16 to float32 is exact
    assert model.predict([model.prepare("a sentence to embed")]).shape == (1, TINY.hidden)


def test_files_the_loader_does_not_read_are_left_behind(tiny: Path, tmp_path: Path) -> None:
    (tiny / "README.md").write_text("a model card")
    half = convert_weights(tiny, tmp_path / "half", "float16", skip=["README.md"])
    assert not (half / "README.md").exists()
    assert (half / "tokenizer.json").is_file() and (half / "1_Pooling" / "config.json").is_file()


# -- the BERT fixtures ---------------------------------------------------------------------------


def test_the_large_shape_is_bert_larges_with_minilms_vocabulary() -> None:
    large = config(SHAPES["large"])
    assert (
        large.num_hidden_layers,
        large.hidden_size,
        large.num_attention_heads,
        large.intermediate_size,
    ) == (
        24,
        1024,
        16,
        4096,
    )
    assert (large.vocab_size, large.max_position_embeddings) == (30522, 512)
    base = config(SHAPES["base"])
    assert (base.num_hidden_layers, base.hidden_size, base.num_attention_heads, base.intermediate_size) == (
        12,
        768,
        12,
        3072,
    )


def test_a_fixture_from_one_seed_is_the_same_twice_and_takes_the_pipeline_given(
    tiny: Path, tmp_path: Path
) -> None:
    again = write(tmp_path / "again", seed=0, shape=TINY, pipeline=tiny)
    assert (again / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    assert (again / "sentence_bert_config.json").read_text() == (
        tiny / "sentence_bert_config.json"
    ).read_text()
