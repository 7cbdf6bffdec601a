"""One rule for every wrapper: a shim bug never breaks Ray, and never goes unsaid.

Wrappers are written as plain functions ``(original, instance, args, kwargs)``
and decorated with :func:`fail_open`. Inside, three outcomes exist:

* :class:`ShimError` -- the user's input or environment is wrong; it reaches
  the user, before the engine starts.
* :class:`NotApplicable` -- not a call the shim handles (another format, a
  local path). Ray's original runs; logged at DEBUG only (sentry's
  ``DidNotEnable``).
* anything else -- a shim bug. Logged as a WARNING that says what Ray does
  instead (``fallback``: e.g. "Ray copies the whole model"), then Ray's
  original runs. An exception raised *by Ray's original* is Ray's and is
  re-raised untouched; the original never runs twice.

A hook that does several things to one function (:mod:`.integrations.engine_config`)
calls them as *steps*, each decorated with :func:`step`: the same three outcomes, except
that a step never calls Ray's code -- the hook does, once -- so a step that does not apply
or fails returns None (the hook goes on with what it had) and the other steps still run.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from .errors import ShimError
from .log import logger

Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]
Step = Callable[..., Any]


class NotApplicable(Exception):
    """This call is not one the shim changes; Ray's own code runs."""


def fail_open(what: str, fallback: str, on_fallback: Optional[Callable[[], None]] = None) -> Callable[[Wrapper], Wrapper]:
    """Decorate a wrapt wrapper body; see the module docstring for the rule."""

    def decorate(body: Wrapper) -> Wrapper:
        @functools.wraps(body)
        def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
            calls = {"started": 0, "returned": 0, "result": None}

            def original(*a: Any, **k: Any) -> Any:
                calls["started"] += 1
                result = wrapped(*a, **k)
                calls["returned"] += 1
                calls["result"] = result
                return result

            original.__wrapped__ = wrapped  # type: ignore[attr-defined]  (decide.bind reads it)
            try:
                return body(original, instance, args, kwargs)
            except ShimError:
                raise
            except NotApplicable as e:
                if calls["started"]:
                    raise RuntimeError(f"ray-runai-shim: {what} declined after running Ray's code") from e
                logger.debug("ray-runai-shim: %s: not applicable (%s)", what, e)
                return wrapped(*args, **kwargs)
            except Exception:
                if calls["started"] > calls["returned"]:
                    raise  # Ray's own error, from Ray's own code
                logger.warning("ray-runai-shim: %s failed (a shim bug; please report it): %s",
                               what, fallback, exc_info=True)
                if on_fallback is not None:
                    on_fallback()
                if calls["returned"]:
                    return calls["result"]
                return wrapped(*args, **kwargs)

        return wrapper

    return decorate


def step(what: str, fallback: str) -> Callable[[Step], Step]:
    """Decorate one step of a hook: ShimError reaches the user; NotApplicable is DEBUG; a bug
    is one WARNING naming *fallback*; both of those return None, and the hook goes on."""

    def decorate(body: Step) -> Step:
        @functools.wraps(body)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return body(*args, **kwargs)
            except ShimError:
                raise
            except NotApplicable as e:
                logger.debug("ray-runai-shim: %s: not applicable (%s)", what, e)
            except Exception:
                logger.warning("ray-runai-shim: %s failed (a shim bug; please report it): %s",
                               what, fallback, exc_info=True)
            return None

        return run

    return decorate
