"""Each case of the C++ extension's self-tests (:mod:`cagrad.native.self_tests`)
rejects an implementation that is wrong on that case alone, and the Python
references of :mod:`cagrad.native.guard_program` agree with the C++ on rare
values; the extension's loader re-raises what its thread raised.

Companion of ``test_native_self_tests.py``: these defects are the ones that
survivors of the seed-0 mutation sample (docs/mutation-testing.md) let
through, where a self-test's case had been changed (another value, node or
bit) or dropped. A defect that only one value of a case shows is
value-specific by nature; each docstring says which value the case must keep.
Each test hands the self-test a wrapper around the real function with one
defect and expects the RuntimeError (or the error the C++ would raise) that
switches the function off; the self-test itself passes the real function
(``test_native.py::test_every_function_passes_its_self_test``).
"""

from __future__ import annotations

import types

import pytest
import torch

from cagrad import native
from cagrad.native import guard_program as gp
from cagrad.native import self_tests

# --- the loader's thread -------------------------------------------------------


def test_the_loaders_thread_reraises_the_exception_it_caught():
    """``_in_own_thread`` hands back fn's result, or re-raises the very
    exception fn raised (not an IndexError of its own): a KeyboardInterrupt
    during the build must reach the user as one."""
    assert native._in_own_thread(lambda: 5) == 5
    error = KeyboardInterrupt("interrupted during the build")

    def interrupted():
        raise error

    with pytest.raises(KeyboardInterrupt) as caught:
        native._in_own_thread(interrupted)
    assert caught.value is error


# --- guard_program.run against collect on rare values --------------------------


def test_run_and_collect_accept_an_int_sequence_longer_than_256(built):
    """An INT_SEQ of 300 items (split into 300 chunks): both hold where the
    sequence is equal (lengths above CPython's cached small ints are equal,
    not identical objects), and fail on a list or a shorter tuple."""
    with torch.enable_grad():
        node = torch.arange(300.0, requires_grad=True).split([1] * 300)[0].grad_fn
    assert type(node._saved_split_sizes) is tuple
    collect = native.collect_fn()
    for want, holds in (((1,) * 300, True), ([1] * 300, False), ((1,) * 299, False)):
        program = ((gp.INT_SEQ, 0, "_saved_split_sizes", want),)
        assert gp.run((node,), program, [], [], built) is holds
        assert collect((node,), program, [], []) is holds


class _ClaimsToBeInt(type):
    """A metaclass whose classes compare equal to ``int``."""

    def __eq__(cls, other):
        return other is int or type.__eq__(cls, other)

    __hash__ = type.__hash__


class _IntLike(metaclass=_ClaimsToBeInt):
    def __eq__(self, other):
        return other == 2

    __hash__ = object.__hash__


class _Saves(torch.autograd.Function):
    """Keeps ``sizes`` on its node (``ctx``), as a custom Function may."""

    @staticmethod
    def forward(ctx, x, sizes):
        ctx.sizes = sizes
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_run_like_collect_wants_exact_ints_in_an_int_sequence(built):
    """INT_SEQ's items must be exactly ints (``PyLong_CheckExact`` in the
    C++): an item whose class claims to equal ``int`` and that equals 2 is
    refused by both, and so is True for 1."""
    with torch.enable_grad():
        x = torch.ones(2, requires_grad=True)
        fake = _Saves.apply(x, (_IntLike(),)).grad_fn
        flag = _Saves.apply(x, (True,)).grad_fn
    assert type(fake.sizes[0]) == int and fake.sizes[0] == 2  # what the class claims
    collect = native.collect_fn()
    for node, want in ((fake, (2,)), (flag, (1,))):
        program = ((gp.INT_SEQ, 0, "sizes", want),)
        assert gp.run((node,), program, [], [], built) is False
        assert collect((node,), program, [], []) is False


# --- hookless and counts ---------------------------------------------------------


def test_hookless_self_test_rejects_a_non_bool_for_no_nodes(built):
    """``hookless(())`` must be the bool True: a reader whose path for an
    empty tuple returns the int 1 is refused (the case ``((), True)``
    compares by identity)."""
    real = native.load().hookless

    def one_for_none(nodes):
        return 1 if nodes == () else real(nodes)

    with pytest.raises(RuntimeError, match=r"hookless\(\) of \[\] is not True"):
        self_tests.hookless(one_for_none, native.load().counts)


def test_hookless_self_test_rejects_counts_that_reports_a_removed_hook(built):
    """A ``counts`` that reports a node whose hook was removed (its dict stays,
    empty) as hooked disagrees with ``hookless``; the self-test must say so
    whichever of the two is wrong."""
    module = native.load()

    def reports_empty_dicts(node, all_lists):
        return module.counts(node, all_lists) or (0, (), (), 0, ({},), 0, (), 0, None)

    with pytest.raises(RuntimeError, match="disagree on a removed hook"):
        self_tests.hookless(module.hookless, reports_empty_dicts)


@pytest.mark.parametrize("defect", ["foreign", "none"])
def test_counts_self_test_rejects_a_python_prehook_misread(built, defect):
    """With one Python pre-hook, ``counts`` must report no foreign (C++)
    pre-hook (item 3) and one dict (item 4): a reader that counts the Python
    hook as foreign too, or one that sees no hook at all, is refused."""
    real = native.load().counts

    def wrong(node, all_lists):
        got = real(node, all_lists)
        if got is None:
            return None
        return None if defect == "none" else (*got[:3], got[3] + 1, *got[4:])

    with pytest.raises(RuntimeError, match="with one Python pre-hook reports"):
        self_tests.counts(wrong)


# --- tensor readers, ints and order -------------------------------------------------


def test_tensor_self_test_rejects_a_key_for_a_sparse_tensor_of_two_elements(built):
    """A ``tensor_key`` whose layout check is on a path taken only by tensors
    of at most one element gives a sparse tensor of two a key: the self-test's
    sparse tensor must have two elements or more."""

    def keys_larger_sparse(x, tensor_type):
        if x.layout is torch.sparse_coo and x.numel() > 1 and type(x) is tensor_type:
            return built.tensor_key(torch.zeros(x.shape), tensor_type)
        return built.tensor_key(x, tensor_type)

    with pytest.raises(RuntimeError, match="a sparse tensor or another type has a key"):
        self_tests._tensor_readers(keys_larger_sparse, built.tensor)


def test_ints_self_test_rejects_a_bare_int_of_three_read_as_one_item(built):
    """A reader that takes a bare int of 3 or more for a one-item sequence
    (as torch's argument parser expands a bare int for an ``int[N]``
    parameter) is refused: the case ``(3, 1)`` must keep an int above 2."""

    def expands_bare_ints(a, n, values):
        if type(a) is int and a >= 3 and n == 1:
            values.append(a)
            return True
        return built.ints(a, n, values)

    with pytest.raises(RuntimeError, match=r"ints\(3, 1\) read as ints \(\[3\]\)"):
        self_tests._ints(expands_bare_ints, built.int_)


def test_int_self_test_rejects_a_reader_wrong_on_the_lowest_cached_small_int(built):
    """CPython caches the ints -5 to 256; a reader with a table for them that
    is off by one at -5 (reads -4) is refused: the case must be -5 itself."""

    def off_at_minus_five(a, values):
        if type(a) is int and a == -5:
            values.append(-4)
            return True
        return built.int_(a, values)

    with pytest.raises(RuntimeError, match=r"int_\(-5\) appended \[-4\]"):
        self_tests._ints(built.ints, off_at_minus_five)


def test_int_self_test_rejects_a_reader_that_truncates_floats(built):
    """``int_(1.5)`` must read False and append nothing: a reader that
    converts a float with ``int()`` (1.5 to 1) is refused."""

    def truncates(a, values):
        return built.int_(int(a) if type(a) is float else a, values)

    with pytest.raises(RuntimeError, match=r"int_\(1.5\) read as an int"):
        self_tests._ints(built.ints, truncates)


def test_orders_self_test_rejects_ties_broken_by_shape(built):
    """An ``order`` that compares (sequence number, input shape) pairs, as a
    sort key might, reads two AccumulateGrad nodes with one sequence number
    but variables of different shapes as unequal: the tie's two leaves must
    differ in shape."""
    real = built.order

    def ties_by_shape(nodes, relation):
        if not real(nodes, relation):
            return False
        shapes = [tuple(n._input_metadata[0].shape) if n._input_metadata else () for n in nodes]
        return all(a == b for a, b, r in zip(shapes, shapes[1:], relation) if r == ord("="))

    with pytest.raises(RuntimeError, match="misreads equal sequence numbers"):
        self_tests._order(ties_by_shape)


# --- collect ---------------------------------------------------------------------


def _collect_with(rewrite):
    """The real ``collect`` run on ``rewrite(nodes, program)``."""
    real = native.collect_fn()
    return lambda nodes, program, values, tensors: real(nodes, rewrite(nodes, program), values, tensors)


def test_collects_self_test_rejects_a_stale_node_for_the_first_instructions(built):
    """A ``collect`` that caches the node of the last instruction by index,
    its cache starting at index 0 with the tuple's last node: instructions
    on node 0 before any other node read the last node. Only a program whose
    first instruction reads node 0 shows it (the batch norm's METADATA)."""

    def stale_start(nodes, program):
        out, leading = [], True
        for op in program:
            leading = leading and op[1] == 0
            out.append((op[0], len(nodes) - 1, *op[2:]) if leading else op)
        return tuple(out)

    with pytest.raises(AttributeError, match="_saved_input"):
        self_tests.collect(_collect_with(stale_start), built)


@pytest.mark.parametrize(
    "code, key_at",
    [
        (gp.METADATA, lambda nodes, op: native.metadata_fns().metadata_key(nodes[op[1]], op[2])),
        (gp.TENSOR, lambda nodes, op: native.metadata_fns().tensor_key(getattr(nodes[op[1]], op[2]), op[3])),
    ],
    ids=["metadata", "tensor"],
)
def test_collects_self_test_rejects_a_key_compared_without_its_lowest_bit(built, code, key_at):
    """A ``collect`` that compares a METADATA or TENSOR key without its bit 0
    is refused: each wrong key the self-test tries must differ from the
    right one in bit 0 alone (``key ^ 1``)."""

    def low_bit_ignored(nodes, program):
        out = []
        for op in program:
            if op[0] == code:
                real = key_at(nodes, op)
                if real is not None and op[-1] | 1 == real | 1:
                    op = (*op[:-1], real)
            out.append(op)
        return tuple(out)

    with pytest.raises(RuntimeError, match=r"collect\(\) of program \d+ gives True"):
        self_tests.collect(_collect_with(low_bit_ignored), built)


def test_collects_self_test_rejects_ints_with_one_item_too_many(built):
    """A ``collect`` whose INTS check is off by one (takes n + 1 items for n)
    is refused: the wrong INTS count the self-test tries must be one short
    of the sizes' four."""

    def one_more(nodes, program):
        out = []
        for op in program:
            if op[0] == gp.INTS:
                a = getattr(nodes[op[1]], op[2], None)
                if type(a) in (tuple, list) and len(a) == op[3] + 1:
                    op = (*op[:3], len(a))
            out.append(op)
        return tuple(out)

    with pytest.raises(RuntimeError, match=r"collect\(\) of program \d+ gives True"):
        self_tests.collect(_collect_with(one_more), built)


def test_collects_self_test_rejects_readers_and_collect_that_refuse_everything(built):
    """A ``collect`` that always reads False, checked through single readers
    whose ``metadata`` refuses every node, agrees with Python on every
    program; the self-test still refuses them, since its program 0 must
    hold."""
    refusing = types.SimpleNamespace(
        **{name: getattr(built, name) for name in ("metadata_key", "tensor_key", "tensor", "ints", "int_", "order")},
        metadata=lambda node, nr, key, sizes: False,
    )
    with pytest.raises(RuntimeError, match="program 0 fails in Python"):
        self_tests.collect(lambda nodes, program, values, tensors: False, refusing)
