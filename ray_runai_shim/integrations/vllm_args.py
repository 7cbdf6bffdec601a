"""Two steps of the engine-config hook (:mod:`.engine_config`) on the config vLLM built.

* :func:`inject_weights` -- vLLM < 0.14 has no ``EngineArgs.model_weights``; it
  reads the weights URI off ``ModelConfig.model_weights``. Ray builds the config
  twice from one args object (once itself, once in ``from_engine_args``), so the
  URI is set on every config built from a local dir a handoff gave with a URI
  (:func:`.decide.handed_weights`).
* :func:`clean_runtime_env` -- vLLM's Ray executor re-uses the replica's
  runtime_env in its own ``ray.init``; with the job-level setup hook (how the
  shim reaches workers) that env holds Ray's reserved hook variable, which Ray
  then rejects (ray#61350).
"""

from __future__ import annotations

from typing import Any, Optional

from ..failopen import NotApplicable, step
from ..log import logger
from ..snapshot.handoff import MODEL_WEIGHTS
from .decide import handed_weights


@step("setting model_weights on vLLM's config", fallback="vLLM loads from the local dir (no weights there)")
def inject_weights(config: Any, instance: Any) -> None:
    uri = handed_weights(getattr(instance, "model", None))
    if uri is None or getattr(instance, MODEL_WEIGHTS, None):
        raise NotApplicable("not a dir handed off for vLLM < 0.14's route")
    object.__setattr__(config.model_config, MODEL_WEIGHTS, uri)


def reusable_runtime_env(env: Any) -> Any:
    """*env* as read back from a worker, made valid as ``ray.init(runtime_env=...)`` input.

    ``ray.get_runtime_context().runtime_env`` holds both the hook field and Ray's
    reserved ``__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR``; Ray's ``ray.init``
    asserts the variable is absent. Dropping it lets Ray derive it from the field
    again; a field that is not an importable path (a callable hook's bare name) is
    dropped too. None when nothing needs to change.
    """
    from ..tables.settings import RAY_WORKER_SETUP_HOOK as RAY_HOOK_ENV

    if not isinstance(env, dict):
        return None
    env_vars = env.get("env_vars") or {}
    if RAY_HOOK_ENV not in env_vars:
        return None
    plain = dict(env.to_dict() if hasattr(env, "to_dict") else env)
    plain["env_vars"] = {k: v for k, v in env_vars.items() if k != RAY_HOOK_ENV}
    hook = plain.get("worker_process_setup_hook")
    if not (isinstance(hook, str) and "." in hook):
        plain.pop("worker_process_setup_hook", None)
    return type(env)(**plain) if type(env) is not dict else plain


@step("cleaning vLLM's ray_runtime_env", fallback="vLLM's config is left as built")
def clean_runtime_env(config: Any) -> None:
    parallel = getattr(config, "parallel_config", None)
    fixed: Optional[Any] = reusable_runtime_env(getattr(parallel, "ray_runtime_env", None))
    if fixed is not None:
        object.__setattr__(parallel, "ray_runtime_env", fixed)
        logger.debug("ray-runai-shim: removed Ray's reserved setup-hook variable from vLLM's ray_runtime_env")

