"""docs/settings.md and service/config/settings.py describe the same settings.

The table in docs/settings.md has the columns variable, default, allowed and meaning.
The rules it must follow:

- **Names.** Every variable ``Settings.from_env`` reads (``_FIELDS``) has exactly one row,
  and every row names one of them, or ``CUDA_VISIBLE_DEVICES``, which
  ``cuda_visible_devices()`` reads.
- **Defaults.** Where the dataclass default is a literal, the default cell's first code span,
  parsed by the setting's own parser, gives that default (`` `on` `` for ``True``,
  `` `127.0.0.1,::1` `` for a tuple); words may follow, as in `` `0` (never)``. Where the
  dataclass default is ``None`` (unset, or computed at start from the machine or from other
  settings, such as "usable cores" or "4 x max batch size"), the cell says so in words: it
  must hold words outside code spans, and no check is made of what they say.
- **Ranges.** Where the parser has bounds (``_Integer``, ``_Number``), the allowed cell
  starts with them as "LO to HI" (digits may be grouped with commas: 1,048,576). Where it has
  choices (``_Choice``), the allowed cell names each one as a code span.
- **Meaning.** Every row says what the setting does; that is for a reader to check.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from service.config.settings import _FIELDS, Settings, _Choice, _Integer, _Number

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
HEADER = ["variable", "default", "allowed", "meaning"]
# Read by service.config.settings.cuda_visible_devices(), outside the dataclass.
OTHER_VARIABLES = {"CUDA_VISIBLE_DEVICES"}

FIELD_OF = {var: name for name, (var, _) in _FIELDS.items()}
DEFAULTS = {field.name: field.default for field in dataclasses.fields(Settings)}
CODE_SPAN = re.compile(r"`([^`]+)`")
RANGE = re.compile(r"^(\d[\d,]*(?:\.\d+)?) to (\d[\d,]*(?:\.\d+)?)\b")


def table_rows() -> list[dict[str, str]]:
    """The settings table's rows, each a dict keyed by the header's columns."""
    rows: list[dict[str, str]] = []
    header_seen = False
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells == HEADER:
            header_seen = True
        elif header_seen and not set("".join(cells)) <= set("-: "):
            assert len(cells) == len(HEADER), f"docs/settings.md: a row needs {len(HEADER)} cells: {line}"
            rows.append(dict(zip(HEADER, cells, strict=True)))
    assert header_seen, f"docs/settings.md has no table headed | {' | '.join(HEADER)} |"
    return rows


ROWS = table_rows()


def row_of(var: str) -> dict[str, str]:
    for row in ROWS:
        if row["variable"] == f"`{var}`":
            return row
    pytest.fail(f"docs/settings.md has no row for {var}: add one")


def test_every_setting_has_exactly_one_row_and_every_row_is_a_setting() -> None:
    named = [row["variable"] for row in ROWS]
    malformed = [cell for cell in named if not re.fullmatch(r"`[A-Z][A-Z0-9_]*`", cell)]
    assert not malformed, f"a variable cell must be one name in backticks: {malformed}"
    names = [cell.strip("`") for cell in named]
    repeated = sorted({name for name in names if names.count(name) > 1})
    assert not repeated, f"docs/settings.md has more than one row for {repeated}"
    missing = sorted(set(FIELD_OF) - set(names))
    assert not missing, f"docs/settings.md has no row for {missing}: add one"
    unknown = sorted(set(names) - set(FIELD_OF) - OTHER_VARIABLES)
    assert not unknown, (
        f"docs/settings.md has rows for {unknown}, which service/config/settings.py does not read"
    )


@pytest.mark.parametrize("var", sorted(FIELD_OF))
def test_the_default_cell_matches_the_dataclass_default(var: str) -> None:
    cell = row_of(var)["default"]
    default = DEFAULTS[FIELD_OF[var]]
    if default is None:
        words = CODE_SPAN.sub("", cell)
        assert re.search(r"[a-z]", words), (
            f"{var} has no literal default: its default cell must say in words what happens "
            f"when it is unset (e.g. 'unset', '4 x max batch size'), got {cell!r}"
        )
        return
    spans = CODE_SPAN.findall(cell)
    assert spans, f"{var} defaults to {default!r}: its default cell must give it in backticks, got {cell!r}"
    parse = _FIELDS[FIELD_OF[var]][1]
    documented = parse(var, spans[0])
    assert documented == default, (
        f"{var}: docs/settings.md says the default is {spans[0]!r} ({documented!r}), "
        f"service/config/settings.py says {default!r}"
    )


def number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.mark.parametrize("var", sorted(FIELD_OF))
def test_the_allowed_cell_states_the_parsers_bounds_and_choices(var: str) -> None:
    row = row_of(var)
    cell = row["allowed"]
    parse = _FIELDS[FIELD_OF[var]][1]
    assert cell and row["meaning"], f"{var}: every row says what is allowed and what the setting means"
    if isinstance(parse, _Integer | _Number):
        match = RANGE.match(cell)
        stated = (number(match[1]), number(match[2])) if match else None
        assert stated == (parse.lo, parse.hi), (
            f"{var} takes {parse.lo:,g} to {parse.hi:,g}: its allowed cell must start with "
            f"'{parse.lo:,} to {parse.hi:,}', got {cell!r}"
        )
    if isinstance(parse, _Choice):
        missing = [choice for choice in parse.allowed if f"`{choice}`" not in cell]
        assert not missing, f"{var}: its allowed cell must name {missing} in backticks, got {cell!r}"
