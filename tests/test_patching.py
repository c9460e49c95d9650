"""Patching that can be undone exactly: wrapped methods come back as the
class held them, subclass layers come off one by one."""

from __future__ import annotations

import functools
import types

import pytest

from vllm_kimi_k3_moe.patching import (
    add_subclass_layer,
    is_plugin_wrapper,
    lost_wrappers,
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


def test_a_wrapper_over_the_plugin_s_stays_and_calls_through() -> None:
    """Other code wrapping the method after the plugin did: the plugin's
    wrapper runs inside it; reverting leaves that code's wrapper working
    (the plugin's only hands on); applying again opens it again."""

    class Owner:
        def method(self) -> int:
            return 1

    wrap_method(Owner, "method", doubled)
    ours = vars(Owner)["method"]
    theirs = functools.wraps(ours)(lambda self: 10 * ours(self))
    Owner.method = theirs
    assert Owner().method() == 20
    assert is_plugin_wrapper(ours) and not is_plugin_wrapper(theirs)
    unwrap_method(Owner, "method")
    assert vars(Owner)["method"] is theirs
    assert Owner().method() == 10
    wrap_method(Owner, "method", doubled)  # opened again, not wrapped twice
    assert vars(Owner)["method"] is theirs
    assert Owner().method() == 20
    assert lost_wrappers() == []


def test_a_wrapper_dropped_by_other_code_is_lost_and_made_anew() -> None:
    class Owner:
        def method(self) -> int:
            return 1

    own = Owner.method
    wrap_method(Owner, "method", doubled)
    Owner.method = own  # put back by code that saved it before
    assert lost_wrappers() == [(Owner, "method", own)]
    unwrap_method(Owner, "method")
    assert lost_wrappers() == []
    wrap_method(Owner, "method", doubled)
    assert Owner().method() == 2
    unwrap_method(Owner, "method")
    assert vars(Owner)["method"] is own


def test_a_closed_wrapper_put_back_by_other_code_is_taken_up_again() -> None:
    class Owner:
        def method(self) -> int:
            return 1

    wrap_method(Owner, "method", doubled)
    ours = vars(Owner)["method"]
    Owner.method = lambda self: 5  # other code's, not calling on ours
    unwrap_method(Owner, "method")  # ours is gone: forgotten, closed
    Owner.method = ours  # that code puts back what it saved
    assert Owner().method() == 1  # closed: hands on
    wrap_method(Owner, "method", doubled)
    assert vars(Owner)["method"] is ours and Owner().method() == 2
    unwrap_method(Owner, "method")
    assert vars(Owner)["method"] is not ours and Owner().method() == 1
