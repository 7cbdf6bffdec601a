"""Diagnostics: store and disk errors mapped to cause and fix (``diagnose``), and secrets kept
out of everything printed, logged or forwarded (``redact``). The ``doctor`` CLI that shows
them is :mod:`ray_runai_shim.doctor`, above everything it inspects."""
