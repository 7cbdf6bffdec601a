"""Diagnostics: the ``doctor`` CLI, store and disk errors mapped to cause and fix
(``diagnose``), and secrets kept out of everything printed (``redact``)."""
