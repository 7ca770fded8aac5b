"""Model loading: ``SERVE_MODEL`` names a built-in model, a factory or a file."""

from __future__ import annotations

from pathlib import Path

from service.errors import SettingsError
from service.models.base import Model, describe
from service.settings import Settings

BUILTIN = ("minilm", "mlp")

__all__ = ["BUILTIN", "Model", "describe", "load_model"]


def load_model(settings: Settings, device: str) -> Model:
    """Build the model ``settings.model`` names, on ``device``. Call once per worker."""
    spec = settings.model
    if spec == "minilm":
        from service.models.minilm import MiniLMModel

        return MiniLMModel(device)
    if spec == "mlp":
        from service.models.mlp import MLPModel

        return MLPModel(settings.mlp_width, settings.mlp_depth, settings.mlp_seed, device)
    if spec.endswith((".pt", ".pt2", ".pth", ".ts")) or "/" in spec:
        from service.models.user import TorchFileModel

        return TorchFileModel(Path(spec), settings.item_shape, device)
    if ":" in spec:
        from service.models.user import FactoryModel

        return FactoryModel(spec, device)
    raise SettingsError(
        f"SERVE_MODEL must be one of {', '.join(BUILTIN)}, a module:factory or a path to a "
        f".pt/.pt2 file, got {spec!r}"
    )
