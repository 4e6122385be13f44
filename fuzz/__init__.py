"""cagrad-fuzz: random autograd programs checked by the differential oracle.

Modules, one concept each:

=================  ========================================================
``ir``             the program IR (leaves, ops, roots, backward mode, resize
                   steps of a size sequence), JSON; re-exports the three below
``ir_types``       the IR's parts: leaves, ops, hooks, inferred value infos
``ir_validate``    validation and shape inference of a program
``ir_check``       the IR's error and its shared checks (names, references)
``ops``            the op catalog: arity, attributes, shape rule, torch impl
``ops_custom``     ops applying custom ``autograd.Function`` s
``ops_inplace``    in-place ops on views (and the rare ``mul_inplace``)
``functions``      the custom ``autograd.Function`` s (standalone classes)
``hooks``          registering a program's hooks; they record the trace
``strategies``     Hypothesis strategies for random valid programs
``draws``          small Hypothesis draws the strategies share
``interpret``      IR -> harness ``Program`` (deterministic leaf values; a
                   size sequence's variants)
``render``         IR -> plain torch source, for people
``oracle``         runs programs through ``harness.run_differential``
``reduce``         IR-level reduction of a failing program
``reproducer``     standalone ``.py`` reproducers, and replaying them
``campaign``       the budgeted, seeded, resumable campaign with shrinking
``cli``            ``python -m fuzz campaign|replay`` (``cagrad-fuzz``)
=================  ========================================================

Importing the package is cheap; ``fuzz.ir`` and ``fuzz.ops`` need torch and
Hypothesis only, the rest also ``harness``.
"""

__all__ = [
    "campaign",
    "cli",
    "functions",
    "hooks",
    "interpret",
    "ir",
    "ops",
    "ops_custom",
    "ops_inplace",
    "oracle",
    "render",
    "reproducer",
    "strategies",
]
