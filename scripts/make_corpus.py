"""Build scripts/corpus/mixed.txt: real English prose, one sentence per line, of mixed length.

The benchmarks send one line per request. Two sources that ship with every
machine this project runs on, so the corpus can be rebuilt offline:
- the Python Language Reference and library topics, as Python ships them for
  ``help()`` (``pydoc_data.topics``): short to medium technical sentences;
- the GNU GPL 3 and Apache 2.0 licence texts from Debian's base-files
  (``/usr/share/common-licenses``): long legal sentences, the long tail.

Code samples, tables and lines that are mostly symbols are dropped. The order is
shuffled with a fixed seed so that any prefix of the file has the same mix.

Usage: python scripts/make_corpus.py [--out scripts/corpus/mixed.txt]
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import random
import re
from pathlib import Path

LICENCES = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")
MIN_WORDS, MAX_WORDS = 4, 130
SEED = 20261122


def sentences(text: str) -> list[str]:
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        # Indented blocks are code samples and grammar rules, not prose.
        if paragraph.startswith(("   ", "\t", ">>>")):
            continue
        flat = " ".join(paragraph.split())
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat):
            words = sentence.split()
            if not MIN_WORDS <= len(words) <= MAX_WORDS or not sentence.endswith((".", "?", "!")):
                continue
            prose = sum(c.isalpha() or c.isspace() for c in sentence) / len(sentence)
            if prose >= 0.8:
                found.append(sentence)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("corpus") / "mixed.txt")
    args = parser.parse_args()
    texts = [*pydoc_data.topics.topics.values()]
    texts += [Path(p).read_text() for p in LICENCES if Path(p).exists()]
    lines = list(dict.fromkeys(s for text in texts for s in sentences(text)))
    random.Random(SEED).shuffle(lines)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} sentences -> {args.out}")


if __name__ == "__main__":
    main()
