"""The snapshot cache's own rules, on the real filesystem with real processes and uids."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path, PurePosixPath

import pytest
from support.fetchchild import child_env, run_child
from support.fixtures import BUCKET

from ray_runai_shim.errors import ShimError
from ray_runai_shim.snapshot import cache
from ray_runai_shim.snapshot.fetch import MANIFEST, fetch_nonweights
from ray_runai_shim.snapshot.staging import owner_token
from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem
from ray_runai_shim.tables import settings

NOBODY = 65534


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """Point the private fallback ($TMPDIR) into this test's tmp dir."""
    t = tmp_path / "tmpdir"
    t.mkdir()
    monkeypatch.setenv("TMPDIR", str(t))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return t




def fs_for(endpoint: str):
    return lambda uri: (endpoint_s3_filesystem(False, endpoint), uri.split("://", 1)[1])


# --------------------------------------------------------------------------- writes


def test_staging_never_writes_through_a_symlink(tmp_path):
    place = cache.Place(tmp_path / cache.DIR_NAME)
    place.base.mkdir()
    victim, elsewhere = tmp_path / "victim.txt", tmp_path / "elsewhere"
    victim.write_text("precious")
    elsewhere.mkdir()
    staging = cache.Staging(place.base)
    try:
        st = os.lstat(staging.path)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        (staging.path / "config.json").symlink_to(victim)  # planted file link
        (staging.path / "sub").symlink_to(elsewhere, target_is_directory=True)  # planted dir link
        with pytest.raises(OSError):
            staging.create(PurePosixPath("config.json"))
        with pytest.raises(OSError):
            staging.create(PurePosixPath("sub/tokenizer.json"))
        assert victim.read_text() == "precious" and list(elsewhere.iterdir()) == []
        # Control: a plain open() -- what the previous code used -- writes through both.
        with open(staging.path / "config.json", "w") as f:
            f.write("clobbered")
        (staging.path / "sub" / "tokenizer.json").write_text("escaped")
        assert victim.read_text() == "clobbered" and (elsewhere / "tokenizer.json").exists()
    finally:
        staging.discard()
    assert not staging.path.exists()


# --------------------------------------------------------------------------- trust


def test_a_cache_only_this_user_can_change_is_used(tmp_path, private_tmp):
    root = tmp_path / "hf"
    root.mkdir(mode=0o755)
    assert cache.untrusted_reason(root) is None
    place = cache.open_place(root)
    assert place == cache.Place(root / cache.DIR_NAME) and not place.private


@pytest.mark.parametrize(
    "setup,words",
    [
        ("other-writable", "writable by others"),
        ("group-writable", "writable by group 100"),
        ("other-owner", f"owned by uid {NOBODY}"),
        ("parent-open", "(above it) is writable by others without the sticky bit"),
        ("link-in-open-dir", "(above it) is writable by others without the sticky bit"),
    ],
)
def test_a_cache_others_can_change_is_not_used(tmp_path, private_tmp, caplog, setup, words):
    root = tmp_path / "hf"
    root.mkdir()
    (root / cache.DIR_NAME).mkdir()
    base = root / cache.DIR_NAME
    if setup == "other-writable":
        base.chmod(0o777)
    elif setup == "group-writable":
        os.chown(base, -1, 100)  # "users": not a private group
        base.chmod(0o775)
    elif setup == "other-owner":
        os.chown(base, NOBODY, NOBODY)
    elif setup == "parent-open":
        root.chmod(0o777)
    elif setup == "link-in-open-dir":
        open_dir = tmp_path / "open"
        open_dir.mkdir()
        open_dir.chmod(0o777)
        (open_dir / "hf").symlink_to(root)  # another user can repoint this link
        root = open_dir / "hf"
    assert words in (cache.untrusted_reason(root / cache.DIR_NAME) or "")
    with caplog.at_level(logging.WARNING, logger="ray.runai_shim"):
        place = cache.open_place(root)
    assert place.private and place.base == private_tmp / f"ray-runai-shim-{os.getuid()}" / cache.DIR_NAME
    assert stat.S_IMODE(place.base.parent.stat().st_mode) == 0o700
    assert words in caplog.text and settings.CACHE_DIR in caplog.text


def test_sticky_shared_parents_and_a_private_group_are_fine(tmp_path, private_tmp):
    import grp
    import pwd

    sticky = tmp_path / "shared"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp
    (sticky / "mine").mkdir(mode=0o755)
    assert cache.untrusted_reason(sticky / "mine") is None
    me = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid())
    if group.gr_name != me or set(group.gr_mem) - {me}:
        pytest.skip("this user has no user-private group")
    (sticky / "mine").chmod(0o775)  # umask 002 distros: group = the user's own
    assert cache.untrusted_reason(sticky / "mine") is None


def test_a_cache_dir_setting_that_names_a_file_warns_and_goes_private(tmp_path, private_tmp, monkeypatch, caplog):
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("")
    monkeypatch.setenv(settings.CACHE_DIR, str(not_a_dir))
    assert cache.cache_root() == not_a_dir
    with caplog.at_level(logging.WARNING, logger="ray.runai_shim"):
        place = cache.open_place()  # no exception inside Ray
    assert place.private and f"cannot create {not_a_dir / cache.DIR_NAME}" in caplog.text
    assert settings.CACHE_DIR in caplog.text


def test_a_squatted_private_dir_is_not_used(private_tmp, caplog):
    squat = private_tmp / f"ray-runai-shim-{os.getuid()}"
    squat.mkdir()
    os.chown(squat, NOBODY, NOBODY)
    place = cache.private_place("test")
    assert place.private and squat not in place.base.parents
    assert place.base.parent.parent == private_tmp and place.base.parent.stat().st_uid == os.getuid()
    assert stat.S_IMODE(place.base.parent.stat().st_mode) == 0o700


def test_no_usable_private_dir_either_is_a_shim_error_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing" / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "missing" / "tmp"))
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: (_ for _ in ()).throw(FileNotFoundError(2, "nope")))
    with pytest.raises(ShimError) as err:
        cache.private_place("cannot create /x: [EACCES] Permission denied")
    assert settings.CACHE_DIR in str(err.value) and "cannot create /x" in str(err.value)


# --------------------------------------------------------------------------- crashed owners, held versions


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_staging_owners_are_told_apart_by_boot_pid_and_start_time(tmp_path):
    boot, pid, start = owner_token().split("-")
    assert cache.staging_owner_alive(f".staging-{boot}-{pid}-{start}-0123abcd")  # this process
    assert not cache.staging_owner_alive(f".staging-{boot}-{pid}-{int(start) + 1}-0123abcd")  # pid reused
    assert not cache.staging_owner_alive(f".staging-{'0' * 8 if boot != '0' * 8 else '1' * 8}-{pid}-{start}-0123abcd")
    assert not cache.staging_owner_alive(f".staging-{boot}-{_dead_pid()}-{start}-0123abcd")
    place = cache.Place(tmp_path)
    dead = _dead_pid()
    names = {
        f".staging-{boot}-{dead}-123-0123abcd": False,  # crashed: removed
        f".staging-{boot}-{pid}-{start}-0123abcd": True,  # alive: kept
        f".old-layout.staging-{dead}-0123abcd": False,  # the previous layout's, crashed
        f".old-layout.staging-{pid}-0123abcd": True,
        ".old-layout.old-0123abcd": False,
    }
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "partial").write_bytes(b"x")
    cache.cleanup(place)
    assert {n: (tmp_path / n).exists() for n in names} == names


def test_old_versions_go_once_nobody_holds_them(tmp_path):
    place = cache.Place(tmp_path)
    group = "s3--b--m-0123456789"
    v1, v2 = tmp_path / f"{group}-aaaaaaaaaaaa", tmp_path / f"{group}-bbbbbbbbbbbb"
    for v in (v1, v2):
        v.mkdir()
        (v / MANIFEST).write_text(json.dumps({"format": cache.FORMAT, "source": "s3://b/m"}))
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from ray_runai_shim.snapshot import cache; from pathlib import Path\n"
         f"assert cache.hold(Path({str(v1)!r}))\nprint('held', flush=True)\nimport sys; sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cache.cleanup(place, group, keep=v2) == []
        assert v1.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert cache.cleanup(place, group, keep=v2) == [v1.name]
    assert not v1.exists() and v2.exists()
    assert not (tmp_path / f".{v1.name}.lock").exists()  # its lock file went with it
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".trash-")] == []


def test_a_tampered_version_is_replaced_not_served(s3, models, tmp_path, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    model = models["tiny"]
    fsp = fs_for(s3.endpoint)
    first = Path(fetch_nonweights(model.uri, "runai_streamer", fs_and_path=fsp, root=tmp_path).local_dir)
    genuine = (model.local / "tokenizer_config.json").read_bytes()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(b"x" * len(genuine))
    (first / "tokenizer_config.json").unlink()
    (first / "tokenizer_config.json").symlink_to(elsewhere)  # same size, through a link
    again = fetch_nonweights(model.uri, "runai_streamer", fs_and_path=fsp, root=tmp_path)
    assert not again.reused and again.local_dir == str(first)  # same content identity, rebuilt
    served = Path(again.local_dir) / "tokenizer_config.json"
    assert not served.is_symlink() and served.read_bytes() == genuine
    (Path(again.local_dir) / "config.json").chmod(0o666)  # now writable by anyone
    third = fetch_nonweights(model.uri, "runai_streamer", fs_and_path=fsp, root=tmp_path)
    assert not third.reused and stat.S_IMODE((Path(third.local_dir) / "config.json").stat().st_mode) == 0o644
    decoy = tmp_path / "decoy"
    shutil.copytree(third.local_dir, decoy)
    shutil.rmtree(third.local_dir)
    Path(third.local_dir).symlink_to(decoy)  # the whole version replaced by a link
    fourth = fetch_nonweights(model.uri, "runai_streamer", fs_and_path=fsp, root=tmp_path)
    assert not fourth.reused and not Path(fourth.local_dir).is_symlink()
    assert sorted(p.name for p in decoy.iterdir()) == sorted(p.name for p in Path(fourth.local_dir).iterdir())


def test_a_read_only_prepopulated_cache_is_reused_without_writing(s3, models, shared_tmp):
    """A cache filled once and then made read-only (an image, a read-only mount)."""
    model = models["tiny"]
    cache_dir = shared_tmp / "ro-cache"
    cache_dir.mkdir()
    os.chown(cache_dir, NOBODY, NOBODY)
    args = {"uri": model.uri, "endpoint": s3.endpoint, "root": str(cache_dir)}
    first, err = run_child(args, child_env(s3, shared_tmp), uid=NOBODY)
    assert "local_dir" in first and not first["private"], (first, err)
    for p in [cache_dir, *cache_dir.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~0o222)
    again, err = run_child({**args, "probe_write": str(cache_dir)}, child_env(s3, shared_tmp), uid=NOBODY)
    assert again["writable"] is False  # control: this user really cannot write there
    assert again["local_dir"] == first["local_dir"] and again["reused"] and not again["private"], (again, err)


# --------------------------------------------------------------------------- settings, recognition


def test_lock_timeout_takes_durations_and_a_bad_value_warns_instead_of_raising(monkeypatch, caplog):
    # Control: the previous module-level float() raised at import for this documented form.
    with pytest.raises(ValueError):
        float("30m")
    proc = subprocess.run(
        [sys.executable, "-c", "import ray_runai_shim.snapshot.fetch\nfrom ray_runai_shim.snapshot.cache import lock_timeout\n"
         "print(lock_timeout())"],
        env={**os.environ, "RAY_RUNAI_SHIM_LOCK_TIMEOUT": "30m"}, capture_output=True, text=True,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "1800.0", proc.stderr
    monkeypatch.setenv("RAY_RUNAI_SHIM_LOCK_TIMEOUT", "half an hour")
    with caplog.at_level(logging.WARNING, logger="ray.runai_shim"):
        assert cache.lock_timeout() == cache.DEFAULT_LOCK_TIMEOUT_S
    assert "RAY_RUNAI_SHIM_LOCK_TIMEOUT" in caplog.text and "half an hour" in caplog.text


def test_snapshot_source_recognises_snapshot_dirs_only(s3, models, tmp_path, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    model = models["tiny"]
    r = fetch_nonweights(model.uri, "runai_streamer", fs_and_path=fs_for(s3.endpoint), root=tmp_path)
    assert cache.snapshot_source(r.local_dir) == model.uri
    assert cache.snapshot_source(Path(r.local_dir)) == model.uri
    assert cache.snapshot_source(str(model.local)) is None  # a model dir, not a snapshot
    assert cache.snapshot_source(model.uri) is None and cache.snapshot_source(None) is None
    other = tmp_path / "elsewhere"
    shutil.copytree(r.local_dir, other)
    assert cache.snapshot_source(str(other)) is None  # not in a ray-runai-shim dir
    assert f"s3://{BUCKET}/" in cache.snapshot_source(r.local_dir)


def test_a_zero_umask_does_not_make_the_cache_untrusted(s3, models, tmp_path, monkeypatch, private_tmp):
    """Some container images run with umask 0000: the directories and files the shim
    creates must still be writable by their owner only, so the cache stays usable."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    model = models["tiny"]
    old = os.umask(0)
    try:
        first = fetch_nonweights(model.uri, "runai_streamer", fs_and_path=fs_for(s3.endpoint), root=tmp_path / "hf")
        again = fetch_nonweights(model.uri, "runai_streamer", fs_and_path=fs_for(s3.endpoint), root=tmp_path / "hf")
    finally:
        os.umask(old)
    assert not first.private and again.reused and again.local_dir == first.local_dir
    modes = {stat.S_IMODE(p.stat().st_mode) & 0o022 for p in [tmp_path / "hf", *Path(first.local_dir).rglob("*")]}
    assert modes == {0}
