"""SERVE_PRECISION: what each device refuses, how exactness is measured, and the check on small models.

The checks run on CPU with tiny models of every text kind. float16 is checked
here too, on a CPU, through the same code a GPU runs (``precision.check``
called directly: on a CPU the service itself refuses float16): that proves the
conversion and the float32 outputs, not the speed, which only a GPU measures
(scripts/bench/gpu_check.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.config.settings import Settings
from service.errors import SettingsError
from service.models import load_model
from service.models import precision as p
from service.models.precision_cache import settle

LENIENT = p.Floor(
    min_cosine=-1, median_cosine=-1, top1_agreement=0, max_score_diff=1e9, clear_share=0, top1_where_clear=0
)
NONE_PASSES = p.Floor(min_cosine=1.01, median_cosine=1.01, top1_agreement=1.01, max_score_diff=-1)


def resolve(requested: str, device: str = "cpu", *, task: str = "embeddings", **kwargs: object) -> str:
    options: dict[str, object] = {"reducible": True, "cpu_flags": frozenset(), "name": "m"} | kwargs
    return p.resolve(requested, device=device, task=task, **options)  # type: ignore[arg-type]


AMX = frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})
AVX512_BF16 = frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})
VNNI_ONLY = frozenset({"avx512f", "avx512_vnni"})


def test_auto_is_float16_for_text_models_on_a_gpu_and_float32_on_a_cpu_without_native_bfloat16() -> None:
    for task in p.TEXT_TASKS:
        assert resolve("auto", "cuda:0", task=task) == "float16"
        assert resolve("auto", "cpu", task=task) == "float32"
        assert resolve("auto", "cpu", task=task, cpu_flags=VNNI_ONLY) == "float32"
    assert resolve("auto", "cuda:0", task="generic") == "float32"
    assert resolve("auto", "cuda:0", reducible=False) == "float32"


def test_auto_is_bfloat16_for_text_models_on_a_cpu_with_amx() -> None:
    for task in p.TEXT_TASKS:
        assert resolve("auto", "cpu", task=task, cpu_flags=AMX) == "bfloat16"
        choice = p.auto_choice(device="cpu", task=task, reducible=True, cpu_flags=AMX, onednn_cache=1024)
        assert choice == p.AutoChoice("bfloat16", "auto: bfloat16, the processor has amx_bf16", "amx_bf16")
    # Not an image program, not a network the service cannot convert, and an int8 never unasked.
    assert resolve("auto", "cpu", task="image", cpu_flags=AMX) == "float32"
    assert resolve("auto", "cpu", task="generic", cpu_flags=AMX) == "float32"
    assert resolve("auto", "cpu", reducible=False, cpu_flags=AMX) == "float32"


def test_auto_on_avx512_bf16_without_amx_is_bfloat16_only_if_it_measures_faster() -> None:
    choice = p.auto_choice(
        device="cpu", task="rerank", reducible=True, cpu_flags=AVX512_BF16, onednn_cache=1024
    )
    assert choice.precision == "bfloat16" and choice.measure and choice.code == "avx512_bf16_faster"
    amx = p.auto_choice(device="cpu", task="rerank", reducible=True, cpu_flags=AMX, onednn_cache=1024)
    assert not amx.measure


def test_auto_keeps_float32_where_the_onednn_cache_is_off_and_says_why() -> None:
    # With no cache bfloat16 builds its kernels at every call: slower than float32.
    assert resolve("auto", "cpu", cpu_flags=AMX, onednn_cache=0) == "float32"
    choice = p.auto_choice(device="cpu", task="embeddings", reducible=True, cpu_flags=AMX, onednn_cache=0)
    assert "SERVE_ONEDNN_CACHE=0" in choice.reason and choice.code == "onednn_cache_off"
    none = p.auto_choice(
        device="cpu", task="embeddings", reducible=True, cpu_flags=VNNI_ONLY, onednn_cache=1024
    )
    assert none.code == "no_bfloat16" and "no native bfloat16" in none.reason


def test_the_onednn_cache_a_process_has_is_onednns_default_unless_set() -> None:
    assert p.onednn_cache_capacity({}) == 1024
    assert p.onednn_cache_capacity({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}) == 0
    assert p.onednn_cache_capacity({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}) == 256


@pytest.mark.parametrize(
    ("requested", "device", "flags", "reason"),
    [
        ("float16", "cpu", frozenset(), "not served on a CPU"),
        ("bfloat16", "cpu", frozenset({"avx2"}), "avx512_bf16 or amx_bf16"),
        ("int8", "cuda:0", frozenset(), "kernels run on CPUs only"),
    ],
)
def test_each_refusal_names_its_reason(
    requested: str, device: str, flags: frozenset[str], reason: str
) -> None:
    with pytest.raises(SettingsError, match=reason) as caught:
        resolve(requested, device, cpu_flags=flags)
    assert f"SERVE_PRECISION={requested}" in str(caught.value)


def test_bfloat16_on_a_cpu_with_native_bfloat16_and_on_a_gpu() -> None:
    assert resolve("bfloat16", "cpu", cpu_flags=frozenset({"avx512_bf16"})) == "bfloat16"
    assert resolve("bfloat16", "cpu", cpu_flags=frozenset({"amx_bf16"})) == "bfloat16"
    assert resolve("bfloat16", "cuda:1") == "bfloat16"
    assert resolve("float16", "cuda:1") == "float16"


def test_a_program_or_factory_runs_in_float32_only() -> None:
    with pytest.raises(SettingsError, match="float32 only"):
        resolve("int8", reducible=False)
    assert resolve("float32", reducible=False) == "float32"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n")
    assert p.cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert p.cpu_flags(tmp_path / "missing") == frozenset()


def test_settings_take_only_known_precisions() -> None:
    assert Settings.from_env({"SERVE_PRECISION": "INT8"}).precision == "int8"
    with pytest.raises(SettingsError, match="SERVE_PRECISION"):
        Settings.from_env({"SERVE_PRECISION": "fp8"})


# -- exactness, pure ------------------------------------------------------------------------


def test_embeddings_compare_by_cosine() -> None:
    reference = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    reduced = np.array([[1.0, 0.0], [0.1, 1.0], [1.0, 0.0]])
    figures = p.compare("embeddings", reference, reduced)
    assert figures["min_cosine"] == pytest.approx(np.sqrt(0.5))
    assert figures["median_cosine"] == pytest.approx(1 / np.sqrt(1.01))


def test_rerank_compares_each_querys_top_document_and_the_scores() -> None:
    reference = np.array([0.9, 0.1, 0.2, 0.8])  # two queries of two documents
    reduced = np.array([0.85, 0.2, 0.7, 0.6])  # the second query's top changed
    figures = p.compare("rerank", reference, reduced, group=2)
    # Neither query leads by more than twice the largest move (1.0): none is clear.
    assert figures == {
        "max_score_diff": pytest.approx(0.5),
        "top1_agreement": 0.5,
        "clear_share": 0,
        "top1_where_clear": 1.0,
    }


def test_a_rerank_query_counts_only_where_its_lead_is_clear_of_twice_the_largest_move() -> None:
    reference = np.array([0.9, 0.1, 0.5, 0.45, 2.0, 1.0, 0.3, 0.31])  # leads of 0.8, 0.05, 1.0 and 0.01
    moves = np.array([0.02, -0.03, 0.03, 0.0, -0.01, 0.0, 0.02, 0.0])  # up to 0.03; the last query flips
    figures = p.compare("rerank", reference, reference + moves, group=2)
    assert figures["top1_agreement"] == 0.75
    # Two queries of four lead by more than 0.06, and both keep their top document. The
    # others could be reordered by rounding alone: they say nothing of the precision.
    assert figures["clear_share"] == 0.5 and figures["top1_where_clear"] == 1
    # A rerank's top1_agreement is not held to the floor: the flipped query had no clear lead.
    assert p.shortfall(figures, p.AUTO_FLOOR) is None
    # Fewer than half clear: the samples cannot tell, and the refusal says so.
    # A move of 0.45 leaves only the third query's lead (1.0) clear of twice it.
    few = p.compare(
        "rerank", reference[:6], reference[:6] + np.array([0.02, -0.03, 0.03, 0.0, 0.0, 0.45]), group=2
    )
    assert few["clear_share"] == pytest.approx(1 / 3)
    why = p.shortfall(few, p.AUTO_FLOOR, configured=p.Floor())
    assert why is not None and why.startswith("clear_share 0.3333 is under 0.5 on the samples: too few")
    assert "tell rounding from a tie" in why
    assert p.shortfall(few, p.Floor()) == why  # an explicit request's floor asks the same share


def test_auto_needs_every_clear_top_document_kept() -> None:
    figures = {"max_score_diff": 0.01, "top1_agreement": 1.0, "clear_share": 0.9, "top1_where_clear": 0.95}
    assert p.shortfall(figures, p.Floor()) is None  # an explicit request's floor: 0.95
    why = p.shortfall(figures, p.Floor().stricter(p.AUTO_FLOOR), configured=p.Floor())
    assert why == "top1_where_clear 0.9500 is under 1 on the samples (auto's floor 1)"


def test_autos_floor_is_the_stricter_of_its_own_and_the_settings() -> None:
    floor = p.Floor(min_cosine=0.9995, max_score_diff=0.05).stricter(p.AUTO_FLOOR)
    assert floor.min_cosine == 0.9995 and floor.median_cosine == 0.999 and floor.top1_agreement == 0.99
    assert floor.max_score_diff == 0.05 and floor.clear_share == 0.5 and floor.top1_where_clear == 1.0
    why = p.shortfall({"min_cosine": 0.9985}, p.Floor().stricter(p.AUTO_FLOOR), configured=p.Floor())
    assert why == "min_cosine 0.9985 is under 0.999 on the samples (auto's floor 0.999)"


def test_classification_compares_labels_by_name() -> None:
    reference = [[{"label": "a", "score": 0.7}, {"label": "b", "score": 0.3}]]
    reduced = [[{"label": "b", "score": 0.55}, {"label": "a", "score": 0.45}]]
    figures = p.compare("classification", reference, reduced)
    assert figures == {"max_score_diff": pytest.approx(0.25), "top1_agreement": 0.0}


def test_fill_mask_compares_the_top_token() -> None:
    one = [{"token_str": "cat", "score": 0.5}, {"token_str": "dog", "score": 0.4}]
    other = [{"token_str": "dog", "score": 0.5}, {"token_str": "cat", "score": 0.4}]
    assert p.compare("fill-mask", [one, [one, other]], [one, [other, one]]) == {"top1_agreement": 0.5}


def test_shortfall_names_the_figure_and_its_setting() -> None:
    floor = p.Floor()
    assert p.shortfall({"min_cosine": 0.97, "median_cosine": 0.99}, floor) is None
    why = p.shortfall({"min_cosine": 0.90, "median_cosine": 0.99}, floor)
    assert why is not None and "min_cosine 0.9000" in why and "SERVE_PRECISION_MIN_COSINE" in why
    why = p.shortfall({"max_score_diff": 0.3, "top1_agreement": 1.0}, floor)
    assert why is not None and "SERVE_PRECISION_MAX_SCORE_DIFF" in why
    assert "not finite" in (p.shortfall({"min_cosine": float("nan")}, floor) or "")


def test_finite_looks_inside_outputs() -> None:
    assert p.finite(np.ones(3)) and p.finite([[{"score": 0.5}]])
    assert not p.finite(np.array([1.0, np.inf])) and not p.finite([[{"score": float("nan")}]])


# -- the check, on tiny models of each kind -------------------------------------------------------


def loaded(path: Path) -> object:
    return load_model(Settings(model=str(path)), "cpu")


@pytest.mark.parametrize("task", ["rerank", "classification", "fill-mask"])
def test_int8_quantizes_every_linear_layer_above_a_lenient_floor(
    model_dirs: dict[str, Path], task: str
) -> None:
    model = loaded(model_dirs[task])
    every = p.linear_layers(model.network())  # type: ignore[attr-defined]
    choice = p.check(model, task, "int8", LENIENT)
    assert choice.precision == "int8" and choice.layers == tuple(every) and not choice.kept_float32
    network = model.network()  # type: ignore[attr-defined]
    assert not p.linear_layers(network), "every Linear layer is now a quantized one"
    items = [model.prepare(item) for item in p.sample_items(task)[0][:4]]  # type: ignore[attr-defined]
    assert len(model.predict(items)) == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize("task", ["rerank", "classification"])
def test_a_precision_under_the_floor_falls_back_to_float32_with_the_reason(
    model_dirs: dict[str, Path], task: str
) -> None:
    model = loaded(model_dirs[task])
    original = model.network()  # type: ignore[attr-defined]
    choice = p.check(model, task, "int8", NONE_PASSES)
    assert choice.precision == "float32"
    assert choice.fallback is not None and "falls back to float32" in choice.fallback
    assert "on the samples (SERVE_PRECISION_" in choice.fallback  # names the figure and the setting
    assert model.network() is original  # type: ignore[attr-defined]


@pytest.mark.parametrize("task", ["embeddings", "rerank", "classification", "fill-mask"])
def test_float16_runs_the_body_reduced_and_answers_in_float32(model_dirs: dict[str, Path], task: str) -> None:
    import torch

    model = loaded(model_dirs[task])
    choice = p.check(model, task, "float16", LENIENT)
    assert choice.precision == "float16", choice.fallback
    assert next(model.network().parameters()).dtype == torch.float16  # type: ignore[attr-defined]
    assert set(choice.exactness) and all(np.isfinite(list(choice.exactness.values())))
    raw, _ = p.sample_items(task)
    outputs = model.predict([model.prepare(item) for item in raw[:8]])  # type: ignore[attr-defined]
    if task in ("embeddings", "rerank"):  # pooled and scored in float32 whatever the network ran in
        assert outputs.dtype == np.float32
    # The body's own output is float32 too, also when it is called as sentence-transformers
    # calls it (its forward method, which skips hooks).
    network = model.network()  # type: ignore[attr-defined]
    ids = torch.tensor([[101, 2023, 102]])
    hidden = network.forward(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True)
    assert all(v.dtype == torch.float32 for v in hidden.values() if v.is_floating_point())


def test_int8_on_real_embeddings_keeps_the_sensitive_layers_in_float32(model_dirs: dict[str, Path]) -> None:
    """all-MiniLM-L6-v2 with every Linear layer in int8 is under the default floor: some stay float32."""
    model = loaded(model_dirs["embeddings"])
    outcome = settle(
        model, "embeddings", Settings(model=str(model_dirs["embeddings"]), precision="int8"), "cpu"
    )
    assert outcome.precision == "int8", outcome.fallback
    assert outcome.kept_float32, "the default floor keeps some layers in float32 on this model"
    assert outcome.exactness["min_cosine"] >= 0.95 and outcome.exactness["median_cosine"] >= 0.98
    described = outcome.describe()
    assert described["in_use"] == "int8" and described["float32_layers"] == list(outcome.kept_float32)


def test_workers_sharing_a_run_dir_check_once(
    model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(model=str(model_dirs["classification"]), precision="int8", run_dir=str(tmp_path))
    settings = settings.replace(precision_min_top1=0.0, precision_max_score_diff=1e9)
    first = settle(loaded(model_dirs["classification"]), "classification", settings, "cpu")
    assert len(list(tmp_path.glob("precision-*.json"))) == 1
    second_model = loaded(model_dirs["classification"])

    def checked_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("a second worker checked again")

    monkeypatch.setattr(p, "check", checked_again)
    second = settle(second_model, "classification", settings, "cpu")
    assert second == first
    assert not p.linear_layers(second_model.network())  # type: ignore[attr-defined]


# -- the search and its failures, on a toy network -----------------------------------------------


def test_the_longest_passing_run_is_found_by_bisection_with_the_last_refusal() -> None:
    def measure(n: int) -> tuple[dict[str, float], str | None]:
        return ({"n": float(n)}, None) if n <= 6 else ({}, f"{n} layers move it too far")

    count, figures, why = p._longest_passing(10, measure, {}, "all 10 move it too far")
    assert (count, figures) == (6, {"n": 6.0}) and why is not None and "layers move it too far" in why
    none_pass = p._longest_passing(10, lambda n: ({}, f"{n} too far"), {}, "all too far")
    assert none_pass[0] == 0 and none_pass[2] == "1 too far"


class Toy:
    """A Reducible model of two Linear layers over fixed vectors, its items indices of them."""

    task = "embeddings"
    name = "toy"

    def __init__(self) -> None:
        import torch

        torch.manual_seed(0)
        self._network = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        self._inputs = torch.randn(200, 8)

    def network(self) -> object:
        return self._network

    def use_network(self, module: object) -> None:
        self._network = module  # type: ignore[assignment]

    def prepare(self, item: str) -> int:
        return len(item) % 200

    def predict(self, batch: list[int]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out: np.ndarray = self._network(self._inputs[batch]).float().numpy()
        return out


def test_a_reduced_network_that_raises_falls_back_with_the_reason_and_the_original_stays() -> None:
    model = Toy()
    original = model.network()

    def run(batch: list[int]) -> np.ndarray:
        if model.network() is not original:
            raise RuntimeError("no kernel for this dtype")
        return model.predict(batch)

    choice = p.check(model, "embeddings", "int8", p.Floor(), run=run)
    assert choice.precision == "float32" and not choice.failed
    assert choice.fallback is not None and "RuntimeError: no kernel for this dtype" in choice.fallback
    assert model.network() is original


def test_a_check_that_cannot_run_at_all_falls_back_and_is_marked_failed() -> None:
    model = Toy()
    original = model.network()

    def run(batch: list[int]) -> np.ndarray:
        raise MemoryError("out of memory")

    choice = p.check(model, "embeddings", "float16", p.Floor(), run=run)
    assert choice.precision == "float32" and choice.failed
    assert "the check failed: MemoryError: out of memory" in (choice.fallback or "")
    assert model.network() is original


def test_the_refusal_names_the_floor_as_set_and_the_samples_reserve() -> None:
    why = p.shortfall({"min_cosine": 0.97}, p.on_samples(p.Floor()), p.Floor())
    assert why == (
        "min_cosine 0.9700 is under 0.98 on the samples (SERVE_PRECISION_MIN_COSINE=0.95, with a reserve "
        "for the tail)"
    )


def test_an_unreadable_entry_is_checked_again(
    model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(model=str(model_dirs["classification"]), precision="int8", run_dir=str(tmp_path))
    settings = settings.replace(precision_min_top1=0.0, precision_max_score_diff=1000.0)
    settle(loaded(model_dirs["classification"]), "classification", settings, "cpu")
    (entry,) = tmp_path.glob("precision-*.json")
    entry.write_text('{"precision": "int8", "unknown_field": 1}')
    checks = []
    real_check = p.check

    def counted(*args: object, **kwargs: object) -> p.Choice:
        checks.append(1)
        return real_check(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(p, "check", counted)
    outcome = settle(loaded(model_dirs["classification"]), "classification", settings, "cpu")
    assert checks == [1] and outcome.precision == "int8"


# -- auto, with the processor's flags fed in -----------------------------------------------------
# bfloat16 runs natively where the machine has avx512_bf16 or amx_bf16, and is
# emulated (slowly, but exactly as rounded) where it has neither: these tests
# run on either.


@pytest.mark.parametrize("task", ["embeddings", "rerank", "classification", "fill-mask"])
def test_auto_on_an_amx_cpu_checks_bfloat16_against_its_stricter_floor_and_says_why(
    model_dirs: dict[str, Path], task: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(p, "cpu_flags", lambda: AMX)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    model = loaded(model_dirs[task])
    outcome = settle(model, task, Settings(model=str(model_dirs[task])), "cpu")
    assert outcome.requested == "auto" and outcome.reason == "auto: bfloat16, the processor has amx_bf16"
    described = outcome.describe()
    assert described["reason"] == outcome.reason
    if outcome.precision == "bfloat16":
        assert outcome.code == "amx_bf16"
        floor = p.on_samples(p.AUTO_FLOOR)
        figures = outcome.exactness
        assert figures.get("min_cosine", 1) >= floor.min_cosine
        assert figures.get("top1_where_clear", 1) == 1 and figures.get("clear_share", 1) >= 0.5
        if task in ("classification", "fill-mask"):
            assert figures["top1_agreement"] >= 0.99
    else:  # a tiny random network may fail auto's floor: then float32, with the figure that failed
        assert outcome.code == "exactness" and outcome.fallback is not None
        assert "bfloat16 falls back to float32" in outcome.fallback and "on the samples" in outcome.fallback
    assert outcome.summary().startswith(f"precision {outcome.precision} (asked: auto); auto: ")


def test_auto_keeps_minilm_in_bfloat16_at_a_min_cosine_of_0_999_or_more(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(p, "cpu_flags", lambda: AMX)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    outcome = settle(loaded(model_dirs["embeddings"]), "embeddings", Settings(model="minilm"), "cpu")
    assert outcome.precision == "bfloat16", outcome.fallback
    assert outcome.exactness["min_cosine"] >= 0.9996  # auto's 0.999, with the tail's reserve


def test_auto_without_native_bfloat16_or_without_the_cache_stays_float32_unchecked(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("float32 needs no check")

    monkeypatch.setattr(p, "check", never)
    for flags, cache, code in ((VNNI_ONLY, "1024", "no_bfloat16"), (AMX, "0", "onednn_cache_off")):
        monkeypatch.setattr(p, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", cache)
        model = loaded(model_dirs["rerank"])
        original = model.network()  # type: ignore[attr-defined]
        outcome = settle(model, "rerank", Settings(model=str(model_dirs["rerank"])), "cpu")
        assert (outcome.precision, outcome.code, outcome.exactness) == ("float32", code, {})
        assert model.network() is original  # type: ignore[attr-defined]


class Timed(Toy):
    """A Toy whose reduced network takes ``slow_s`` more a call: what a slower bfloat16 looks like."""

    def __init__(self, slow_s: float) -> None:
        super().__init__()
        self.original = self.network()
        self.slow_s = slow_s

    def predict(self, batch: list[int]) -> np.ndarray:
        import time

        import torch

        # A negative slow_s slows float32 instead.
        reduced = self.network() is not self.original
        if (reduced and self.slow_s > 0) or (not reduced and self.slow_s < 0):
            time.sleep(abs(self.slow_s))
        network = self._network
        dtype = next(network.parameters()).dtype  # type: ignore[attr-defined]
        with torch.inference_mode():
            out: np.ndarray = network(self._inputs[batch].to(dtype)).float().numpy()
        return out


def test_a_measured_bfloat16_is_kept_only_where_it_is_faster() -> None:
    slower = Timed(slow_s=0.02)  # 20 ms a call on a network that takes microseconds
    choice = p.check(slower, "embeddings", "bfloat16", LENIENT, measure=True)
    assert choice.precision == "float32" and choice.speedup is not None and choice.speedup < p.MIN_SPEEDUP
    assert "float32's speed, under 1.05x" in (choice.fallback or "")
    assert slower.network() is slower.original

    # float32 20 ms slower a call: the reduced network measures faster, and is kept with its figure.
    faster = Timed(slow_s=-0.02)
    kept_faster = p.check(faster, "embeddings", "bfloat16", LENIENT, measure=True)
    assert kept_faster.precision == "bfloat16" and (kept_faster.speedup or 0) > p.MIN_SPEEDUP
    assert faster.network() is not faster.original

    # Unmeasured (amx_bf16), a slower network is kept: its speed is not asked.
    kept = p.check(Timed(slow_s=0.002), "embeddings", "bfloat16", LENIENT)
    assert kept.precision == "bfloat16" and kept.speedup is None


def test_the_measured_outcome_names_its_speed_and_code(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.models import precision_cache

    target = precision_cache.Target("bfloat16", p.Floor(), p.Floor(), "auto: ...", "avx512_bf16_faster", True)
    kept = precision_cache._outcome("auto", p.Choice("bfloat16", speedup=1.31), target)
    assert kept.code == "avx512_bf16_faster" and kept.describe()["speedup_vs_float32"] == 1.31
    assert "measured 1.31x float32's speed" in kept.summary()
    slower = precision_cache._outcome("auto", p.Choice("float32", fallback="slower", speedup=0.8), target)
    assert slower.code == "slower"
