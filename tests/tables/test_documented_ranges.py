"""The ranges and the version the docs state are the tables' and the package's own: generated
from :mod:`ray_runai_shim.tables.support` and :mod:`ray_runai_shim.version` here and looked for
in README.md, setup.cfg and CHANGELOG.md, so a table change that the docs do not follow fails."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from ray_runai_shim.tables.support import (
    AUX_PULL,
    HANDOFF,
    PEER_FILES,
    RAY_RANGES,
    RELAY,
    S3_ANONYMOUS,
    SERVE_RANGES,
    SHARDED_FORMAT,
    TOKENIZER,
)
from ray_runai_shim.version import __version__

ROOT = Path(__file__).resolve().parents[2]
README = " ".join((ROOT / "README.md").read_text().split())  # one space between words, line breaks too


def span(*patches: str, ranges=RAY_RANGES + SERVE_RANGES, dash: str = "–") -> str:
    """``2.45–2.60``: the first and the last Ray minor of the ranges holding any of *patches*
    (every range when none is given)."""
    hits = [r for r in ranges if not patches or r.patches & set(patches)]
    low = min(r.low for r in hits)
    high = max(r.high for r in hits)
    return f"{low[0]}.{low[1]}{dash}{high[0]}.{high[1] - 1}"


def test_the_supported_range_in_setup_cfg_and_the_readme_is_the_tables():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert f"(Ray {span(dash='-')})" in cfg["metadata"]["description"]
    assert f"every Ray minor {span()}" in README


def test_what_the_readme_says_streams_where_is_the_tables():
    assert f"on Ray **{span(HANDOFF, SHARDED_FORMAT, ranges=RAY_RANGES)}**" in README
    for phrase, patch in (("tokenizer-only downloads served complete", TOKENIZER),
                          ("`s3://anonymous@` URIs", S3_ANONYMOUS),
                          ("when engines start together on a node", AUX_PULL),
                          ("the non-weight files for vLLM workers on other nodes", PEER_FILES),
                          ("one streamer memory budget per node", RELAY)):
        assert f"{phrase} ({span(patch)})" in README, (phrase, span(patch))


def test_one_version_everywhere():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(r"^## (\S+)", changelog, re.M).group(1) == __version__
    assert f"ray-runai-shim {__version__}:" in README  # the banner the README shows
    assert "version = attr: ray_runai_shim.version.__version__" in (ROOT / "setup.cfg").read_text()
