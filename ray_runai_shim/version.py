"""The package's version, in one place (setup.cfg reads it; the log line and doctor show it)."""

__version__ = "0.2.0"
