"""Where narrowed snapshots live on a node, and the rules that keep them honest.

Layout: ``<root>/ray-runai-shim/<uri>-<store>-<content>/`` — one directory per
(store, URI, content) version. *store* hashes the endpoint, signed/unsigned and
the URI, so the same ``s3://bucket/path`` on two stores never shares a
directory; *content* hashes every non-weight key with its size and the
store's content identity (ETag / generation) or, where the store gives none,
the bytes' SHA-256. A version is only ever created complete, by renaming a
staging directory into place, and is never rewritten: a change in the bucket
makes a new version.

Old versions are deleted only when no process holds them (:mod:`.locks`);
versions are assembled in staging directories that a later run can clean up
after a crash (:mod:`.staging`).

Trust: another local user who can write into the cache could plant a
snapshot (config, tokenizer, remote-code ``*.py``). A cache directory that
is not owned by this user, is writable by group/others, or sits below such a
directory is not used; the files are fetched into a private per-user
directory instead (one WARNING says why).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from ..log import logger
from ..redact import MASK, redact_url
from ..tables import settings
from .locks import CacheUnusable, fetch_lock, hold, lock_path, try_exclusive
from .locks import close as close_lock
from .staging import LEGACY_OLD, LEGACY_STAGING, STAGING, Staging, read_json, staging_owner_alive

__all__ = [
    "DIR_NAME",
    "MANIFEST",
    "CacheUnusable",
    "Place",
    "Staging",
    "cache_root",
    "cleanup",
    "content_digest",
    "discard",
    "fetch_lock",
    "group_name",
    "hold",
    "lock_path",
    "lock_timeout",
    "manifest",
    "open_place",
    "private_place",
    "read_manifest",
    "snapshot_source",
    "staging_owner_alive",
    "untrusted_reason",
    "verify",
    "version_dir",
]

DIR_NAME = "ray-runai-shim"
MANIFEST = ".ray-runai-shim.json"
FORMAT = 2
DEFAULT_LOCK_TIMEOUT_S = 1800.0

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: What a delete in progress (or interrupted) renames a version to.
_TRASH = re.compile(r"^\.trash-[0-9a-f]{8}-(?P<name>.+)$")


# --------------------------------------------------------------------------- where


def cache_root() -> Path:
    """Where narrowed snapshots live: next to Ray's own model cache."""
    explicit = settings.path(settings.CACHE_DIR) or settings.path("TRANSFORMERS_CACHE")
    if explicit:
        return explicit
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE).expanduser()
    except Exception:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
        )
        return Path(home, "hub").expanduser()


def lock_timeout() -> float:
    """``RAY_RUNAI_SHIM_LOCK_TIMEOUT`` (``1800``, ``90s``, ``30m``, ``1h``); bad values warn."""
    return settings.seconds(settings.LOCK_TIMEOUT, DEFAULT_LOCK_TIMEOUT_S)


@dataclass(frozen=True)
class Place:
    """The ``ray-runai-shim`` directory a fetch uses, and whether it is the private fallback."""

    base: Path
    private: bool = False


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else -1


def _group_is_private(gid: int) -> bool:
    """A user-private group (same name as this user, no other members): group write is
    then no wider than owner write (the ``umask 002`` convention of many distros)."""
    try:
        import grp
        import pwd

        me = pwd.getpwuid(_uid()).pw_name
        group = grp.getgrgid(gid)
        return gid == os.getgid() and group.gr_name == me and set(group.gr_mem) <= {me}
    except (ImportError, KeyError, OSError):
        return False


def _writable_by_others(st: os.stat_result) -> Optional[str]:
    if st.st_mode & stat.S_IWOTH:
        return "others"
    if st.st_mode & stat.S_IWGRP and not _group_is_private(st.st_gid):
        return f"group {st.st_gid}"
    return None


def untrusted_reason(path: Path) -> Optional[str]:
    """Why another local user could change what is under *path*; None when only this
    user (or root) can. *path* must exist."""
    uid = _uid()
    if uid < 0:
        return None
    real = Path(os.path.realpath(path))
    st = os.stat(real)
    if st.st_uid != uid:
        return f"{real} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    who = _writable_by_others(st)
    if who:
        return f"{real} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    absolute = Path(os.path.abspath(path))
    for chain in (real.parents, absolute.parents):
        for parent in chain:
            st = os.stat(parent)
            if st.st_uid not in (0, uid):
                return f"{parent} (above it) is owned by uid {st.st_uid}, who can replace what is below"
            who = _writable_by_others(st)
            if who and not st.st_mode & stat.S_ISVTX:
                return f"{parent} (above it) is writable by {who} without the sticky bit"
    return None


def _makedirs(path: Path) -> None:
    """``mkdir -p`` whose new directories are never group/other-writable, whatever the
    umask (0000 in some containers would make them writable by all, and so untrusted)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o755)
        except FileExistsError:
            continue
        os.chmod(p, stat.S_IMODE(os.stat(p).st_mode) & ~0o022)


def open_place(root: Optional[Path] = None) -> Place:
    """The shared cache under *root* (default :func:`cache_root`) when this user can
    trust and write it; otherwise the private directory, with one WARNING saying why."""
    base = Path(os.path.abspath(Path(root or cache_root()).expanduser())) / DIR_NAME
    try:
        _makedirs(base)
        reason = untrusted_reason(base)
    except OSError as e:
        return private_place(f"cannot create {base}: [{errno.errorcode.get(e.errno or 0, e.errno)}] {e.strerror}")
    if reason is None:
        return Place(base)
    return private_place(
        f"not trusting the cache {base}: {reason}; another local user could plant files there "
        "(config, tokenizer, remote code)"
    )


def private_place(reason: str) -> Place:
    """``$TMPDIR/ray-runai-shim-<uid>/ray-runai-shim`` (0700, checked to be this user's),
    or a fresh ``mkdtemp`` when someone else squats that name."""
    from ..errors import ShimError

    uid = _uid()
    tmp = Path(tempfile.gettempdir())
    try:
        root = tmp / f"{DIR_NAME}-{uid}"
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(root)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(root, 0o700)
        else:  # someone else squats the name: a fresh directory of our own
            root = Path(tempfile.mkdtemp(prefix=f"{DIR_NAME}-{uid}-"))
        base = root / DIR_NAME
        try:
            os.mkdir(base, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            raise OSError(errno.EEXIST, f"{base} is not a directory owned by uid {uid}")
    except OSError as e:
        raise ShimError(
            f"ray-runai-shim: cannot use a cache for the non-weight files ({reason}), nor a private "
            f"directory under {tmp}: {e}. Set {settings.CACHE_DIR} to a directory this user "
            f"(uid {uid}) owns and can write."
        ) from e
    _warn_once(
        f"ray-runai-shim: {reason}. Fetching the non-weight files into {base} (private to uid {uid}) "
        f"instead. To share one cache between this user's actors, set {settings.CACHE_DIR} to a "
        "directory owned by this user and not writable by group/others."
    )
    return Place(base, private=True)


# --------------------------------------------------------------------------- names


def _flat(uri: str) -> str:
    """A readable, filesystem-safe form of *uri* for directory names (no userinfo on disk)."""
    clean = redact_url(uri.rstrip("/")).replace(f"{MASK}@", "")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", clean.replace("://", "--").replace("/", "--"))[:96]


def group_name(uri: str, store_key: str) -> str:
    """The name prefix shared by every version of *uri* from one store."""
    digest = hashlib.sha256(f"{store_key}\n{uri.rstrip('/')}".encode()).hexdigest()[:10]
    return f"{_flat(uri)}-{digest}"


def content_digest(files: Mapping[str, tuple[int, str]]) -> str:
    """Hash of every (key, size, content identity)."""
    h = hashlib.sha256()
    for key in sorted(files):
        size, ident = files[key]
        h.update(f"{key}\0{size}\0{ident}\n".encode())
    return h.hexdigest()[:12]


def version_dir(place: Place, group: str, digest: str) -> Path:
    return place.base / f"{group}-{digest}"


# --------------------------------------------------------------------------- manifest & verify


def manifest(source: str, store_key: str, files: Mapping[str, dict[str, Any]], weights: Mapping[str, int]) -> dict:
    """What a version records: where it came from, and each file's size and identity."""
    return {
        "format": FORMAT,
        "source": source.rstrip("/"),
        "store": store_key,
        "files": {k: dict(v) for k, v in sorted(files.items())},
        "weights": dict(sorted(weights.items())),
    }


def _trusted_entry(st: os.stat_result) -> bool:
    return st.st_uid in (0, _uid()) and _writable_by_others(st) is None


def read_manifest(vdir: Path) -> Optional[dict]:
    """The manifest of *vdir*, read without following a symlink; None if absent/invalid."""
    return read_json(vdir / MANIFEST, 16 << 20)


def verify(
    vdir: Path, source: str, store_key: str, files: Mapping[str, tuple[int, str]], paths: Mapping[str, PurePosixPath]
) -> bool:
    """True when *vdir* is a complete version of exactly *files* (key -> size, identity),
    owned by this user (or root), not writable by others, and free of symlinks."""
    try:
        st = os.lstat(vdir)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or not _trusted_entry(st):
        return False
    recorded = read_manifest(vdir)
    if not recorded or recorded.get("format") != FORMAT:
        return False
    if recorded.get("source") != source.rstrip("/") or recorded.get("store") != store_key:
        return False
    rec_files = recorded.get("files")
    if not isinstance(rec_files, dict) or set(rec_files) != set(files):
        return False
    checked: set[PurePosixPath] = set()
    for key, (size, ident) in files.items():
        entry = rec_files.get(key) or {}
        if entry.get("size") != size or entry.get("id") != ident:
            return False
        rel = paths[key]
        for parent in reversed(list(rel.parents)[:-1]):
            if parent in checked:
                continue
            try:
                pst = os.lstat(vdir / parent)
            except OSError:
                return False
            if not stat.S_ISDIR(pst.st_mode) or not _trusted_entry(pst):
                return False
            checked.add(parent)
        try:
            fst = os.lstat(vdir / rel)
        except OSError:
            return False
        if not stat.S_ISREG(fst.st_mode) or fst.st_size != size or not _trusted_entry(fst):
            return False
    return True


# --------------------------------------------------------------------------- the reuse policy


def reusable(place: Place, group: str, source: str, store_key: str, ids: Mapping[str, tuple[int, str]],
             paths: Mapping[str, PurePosixPath]) -> tuple[Path, bool]:
    """The version directory of exactly *ids* (key -> size, content identity), held for reading
    from now on whether or not it exists yet (so no cleanup removes it once made), and whether it
    is complete and trustworthy now. When it is, the group's other versions nobody reads go."""
    vdir = version_dir(place, group, content_digest(ids))
    hold(vdir)
    ok = verify(vdir, source, store_key, ids, paths)
    if ok:
        cleanup(place, group, keep=vdir)
    return vdir, ok


def commit_version(place: Place, group: str, vdir: Path, staging: Staging, record: dict) -> None:
    """Write *record* as the manifest and rename *staging* to *vdir* whole, replacing a broken
    version left there (tampered, half-deleted); then the group's unread versions go. OSError
    from the disk is the caller's to name."""
    with staging.create(PurePosixPath(MANIFEST), mode=0o600) as out:
        out.write(json.dumps(record, indent=1, sort_keys=True).encode())
    if vdir.exists() or vdir.is_symlink():
        discard(place, vdir)
    staging.commit(vdir)
    cleanup(place, group, keep=vdir)


# --------------------------------------------------------------------------- cleanup


def _remove_under_lock(place: Place, name: str, target: Path) -> bool:
    """Delete *target* (version *name* or its trash) if nobody holds ``.<name>.lock``."""
    lock = place.base / f".{name}.lock"
    fd = try_exclusive(lock)
    if fd is None:
        return False
    try:
        if target.name == name:
            trash = place.base / f".trash-{uuid.uuid4().hex[:8]}-{name}"
            try:
                os.rename(target, trash)
            except FileNotFoundError:
                trash = None
            target = trash or target
        if target.is_symlink():
            target.unlink()  # a planted link: remove the link, never what it points to
        else:
            shutil.rmtree(target, ignore_errors=True)
        if not (place.base / name).exists():
            try:
                os.unlink(lock)
            except OSError:
                pass
        return True
    finally:
        close_lock(fd)


def discard(place: Place, vdir: Path) -> None:
    """Move a broken version out of the way now; delete it once nobody holds it."""
    trash = place.base / f".trash-{uuid.uuid4().hex[:8]}-{vdir.name}"
    try:
        os.rename(vdir, trash)
    except FileNotFoundError:
        return
    _remove_under_lock(place, vdir.name, trash)


def cleanup(place: Place, group: Optional[str] = None, keep: Optional[Path] = None) -> list[str]:
    """Remove what nobody can use any more; returns the names removed.

    * versions of *group* other than *keep* that no process holds;
    * staging dirs whose owner process is gone (``kill -9``, OOM, node reboot);
    * trash left by an interrupted delete, lock files of versions that no longer exist.
    """
    removed: list[str] = []
    try:
        names = os.listdir(place.base)
    except OSError:
        return removed
    present = set(names)
    for name in names:
        try:
            if _cleanup_entry(place, name, names, present, group, keep):
                removed.append(name)
        except OSError:  # best effort: a concurrent cleanup, a permission change
            continue
    return removed


def _cleanup_entry(
    place: Place, name: str, names: list[str], present: set[str], group: Optional[str], keep: Optional[Path]
) -> bool:
    path = place.base / name
    st = os.lstat(path)
    if st.st_uid != _uid():
        return False  # never touch other users' entries
    if stat.S_ISDIR(st.st_mode):
        if group and name.startswith(f"{group}-") and (keep is None or name != keep.name):
            return read_manifest(path) is not None and _remove_under_lock(place, name, path)
        if (STAGING.match(name) or LEGACY_STAGING.match(name)) and not staging_owner_alive(name):
            shutil.rmtree(path, ignore_errors=True)
            return True
        if LEGACY_OLD.match(name):
            shutil.rmtree(path, ignore_errors=True)
            return True
        m = _TRASH.match(name)
        return bool(m) and _remove_under_lock(place, m["name"], path)
    if name.endswith(".lock") and name.startswith(".") and not name.endswith(".fetch-lock"):
        version = name[1 : -len(".lock")]
        if version in present or any(_TRASH.match(n) and n.endswith(f"-{version}") for n in names):
            return False
        fd = try_exclusive(path)
        if fd is not None:
            try:
                if not (place.base / version).exists():
                    os.unlink(path)
            finally:
                close_lock(fd)
    return False


# --------------------------------------------------------------------------- recognise


def snapshot_source(path: Any) -> Optional[str]:
    """The URI a shim snapshot dir was fetched from (its manifest's ``source``), else None.

    A snapshot is a directory whose parent is named ``ray-runai-shim`` and that holds the
    manifest (in the shared cache or the private fallback alike)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    text = os.fspath(path)
    if "://" in text:
        return None
    p = Path(text)
    if p.parent.name != DIR_NAME:
        return None
    recorded = read_manifest(p)
    source = recorded.get("source") if recorded else None
    return source if isinstance(source, str) and source else None

