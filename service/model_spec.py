"""What ``SERVE_MODEL`` names, checked without loading anything.

Free of torch, numpy and the user's code, so that the gunicorn master can refuse
a bad value before it forks a worker: numpy imported in the master would size
its BLAS pool for every worker before their thread settings apply.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from service.errors import SettingsError

BUILTIN = ("minilm", "mlp")
# .pt2 is a torch.export program; the others are TorchScript.
FILE_SUFFIXES = (".pt", ".pt2", ".pth", ".ts")


def kind(spec: str) -> str:
    """``minilm``, ``mlp``, ``file`` or ``factory``; raises SettingsError for none of them."""
    if spec in BUILTIN:
        return spec
    if spec.endswith(FILE_SUFFIXES) or "/" in spec:
        return "file"
    if ":" in spec:
        return "factory"
    close = difflib.get_close_matches(spec, BUILTIN, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise SettingsError(
        f"SERVE_MODEL must be one of {', '.join(BUILTIN)}, a module:factory or a path to a "
        f"{'/'.join(FILE_SUFFIXES)} file, got {spec!r}{hint}"
    )


def check_spec(spec: str) -> str:
    """The kind of model ``spec`` names, once it could name one; else a SettingsError.

    Refused: a name that is none of the kinds, a file that does not exist, a
    factory that is not ``module:callable``. Whether a factory's module imports
    is found out only in the workers, where its imports (torch, usually) belong.
    """
    found = kind(spec)
    if found == "file":
        path = Path(spec)
        if not path.is_file():
            where = "" if path.is_absolute() else f" under {Path.cwd()}"
            raise SettingsError(f"SERVE_MODEL={spec!r}: no such file{where}")
    elif found == "factory":
        module, _, attr = spec.partition(":")
        if not all(part.isidentifier() for part in module.split(".")) or not attr.isidentifier():
            raise SettingsError(
                f"SERVE_MODEL={spec!r}: a factory is named package.module:callable, "
                "such as mypackage.models:build"
            )
    return found
