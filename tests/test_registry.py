"""The registry: wrap a name once, restore the exact original, leave captured wrappers inert.

Real modules made for the test (``types.ModuleType``), real wrapt wrappers: what every
target of :data:`ray_runai_shim.tables.targets.TARGETS` relies on, apart from any of them.
"""

from __future__ import annotations

import logging
import types

import pytest

from ray_runai_shim import registry


@pytest.fixture
def mod(monkeypatch):
    # A registry of the test's own: whatever else this worker process installed stays as it is.
    monkeypatch.setattr(registry, "_applied", [])
    monkeypatch.setattr(registry, "_appended", [])
    m = types.ModuleType("rrs_test_victim")

    def f(x):
        return ("f", x)

    class C:
        @staticmethod
        def s(x):
            return ("s", x)

        def m(self, x):
            return ("m", x)

    m.f, m.C, m.alias = f, C, f
    m.names = ["a"]
    yield m
    registry.restore_all()


def tag(label):
    def wrapper(wrapped, instance, args, kwargs):
        return (label, wrapped(*args, **kwargs))

    return wrapper


def test_a_name_is_wrapped_once_per_patch_and_restored_to_the_very_object(mod):
    original_f, original_s = mod.f, vars(mod.C)["s"]
    assert registry.wrap("p", "m.f", mod, "f", tag("w")) is True
    assert registry.wrap("p", "m.f", mod, "f", tag("w")) is False  # installed twice = once
    assert mod.f(1) == ("w", ("f", 1))
    assert registry.wrap("p", "m.C.s", mod, "C.s", tag("w")) is True
    assert mod.C.s(2) == ("w", ("s", 2)) and mod.C().m(3) == ("m", 3)
    assert registry.applied() == [("p", "m.f"), ("p", "m.C.s")]
    registry.restore_all()
    assert mod.f is original_f and vars(mod.C)["s"] is original_s  # a staticmethod stays one
    assert registry.applied() == []
    # Control: the wrapper really was in place (not a no-op that happened to pass).
    assert registry.wrap("p", "m.f", mod, "f", tag("w")) is True and mod.f is not original_f


def test_an_alias_of_a_wrapped_name_is_recorded_and_restored_to_the_shared_original(mod):
    original = mod.f
    registry.wrap("p", "m.f", mod, "f", tag("w"))
    mod.alias = mod.f  # ray.init is ray._private.worker.init
    assert registry.wrap("p", "m.alias", mod, "alias", tag("w")) is True
    assert mod.alias(1) == ("w", ("f", 1))  # not wrapped twice
    registry.restore_all()
    assert mod.f is original and mod.alias is original


def test_wrappers_of_two_patches_stack_and_unwind_in_order(mod):
    original = mod.f
    registry.wrap("inner", "m.f", mod, "f", tag("inner"))
    registry.wrap("outer", "m.f", mod, "f", tag("outer"))
    assert mod.f(1) == ("outer", ("inner", ("f", 1)))
    registry.restore_all()
    assert mod.f is original


def test_a_wrapper_captured_before_uninstall_is_inert_after_it(mod, caplog):
    registry.wrap("p", "m.f", mod, "f", tag("w"))
    captured = mod.f  # another module did ``from rrs_test_victim import f``
    assert captured(1) == ("w", ("f", 1))
    registry.restore_all()
    assert captured(1) == ("f", 1)  # calls the original straight through

    # Re-patched by someone else on top of ours: ours is left in place, and inert.
    registry.wrap("p", "m.f", mod, "f", tag("w"))
    ours = mod.f
    mod.f = types.FunctionType(ours.__wrapped__.__code__, {}, "theirs")  # another library's patch
    with caplog.at_level(logging.WARNING, logger="ray.runai_shim"):
        registry.restore_all()
    assert mod.f.__name__ == "theirs" and ours(2) == ("f", 2)
    assert any("re-patched by someone else" in r.getMessage() for r in caplog.records)


def test_append_adds_in_place_once_and_removes_exactly(mod):
    names = mod.names
    assert registry.append("p", "m.names", mod, "names", "b") is True
    assert registry.append("p", "m.names", mod, "names", "b") is False
    assert mod.names is names and names == ["a", "b"]
    registry.restore_all()
    assert mod.names is names and names == ["a"]


def test_resolve_names_a_missing_attribute(mod):
    with pytest.raises(AttributeError):
        registry.resolve(mod, "C.nope")


def test_one_hook_gets_one_layer_and_each_patch_switches_its_step_on(mod):
    """A function several patches change is wrapped once, by its one hook; each patch is a step
    that hook reads from :func:`registry.patches_on`; uninstall restores the very original once."""
    original = mod.f
    seen = []

    def hook(wrapped, instance, args, kwargs):
        seen.append(registry.patches_on("m.f"))
        return ("hook", wrapped(*args, **kwargs))

    assert registry.wrap("a", "m.f", mod, "f", hook) is True
    assert registry.wrap("b", "m.f", mod, "f", hook) is True
    assert registry.wrap("b", "m.f", mod, "f", hook) is False  # installed twice = once
    assert mod.f(1) == ("hook", ("f", 1))  # one layer, not two
    assert seen == [frozenset({"a", "b"})] and registry.patches_on("m.other") == frozenset()
    assert registry.applied() == [("a", "m.f"), ("b", "m.f")]
    held = mod.f
    registry.restore_all()
    assert mod.f is original and registry.patches_on("m.f") == frozenset()
    assert held(2) == ("f", 2)  # a captured hook is inert
    # Control: a different wrapper on the same name still stacks (two layers).
    registry.wrap("a", "m.f", mod, "f", hook)
    registry.wrap("c", "m.f", mod, "f", tag("other"))
    assert mod.f(3) == ("other", ("hook", ("f", 3)))
