"""The models: loading what ``SERVE_MODEL`` names, and everything that touches torch to run it.

Runs in each worker (and, built but never run, in the gunicorn master):
loading a built-in model, a model directory, a factory or a file (here,
registry, user); the kinds of model (minilm, hf and the text kinds, image,
mlp); their precision and its exactness check (precision, precision_cache);
their call shapes (shapes); and the process's torch pools and device (device).
"""

from __future__ import annotations

from pathlib import Path

from service.config.model_spec import BUILTIN, check_spec
from service.config.settings import Settings
from service.models.base import Model, describe

__all__ = ["BUILTIN", "Model", "describe", "load_model"]


def load_model(settings: Settings, device: str, *, may_run: bool = True) -> Model:
    """Build the model ``settings.model`` names, on ``device``: once per worker, or once in the master.

    ``may_run=False`` builds it without running it (no trace, no warm-up), as
    the gunicorn master must (service.host.preload); ``network_settled``
    finishes it where it runs.
    """
    spec = settings.model
    kind = check_spec(spec)
    if kind == "minilm":
        from service.models.minilm import MiniLMModel

        return MiniLMModel(device, trace=may_run)
    if kind == "mlp":
        from service.models.mlp import MLPModel

        return MLPModel(settings.mlp_width, settings.mlp_depth, settings.mlp_seed, device)
    if kind == "directory":
        from service.models.registry import load_directory

        return load_directory(Path(spec), device, settings.max_image_pixels, settings.image_layout)
    # The text kinds convert weights saved in float16 or bfloat16 to float32
    # (service.models.hf.in_float32). A program (a file, or an image directory's)
    # and a factory's model keep the dtypes they were built with: a traced graph
    # may fix dtypes inside it, and a factory's author chose its own; neither
    # offers a network the precision check could measure anyway.
    if kind == "file":
        from service.models.user import TorchFileModel

        return TorchFileModel(Path(spec), settings.item_shape, device)
    from service.models.user import FactoryModel

    return FactoryModel(spec, device)
