"""A sentence-transformers directory's prompts, read from ``config_sentence_transformers.json``.

Embedders trained with instructions (E5's "query: ", nomic's
"search_document: ") keep them in that file as ``prompts`` (name to text) and
``default_prompt_name``. Free of torch and numpy, like service.config.model_spec,
which reads and checks them (read_prompts): the gunicorn master refuses a malformed file before it
forks. service.models.embeddings applies them; service.models.prompts chooses
one for a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.errors import SettingsError, json_type

PROMPTS_FILE = "config_sentence_transformers.json"


@dataclass(frozen=True)
class Prompts:
    """A model's prompts by name, and the one a request that names none gets (None: no prompt)."""

    by_name: dict[str, str]
    default_name: str | None = None

    @property
    def default(self) -> str:
        """The text every item gets when its request names no prompt ("" for none)."""
        return self.by_name[self.default_name] if self.default_name is not None else ""

    def describe(self) -> dict[str, Any]:
        """What /info and /v1/models say of them."""
        return {"prompts": dict(self.by_name), "default_prompt_name": self.default_name}

    def summary(self) -> str:
        """For the start log."""
        named = ", ".join(f"{name} ({text!r})" for name, text in self.by_name.items())
        default = f"{self.default_name!r}" if self.default_name is not None else "none"
        return f"prompts {named}; default prompt {default}"


def prompts_from(document: dict[str, Any], where: str) -> Prompts | None:
    """The prompts a parsed config lists; None without any prompt. ``where`` begins each error.

    A SettingsError names the key for a config that is not what
    sentence-transformers saves: ``prompts`` an object of strings, and
    ``default_prompt_name`` null or one of its names.
    """
    prompts = document.get("prompts")
    default = document.get("default_prompt_name")
    if prompts is None:
        prompts = {}
    if not isinstance(prompts, dict):
        raise SettingsError(
            f'{where}: "prompts" must be an object of prompt names to texts, '
            f'such as {{"query": "query: "}}, got {json_type(prompts)}'
        )
    for name, text in prompts.items():
        if not isinstance(text, str):
            raise SettingsError(
                f'{where}: "prompts" {name!r} must be a string (the text put before each input), '
                f"got {json_type(text)}"
            )
    if default is not None and not isinstance(default, str):
        raise SettingsError(
            f'{where}: "default_prompt_name" must be null or a name in "prompts", got {json_type(default)}'
        )
    if default is not None and default not in prompts:
        known = ", ".join(repr(name) for name in prompts) or "none"
        raise SettingsError(
            f'{where}: "default_prompt_name" is {default!r}, which "prompts" does not name; '
            f"its prompts: {known}"
        )
    if not prompts:
        return None
    return Prompts(dict(prompts), default)
