"""Small Hypothesis draws shared by the program strategies
(:mod:`fuzz.strategies`, :mod:`fuzz.features_graph`, :mod:`fuzz.training_gen`).

Every draw here is a fixed sequence of Hypothesis calls: changing one
changes every generated program (and what a seed replays), so the
strategies keep them in one place.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def rare(draw: Any, one_in: int = 8) -> bool:
    """True about once in ``one_in`` draws; shrinks to False.

    ``draw`` is a :func:`hypothesis.strategies.composite` draw; one
    ``st.integers(0, one_in - 1)`` is drawn, True when it is the largest.
    """
    return draw(st.integers(0, one_in - 1)) == one_in - 1


__all__ = ["rare"]
