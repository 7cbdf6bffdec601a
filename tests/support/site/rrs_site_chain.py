"""Run the ``sitecustomize`` that this dir's own ``sitecustomize`` shadows.

Python imports only the first ``sitecustomize`` on sys.path; putting this dir on
PYTHONPATH must not silently disable one that the interpreter (a distro, a venv,
a matrix layer) already had.
"""

from __future__ import annotations

import os
import sys

#: The dir holding the test ``sitecustomize`` (this module sits next to it).
SITE_DIR = os.path.dirname(os.path.abspath(__file__))
#: Where the shadowed module ends up in sys.modules.
SHADOWED_NAME = "_shadowed_sitecustomize"


def chain_shadowed_sitecustomize() -> None:
    """Run any other ``sitecustomize`` later on sys.path, which the test one shadows."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != SITE_DIR]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[SHADOWED_NAME] = module
    spec.loader.exec_module(module)
