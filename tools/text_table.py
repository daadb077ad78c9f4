"""Plain-text tables for the tools' printed reports."""

from __future__ import annotations


def text_table(head: tuple[str, ...], body: list[tuple[str, ...]], right: set[int] | None = None) -> list[str]:
    """Lines of a table: the head, a rule, the body; columns in ``right`` (default: all) right-aligned."""
    rows = [head, *body]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    align = (lambda i: True) if right is None else (lambda i: i in right)  # noqa: E731
    lines = ["  ".join(c.rjust(w) if align(i) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
