"""The one markdown table writer every report uses (parity.md, the served check, the bench report, the
run summary, the repository's README)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines: the header, its separator, then a line per row (each cell as str())."""
    return [
        f"| {' | '.join(header)} |",
        "|" + "---|" * len(header),
        *(f"| {' | '.join(str(c) for c in row)} |" for row in rows),
    ]


def size(n: float) -> str:
    """Bytes in words a table can hold: 812 KB, 44.7 MB, 1.04 GB (powers of ten, as disk sizes are given)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{1 if unit == 'MB' else 2 if unit == 'GB' else 0}f} {unit}"
    return f"{int(n)} B"


def cell(v: Any, spec: str = ".2f", dash: str = "-") -> str:
    """A number as a table cell in ``spec``; ``dash`` where there is none."""
    return format(v, spec) if isinstance(v, (int, float)) else dash
