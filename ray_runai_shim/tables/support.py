"""What each Ray release needs, as data.

The tables come from reading every released Ray wheel 2.43-2.60 (see the
compatibility tables in docs/compatibility.md). They say which patch *names* a release gets;
:mod:`.targets` says which Ray names each patch touches, and its feature
checks (``unless_has``: e.g. a stage module that already has
``STREAMING_LOAD_FORMATS`` is left alone) have the last word. A Ray outside
the tables gets nothing.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from . import schemes

#: Formats whose weights vLLM reads from the URI itself.
STREAMING_FORMATS: frozenset[str] = frozenset(
    {"runai_streamer", "runai_streamer_sharded", "tensorizer"}
)

#: Patch names.
DOWNLOAD = "batch-download"  # narrow the stage's MODEL_AND_TOKENIZER download
HANDOFF = "batch-handoff"  # give vLLM the weights URI next to the local dir
ENDPOINT = "s3-endpoint"  # make Ray's pyarrow S3 filesystem honour AWS_ENDPOINT_URL
SHARDED_FORMAT = "sharded-format"  # teach 2.51 that runai_streamer_sharded streams
ACTIVATION = "worker-activation"  # carry the shim into the job's worker processes
SERVE_DOWNLOAD = "serve-download"  # narrow Serve LLM's node-init MODEL_AND_TOKENIZER download
SERVE_HANDOFF = "serve-handoff"  # give Serve's vLLM engine the weights URI next to the local dir
RUNTIME_ENV = "vllm-runtime-env"  # keep vLLM's own ray.init valid under the job's setup hook
TOKENIZER = "tokenizer-download"  # serve tokenizer-only downloads complete, from the snapshot
SERVE_ACTIVATION = "serve-activation"  # carry the shim into replicas of config-deployed apps
SERVE_MIRROR = "serve-mirror-uri"  # give Serve's vLLM engine the mirror URI, not the bare model_id
S3_ANONYMOUS = "s3-anonymous"  # map Ray's s3://anonymous@ URIs to the streamer's unsigned mode (2.51+)
AUX_PULL = "vllm-aux-pull"  # fetch vLLM's non-weight files once per node, locked (vLLM 0.11-0.15 race)
PEER_FILES = "vllm-peer-files"  # the non-weight files on every node a vLLM worker runs on (vllm#50616)
RELAY = "node-relay"  # N readers on a node (engines x ranks) read the store once; one streamer memory budget
RELAY_READER = "node-relay-reader"  # each vLLM rank reads the relay's copy as it lands (#36)
#: Patches of vLLM's own code that hold whatever the Ray release, and apply in processes that
#: never import Ray (vLLM's engine core and workers): not in the per-release tables.
RAY_FREE = frozenset({RELAY_READER})
OFFLINE = "vllm-offline-uri"  # keep an object-store model out of vLLM's HF_HUB_OFFLINE Hub lookup (vLLM 0.10.2-0.22)

#: vLLM releases whose own pull of the non-weight files wipes and re-creates a shared
#: directory on every engine config (``rmtree`` + ``makedirs``): engines starting together
#: on one node race (ray#60681). vLLM 0.16 fixed it (vllm#33604). [low, high), (major, minor).
VLLM_AUX_PULL_RACE: tuple[tuple[int, int], tuple[int, int]] = ((0, 11), (0, 16))
#: vLLM releases whose ``EngineArgs.__post_init__``, under ``HF_HUB_OFFLINE=1``, hands every model
#: and tokenizer to ``get_model_path`` -> ``snapshot_download(repo_id=...)``, object-store URIs
#: included: ``HFValidationError`` before anything streams. Added in 0.10.2; vLLM 0.23 skips
#: ``is_cloud_storage`` URIs there. [low, high), (major, minor); 0.10.0/0.10.1 have no such call.
VLLM_OFFLINE_HUB_LOOKUP: tuple[tuple[int, int], tuple[int, int]] = ((0, 10), (0, 23))
#: What vLLM 0.23 keeps out of that lookup (``is_cloud_storage``): the object stores it streams from.
OBJECT_STORE_SCHEMES = tuple(f"{s}://" for s in schemes.VLLM_OBJECT_STORE)
_OFFLINE_WHY = ("with HF_HUB_OFFLINE=1, vLLM 0.10.2-0.22 look the object-store URI up on the Hub "
                "(HFValidationError): the shim keeps it out of that lookup")
_PEER_WHY = ("vLLM's workers on other nodes (tensor/pipeline parallel across nodes) are told a model "
             "directory that exists only where the engine was configured (vllm#50616)")
_RELAY_WHY = ("every engine and tensor-parallel rank on a node streams the whole checkpoint (N x S from "
              "the store, N x 40 GB of streamer memory): the shim reads it once per node and bounds the memory")
_RACE_WHY = ("with vLLM 0.11-0.15, engines starting together on one node race on vLLM's own pull of "
             "the non-weight files (ray#60681): the shim fetches them once per node, locked")


class Range(NamedTuple):
    low: tuple[int, int]  # inclusive (major, minor)
    high: tuple[int, int]  # exclusive
    patches: frozenset[str]
    why: str
    needs: str = ""  # patch only where this package is installed (else nothing: not applicable)


RAY_RANGES: tuple[Range, ...] = (
    Range((2, 43), (2, 45), frozenset(), "the vLLM stage downloads nothing and passes the URI"),
    Range(
        (2, 45),
        (2, 50),
        frozenset({RELAY, DOWNLOAD, HANDOFF, ENDPOINT, ACTIVATION, RUNTIME_ENV, TOKENIZER, PEER_FILES}),
        "the vLLM stage downloads the whole model and hands vLLM the local copy (ray#55574); "
        "tokenizer-only downloads drop chat_template.jinja, vocab.json, ... (ray#62047); " + _PEER_WHY + "; " + _RELAY_WHY,
    ),
    Range(
        (2, 50),
        (2, 51),
        frozenset({RELAY, DOWNLOAD, HANDOFF, ACTIVATION, RUNTIME_ENV, TOKENIZER, PEER_FILES}),
        "the vLLM stage skips *.safetensors for runai_streamer/tensorizer (runai_streamer_sharded: "
        "the whole model) but still hands vLLM the local copy; tokenizer-only downloads drop "
        "chat_template.jinja, vocab.json, ... (ray#62047); " + _PEER_WHY + "; " + _RELAY_WHY,
    ),
    Range(
        (2, 51),
        (2, 52),
        frozenset({RELAY, SHARDED_FORMAT, ACTIVATION, RUNTIME_ENV, TOKENIZER, S3_ANONYMOUS, AUX_PULL, PEER_FILES,
                   OFFLINE}),
        "the vLLM stage streams runai_streamer/tensorizer but not runai_streamer_sharded; "
        "tokenizer-only downloads drop chat_template.jinja, vocab.json, ... (ray#62047); "
        "s3://anonymous@ URIs reach vLLM as given, which the streamer cannot open; " + _RACE_WHY + "; " + _PEER_WHY + "; " + _RELAY_WHY + "; " + _OFFLINE_WHY,
    ),
    Range(
        (2, 52),
        (2, 56),
        frozenset({RELAY, ACTIVATION, RUNTIME_ENV, TOKENIZER, S3_ANONYMOUS, AUX_PULL, PEER_FILES, OFFLINE}),
        "the vLLM stage streams all formats natively; tokenizer-only downloads drop "
        "chat_template.jinja, vocab.json, merges.txt, ... (ray#62047); "
        "s3://anonymous@ URIs reach vLLM as given, which the streamer cannot open; " + _RACE_WHY + "; " + _PEER_WHY + "; " + _RELAY_WHY + "; " + _OFFLINE_WHY,
    ),
    Range(
        (2, 56),
        (2, 61),
        frozenset({RELAY, ACTIVATION, TOKENIZER, S3_ANONYMOUS, PEER_FILES, OFFLINE}),
        "the vLLM stage streams all formats natively; tokenizer-only downloads keep chat templates "
        "(ray#62121) but still drop vocab.json, merges.txt, special_tokens_map.json, ...; "
        "s3://anonymous@ URIs reach vLLM as given, which the streamer cannot open; " + _PEER_WHY + "; " + _RELAY_WHY
        + "; " + _OFFLINE_WHY,
        needs="vllm",
    ),
)

#: Ray Serve LLM, by the same rules. Ranges the shim does not patch say what the
#: user sees there and what to do instead (research: ray-versions.md §1, §3, §7).
SERVE_RANGES: tuple[Range, ...] = (
    Range(
        (2, 43),
        (2, 45),
        frozenset(),
        "Serve passes string URIs to vLLM; CloudMirrorConfig sources are downloaded in full "
        "(not covered: use a string URI)",
    ),
    Range(
        (2, 45),
        (2, 52),
        frozenset({RELAY, SERVE_DOWNLOAD, SERVE_HANDOFF, SERVE_ACTIVATION}),
        "Serve LLM's node initialisation downloads the whole model (string URI or "
        "CloudMirrorConfig; with pipeline parallelism > 1 on every node of the placement group) and "
        "hands vLLM the local copy",
    ),
    Range(
        (2, 52),
        (2, 57),
        frozenset({RELAY, SERVE_MIRROR, ACTIVATION, SERVE_ACTIVATION, AUX_PULL}),
        "Serve LLM streams string URIs natively, but a CloudMirrorConfig source with a streaming "
        "load_format hands vLLM the bare model_id (fixed in 2.59 by ray#65753): the shim gives "
        "vLLM the mirror URI; " + _RACE_WHY,
    ),
    Range(
        (2, 57),
        (2, 59),
        frozenset({RELAY, SERVE_MIRROR, ACTIVATION, SERVE_ACTIVATION}),
        "Serve LLM hands vLLM the bare model_id for every remote source with a streaming "
        "load_format (ray#64978/ray#65477, a 2.57 regression fixed in 2.59): the shim gives vLLM "
        "the source URI",
    ),
    Range((2, 59), (2, 61), frozenset(), "Serve LLM streams string URIs and CloudMirrorConfig natively"),
)


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``"2.48.0rc1"`` -> ``(2, 48, 0)``; None when it is not a release number."""
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


class Plan(NamedTuple):
    ray_version: str
    patches: frozenset[str]
    why: str
    known: bool


@functools.cache
def installed(package: str) -> bool:
    """Whether *package* can be imported here, without importing it (once per process: the
    plan is asked on every consumer-module import)."""
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def plan_for(ray_version: str, ranges: tuple[Range, ...] = RAY_RANGES) -> Plan:
    """Which patches the table asks for on this Ray (Ray Data's table unless told)."""
    v = parse_version(ray_version)
    if v is not None:
        for r in ranges:
            if r.low <= v[:2] < r.high:
                if r.needs and not installed(r.needs):
                    return Plan(ray_version, frozenset(), f"{r.why} ({r.needs} is not installed here)", True)
                return Plan(ray_version, r.patches, r.why, True)
    return Plan(
        ray_version,
        frozenset(),
        "this Ray release is outside the range ray-runai-shim knows (2.43-2.60)",
        False,
    )


def patches_for(ray_version: str) -> frozenset[str]:
    """Every patch name this Ray gets, Ray Data's and Serve LLM's together."""
    return plan_for(ray_version).patches | plan_for(ray_version, SERVE_RANGES).patches


def normalize_load_format(value: object) -> str | None:
    """vLLM accepts a str or a ``LoadFormat`` str-enum; compare on the lowercase value."""
    if value is None:
        return None
    value = getattr(value, "value", value)
    return str(value).strip().lower()


def is_streaming_format(value: object) -> bool:
    return normalize_load_format(value) in STREAMING_FORMATS


REMOTE_SCHEMES = schemes.RAY_REMOTE_PREFIXES


def is_object_store_uri(model: object) -> bool:
    """What vLLM 0.23's ``is_cloud_storage`` says (any case): an ``s3://``/``gs://``/``az://`` URI."""
    return schemes.is_vllm_object_store(model)


def is_remote_uri(model: object) -> bool:
    """The sources Ray 2.45-2.51 download themselves (``is_remote_path``)."""
    return schemes.is_ray_remote(model)


ANONYMOUS = "anonymous@"


def join_anonymous(uri: str) -> str:
    """``s3://bucket/...`` -> Ray's unsigned spelling ``s3://anonymous@bucket/...`` (the inverse of
    :func:`split_anonymous`; other schemes and URIs already so spelled are returned as given)."""
    scheme, sep, rest = uri.partition("://")
    if scheme != "s3" or not sep or rest.startswith(ANONYMOUS):
        return uri
    return f"{scheme}{sep}{ANONYMOUS}{rest}"


def split_anonymous(uri: str) -> tuple[str, bool]:
    """Ray's ``s3://anonymous@bucket/...`` form -> (``s3://bucket/...``, True)."""
    scheme, sep, rest = uri.partition("://")
    if sep and rest.startswith(ANONYMOUS):
        return f"{scheme}{sep}{rest[len(ANONYMOUS):]}", True
    return uri, False
