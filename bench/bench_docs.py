"""bench part: the generated block of a docs page, between a BEGIN and an END marker.

``bench_coldstart.py`` and ``bench_nodes.py`` each rewrite their own block of
docs/benchmarks.md with ``--docs``; this is the one implementation they share (each passes its
own markers and page name).
"""

from __future__ import annotations

from pathlib import Path


def page(path: Path, default_name: str) -> Path:
    """A folder -> its page *default_name* (``docs/`` -> ``docs/benchmarks.md``); a file is taken as given."""
    return path / default_name if path.is_dir() else path


def has_block(path: Path, begin: str, end: str) -> bool:
    """Whether *path* is a file with exactly one *begin* ... *end* block."""
    if not path.is_file():
        return False
    text = path.read_text()
    return text.count(begin) == 1 and text.count(end) == 1


def write_block(path: Path, begin: str, end: str, block: str) -> None:
    """Replace the *begin* ... *end* block of the page *path* with *block* (markers included)."""
    if not has_block(path, begin, end):
        raise SystemExit(f"{path} needs exactly one {begin} ... {end} block to rewrite")
    head, rest = path.read_text().split(begin)
    _old, tail = rest.split(end)
    path.write_text(head + block + tail)
