"""The installer's one INFO line per job: short, and the full reasons elsewhere."""

from __future__ import annotations

import pytest

import ray_runai_shim
from ray_runai_shim import patches
from ray_runai_shim.tables.support import RAY_RANGES, SERVE_RANGES, plan_for

RELEASES = [f"2.{minor}.{micro}" for minor in range(40, 64) for micro in (0, 13)] + ["2.48.0rc1", "3.0.0"]


@pytest.mark.parametrize("version", RELEASES)
def test_the_line_is_at_most_160_characters_and_says_what_streams(version):
    line = patches.announcement(version)
    assert len(line) <= 160, line
    assert line.startswith(f"ray-runai-shim {ray_runai_shim.__version__}: Ray {version}: Ray Data: ")
    assert "; Serve LLM: " in line and line.endswith("details: ray-runai-shim doctor")
    assert ("nothing to patch" in line) == (not plan_for(version).patches and not plan_for(version, SERVE_RANGES).patches)


def test_the_full_reasons_are_in_status_and_doctor_not_in_the_line():
    line = patches.announcement("2.48.0")
    why = next(r.why for r in RAY_RANGES if r.low <= (2, 48) < r.high)
    assert plan_for("2.48.0").why == why and why not in line and len(why) > 160
    assert "Ray Data: shim streams" in line  # 2.48 copies the model without the shim
    assert "Ray Data: Ray streams; Serve LLM: Ray streams" in patches.announcement("2.60.0")
