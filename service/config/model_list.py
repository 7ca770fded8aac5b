"""The models ``SERVE_MODEL`` lists, and the names clients pick them by. Pure: no torch, no I/O.

The grammar (docs/models.md, "Several models in one service")::

    SERVE_MODEL = entry ("," entry)*
    entry       = [names "="] spec
    names       = name ("|" name)*

A spec is any of the forms one model takes (a built-in, a directory, a file,
``module:factory``). The first name is the model's served name, in answers and
metric labels; the others are aliases a client may send instead (Cohere's
``rerank-v3.5``, say). An entry without names is served by the name its model
gives itself, as a lone model always was. The first entry is the default: the
model of a request that names none.

A spec holding ``,`` or ``=`` writes them ``\\,`` and ``\\=`` (a backslash itself
``\\\\``): every other character is taken as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from service.errors import SettingsError

# Names as the protocols' clients send them: "all-MiniLM-L6-v2", "rerank-v3.5",
# "sentence-transformers/all-MiniLM-L6-v2", "BAAI/bge-m3:latest".
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
_ESCAPABLE = {",", "=", "\\"}


@dataclass(frozen=True)
class ModelEntry:
    spec: str
    # The served name first, then the aliases; empty: the model's own name.
    names: tuple[str, ...] = ()

    @property
    def name(self) -> str | None:
        return self.names[0] if self.names else None


def parse_models(value: str) -> tuple[ModelEntry, ...]:
    """The entries of a ``SERVE_MODEL`` value, in order; SettingsError naming what is wrong."""
    entries = []
    for raw, equals in _split(value):
        names: tuple[str, ...] = ()
        if equals is None:
            spec = raw
        else:
            spec, names = raw[equals + 1 :], _names(raw[:equals], value)
        spec = _unescape(spec).strip()
        if not spec:
            raise SettingsError(
                f"SERVE_MODEL={value!r}: an entry names no model ({raw.strip() or 'empty'!r})"
            )
        entries.append(ModelEntry(spec, names))
    seen: dict[str, str] = {}
    for entry in entries:
        for name in entry.names:
            if name in seen:
                raise SettingsError(
                    f"SERVE_MODEL={value!r}: the name {name!r} is given to both {seen[name]!r} and "
                    f"{entry.spec!r}; each name picks one model"
                )
            seen[name] = entry.spec
    return tuple(entries)


def _split(value: str) -> Iterator[tuple[str, int | None]]:
    """Each entry as written (escapes kept) and where its first unescaped ``=`` is (None: none)."""
    start, equals, escaped = 0, None, False
    for i, char in enumerate(value):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "=" and equals is None:
            equals = i - start
        elif char == ",":
            yield value[start:i], equals
            start, equals = i + 1, None
    yield value[start:], equals


def _names(raw: str, value: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in raw.split("|"))
    for name in names:
        if not NAME.fullmatch(name):
            raise SettingsError(
                f"SERVE_MODEL={value!r}: {name!r} is not a model name; a name is letters, digits and "
                "._:/@+- (starting with a letter or digit), and aliases follow it after |, as in "
                "rerank|rerank-v3.5=/models/cross-encoder"
            )
    return names


def _unescape(spec: str) -> str:
    out, escaped = [], False
    for char in spec:
        if escaped:
            out.append(char if char in _ESCAPABLE else "\\" + char)
            escaped = False
        elif char == "\\":
            escaped = True
        else:
            out.append(char)
    if escaped:
        out.append("\\")
    return "".join(out)
