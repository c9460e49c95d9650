"""Patching that can be undone exactly: wrapped methods come back as the
class held them, subclass layers come off one by one."""

from __future__ import annotations

import types

import pytest

from vllm_kimi_k3_moe.patching import (
    add_subclass_layer,
    remove_subclass_layer,
    unwrap_method,
    upstream_class,
    wrap_method,
)


def doubled(own):
    def wrapper(*args):
        return 2 * own(*args)

    return wrapper


class Base:
    def inherited(self) -> int:
        return 1


class Upstream(Base):
    def method(self) -> int:
        return 1

    @staticmethod
    def static() -> int:
        return 1

    @classmethod
    def klass(cls) -> int:
        return 1


@pytest.mark.parametrize("name", ["method", "static", "klass", "inherited"])
def test_wrapping_keeps_the_descriptor_and_unwrapping_restores_it(name) -> None:
    held = dict(vars(Upstream))
    wrap_method(Upstream, name, doubled)
    wrap_method(Upstream, name, doubled)  # applying twice wraps once
    assert getattr(Upstream(), name)() == 2
    if name in ("static", "klass"):
        assert getattr(Upstream, name)() == 2  # still callable on the class
        assert type(vars(Upstream)[name]) is type(held[name])
    unwrap_method(Upstream, name)
    unwrap_method(Upstream, name)  # unwrapping twice changes nothing
    assert dict(vars(Upstream)) == held  # the very objects, or none inherited
    assert getattr(Upstream(), name)() == 1


class PatchA:
    def who(self) -> str:
        return "A+" + super().who()


class PatchB:
    def who(self) -> str:
        return "B+" + super().who()


class Model:
    def who(self) -> str:
        return "model"


def test_subclass_layers_come_off_independently() -> None:
    module = types.ModuleType("upstream_module")
    module.Model = Model
    add_subclass_layer(module, "Model", PatchA)
    add_subclass_layer(module, "Model", PatchB)
    add_subclass_layer(module, "Model", PatchA)  # already there: unchanged
    assert module.Model().who() == "B+A+model"
    assert upstream_class(module.Model) is Model
    assert module.Model.__name__ == module.Model.__qualname__ == "Model"
    remove_subclass_layer(module, "Model", PatchA)
    assert module.Model().who() == "B+model"
    assert issubclass(module.Model, Model) and not issubclass(module.Model, PatchA)
    remove_subclass_layer(module, "Model", PatchB)
    assert module.Model is Model
    remove_subclass_layer(module, "Model", PatchB)  # nothing left to remove
    assert module.Model is Model


def test_layers_added_again_give_back_the_same_class() -> None:
    """``unregister()`` then ``register()`` in one process (``selftest`` takes
    the plugin out for vLLM alone's partition) leaves the class a module
    imported from the patched one (vLLM's MTP draft) the module's class."""
    module = types.ModuleType("upstream_module")
    module.Model = Model
    add_subclass_layer(module, "Model", PatchA)
    add_subclass_layer(module, "Model", PatchB)
    imported = module.Model
    remove_subclass_layer(module, "Model", PatchB)
    remove_subclass_layer(module, "Model", PatchA)
    assert module.Model is Model
    add_subclass_layer(module, "Model", PatchA)
    add_subclass_layer(module, "Model", PatchB)
    assert module.Model is imported
