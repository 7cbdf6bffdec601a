"""The one exception type the shim lets escape into Ray.

Everything else raised inside a wrapper is treated as a shim bug: logged, and
Ray's original behaviour runs instead. A ``ShimError`` is a problem with the
user's input or environment that Ray would also fail on, only later and less
clearly (after GPUs are reserved and the engine is starting), so it is raised
before the engine starts, naming the URI, the problem and the fix.

Its message is redacted on construction (:mod:`.redact`): URL userinfo,
credential query parameters and secret environment values never reach Ray's
error reports, whoever raised it.
"""


class ShimError(ValueError):
    """A foreseeable failure: bad model source, missing dependency, S3 fault."""

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            from .redact import (
                redact_text,  # here, not at import: ``import ray_runai_shim`` stays cheap
            )

            args = (redact_text(args[0]), *args[1:])
        super().__init__(*args)
