"""The one engine-config hook (:mod:`ray_runai_shim.integrations.engine_config`): vLLM's real
``EngineArgs.create_engine_config`` (vLLM 0.32), wrapped once, its steps called in the order the
hook's code says -- the ones on the arguments before vLLM builds the config, the ones on the
config after -- and only the steps whose patch is on.

Each case runs in a fresh interpreter (the hook changes vLLM's class for the whole process),
with the steps wrapped to record what they were handed.
"""

from __future__ import annotations

import pytest
from support.procs import last_json, run_python

pytestmark = pytest.mark.slow

PROBE = """
import json
from ray_runai_shim import registry
from ray_runai_shim.integrations import anonymous, aux_pull, engine_config, engine_relay as relay, vllm_args
import vllm.engine.arg_utils as au

calls = []
def record(module, name):
    real = getattr(module, name)
    def step(*args):
        calls.append([name, type(args[0]).__name__])
        return real(*args)
    setattr(module, name, step)
for module, name in ((relay, "checks"), (aux_pull, "hand_off"), (anonymous, "plain_uri"),
                     (vllm_args, "inject_weights"), (vllm_args, "clean_runtime_env"), (relay, "relay_config")):
    record(module, name)
for patch in {patches!r}:
    registry.wrap(patch, engine_config.NAME, au, "EngineArgs.create_engine_config", engine_config.create_engine_config)
args = au.EngineArgs(model={local!r}, load_format="runai_streamer", dtype="float32", max_model_len=256,
                     enforce_eager=True)
config = args.create_engine_config()
depth, fn = 0, au.EngineArgs.__dict__["create_engine_config"]
while type(fn).__name__ == "FunctionWrapper":  # the test site's recorder may wrap it too: count ours
    depth, fn = depth + (fn._self_wrapper is engine_config.create_engine_config), fn.__wrapped__
print(json.dumps({{"calls": calls, "depth": depth, "model": config.model_config.model}}))
"""

ALL = ["batch-handoff", "vllm-runtime-env", "s3-anonymous", "vllm-aux-pull", "node-relay"]


def _run(models, sandbox, patches):
    return last_json(run_python(PROBE.format(patches=patches, local=str(models["tiny"].local)), env=sandbox.env))


def test_every_step_in_the_hooks_order_around_one_build(models, sandbox):
    out = _run(models, sandbox, ALL)
    assert out["depth"] == 1, out  # five patches, one layer of the hook
    assert out["calls"] == [
        ["checks", "EngineArgs"], ["hand_off", "EngineArgs"], ["plain_uri", "EngineArgs"],  # the arguments
        ["inject_weights", "VllmConfig"], ["clean_runtime_env", "VllmConfig"], ["relay_config", "VllmConfig"],
    ], out
    assert out["model"] == str(models["tiny"].local)  # a local model: every step left it alone


def test_only_the_steps_whose_patch_is_on_run(models, sandbox):
    out = _run(models, sandbox, ["node-relay"])
    # the weights injection runs wherever a handoff recorded a dir (none here: it leaves the config)
    assert out["calls"] == [["checks", "EngineArgs"], ["inject_weights", "VllmConfig"],
                            ["relay_config", "VllmConfig"]], out
    # Control: with no step on, the hook changes nothing but still injects nothing.
    assert _run(models, sandbox, ["batch-handoff"])["calls"] == [["inject_weights", "VllmConfig"]]
