"""A mixture-of-experts layer whose router sends a different number of
tokens to each expert at every step: data-dependent sizes.

Each expert's token count reaches the backward as the first size of many
tensors (the gathered tokens, their hidden activations, the index, the
routing weights). cagrad traces the second backward with symbols (the
first is static); duck sizing gives slots of equal value one symbol, and
slots that changed share one only with slots whose values they shared at
every capture (:class:`cagrad.capture.compiler.AutogradCompilerInstance`).
Before, two experts' counts that happened to be equal at the dynamic
capture shared a symbol, and the next step that told them apart captured
again, until ``too_many_size_variants`` sent the layer to eager for good.
Counts of 0 and 1 are symbols too (:mod:`cagrad.capture.shape_env`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cagrad

from .conftest import same

EXPERTS, TOKENS, TOP_K, DIM = 4, 8, 2, 6


class MoE(nn.Module):
    """(TOKENS, DIM) -> (TOKENS, DIM): top-2 routing over 4 two-layer
    experts, each run on the tokens routed to it (``index_select``) and
    added back weighted (``index_add``). ``route`` (TOKENS, EXPERTS), added
    to the router's logits before the top-k, picks the assignment; the
    routing weights stay the router's softmax, so its gradient flows."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.up = nn.ModuleList(nn.Linear(DIM, 10) for _ in range(EXPERTS))
        self.down = nn.ModuleList(nn.Linear(10, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        idx = torch.topk(probs.detach() + route, TOP_K, dim=-1).indices
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            tok, slot = torch.where(idx == e)
            h = self.down[e](torch.relu(self.up[e](x.index_select(0, tok))))
            weight = probs.index_select(0, tok).gather(1, torch.full_like(slot, e).unsqueeze(1))
            out = out.index_add(0, tok, h * weight)
        return out


def _route(counts: list[int]) -> torch.Tensor:
    """A (TOKENS, EXPERTS) bias whose top-2 sends ``counts[e]`` tokens to
    expert ``e`` (the counts sum to TOKENS * TOP_K, each at most TOKENS):
    the assignments are dealt round-robin over the tokens."""
    assert sum(counts) == TOKENS * TOP_K and max(counts) <= TOKENS
    route = torch.zeros(TOKENS, EXPERTS)
    order = [e for e in sorted(range(EXPERTS), key=lambda e: -counts[e]) for _ in range(counts[e])]
    for i, e in enumerate(order):
        route[i % TOKENS, e] = 100.0
    assert route.count_nonzero(dim=1).eq(TOP_K).all()
    return route


def _steps(count_sets: list[list[int]], steps: int) -> list[list]:
    torch.manual_seed(0)
    moe = MoE()
    out = []
    for step in range(steps):
        x = torch.randn(TOKENS, DIM, requires_grad=True)
        moe(x, _route(count_sets[step % len(count_sets)])).pow(2).sum().backward()
        out.append([(g.clone(), g.stride()) for g in [x.grad] + [p.grad for p in moe.parameters()]])
    return out


def _count_sets(seed: int, low: int, n: int) -> list[list[int]]:
    """``n`` count vectors (each count >= ``low``) summing to TOKENS *
    TOP_K: the first two fixed, the others random. Every count changes from
    the first to the second, and in the second all are equal: the dynamic
    capture's slots had one value, and duck sizing gave them one symbol."""
    g = torch.Generator().manual_seed(seed)
    sets = [[6, 2, 5, 3], [4, 4, 4, 4]] if low >= 2 else [[0, 8, 7, 1], [4, 4, 4, 4]]
    while len(sets) < n:
        c = [low] * EXPERTS
        for _ in range(TOKENS * TOP_K - low * EXPERTS):
            e = int(torch.randint(EXPERTS, (1,), generator=g))
            if c[e] < TOKENS:
                c[e] += 1
        if sum(c) == TOKENS * TOP_K:
            sets.append(c)
    return sets


def _check(count_sets: list[list[int]], steps: int, backend: str = "eager") -> None:
    """Eager autograd, then cagrad with ``backend``: the gradients (bitwise
    for ``"eager"``; inductor's kernels sum in another order, so within
    float32's default tolerance) and ``.grad`` strides at every step."""
    expected = _steps(count_sets, steps)
    cagrad.reset()
    with cagrad.enable(backend):
        got = _steps(count_sets, steps)
    for e_step, g_step in zip(expected, got):
        for (e, e_strides), (g, g_strides) in zip(e_step, g_step):
            if backend == "eager":
                same(e, g)
            else:
                torch.testing.assert_close(g, e)
            assert g_strides == e_strides


def test_varying_expert_counts_settle_at_two_captures():
    """50 steps, each expert's count drawn anew (2 to 8 tokens): a static
    capture, a dynamic one, hits after; the gradients and ``.grad`` strides
    are eager's at every step."""
    steps = 50
    _check(_count_sets(1, 2, steps), steps)
    c = cagrad.counters
    assert c["fallbacks"] == 0, dict(c["fallback_reasons"])
    assert c["captures"] == 2 and c["cache_hits"] == steps - 2


@pytest.mark.skipif(
    torch.__version__.split("+")[0] not in ("2.12.1", "2.13.0", "2.14.1"),
    reason="cagrad.capture.shape_env recognizes the sources of torch 2.12.1, 2.13.0 and 2.14.1 only; "
    "other versions guard sizes of 1 as before (sound, one more capture)",
)
def test_expert_counts_of_one_settle_at_two_captures():
    """50 steps whose counts include 1 (each at least 1 after the first
    step, which sends one expert no token and another one): the counts'
    symbols may be 1 (:mod:`cagrad.capture.shape_env`), so a static
    capture and a dynamic one serve every step (before: 3 captures)."""
    steps = 50
    _check(_count_sets(2, 1, steps), steps)
    c = cagrad.counters
    assert c["fallbacks"] == 0, dict(c["fallback_reasons"])
    assert c["captures"] == 2 and c["cache_hits"] == steps - 2


@pytest.mark.skipif(
    torch.__version__.split("+")[0] not in ("2.12.1", "2.13.0", "2.14.1"),
    reason="cagrad.capture.shape_env recognizes the sources of torch 2.12.1, 2.13.0 and 2.14.1 only; "
    "other versions specialize sizes of 0 (sound, more captures)",
)
@pytest.mark.parametrize("seed", [2, 3])
def test_expert_counts_of_zero_and_one_settle_at_two_captures(seed):
    """50 steps whose counts include 0 and 1 (the first step sends one
    expert no token and another one): the counts' symbols may be 0
    (:mod:`cagrad.capture.shape_env`), so a static capture and a dynamic
    one serve every pattern of which experts get no token (before: 4 and 3
    captures for these seeds)."""
    steps = 50
    _check(_count_sets(seed, 0, steps), steps)
    c = cagrad.counters
    assert c["fallbacks"] == 0, dict(c["fallback_reasons"])
    assert c["captures"] <= 2 and c["captures"] + c["cache_hits"] == steps


_INDUCTOR_SETS = [[0, 8, 7, 1], [4, 4, 4, 4], [1, 0, 7, 8], [5, 1, 2, 8], [3, 6, 0, 7], [2, 2, 4, 8]]


@pytest.fixture
def no_inductor_caches():
    """An entry that inductor or AOTAutograd cached for the same graph
    before brings its size guards back when loaded
    (docs/checkpointing-and-dynamic-sizes.md): every compile here is fresh.
    Through the config's own ``patch``: pytest's monkeypatch cannot undo a
    setattr on torch's config modules (the option then no longer exists)."""
    import torch._inductor.config

    with torch._inductor.config.patch(force_disable_caches=True):
        yield


@pytest.mark.skipif(
    torch.__version__.split("+")[0] not in ("2.12.1", "2.13.0", "2.14.1"),
    reason="cagrad.capture.backend_queries recognizes the sources of torch 2.12.1, 2.13.0 and 2.14.1 only",
)
def test_inductor_expert_counts_of_zero_and_one_need_no_third_capture(monkeypatch, no_inductor_caches):
    """Under inductor, steps whose counts put 0 and 1 on different experts
    (each count changes from the first step to the second): a static
    capture and a symbolic one serve every step, no fallback. Without
    static compiles (``CAGRAD_SPECIALIZE=0``: the symbolic code is compiled
    at the second capture, two inductor compiles in all). Before
    (cagrad.capture.backend_queries): inductor's compile guarded ``s != 0``
    (functionalization's storage size, constant folding), ``s != 1`` and
    ``s*6 >= 2`` (its broadcasts, ``aten.index``'s output permutation) on
    each expert's count: 5 captures in these 12 steps on torch 2.13.0."""
    monkeypatch.setenv("CAGRAD_SPECIALIZE", "0")
    steps = 2 * len(_INDUCTOR_SETS)
    _check(_INDUCTOR_SETS, steps, "inductor")
    c = cagrad.counters
    assert c["fallbacks"] == 0, dict(c["fallback_reasons"])
    assert c["captures"] == 2 and c["cache_hits"] == steps - 2


@pytest.mark.slow
@pytest.mark.skipif(
    torch.__version__.split("+")[0] not in ("2.12.1", "2.13.0", "2.14.1"),
    reason="cagrad.capture.backend_queries recognizes the sources of torch 2.12.1, 2.13.0 and 2.14.1 only",
)
def test_inductor_expert_counts_of_zero_and_one_settle_at_two_captures(monkeypatch, no_inductor_caches):
    """The 50 steps of counts 0 to 8 (seed 2) under inductor as cagrad
    compiles by default (static first, symbolic code at the first other
    sizes, static compiles of hot sizes): at most 2 captures, no fallback
    (before: 6 captures, 2 ``dynamic_shapes`` fallbacks)."""
    steps = 50
    _check(_count_sets(2, 0, steps), steps, "inductor")
    c = cagrad.counters
    assert c["fallbacks"] == 0, dict(c["fallback_reasons"])
    assert c["captures"] <= 2 and c["captures"] + c["cache_hits"] == steps
