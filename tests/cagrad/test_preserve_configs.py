"""cagrad.preserve.preserved() and torch's config modules (issue 38).

``preserved()`` reads the Dynamo, inductor and functorch configs around
every backend compile. It reads them from torch's cached export where torch
has one (no deep copy of the 800-odd keys), and still puts back a change of
every kind: a value set, a ``patch`` left entered, a container replaced or
changed in place. Checked against torch's own ``get_config_copy()`` taken
before and after.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo  # the configs are read where imported
import torch._functorch.config
import torch._inductor.config

from cagrad import preserve
from cagrad.preserve import preserved

CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
#: a list-valued inductor key, changed in place and replaced below
LIST_KEY = "_fuse_ddp_communication_passes"
#: a set-valued Dynamo key no other test sets (one set once reads fresh from then on)
STALE_KEY = "reorderable_logging_functions"


def _users_function() -> None:
    """An item for :data:`STALE_KEY`."""


def _copies() -> dict[str, dict]:
    return {name: sys.modules[name].get_config_copy() for name in CONFIGS}


@pytest.fixture
def inductor() -> Iterator[object]:
    before = _copies()
    yield sys.modules["torch._inductor.config"]
    for name, values in before.items():  # put back whatever a failing test left
        mod = sys.modules[name]
        now = mod.get_config_copy()
        for key, value in values.items():
            if now[key] != value:
                setattr(mod, key, value)


def test_every_kind_of_config_change_is_put_back(inductor: object) -> None:
    mod = inductor
    assert isinstance(getattr(mod, LIST_KEY), list)
    before = _copies()
    with preserved():
        getattr(mod, LIST_KEY).append("added in place")
        torch._dynamo.config.recompile_limit += 1
        torch._dynamo.config.traceable_tensor_subclasses = {torch.Tensor}
        torch._functorch.config.patch(donated_buffer=not torch._functorch.config.donated_buffer).__enter__()
        mod.max_autotune = not mod.max_autotune
    assert _copies() == before
    assert "added in place" not in getattr(mod, LIST_KEY)


def test_a_change_made_before_is_kept(inductor: object) -> None:
    """A container changed in place before the body (torch's cached export
    still holds the value from before that change, for a key never set in
    this process) stays as it is."""
    mod = sys.modules["torch._dynamo.config"]
    preserve._export(mod)  # where torch caches its export: filled now, before the change
    getattr(mod, STALE_KEY).add(_users_function)
    before = _copies()
    with preserved():
        pass
    assert _copies() == before
    assert _users_function in getattr(mod, STALE_KEY)


def test_no_full_config_copy_where_torch_caches_its_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned by count: where the cached export exists, a preserved() with
    an unchanged config takes no ``get_config_copy()`` of any module (each
    used to take two per module)."""
    mods = [sys.modules[name] for name in CONFIGS]
    if any(preserve._export(mod) is None for mod in mods):
        pytest.skip("this torch's config modules have no cached export")
    calls = []
    cls = type(mods[0])
    original = cls.get_config_copy

    def counting(self: object) -> dict:
        calls.append(self)
        return original(self)

    limit = torch._dynamo.config.recompile_limit
    monkeypatch.setattr(cls, "get_config_copy", counting)
    with preserved():
        torch._dynamo.config.recompile_limit += 1
    assert calls == []
    assert torch._dynamo.config.recompile_limit == limit


def test_a_value_set_to_an_equal_one_of_another_type_is_put_back() -> None:
    """``8 -> 8.0`` compares equal but is another value (the state oracle
    reports it, ``harness/global_state.py``): put back with its type."""
    config = torch._dynamo.config
    before = config.recompile_limit
    assert type(before) is int
    try:
        with preserved():
            config.recompile_limit = float(before)
        assert type(config.recompile_limit) is int and config.recompile_limit == before
    finally:
        config.recompile_limit = before
