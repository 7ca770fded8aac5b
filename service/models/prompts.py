"""Choosing a request's prompt: by the name it sends, or the model's default.

A model with prompts (a sentence-transformers directory whose config lists
them, service.config.prompt_spec) holds them as ``prompts``; any other model
has none. The protocols call ``with_prompt`` in the request thread, before
``prepare_items``: a named prompt travels to the model's ``prepare`` with each
text (``Prompted``), and a bare text gets the model's default prompt there, as
``SentenceTransformer.encode`` gives it to a call that names none. So every
route, the precision check and the cost calibration see the same items.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.config.prompt_spec import Prompts
from service.errors import InvalidInput, json_type
from service.models.base import Model


@dataclass(frozen=True, slots=True)
class Prompted:
    """A client's text with the prompt its request named, for a model's ``prepare``."""

    text: Any  # as the client sent it: prepare checks it
    prompt_name: str


def prompts_of(model: Model) -> Prompts | None:
    prompts = getattr(model, "prompts", None)
    return prompts if isinstance(prompts, Prompts) else None


def with_prompt(model: Model, texts: list[Any], prompt_name: Any) -> list[Any]:
    """The items to hand to service.http.payload.prepare_items in place of ``texts``.

    Each text with the model's prompt ``prompt_name`` applied, or its default
    prompt when None (applied by ``prepare``, so ``texts`` come back as they
    are). A model without prompts: ``texts`` unchanged when ``prompt_name`` is
    None. An InvalidInput (422: the name does not fit the model) names the
    known prompts (or says the model has none) for an unknown name, and
    refuses a name that is not a string.
    """
    if prompt_name is None:
        return texts
    check_prompt_name(model, prompt_name)
    return [Prompted(text, prompt_name) for text in texts]


def prompt_text(model: Model, prompt_name: Any) -> str:
    """The text the prompt ``prompt_name`` (None: the default) puts before each input; "" for none.

    For a route that shows tokens rather than embedding them (TEI's ``/tokenize``
    takes ``prompt_name`` too). Refuses a name as ``with_prompt`` does.
    """
    if prompt_name is not None:
        check_prompt_name(model, prompt_name)
    prompts = prompts_of(model)
    if prompts is None:
        return ""
    return prompts.by_name[prompt_name] if prompt_name is not None else prompts.default


def check_prompt_name(model: Model, prompt_name: Any) -> None:
    """Refuse (InvalidInput) a ``prompt_name`` the model does not have."""
    if not isinstance(prompt_name, str):
        raise InvalidInput(f'"prompt_name" must be a string naming a prompt, got {json_type(prompt_name)}')
    prompts = prompts_of(model)
    if prompts is None:
        raise InvalidInput(
            f'"prompt_name" {prompt_name[:100]!r}: model {model.name!r} has no prompts (its directory\'s '
            'config_sentence_transformers.json lists none); leave "prompt_name" out'
        )
    if prompt_name not in prompts.by_name:
        known = ", ".join(repr(name) for name in prompts.by_name)
        raise InvalidInput(
            f'"prompt_name" {prompt_name[:100]!r} is not a prompt of model {model.name!r}; '
            f"its prompts: {known}"
        )
