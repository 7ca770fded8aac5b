"""A Flask + gunicorn service that serves PyTorch models, naive and batched."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flask import Flask

    from service.config.settings import Settings

__all__ = ["__version__", "create_app"]

# The one place the version lives at run time; a test keeps it equal to pyproject.toml's.
__version__ = "0.1.0"


def create_app(settings: Settings | None = None) -> Flask:
    # Imported here so that ``import service`` stays cheap and starts nothing.
    from service.http.app import create_app as build

    return build(settings)
