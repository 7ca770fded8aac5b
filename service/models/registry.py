"""Which module serves a model directory's task: one module per kind, imported only when used.

service.config.model_spec recognises the task from the directory's files (without
torch, in the gunicorn master); this maps it to the kind's class, in the worker.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from service.config.model_spec import directory_task
from service.models.base import CLASSIFICATION, EMBEDDINGS, FILL_MASK, RERANK, Model

KINDS = {
    EMBEDDINGS: ("service.models.embeddings", "SentenceEmbeddingModel"),
    RERANK: ("service.models.rerank", "CrossEncoderModel"),
    CLASSIFICATION: ("service.models.classification", "SequenceClassifierModel"),
    FILL_MASK: ("service.models.fill_mask", "MaskedLMModel"),
}


def load_directory(path: Path, device: str, max_image_pixels: int, image_layout: str = "auto") -> Model:
    """The model a directory holds, served by the kind its files call for."""
    task = directory_task(path)
    if task == "image":
        from service.models.image import ImageModel

        return ImageModel(path, device, max_image_pixels, image_layout)
    module, cls = KINDS[task]
    model: Model = getattr(importlib.import_module(module), cls)(path, device)
    return model
