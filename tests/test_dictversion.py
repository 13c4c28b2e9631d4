"""The dict version tags that let the snapshot checks skip unchanged namespaces.

Each check is run with the tags as krex reads them and, as its negative control, with a
reader that never moves (an offset whose value a rebinding does not change): the same
rebinding then goes unseen, so the checks below rest on the tags, not on the fallback.
"""

from __future__ import annotations

import gc
import sys
import types

import pytest

from krex.workers import dictversion, fingerprint, snapshot

pytestmark = pytest.mark.skipif(not dictversion._supported(),
                                reason="dict version tags are read on CPython 3.6-3.13 only")

SOURCE = """
def f(a=1):
    return a

class C:
    attr = 1

    def m(self):
        return 2

value = [1]
"""


@pytest.fixture
def module():
    mod = types.ModuleType("krex_fake_tagged")
    exec(SOURCE, vars(mod))
    mod.C.__module__ = "krex_fake_tagged"
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


@pytest.fixture
def stuck(monkeypatch):
    """The negative control: read ``ob_type`` (the same for every dict) instead of the
    tag: a reader that never moves."""
    def use() -> None:
        monkeypatch.setattr(dictversion, "_TAG", dictversion._WORD)
    return use


def test_the_self_test_passes_here_and_fails_for_a_reader_that_does_not_track():
    assert dictversion.available()
    assert dictversion._self_test(dictversion.read)
    assert not dictversion._self_test(lambda d: 0)
    assert not dictversion._self_test(lambda d: len(d))  # moves on some mutations only


def test_the_switch_turns_the_tags_off(monkeypatch, module):
    monkeypatch.setenv("KREX_DICT_TAGS", "0")
    assert not dictversion.available()
    before = fingerprint.Bindings([module.__name__])
    assert before.untracked and before.changed() == []
    module.f = print
    assert before.changed() == ["krex_fake_tagged.f"]  # the full comparison


REBINDS = {
    "module global": lambda m: setattr(m, "value", [1]),
    "through globals()": lambda m: vars(m).__setitem__("value", [1]),
    "removed": lambda m: delattr(m, "value"),
    "class attribute": lambda m: setattr(m.C, "attr", 2),
    "method": lambda m: setattr(m.C, "m", lambda self: 3),
    "class dict reached by gc": lambda m: next(
        r for r in gc.get_referents(vars(m.C)) if type(r) is dict).__setitem__("attr", 5),
}


@pytest.mark.parametrize("how", sorted(REBINDS))
@pytest.mark.parametrize("control", [False, True], ids=["tags", "stuck-control"])
def test_the_fingerprint_sees_every_rebinding_by_its_tags(module, stuck, how, control):
    if control:
        stuck()
    before = fingerprint.Bindings([module.__name__])
    assert not before.untracked
    for _ in range(3):  # checked again and again: the kept answers stay right
        assert before.changed() == []
    REBINDS[how](module)
    assert bool(before.changed()) is not control


def test_the_fingerprint_forgets_a_change_put_back(module):
    before = fingerprint.Bindings([module.__name__])
    original = module.C.attr
    module.C.attr = 2
    assert before.changed() == ["krex_fake_tagged.C.attr"]
    module.C.attr = original
    assert before.changed() == []
    module.new_name = 1  # new names are not judged, even though the tag moved
    assert before.changed() == []


@pytest.mark.parametrize("control", [False, True], ids=["tags", "stuck-control"])
def test_the_snapshot_sees_a_rebinding_by_its_tags(module, stuck, control):
    if control:
        stuck()
    snap = snapshot.take()
    assert snap.bindings is not None and snap.bindings.tracker is not None
    assert snap.bindings.unchanged() and snap.bindings.unchanged()
    module.value = [1]
    assert (module.__name__ in snap.bindings.changed()) is not control
    if not control:
        assert snapshot._restore_globals(snap) == ["krex_fake_tagged.value"]
        assert snap.bindings.unchanged()  # put back: the next look is quiet again


def test_function_parts_are_checked_without_any_tag(module):
    before = fingerprint.Bindings([module.__name__])
    module.f.__defaults__ = (2,)
    assert before.changed() == ["krex_fake_tagged.f"]
