"""The one markdown table writer every report uses (parity.md, the served check, the bench report, the
run summary, the repository's README)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines: the header, its separator, then a line per row (each cell as str())."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header),
            *(f"| {' | '.join(str(c) for c in row)} |" for row in rows)]
