"""Files named on the command line: a path as given (relative to the current folder), else one of the examples
installed with atoll (`atoll.examples`, the repository's examples/ folder), so `--job examples/tiny.toml` and
`--cluster examples/clusters/two-regions.toml` work from any folder."""

from __future__ import annotations

from importlib import resources
from pathlib import Path, PurePosixPath


def examples_dir() -> Path:
    """The folder of the installed examples."""
    return Path(str(resources.files("atoll.examples")))


def input_path(given: str | Path) -> Path:
    """`given` made absolute when it exists; else the installed example it names (`examples/tiny.toml`,
    `tiny.toml`); else `given` unchanged, for the caller's not-found error to name."""
    path = Path(given).expanduser()
    if path.exists() or path.is_absolute():
        return path.resolve() if path.exists() else path
    parts = PurePosixPath(path.as_posix()).parts
    if parts and parts[0] == "examples":
        parts = parts[1:]
    if parts:
        example = examples_dir().joinpath(*parts)
        if example.is_file():
            return example
    return path
