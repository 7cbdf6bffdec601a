"""Every name the shim touches, as data (ddtrace's ``_monkey.py`` style).

A target says which *consumer* module to watch, which attribute inside it to
wrap (a dotted path, resolved like wrapt's ``resolve_path``), which wrapper to
use (a ``module:function`` string, imported only when the consumer module is),
and under which patch name the version tables in :mod:`.support` switch it on.
A function is wrapped once, by one hook: where several patches change one
function, their rows name the same hook, and each row switches that patch's
step on (the hook's code says the order).
Feature checks have the last word: ``unless_has`` skips a target when the
module already has the upstream fix, ``requires`` names what must exist for
the wrapper to make sense (else one WARNING: Ray changed shape), ``only_for``
limits it to the releases of another package that carry the bug (``(package,
low, high)``: that package's ``__version__`` in [low, high)), and ``if_has``
skips it quietly where the module does not hold that name (a class that moved
between modules across releases: one target per home).

The installer (:mod:`.patches`), the banner, ``status()``, ``doctor`` and the
tests are all generated from :data:`TARGETS`. Nothing here imports anything.
"""

from __future__ import annotations

from typing import NamedTuple

from .support import (
    ACTIVATION,
    AUX_PULL,
    DOWNLOAD,
    ENDPOINT,
    HANDOFF,
    OFFLINE,
    PEER_FILES,
    RELAY,
    RELAY_READER,
    RUNTIME_ENV,
    S3_ANONYMOUS,
    SERVE_ACTIVATION,
    SERVE_DOWNLOAD,
    SERVE_HANDOFF,
    SERVE_MIRROR,
    SHARDED_FORMAT,
    TOKENIZER,
    VLLM_AUX_PULL_RACE,
    VLLM_OFFLINE_HUB_LOOKUP,
)

STAGE_MODULE = "ray.llm._internal.batch.stages.vllm_engine_stage"
CHAT_TEMPLATE_STAGE = "ray.llm._internal.batch.stages.chat_template_stage"
TOKENIZE_STAGE = "ray.llm._internal.batch.stages.tokenize_stage"
PROCESSOR_MODULE = "ray.llm._internal.batch.processor.vllm_engine_proc"
CLOUD_UTILS = "ray.llm._internal.common.utils.cloud_utils"
DOWNLOAD_UTILS = "ray.llm._internal.common.utils.download_utils"
NODE_INIT = "ray.llm._internal.serve.deployments.utils.node_initialization_utils"
VLLM_MODELS = "ray.llm._internal.serve.deployments.llm.vllm.vllm_models"
REMOTE_NODE_INIT = "ray.llm._internal.serve.utils.node_initialization_utils"  # 2.51
ENGINES_VLLM_MODELS = "ray.llm._internal.serve.engines.vllm.vllm_models"  # 2.51
VLLM_ARG_UTILS = "vllm.engine.arg_utils"
VLLM_WORKER_BASE = "vllm.v1.worker.worker_base"  # WorkerWrapperBase once V0 is gone (0.13, 0.15, 0.32 read)
VLLM_V0_WORKER_BASE = "vllm.worker.worker_base"  # ... and before (0.10.2 read)
VLLM_ASYNC_LLM = "vllm.v1.engine.async_llm"  # AsyncLLM (= AsyncLLMEngine): returns once every rank loaded
VLLM_LLM_ENGINE = "vllm.v1.engine.llm_engine"  # LLMEngine (vllm.LLM), likewise
VLLM_RUNAI_LOADER = "vllm.model_executor.model_loader.runai_streamer_loader"  # each rank's weights iterator
SERVE_BUILD_APP = "ray.serve._private.build_app"  # run by the controller's config-deploy build task

#: One hook per patched function: rows of several patches on one function name the same hook,
#: which calls each patch's step in the order its code says (the registry stacks nothing).
ENGINE_CONFIG_HOOK = "ray_runai_shim.integrations.engine_config:create_engine_config"
SERVE_KWARGS_HOOK = "ray_runai_shim.integrations.serve_engine_kwargs:init_kwargs"

WRAP = "wrap"  # replace module.attr by a wrapt FunctionWrapper
APPEND = "append"  # append ``value`` to the list at module.attr, in place (aliases see it)
CALL = "call"  # call the wrapper with the module once it is imported (no name changes)


class Target(NamedTuple):
    patch: str
    module: str
    attr: str
    wrapper: str = ""
    kind: str = WRAP
    unless_has: str = ""
    requires: tuple[str, ...] = ()
    value: str = ""
    only_for: tuple = ()  # (package, (major, minor) low, (major, minor) high): else not applicable
    if_has: str = ""  # the module holds this name only in some releases (another target covers the rest)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module


TARGETS: tuple[Target, ...] = (
    # Activation: announce once, and carry the shim into the job's workers (ray.init).
    Target(ACTIVATION, "ray", "", "ray_runai_shim.activation.ray_init:on_ray_imported", kind=CALL),
    Target(ACTIVATION, "ray._private.worker", "init", "ray_runai_shim.activation.ray_init:ray_init"),
    Target(ACTIVATION, "ray", "init", "ray_runai_shim.activation.ray_init:ray_init"),
    # Serve apps deployed from a config file: the replicas load the shim through the autoload.
    Target(SERVE_ACTIVATION, SERVE_BUILD_APP, "_set_default_runtime_env",
           "ray_runai_shim.activation.serve_config:set_default_runtime_env", requires=("build_app",)),
    # Ray 2.45-2.49's pyarrow S3 filesystem ignores AWS_ENDPOINT_URL.
    Target(ENDPOINT, CLOUD_UTILS, "CloudFileSystem.get_fs_and_path", "ray_runai_shim.stores.endpoint:get_fs_and_path_wrapper"),
    # 2.51: runai_streamer_sharded is missing from the list of streaming formats.
    Target(SHARDED_FORMAT, DOWNLOAD_UTILS, "STREAMING_LOAD_FORMATS", kind=APPEND, value="runai_streamer_sharded"),
    # Ray Data's vLLM stage (2.45-2.50): open the stage context, narrow the download, hand off.
    Target(HANDOFF, STAGE_MODULE, "vLLMEngineStageUDF.__init__", "ray_runai_shim.integrations.ray_data:udf_init",
           unless_has="STREAMING_LOAD_FORMATS", requires=("vLLMEngineWrapper",)),
    Target(HANDOFF, STAGE_MODULE, "vLLMEngineWrapper.__init__", "ray_runai_shim.integrations.ray_data:engine_init",
           unless_has="STREAMING_LOAD_FORMATS", requires=("vLLMEngineStageUDF",)),
    Target(DOWNLOAD, STAGE_MODULE, "download_model_files", "ray_runai_shim.integrations.ray_data:download",
           unless_has="STREAMING_LOAD_FORMATS", requires=("vLLMEngineStageUDF",)),
    # The tokenizer-only downloads of the chat-template / tokenize stages (ray#62047; from 2.56
    # ray#62121 keeps chat templates, but vocab.json, merges.txt, ... are still dropped).
    Target(TOKENIZER, CHAT_TEMPLATE_STAGE, "download_model_files", "ray_runai_shim.integrations.tokenizer:download"),
    Target(TOKENIZER, TOKENIZE_STAGE, "download_model_files", "ray_runai_shim.integrations.tokenizer:download"),
    # The processor's config read (telemetry, in the driver). 2.59+ import download_model_files
    # inside build_vllm_engine_processor, so the module holds no such name: nothing to wrap there.
    Target(TOKENIZER, PROCESSOR_MODULE, "download_model_files", "ray_runai_shim.integrations.tokenizer:download",
           if_has="download_model_files"),
    # vLLM's engine config, one hook (integrations/engine_config.py says the order of its steps):
    # vLLM < 0.14 reads the weights URI off every config the args build; vLLM's Ray executor must
    # not re-use Ray's reserved setup-hook variable (ray#61350); Ray 2.51+ hands vLLM s3://anonymous@
    # URIs as given; vLLM 0.11-0.15 wipe and re-pull the non-weight files per engine, so engines on
    # one node race (ray#60681); and the node relay (below).
    Target(HANDOFF, VLLM_ARG_UTILS, "EngineArgs.create_engine_config", ENGINE_CONFIG_HOOK),
    Target(RUNTIME_ENV, VLLM_ARG_UTILS, "EngineArgs.create_engine_config", ENGINE_CONFIG_HOOK),
    Target(S3_ANONYMOUS, VLLM_ARG_UTILS, "EngineArgs.create_engine_config", ENGINE_CONFIG_HOOK),
    Target(AUX_PULL, VLLM_ARG_UTILS, "EngineArgs.create_engine_config", ENGINE_CONFIG_HOOK,
           only_for=("vllm", *VLLM_AUX_PULL_RACE)),
    # vLLM 0.10.2-0.22 with HF_HUB_OFFLINE=1: EngineArgs.__post_init__ hands the model (and tokenizer) to
    # the module's own get_model_path, a Hub snapshot_download for anything not on disk: an object-store
    # URI fails there (HFValidationError) before anything streams. vLLM 0.23 skips cloud URIs; 0.10.0/0.10.1
    # hold no such name (if_has).
    Target(OFFLINE, VLLM_ARG_UTILS, "get_model_path", "ray_runai_shim.integrations.offline:get_model_path",
           only_for=("vllm", *VLLM_OFFLINE_HUB_LOOKUP), if_has="get_model_path"),
    # Every reader on a node (engines x TP/PP ranks) streams the whole checkpoint: relay it through
    # node memory, read once; one streamer memory budget per node (the engine-config hook's last
    # step, so it sees the weights URI vLLM will stream); released once loaded.
    Target(RELAY, VLLM_ARG_UTILS, "EngineArgs.create_engine_config", ENGINE_CONFIG_HOOK),
    Target(RELAY, STAGE_MODULE, "vLLMEngineStage.__init__", "ray_runai_shim.integrations.engine_relay:stage_init",
           if_has="vLLMEngineStage"),
    Target(RELAY, VLLM_ASYNC_LLM, "AsyncLLM.__init__", "ray_runai_shim.integrations.engine_relay:engine_ready",
           if_has="AsyncLLM"),
    Target(RELAY, VLLM_LLM_ENGINE, "LLMEngine.__init__", "ray_runai_shim.integrations.engine_relay:engine_ready",
           if_has="LLMEngine"),
    # each rank reads the relay's copy as it lands (the engine's process pipelines only where this applies)
    Target(RELAY_READER, VLLM_RUNAI_LOADER, "RunaiModelStreamerLoader._get_weights_iterator",
           "ray_runai_shim.integrations.runai_loader:weights_iterator", if_has="RunaiModelStreamerLoader"),
    # vLLM's workers on other nodes (TP/PP across nodes) are told a model dir that exists only on the
    # node that built the config (vllm#50616): fetch the non-weight files there, in the worker.
    Target(PEER_FILES, VLLM_WORKER_BASE, "WorkerWrapperBase.init_worker", "ray_runai_shim.integrations.peer_files:init_worker",
           if_has="WorkerWrapperBase"),
    Target(PEER_FILES, VLLM_V0_WORKER_BASE, "WorkerWrapperBase.init_worker", "ray_runai_shim.integrations.peer_files:init_worker",
           if_has="WorkerWrapperBase"),
    # Serve LLM 2.45-2.50: node init in the replica, then vLLM's arguments.
    Target(SERVE_DOWNLOAD, NODE_INIT, "_initialize_local_node", "ray_runai_shim.integrations.serve:local_node",
           unless_has="STREAMING_LOAD_FORMATS", requires=("download_model_files",)),
    Target(SERVE_DOWNLOAD, NODE_INIT, "download_model_files", "ray_runai_shim.integrations.serve:local_node_download",
           unless_has="STREAMING_LOAD_FORMATS", requires=("_initialize_local_node",)),
    # ... and with pipeline parallelism > 1, Ray's full download on every node of the placement group.
    Target(SERVE_DOWNLOAD, NODE_INIT, "initialize_worker_nodes", "ray_runai_shim.integrations.serve:worker_nodes",
           unless_has="STREAMING_LOAD_FORMATS", requires=("initialize_node",)),
    Target(SERVE_HANDOFF, VLLM_MODELS, "VLLMEngineConfig.get_initialization_kwargs", SERVE_KWARGS_HOOK),
    # Serve LLM 2.51: per-node ray.remote(initialize_remote_node) downloads (not the task itself:
    # Ray pickles it by reference), and the same handoff in the moved module.
    Target(SERVE_DOWNLOAD, REMOTE_NODE_INIT, "download_model_files", "ray_runai_shim.integrations.serve:remote_node_download",
           requires=("initialize_remote_node",)),
    Target(SERVE_HANDOFF, ENGINES_VLLM_MODELS, "VLLMEngineConfig.get_initialization_kwargs", SERVE_KWARGS_HOOK),
    # Serve LLM 2.52-2.58: a streaming mirror source reaches vLLM as the bare model_id (ray#64978).
    Target(SERVE_MIRROR, ENGINES_VLLM_MODELS, "VLLMEngineConfig.get_initialization_kwargs", SERVE_KWARGS_HOOK),
)


def modules() -> tuple[str, ...]:
    """The consumer modules to watch, in table order, each once."""
    return tuple(dict.fromkeys(t.module for t in TARGETS))


def for_module(module: str) -> tuple[Target, ...]:
    return tuple(t for t in TARGETS if t.module == module)


def wrapper_modules() -> tuple[str, ...]:
    return tuple(dict.fromkeys(t.wrapper.partition(":")[0] for t in TARGETS if t.wrapper))
