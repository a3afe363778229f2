"""Argument types for the command line: numbers checked as argparse reads them.

`type=seconds(...)`, `type=number(...)` and `type=count(...)` turn a bad value into argparse's own one-line error
naming the flag (`atoll coordinator: error: argument --lease: must be a positive number of seconds, got -5`), so a
NaN, an infinity, a negative wait or a count past what the wire carries never reaches a `timedelta`, a protobuf
field or a loop.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

MAX_SECONDS = 10 * 365 * 24 * 3600.0
"""The longest wait a flag may give: ten years (a `timedelta` overflows near 2.7 million years; nothing here waits
that long on purpose)."""
MAX_COUNT = 2**62
"""The largest count a flag may give (the wire's signed 64-bit integers, with room to add)."""


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def number(*, least: float | None = None, most: float | None = None, above: float | None = None,
           what: str = "a number") -> Callable[[str], float]:
    """A finite float within [least, most] (and greater than `above` where given)."""

    def parse(text: str) -> float:
        x = _float(text)
        bounds = []
        if above is not None:
            bounds.append(f"greater than {above:g}")
        if least is not None:
            bounds.append(f"at least {least:g}")
        if most is not None:
            bounds.append(f"at most {most:g}")
        ok = math.isfinite(x) and (above is None or x > above) and (least is None or x >= least) and \
            (most is None or x <= most)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {what}{' ' + ' and '.join(bounds) if bounds else ''}, "
                                             f"got {text}")
        return x

    return parse


def seconds(*, positive: bool = True, most: float = MAX_SECONDS) -> Callable[[str], float]:
    """Seconds: finite, positive (or >= 0 with `positive=False`), at most `most`."""
    what = "a positive number of seconds" if positive else "a number of seconds >= 0"

    def parse(text: str) -> float:
        x = _float(text)
        if math.isnan(x) or (x <= 0 if positive else x < 0):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        if x > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:,.0f} seconds, got {text}")
        return x

    return parse


def count(*, least: int = 1, most: int = MAX_COUNT, what: str = "a whole number") -> Callable[[str], int]:
    """An integer within [least, most]."""

    def parse(text: str) -> int:
        try:
            x = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not least <= x <= most:
            raise argparse.ArgumentTypeError(f"must be {what} from {least:,} to {most:,}, got {text}")
        return x

    return parse
