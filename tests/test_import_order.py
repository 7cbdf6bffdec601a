"""Every import/patch/unpatch order, for every module in the targets table, each in a fresh
interpreter (ddtrace's ``tests/contrib/patch.py`` style), plus a test that the list is complete.

For each consumer module the orders are generated, not hand-picked:

* ``module_first``: the module, then the shim. Before the shim is imported, the pristine
  module says which of its targets exist and which the table asks for on this Ray: the
  expectation for every order;
* ``shim_first``: ``import ray_runai_shim`` then the module; then ``install()`` twice more;
* ``cycle``: module, shim, ``uninstall()`` (exact originals back), ``uninstall()`` again,
  ``install()`` (patched again);
* ``uninstall_first``: shim, ``uninstall()``, then the module (left untouched).

"Fresh" is about the modules under test: each order runs in a fork of one interpreter that has
imported torch, transformers and the other packages Ray and vLLM import, and nothing of Ray,
vLLM, wrapt's hooks or the shim (``support/zygote.py``; a new interpreter per order where that
cannot be made). That saves ~13 s of ~16 s per order.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest
import ray
from support.procs import base_env, last_json, run_python
from support.zygote import Zygote

from ray_runai_shim.tables import targets
from ray_runai_shim.tables.support import RAY_FREE, patches_for

pytestmark = pytest.mark.ray  # starts Ray (a cluster, a job, Serve, an engine) in its processes

WANTED = patches_for(ray.__version__) | RAY_FREE  # the Ray-free ones apply whatever the release
SITE_ENV = {"RAY_RUNAI_SHIM_TEST_COMPAT": "1", "RAY_RUNAI_SHIM_TEST_SERVE_COMPAT": "1"}

PROBE = """
import json, sys, importlib, wrapt
MODULE = {module!r}
TARGETS = {targets!r}   # [attr, kind, patch, unless_has, requires] for this module
WANTED = set({wanted!r})

def resolve(obj, path):
    *parents, attr = path.split(".")
    for p in parents:
        obj = getattr(obj, p)
    return vars(obj)[attr] if attr in vars(obj) else getattr(obj, attr)

def has(mod, path):
    try:
        resolve(mod, path); return True
    except (AttributeError, KeyError):
        return False

def depth(obj):
    n = 0
    while isinstance(obj, wrapt.FunctionWrapper):
        n += 1; obj = obj.__wrapped__
    return n

def state():
    mod = sys.modules[MODULE]
    out = {{}}
    for attr, kind, *_ in TARGETS:
        if not attr or not has(mod, attr):
            continue
        value = resolve(mod, attr)
        out[attr] = depth(value) if kind == "wrap" else (list(value) if isinstance(value, list) else None)
    return out

def captured():
    mod = sys.modules[MODULE]
    return {{attr: resolve(mod, attr) for attr, kind, *_ in TARGETS if attr and kind == "wrap" and has(mod, attr)}}

def inert(held):
    # A wrapper another module captured before uninstall() calls the original straight through.
    out = {{}}
    for attr, value in held.items():
        while isinstance(value, wrapt.FunctionWrapper):
            enabled = getattr(value, "_self_enabled", None)
            if enabled is None or enabled():
                out[attr] = False
                break
            value = value.__wrapped__
        else:
            out[attr] = True
    return out

def raw():
    mod = sys.modules[MODULE]
    return {{attr: id(resolve(mod, attr)) for attr, kind, *_ in TARGETS if attr and kind == "wrap" and has(mod, attr)}}

def expected():
    # The table's rules, read on the pristine module: which names this Ray gets wrapped how often.
    mod = sys.modules[MODULE]
    out = {{}}
    for attr, kind, patch, unless_has, requires in TARGETS:
        if kind == "call" or not has(mod, attr):
            continue
        applies = patch in WANTED and not (unless_has and has(mod, unless_has)) and all(has(mod, r) for r in requires)
        if kind == "wrap":  # one hook per function, however many of its rows apply
            out[attr] = max(out.get(attr, 0), int(applies))
        else:
            base = [x for x in resolve(mod, attr) if x != {value!r}]
            out[attr] = base + ([{value!r}] if applies else [])
    return out

def imp():
    # Ray's LLM stack imports vLLM; the shim does nothing in a process without Ray.
    import ray
    importlib.import_module(MODULE)
"""

ORDERS = {
    "shim_first": (
        "import ray_runai_shim\nimp()\nfirst = state()\n"
        "ray_runai_shim.install(); ray_runai_shim.install()\nimport ray_runai_shim as again\n"
        "print(json.dumps({'state': first, 'again': state(), 'same_module': again is ray_runai_shim}))"
    ),
    "module_first": (
        "imp()\npristine = {'expected': expected(), 'state': state()}\nimport ray_runai_shim\n"
        "print(json.dumps({'state': state(), 'pristine': pristine}))"
    ),
    "cycle": (
        "imp()\nbefore = raw()\nimport ray_runai_shim\npatched = state()\nheld = captured()\n"
        "ray_runai_shim.uninstall()\nrestored = raw() == before\nafter = state()\ninert_after = inert(held)\n"
        "ray_runai_shim.uninstall()\nray_runai_shim.install()\n"
        "print(json.dumps({'patched': patched, 'restored': restored, 'after': after, 'again': state(),"
        " 'inert': inert_after,"
        " 'installed': ray_runai_shim.status()['installed']}))"
    ),
    "uninstall_first": (
        "import ray_runai_shim\nray_runai_shim.uninstall()\nimp()\n"
        "print(json.dumps({'state': state(), 'patched': ray_runai_shim.status()['patched']}))"
    ),
}


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


TOKENIZER_MODULES_IF_PLANNED = (
    [t.module for t in targets.TARGETS if t.patch == "tokenizer-download"] if "tokenizer-download" in WANTED else []
)
PRESENT = [m for m in targets.modules() if _present(m)]
ABSENT = [m for m in targets.modules() if m not in PRESENT]


def _script(module: str, body: str) -> str:
    rows = [[t.attr, t.kind, t.patch, t.unless_has, list(t.requires)] for t in targets.for_module(module)]
    values = {t.value for t in targets.for_module(module) if t.value}
    return PROBE.format(module=module, targets=rows, wanted=sorted(WANTED), value=next(iter(values), None)) + body


_RUNS: dict[str, dict[str, dict]] = {}
_ZYGOTE: dict[str, Optional[Zygote]] = {}
_ZYGOTE_LOCK = threading.Lock()


def _fresh(code: str) -> subprocess.CompletedProcess:
    """*code* in a fresh interpreter: a fork of the zygote (torch, transformers and the like
    already imported; nothing of Ray, vLLM or the shim), or a new one where it cannot be made."""
    with _ZYGOTE_LOCK:  # the orders run two at a time: one zygote for both
        if "z" not in _ZYGOTE:
            try:
                _ZYGOTE["z"] = Zygote(base_env(SITE_ENV), PRESENT)
            except RuntimeError as e:
                print(f"import-order tests: a new interpreter per order ({e})", file=sys.stderr)
                _ZYGOTE["z"] = None
        zygote = _ZYGOTE["z"]
    if zygote is None:
        return run_python(code, env=base_env(SITE_ENV))
    proc = zygote.run(code)
    assert proc.returncode == 0, f"order failed ({proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module", autouse=True)
def _close_zygote():
    yield
    zygote = _ZYGOTE.pop("z", None)
    if zygote is not None:
        zygote.close()


def runs_for(module: str) -> dict[str, dict]:
    """Every order for *module*, each in its own fresh interpreter, two at a time (2 cores);
    computed once, on first use, so a ``-k`` selection runs only what it selects."""
    if module not in _RUNS:
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = pool.map(lambda o: last_json(_fresh(_script(module, ORDERS[o]))), ORDERS)
            _RUNS[module] = dict(zip(ORDERS, results))
    return _RUNS[module]


def _zeroed(state: dict) -> dict:
    return {k: (0 if isinstance(v, int) else v) for k, v in state.items()}


@pytest.mark.parametrize("module", PRESENT)
def test_every_order_ends_in_the_same_patched_state(module):
    r = runs_for(module)
    expected = r["module_first"]["pristine"]["expected"]
    assert r["shim_first"]["state"] == expected
    assert r["shim_first"]["again"] == expected  # install() twice and a re-import never double-wrap
    assert r["shim_first"]["same_module"]
    assert r["module_first"]["state"] == expected
    assert r["cycle"]["patched"] == expected and r["cycle"]["again"] == expected and r["cycle"]["installed"]


@pytest.mark.parametrize("module", PRESENT)
def test_uninstall_restores_exact_originals_and_uninstall_first_touches_nothing(module):
    r = runs_for(module)
    pristine = r["module_first"]["pristine"]["state"]
    assert r["cycle"]["restored"] is True  # the very same objects, by identity
    assert r["cycle"]["after"] == pristine
    assert r["uninstall_first"]["state"] == pristine
    assert r["uninstall_first"]["patched"] == []
    assert pristine == _zeroed(pristine)  # nothing wrapped before the shim


ROWS = list(enumerate(targets.TARGETS))


@pytest.mark.parametrize("index, row", ROWS, ids=[f"{i}-{t.patch}-{t.name}" for i, t in ROWS])
def test_the_patch_contract_holds_for_every_row_of_the_table(index, row):
    """ddtrace's ``PatchTestCase``, one case per row of ``TARGETS`` (from the same fresh
    interpreters as the order tests): whichever is imported first, installed twice = once;
    ``uninstall()`` puts the exact original back and leaves a wrapper captured before it inert."""
    if row.module in ABSENT:
        assert not _present(row.module)  # not in this Ray: nothing to patch, nothing touched
        return
    r = runs_for(row.module)
    expected = r["module_first"]["pristine"]["expected"]
    if row.kind == targets.CALL or row.attr not in expected:
        assert row.attr not in r["shim_first"]["state"] or row.kind != targets.WRAP
        return  # a call-on-import row, or a name this release does not hold (if_has)
    for order in (r["shim_first"]["state"], r["shim_first"]["again"], r["module_first"]["state"],
                  r["cycle"]["patched"], r["cycle"]["again"]):
        assert order[row.attr] == expected[row.attr], (row, order)
    pristine = r["module_first"]["pristine"]["state"]
    assert r["cycle"]["after"][row.attr] == pristine[row.attr] and r["uninstall_first"]["state"][row.attr] == pristine[row.attr]
    if row.kind == targets.WRAP:
        assert r["cycle"]["restored"] is True and r["cycle"]["inert"][row.attr] is True


def test_the_contract_has_one_case_per_row():
    assert len(ROWS) == len(targets.TARGETS) and [t for _, t in ROWS] == list(targets.TARGETS)


def test_the_generated_list_is_complete():
    """Every module and every target of the table is exercised here or is absent from this Ray."""
    assert set(PRESENT) | set(ABSENT) == set(targets.modules())
    covered = {(t.module, t.attr) for m in PRESENT for t in targets.for_module(m)}
    assert covered | {(t.module, t.attr) for t in targets.TARGETS if t.module in ABSENT} == {
        (t.module, t.attr) for t in targets.TARGETS
    }
    # On this Ray (2.48) the modules Ray Data and Serve LLM patch must be importable here, so
    # the suite cannot pass by finding nothing to test.
    assert {targets.STAGE_MODULE, targets.NODE_INIT, targets.VLLM_MODELS, targets.VLLM_ARG_UTILS} <= set(PRESENT)


def test_what_ray_2_48_gets_wrapped():
    """The issue's list for Ray 2.45-2.49 (not the table's): these names and no others."""
    if ray.__version__ != "2.48.0":
        pytest.skip("the default venv pins Ray 2.48.0; other releases: tests/matrix/test_ray_release.py")
    runs = {m: runs_for(m) for m in PRESENT}
    wrapped = {f"{m}.{attr}" for m, r in runs.items() for attr, d in r["shim_first"]["state"].items()
               if isinstance(d, int) and d}
    stage = targets.STAGE_MODULE
    assert wrapped == {
        "ray.init", "ray._private.worker.init",
        f"{stage}.download_model_files", f"{stage}.vLLMEngineStageUDF.__init__", f"{stage}.vLLMEngineWrapper.__init__",
        "ray.llm._internal.common.utils.cloud_utils.CloudFileSystem.get_fs_and_path",
        f"{targets.NODE_INIT}._initialize_local_node", f"{targets.NODE_INIT}.download_model_files",
        f"{targets.NODE_INIT}.initialize_worker_nodes",  # #15: Serve with pipeline parallelism > 1
        f"{targets.VLLM_MODELS}.VLLMEngineConfig.get_initialization_kwargs",
        "vllm.engine.arg_utils.EngineArgs.create_engine_config",
        # #16: vLLM's workers on other nodes get the non-weight files (vllm#50616).
        f"{targets.VLLM_WORKER_BASE}.WorkerWrapperBase.init_worker",
        # #12: config-deployed Serve apps (acts only inside a Ray worker: the controller's build task).
        f"{targets.SERVE_BUILD_APP}._set_default_runtime_env",
        # #25/#29: the node relay swaps the weights URI after the config is built, released when loaded.
        f"{targets.VLLM_ASYNC_LLM}.AsyncLLM.__init__", f"{targets.VLLM_LLM_ENGINE}.LLMEngine.__init__",
        f"{stage}.vLLMEngineStage.__init__",  # Ray Data's engine count per node, for the relay
        # #36: each rank reads the relay's copy as it lands.
        f"{targets.VLLM_RUNAI_LOADER}.RunaiModelStreamerLoader._get_weights_iterator",
    } | {f"{m}.download_model_files" for m in TOKENIZER_MODULES_IF_PLANNED}
    # One hook, not a stack: the handoff, vLLM's runtime_env and the relay are steps of it.
    assert runs[targets.VLLM_ARG_UTILS]["shim_first"]["state"]["EngineArgs.create_engine_config"] == 1


def test_each_patched_function_has_one_hook():
    """Rows of several patches on one function name the same hook (whose code says the order)."""
    hooks: dict[str, set[str]] = {}
    for t in targets.TARGETS:
        if t.kind == targets.WRAP:
            hooks.setdefault(t.name, set()).add(t.wrapper)
    assert {name: ws for name, ws in hooks.items() if len(ws) > 1} == {}
    assert hooks[f"{targets.VLLM_ARG_UTILS}.EngineArgs.create_engine_config"] == {targets.ENGINE_CONFIG_HOOK}


STEPS_PROBE = """
import json, ray_runai_shim, ray
from ray_runai_shim import registry
from ray_runai_shim.integrations import engine_config
import vllm.engine.arg_utils
print(json.dumps(sorted(registry.patches_on(engine_config.NAME))))
"""


def test_the_engine_config_steps_on_for_this_release():
    """Which steps of the one engine-config hook this Ray and vLLM switch on (2.48, vLLM 0.32):
    the batch handoff's weights URI, vLLM's runtime_env, the relay; not the 2.51+ anonymous@
    mapping, not the aux-pull fix (vLLM 0.11-0.15 only)."""
    if ray.__version__ != "2.48.0":
        pytest.skip("the default venv pins Ray 2.48.0")
    out = last_json(run_python(STEPS_PROBE, env=base_env(site=False)))
    assert out == sorted({"batch-handoff", "vllm-runtime-env", "node-relay"}), out



@pytest.mark.parametrize("module", sorted(set(targets.wrapper_modules())
                                          | {"ray_runai_shim.patches", "ray_runai_shim.tables.targets",
                                             "ray_runai_shim.doctor", "ray_runai_shim.snapshot.fetch",
                                             "ray_runai_shim.snapshot.relay"}))
def test_any_shim_module_can_be_the_first_import(module):
    out = last_json(run_python(f"import json, sys\nimport {module}\nprint(json.dumps(sorted(sys.modules)))",
                               env=base_env(site=False)))
    assert module in out


def test_importing_the_shim_imports_neither_ray_nor_vllm_nor_wrapt():
    out = last_json(run_python(
        "import json, sys\nimport ray_runai_shim\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'vllm', 'torch', 'transformers', 'pyarrow', 'wrapt'))))", env=base_env(site=False)))
    assert out == []


def test_kill_switch_env_var():
    body = (
        "import json, ray_runai_shim\nimport ray.llm._internal.batch.stages.vllm_engine_stage as m, wrapt\n"
        "ray_runai_shim.install()\ns = ray_runai_shim.status()\n"
        "print(json.dumps({'wrapped': isinstance(m.vLLMEngineStageUDF.__dict__['__init__'], wrapt.ObjectProxy),"
        " 'disabled': s['disabled_by_env'], 'installed': s['installed'], 'patched': s['patched']}))"
    )
    out = last_json(run_python(body, env=base_env({"RAY_RUNAI_SHIM_DISABLE": "1"}, site=False)))
    assert out == {"wrapped": False, "disabled": True, "installed": False, "patched": []}


def test_a_failing_target_never_breaks_import_ray():
    """A wrapper that cannot load (Ray or the shim changed shape): logged; Ray imports and runs
    unpatched there; every other target still applies."""
    body = (
        "import io, json, logging\n"
        "buf = io.StringIO(); logging.getLogger('ray.runai_shim').addHandler(logging.StreamHandler(buf))\n"
        "import ray_runai_shim.tables.targets as t\n"
        "t.TARGETS = tuple(x._replace(wrapper='json:no_such_wrapper') if x.module == t.STAGE_MODULE else x"
        " for x in t.TARGETS)\n"
        "import ray_runai_shim, ray.data\nimport ray.llm._internal.batch.stages.vllm_engine_stage\n"
        "p = ray_runai_shim.status()['patched']\n"
        "print(json.dumps({'stage': [n for n in p if 'vllm_engine_stage' in n], 'others': len(p),"
        " 'logged': 'patching ray.llm._internal.batch.stages.vllm_engine_stage.vLLMEngineStageUDF.__init__ failed'"
        " in buf.getvalue()}))"
    )
    out = last_json(run_python(body, env=base_env(site=False)))
    assert out["stage"] == [] and out["logged"] is True
    assert out["others"] >= 3  # ray.init x2 and the endpoint still applied


def test_status_has_one_shape_before_and_after_ray():
    out = last_json(run_python(
        "import json, ray_runai_shim\nbefore = ray_runai_shim.status()\n"
        "import ray.llm._internal.batch.stages.vllm_engine_stage\nafter = ray_runai_shim.status()\n"
        "print(json.dumps({'before': before, 'after': after}))", env=base_env(site=False)))
    assert set(out["before"]) == set(out["after"])
    assert out["before"]["waiting_for_ray"] is True and out["before"]["patched"] == []
    assert out["after"]["ray_version"] == ray.__version__
    assert "batch-handoff" in out["after"]["plan"] and "batch-handoff" in out["after"]["patches_applied"]
    json.dumps(out)
