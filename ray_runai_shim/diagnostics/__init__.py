"""Diagnostics: store and disk errors mapped to cause and fix (``diagnose``). Secrets are kept
out of everything printed by :mod:`ray_runai_shim.redact`, below everything; the ``doctor`` CLI
that shows them is :mod:`ray_runai_shim.doctor`, above everything it inspects."""
