"""A user's own worker_process_setup_hook, importable by Ray workers (this dir is on PYTHONPATH)."""

import os


def mark_worker() -> None:
    os.environ["USER_SETUP_HOOK_RAN"] = "string-hook"
