"""The one exception type the shim lets escape into Ray.

Everything else raised inside a wrapper is treated as a shim bug: logged, and
Ray's original behaviour runs instead. A ``ShimError`` is a problem with the
user's input or environment that Ray would also fail on, only later and less
clearly (after GPUs are reserved and the engine is starting), so it is raised
before the engine starts, naming the URI, the problem and the fix.
"""


class ShimError(ValueError):
    """A foreseeable failure: bad model source, missing dependency, S3 fault."""
