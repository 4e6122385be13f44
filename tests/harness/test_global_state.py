"""harness/global_state.py: two reads of an unchanged state compare equal."""

from __future__ import annotations

import sys
import types

from harness import global_state


def test_equal_sets_in_another_order_are_no_difference(monkeypatch) -> None:
    # 0 and 8 share a slot of a small set's table: which comes first in
    # iteration depends on insertion order, so the two reprs differ
    first, second = set(), set()
    first.add(0), first.add(8)
    second.add(8), second.add(0)
    assert first == second and repr(first) != repr(second)
    configs = iter([{"names": first}, {"names": second}])
    fake = types.ModuleType("fake_config_for_global_state")
    fake.get_config_copy = lambda: next(configs)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    read = global_state._config(fake.__name__)
    a = global_state.GlobalState({"fake_config": read()})
    b = global_state.GlobalState({"fake_config": read()})
    assert a.diff(b) == []


def test_a_changed_set_is_a_difference(monkeypatch) -> None:
    configs = iter([{"names": {0, 8}}, {"names": {0, 9}}])
    fake = types.ModuleType("fake_config_for_global_state")
    fake.get_config_copy = lambda: next(configs)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    read = global_state._config(fake.__name__)
    diff = global_state.GlobalState({"fake_config": read()}).diff(global_state.GlobalState({"fake_config": read()}))
    assert [d.field for d in diff] == ["fake_config"]
