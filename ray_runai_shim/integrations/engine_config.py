"""vLLM's ``EngineArgs.create_engine_config``: the one hook, and what it does to an engine, in order.

Every front-end meets vLLM here, in the process that builds the engine (Ray Data's stage actor,
a Serve replica, a plain driver). vLLM's own method runs once; around it, each step where the
version tables and feature checks switched its patch on (:func:`.registry.patches_on`; the
rows of :data:`.tables.targets.TARGETS` that name this hook):

before vLLM builds the config, on its arguments --

1. :func:`.engine_relay.checks` (node-relay) -- a wrong streamer memory limit is the user's error,
   raised now; does this format leave anything to relay;
2. :func:`.aux_pull.hand_off` (aux-pull, vLLM 0.11-0.15) -- the locked non-weight fetch, and
   vLLM's args point at it (it sees Ray's ``s3://anonymous@`` URI: the fetch honours it);
3. :func:`.anonymous.plain_uri` (s3-anonymous, Ray 2.51+) -- ``s3://anonymous@`` becomes the
   streamer's plain URI plus unsigned requests;

on the config vLLM built --

4. :func:`.vllm_args.inject_weights` (vLLM < 0.14) -- the weights URI on every config built
   from a dir a handoff gave with one (Ray Data, Serve, step 2 alike);
5. :func:`.vllm_args.clean_runtime_env` (vllm-runtime-env) -- no reserved Ray variable in the
   runtime_env vLLM's Ray executor re-uses (ray#61350);
6. :func:`.engine_relay.relay_config` (node-relay) -- last, so it sees the weights URI vLLM will
   stream: relay or stream, and the streamer's memory budget.

Each step follows :func:`.failopen.step`: one that fails is logged and skipped, the others run.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import registry
from ..failopen import fail_open
from ..tables.support import AUX_PULL, RELAY, RUNTIME_ENV, S3_ANONYMOUS
from ..tables.targets import VLLM_ARG_UTILS
from . import anonymous, aux_pull, engine_relay, vllm_args

NAME = f"{VLLM_ARG_UTILS}.EngineArgs.create_engine_config"


@fail_open("vLLM's engine config", fallback="vLLM builds its config from the arguments as given")
def create_engine_config(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    on = registry.patches_on(NAME)
    relaying = RELAY in on and engine_relay.checks(instance)
    if AUX_PULL in on:
        aux_pull.hand_off(instance)
    if S3_ANONYMOUS in on:
        anonymous.plain_uri(instance)
    config = original(*args, **kwargs)
    vllm_args.inject_weights(config, instance)
    if RUNTIME_ENV in on:
        vllm_args.clean_runtime_env(config)
    if relaying:
        engine_relay.relay_config(config, instance)
    return config
