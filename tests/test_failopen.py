"""The fail-open rule every wrapper relies on, on its own: a shim bug never breaks Ray and is
never silent; the user's own error reaches the user; Ray's error stays Ray's; Ray's code
never runs twice."""

from __future__ import annotations

import logging

import pytest

from ray_runai_shim.errors import ShimError
from ray_runai_shim.failopen import NotApplicable, fail_open, step


class Ray:
    """Stands for the wrapped Ray function: counts its calls, may raise its own error."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = 0, fail

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.fail:
            raise RuntimeError("Ray's own error")
        return ("ray", args, kwargs)


def run(body, ray, *args, **kwargs):
    return fail_open("the test hook", fallback="Ray copies the whole model")(body)(ray, None, args, kwargs)


def test_the_hooks_result_is_returned_and_ray_runs_once():
    ray = Ray()
    assert run(lambda original, i, a, k: ("shim", original(*a, **k)), ray, 1) == ("shim", ("ray", (1,), {}))
    assert ray.calls == 1


def test_not_applicable_runs_rays_code_once_and_says_nothing_above_debug(caplog):
    ray = Ray()

    def body(original, i, a, k):
        raise NotApplicable("a local path")

    with caplog.at_level(logging.DEBUG, logger="ray.runai_shim"):
        assert run(body, ray, 2) == ("ray", (2,), {})
    assert ray.calls == 1
    assert [r.levelno for r in caplog.records if "the test hook" in r.getMessage()] == [logging.DEBUG]


def test_a_shim_bug_is_logged_once_and_ray_runs_instead(caplog):
    ray, fell_back = Ray(), []

    def body(original, i, a, k):
        raise KeyError("bug")

    hook = fail_open("the test hook", fallback="Ray copies the whole model", on_fallback=lambda: fell_back.append(1))
    with caplog.at_level(logging.WARNING, logger="ray.runai_shim"):
        assert hook(body)(ray, None, (3,), {}) == ("ray", (3,), {})
    said = [r for r in caplog.records if "the test hook failed" in r.getMessage()]
    assert len(said) == 1 and "a shim bug" in said[0].getMessage() and "Ray copies the whole model" in said[0].getMessage()
    assert said[0].exc_info is not None and ray.calls == 1 and fell_back == [1]


def test_a_bug_after_rays_code_returned_keeps_its_result_and_never_runs_it_twice(caplog):
    ray = Ray()

    def body(original, i, a, k):
        original(*a, **k)
        raise ZeroDivisionError

    with caplog.at_level(logging.WARNING, logger="ray.runai_shim"):
        assert run(body, ray, 4) == ("ray", (4,), {})
    assert ray.calls == 1


def test_rays_own_error_is_re_raised_untouched_and_not_retried(caplog):
    ray = Ray(fail=True)
    with caplog.at_level(logging.WARNING, logger="ray.runai_shim"):
        with pytest.raises(RuntimeError, match="Ray's own error"):
            run(lambda original, i, a, k: original(*a, **k), ray)
    assert ray.calls == 1 and not [r for r in caplog.records if "shim bug" in r.getMessage()]


def test_the_users_error_reaches_the_user():
    ray = Ray()

    def body(original, i, a, k):
        raise ShimError("ray-runai-shim: the model URI names no bucket")

    with pytest.raises(ShimError, match="names no bucket"):
        run(body, ray)
    assert ray.calls == 0


def test_declining_after_rays_code_ran_is_itself_a_bug():
    ray = Ray()

    def body(original, i, a, k):
        original(*a, **k)
        raise NotApplicable("too late")

    with pytest.raises(RuntimeError, match="declined after running Ray's code"):
        run(body, ray)
    assert ray.calls == 1


def test_a_hooks_steps_fail_one_at_a_time_and_the_hook_goes_on(caplog):
    """One hook, several steps (the engine-config hook): a step that does not apply or has a bug
    returns None and the next step still runs; Ray's code runs once; the user's error is raised."""
    ray, done = Ray(), []

    @step("the first step", fallback="left as built")
    def broken(config):
        raise KeyError("bug")

    @step("the second step", fallback="left as built")
    def not_here(config):
        raise NotApplicable("another format")

    @step("the third step", fallback="left as built")
    def works(config):
        done.append(config)
        return "changed"

    @fail_open("the test hook", fallback="Ray copies the whole model")
    def hook(original, instance, args, kwargs):
        config = original(*args, **kwargs)
        return [broken(config), not_here(config), works(config)]

    with caplog.at_level(logging.DEBUG, logger="ray.runai_shim"):
        assert hook(ray, None, (4,), {}) == [None, None, "changed"]
    assert ray.calls == 1 and done == [("ray", (4,), {})]
    levels = {r.getMessage().split(":")[1].strip(): r.levelno for r in caplog.records}
    assert levels["the first step failed (a shim bug; please report it)"] == logging.WARNING
    assert levels["the second step"] == logging.DEBUG

    @step("the user's step", fallback="left as built")
    def users_error(config):
        raise ShimError("RUNAI_STREAMER_MEMORY_LIMIT=abc is not a number of bytes")

    with pytest.raises(ShimError, match="not a number"):
        users_error(None)
