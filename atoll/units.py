"""Figures for people: a duration in the unit that shows it, from microseconds to hours of seconds; a count with
its noun."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """`seconds` with three significant digits in µs, ms or s (0.00042 -> "420 µs", 0.0123 -> "12.3 ms",
    4.2 -> "4.20 s", 1234 -> "1,234 s"), so a tiny model's step is not printed as "0.000 s"."""
    x = abs(seconds)
    if x == 0:
        return "0 s"
    if x < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if x < 1:
        return f"{seconds * 1e3:.3g} ms"
    if x < 100:
        return f"{seconds:.2f} s"
    return f"{seconds:,.0f} s"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` with its noun, singular for one: counted(1, "node") -> "1 node", counted(3, "node") -> "3 nodes"."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
