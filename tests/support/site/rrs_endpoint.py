"""Point Ray 2.48's pyarrow ``S3FileSystem`` at ``AWS_ENDPOINT_URL(_S3)`` (test-only).

pyarrow ignores those vars (apache/arrow#49643). Only for control runs with the
shim disabled (``RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER=1``): it makes Ray's own
download path reach the fake S3.
"""

from __future__ import annotations

import os
from typing import Any

from rrs_flags import ENV_ENDPOINT_ADAPTER, flag


def enabled() -> bool:
    return flag(ENV_ENDPOINT_ADAPTER)


def install(wrapt: Any) -> None:
    def get_fs_and_path(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        fs, path = wrapped(*args, **kwargs)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        import pyarrow.fs as pa_fs

        if endpoint and isinstance(fs, pa_fs.S3FileSystem):
            scheme, _, host = endpoint.partition("://")
            old = fs.__reduce__()[1][0]  # the constructor kwargs, incl. 'anonymous'
            fs = pa_fs.S3FileSystem(
                anonymous=bool(old.get("anonymous", False)),
                endpoint_override=host.rstrip("/"),
                scheme=scheme,
                region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            )
        return fs, path

    @wrapt.when_imported("ray.llm._internal.common.utils.cloud_utils")
    def _cloud_utils(mod: Any) -> None:
        # Ray >= 2.53 moved to per-provider filesystems that read AWS_ENDPOINT_URL_S3 themselves.
        if "get_fs_and_path" in vars(getattr(mod, "CloudFileSystem", object)):
            wrapt.wrap_function_wrapper(mod, "CloudFileSystem.get_fs_and_path", get_fs_and_path)
