"""``python -m ray_runai_shim doctor [URI]``."""

import sys

from .doctor import main

sys.exit(main())
