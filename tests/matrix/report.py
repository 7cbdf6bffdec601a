"""Turn the matrix verdicts in ``.matrix/results/`` into the compatibility tables of docs/compatibility.md.

    python tests/matrix/report.py                                 # print the tables
    python tests/matrix/report.py --docs docs/compatibility.md    # rewrite the marked blocks in place
    python tests/matrix/report.py --docs docs/                    # the same (the page in that folder)

Nothing here is written by hand: every cell comes from a verdict a matrix session
wrote after running the real release (tests/matrix/test_ray_release.py and the
junit XML of its pytest run, tests/matrix/vllm_envs.py, tests/matrix/test_oracle.py).
A release with no verdict is shown as "not run".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from matrix.ray_envs import RAY_RELEASES, RESULTS  # noqa: E402

PATCH_LABELS = (
    ("vllm_engine_stage.download_model_files", "narrowed download"),
    ("vLLMEngineStageUDF.__init__", "handoff"),
    ("get_fs_and_path", "S3 endpoint"),
    ("ray.init", "worker activation"),
    ("chat_template_stage.download_model_files", "tokenizer-only downloads from the snapshot"),
)
FORMATS = ("runai_streamer", "runai_streamer_sharded")


def _junit(path: Path) -> dict[str, dict[str, int]]:
    """Per test file: passed / failed / skipped counts."""
    out: dict[str, dict[str, int]] = {}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").rsplit(".", 1)[-1]
        counts = out.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return out


def _alone(control: dict | None) -> str:
    if not control:
        return "not run"
    if control["streams"]:
        return "streams"
    if control["weight_files_on_disk"]:
        return f"copies all {control['weight_files_on_disk']} weight files, vLLM gets the copy"
    return "vLLM gets a local dir with no weights"


def _patches(v: dict) -> str:
    names = v.get("patched", [])
    labels = [label for key, label in PATCH_LABELS if any(n.endswith(key) for n in names)]
    if v.get("row") == "sharded-format":
        labels.insert(0, "`runai_streamer_sharded` added to `STREAMING_LOAD_FORMATS`")
    return ", ".join(labels) if labels else "none (one INFO line)"


def _with_shim(v: dict) -> str:
    shim = v.get("shim") or {}
    routes = {shim[f]["route"] for f in FORMATS if f in shim}
    if not routes:
        return "not run"
    route = " / ".join(sorted(routes)).replace(" (shim)", "").replace(" (Ray)", "")
    disk = sum(shim[f]["weights_on_disk"] for f in FORMATS if f in shim)
    return f"{route}; {disk} weight bytes on disk"


def _serve(v: dict) -> str:
    if "serve_patched" not in v:
        return "not run"
    names = v["serve_patched"]
    if not names:
        return "none"
    labels = []
    downloads = any(n.endswith("download_model_files") for n in names)
    if downloads:
        labels.append("narrowed node-init download")
    if any(n.endswith("initialize_worker_nodes") for n in names):
        labels.append("per-node fetch (pipeline parallel)")
    if any(n.endswith("get_initialization_kwargs") for n in names):
        labels.append("handoff" if downloads else "mirror URI instead of the bare `model_id`")
    if any(n.endswith("_set_default_runtime_env") for n in names):
        labels.append("config-deployed replicas")
    return ", ".join(labels)


def _tokenizer(v: dict) -> str:
    """What a tokenizer-only download of a current checkpoint misses, Ray alone / with the shim."""
    t = v.get("tokenizer_only")
    if not t:
        return "not run"

    def missing(names: list | None) -> str:
        return "nothing" if not names else ", ".join(f"`{n}`" for n in names)

    return f"Ray alone: {missing(t.get('ray'))}; with the shim: {missing(t.get('shim'))}"


def _sum(*counts: dict[str, int] | None) -> dict[str, int] | None:
    present = [c for c in counts if c]
    if not present:
        return None
    return {k: sum(c.get(k, 0) for c in present) for k in ("passed", "failed")}


def _counts(c: dict[str, int] | None) -> str:
    if not c:
        return "—"
    text = f"{c['passed']} passed"
    if c["failed"]:
        text += f", **{c['failed']} failed**"
    return text


def _previous_e2e(previous: str) -> dict[str, str]:
    """The end-to-end cell of each release in the page's current table (its last column)."""
    cells = {}
    for line in previous.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(parts) > 2 and re.fullmatch(r"\d+\.\d+\.\d+", parts[0]):
            cells[parts[0]] = parts[-1]
    return cells


def ray_table(previous: str = "") -> str:
    """One row per release from this run's verdicts. A release-checks-only run has no end-to-end
    result: that cell keeps the page's current one, marked as from an earlier run."""
    earlier = _previous_e2e(previous)
    head = (
        "| Ray | Ray alone, `runai_streamer` | Ray alone, `runai_streamer_sharded` | the shim patches "
        "| with the shim (both formats) | Serve LLM: the shim patches "
        "| tokenizer-only download of a current checkpoint misses | release checks | end to end (real vLLM) |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for version in RAY_RELEASES:
        path = RESULTS / f"ray-{version}.json"
        if not path.exists():
            rows.append(f"| {version} | not run | | | | | | | |")
            continue
        v = json.loads(path.read_text())
        release = _junit(RESULTS / f"ray-{version}.xml").get("test_ray_release")
        e2e_runs = _junit(RESULTS / f"ray-{version}-e2e.xml")
        e2e = _sum(e2e_runs.get("test_pipeline") or e2e_runs.get("test_sharded_pipeline"),
                   e2e_runs.get("test_default_stages"))
        e2e_cell = _counts(e2e)
        if e2e is None and earlier.get(version, "—").rstrip(")").split(" (")[0] not in ("—", "not run", ""):
            e2e_cell = f"{earlier[version].split(' (')[0]} (earlier run)"
        control = v.get("control") or {}
        rows.append(
            f"| {version} | {_alone(control.get(FORMATS[0]))} | {_alone(control.get(FORMATS[1]))} "
            f"| {_patches(v)} | {_with_shim(v)} | {_serve(v)} | {_tokenizer(v)} | {_counts(release)} "
            f"| {e2e_cell} |"
        )
    return head + "\n".join(rows) + "\n"


def _vkey(path: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", path.stem))


def _race(v: dict) -> bool:
    return "control" in (v.get("checks") or {}) or "vllm_race" in (v.get("tests") or "").split("+")


def _other_tests(v: dict) -> bool:
    """A layer that ran its own tests (the race, the offline lookup), not the handoff."""
    return _race(v) or bool(v.get("tests")) or "offline_control" in (v.get("checks") or {})


def vllm_table() -> str:
    paths = [p for p in sorted(RESULTS.glob("vllm-*.json"), key=_vkey) if not _other_tests(json.loads(p.read_text()))]
    if not paths:
        return "not run\n"
    lines = [
        "| vLLM | driven by Ray | imports here | route the shim takes | tensors streamed = local "
        "| weight files on disk | local dir without the URI | `model=s3://…` instead | result |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        v = json.loads(path.read_text())
        summ = v.get("summary") or {}
        checks = v.get("checks") or {}
        streamed = summ.get("tensors_streamed") or {}
        equal = summ.get("tensors_equal") or {}
        tensors = ", ".join(f"{m}: {equal.get(m, 0)}/{n}" for m, n in sorted(streamed.items())) or "—"
        disk = sum(c.get("weight_files_on_local_disk", 0) for c in checks.values() if isinstance(c, dict))
        routes = "; ".join(r.split(" (")[0] for r in summ.get("route") or []) or "—"
        alt = summ.get("model_uri_alternative_works")
        alt_text = "works" if alt else (summ.get("model_uri_alternative_error") or "fails").split(":")[0]
        imports = "yes" if v.get("importable") else f"no: {v.get('error', '')}"
        lines.append(
            f"| {v['vllm']} | {v.get('ray', '')} | {imports} | `{routes}` on a local dir fetched by "
            f"{'/'.join(summ.get('local_dir_fetched_by') or ['?'])} | {tensors} | {disk} "
            f"| {(summ.get('without_injection') or '—').replace('|', '/')} | {alt_text} "
            f"| {'pass' if v.get('passed') else '**FAIL**'} |"
        )
    return "\n".join(lines) + "\n"


def race_table() -> str:
    """vLLM 0.11-0.15's aux-pull race (tests/matrix/vllm_race/): N engines x rounds, without and with the shim."""
    runs = [v for v in (json.loads(p.read_text()) for p in sorted(RESULTS.glob("vllm-*.json"), key=_vkey)) if _race(v)]
    if not runs:
        return "not run\n"
    lines = [
        "| vLLM | driven by Ray | engine starts without the shim | errors | with the shim | GETs per "
        "non-weight object | tensors vLLM's loader streamed (signed / `anonymous@`) | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in runs:
        c = v.get("checks") or {}
        ctl, shim = c.get("control") or {}, c.get("with_shim") or {}
        streamed = " / ".join(f"{a}: {c[f'streamed_{a}']['tensors']}" for a in ("signed", "anonymous")
                              if f"streamed_{a}" in c) or "—"
        total = ctl.get("engines", 0) * ctl.get("rounds", 0)
        kinds = ", ".join(f"{k} ×{n}" for k, n in sorted((ctl.get("kinds") or {}).items())) or "—"
        gets = sorted({n for p, n in (shim.get("gets") or {}).items() if p.count("/") > 1})
        stotal = shim.get("engines", 0) * shim.get("rounds", 0)
        lines.append(
            f"| {v['vllm']} | {v.get('ray', '')} | {ctl.get('failed', '?')} of {total} failed | {kinds} "
            f"| {stotal - shim.get('failed', 0) if shim else '?'} of {stotal} started | "
            f"{'/'.join(map(str, gets)) or '—'} | {streamed} tensors, each equal | "
            f"{'pass' if v.get('passed') else '**FAIL**'} |"
        )
    return "\n".join(lines) + "\n"


def _streamed(checks: dict, key: str) -> str:
    r = checks.get(key) or {}
    return f"{r['tensors_equal']}/{r['tensors']} equal" if r.get("tensors") else (r.get("error") or "—")[:80]


def offline_table() -> str:
    """vLLM 0.10.2-0.22 under HF_HUB_OFFLINE=1 (tests/matrix/vllm_offline/): the Hub lookup of an s3:// model."""
    runs = [v for v in (json.loads(p.read_text()) for p in sorted(RESULTS.glob("vllm-*.json"), key=_vkey))
            if "offline_control" in (v.get("checks") or {})]
    if not runs:
        return "not run\n"
    lines = [
        "| vLLM | driven by Ray | `EngineArgs(model=s3://…)` without the shim | with the shim: tensors streamed "
        "| result |",
        "|---|---|---|---|---|",
    ]
    for v in runs:
        c = v.get("checks") or {}
        ctl = c.get("offline_control") or {}
        frame = next((f for f in ctl.get("frames") or [] if "get_model_path" in f), "")
        err = (ctl.get("error") or "—").split(":")[0].rsplit(".", 1)[-1]
        lines.append(
            f"| {v['vllm']} | {v.get('ray', '')} | {err} (`{frame.split(' ')[0]}`) | {_streamed(c, 'offline_with_shim')} "
            f"| {'pass' if v.get('passed') else '**FAIL**'} |"
        )
    return "\n".join(lines) + "\n"


def oracle_table() -> str:
    path = RESULTS / "oracle.json"
    if not path.exists():
        return "not run\n"
    v = json.loads(path.read_text())
    rows = [
        ("shimmed", v.get("shimmed")),
        ("oracle", v.get("oracle")),
        ("same greedy tokens", v.get("same_tokens")),
        ("weight files on local disk", v.get("weight_files_on_disk")),
        ("weight GETs", v.get("weight_gets")),
        ("the oracle's vLLM got", f"`model={v.get('oracle_vllm_model')}`"),
        ("result", "pass" if v.get("pass") else "**FAIL**"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {val} |" for k, val in rows) + "\n"


BLOCKS = {"ray": ray_table, "vllm": vllm_table, "race": race_table, "offline": offline_table,
          "oracle": oracle_table}
#: The docs page that holds the ``matrix:`` blocks (``--docs docs/`` means this file in that folder).
PAGE = "compatibility.md"


def page(path: Path) -> Path:
    """``docs/`` -> ``docs/compatibility.md``; a file path is taken as given."""
    return path / PAGE if path.is_dir() else path


def rewrite(doc: Path, blocks: tuple[str, ...] = tuple(BLOCKS)) -> None:
    """Rewrite *blocks* of the page *doc* from the verdicts here (a partial run: only its own blocks).
    A requested block whose markers are not in the page is an error: nothing is written."""
    text = doc.read_text()
    for name, render in BLOCKS.items():
        if name not in blocks:
            continue
        start, end = f"<!-- matrix:{name}:start -->", f"<!-- matrix:{name}:end -->"
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        found = pattern.search(text)
        if not found:
            raise SystemExit(f"{doc} has no {start} ... {end} block to rewrite")
        block = f"{start}\n{render(found.group(0)) if name == 'ray' else render()}{end}"
        text = pattern.sub(lambda _m, b=block: b, text)
    doc.write_text(text)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=Path, metavar="PATH",
                    help=f"rewrite the marked blocks of this page (a folder: its {PAGE})")
    ap.add_argument("--blocks", default=",".join(BLOCKS), help=f"which of {', '.join(BLOCKS)} (default: all)")
    args = ap.parse_args(argv)
    if args.docs:
        rewrite(page(args.docs), tuple(args.blocks.split(",")))
    else:
        for name, render in BLOCKS.items():
            print(f"## {name}\n{render()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
