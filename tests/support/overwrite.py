"""An object overwritten in the store while the node relay copies it (a torn-copy test's part)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable


def when_copying(relay_base: Path, put: Callable[[], None], after: float = 0.5, timeout: float = 30.0
                 ) -> threading.Thread:
    """A started thread that waits for a relay copy to begin in *relay_base* (its ``.live``
    directory), then *after* seconds runs *put*: the store's object changes mid-copy."""

    def run() -> None:
        deadline = time.monotonic() + timeout
        while not (relay_base.is_dir() and any(p.name.endswith(".live") for p in relay_base.iterdir())):
            assert time.monotonic() < deadline, "the relay's copy never began"
            time.sleep(0.02)
        time.sleep(after)
        put()

    t = threading.Thread(target=run, name="overwrite-mid-copy")
    t.start()
    return t
