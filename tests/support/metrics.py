"""Read a Prometheus text scrape back into numbers the tests can compare."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    samples: list[tuple[str, dict[str, str], float]]

    @classmethod
    def parse(cls, text: str | bytes) -> Scrape:
        if isinstance(text, bytes):
            text = text.decode()
        return cls(
            [
                (sample.name, dict(sample.labels), sample.value)
                for family in text_string_to_metric_families(text)
                for sample in family.samples
            ]
        )

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
        return sum(
            value
            for sample_name, sample_labels, value in self.samples
            if sample_name == name and labels.items() <= sample_labels.items()
        )

    def series(self, name: str) -> list[dict[str, str]]:
        return [labels for sample_name, labels, _ in self.samples if sample_name == name]

    def names(self) -> set[str]:
        return {name for name, _, _ in self.samples}
