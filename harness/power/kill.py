"""The killers: what cosmic-ray runs against each mutant (its test command).

Run as a script from the mutated copy's root (``python harness/power/kill.py
--killers tests,golden,fuzz ...``); standard library only, so it never imports
the mutated code itself. Each killer is a subprocess, run in the order given;
the first that exits non-zero kills the mutant and the rest are skipped.

* ``tests``: a fast pytest subset (:data:`TEST_FILES`, ``-x``): semantics
  against eager autograd, graph tasks, formulas, cache-key soundness,
  capture, size checks, leaf hooks (guarded hits of segmented graphs),
  saved-tensor hooks, the C++ extension's self-tests, hit guards and keys on
  rare values, TraceShapeEnv's sites, the capture helpers' contracts, what
  a backend assumed about the symbols; about 50 s at a load average of 9 on
  2 cores.
* ``golden``: ``python -m golden_graphs check`` (FX graphs and cache keys of
  62 scenarios against the snapshot set of the installed torch).
* ``fuzz``: ``python -m fuzz campaign`` bounded by ``--programs`` programs
  (the budget is no bound), subject ``cagrad[eager]`` only, seed 0, one
  worker, no shrinking.

Environment of every killer: ``PYTHONPATH`` the copy's root (the mutant is
what is imported, whatever the caller's path), ``TORCH_EXTENSIONS_DIR`` a
fresh copy of ``--ext-seed`` (a mutant of the extension's build code cannot
leave a build that a later mutant loads), no ``CAGRAD_CACHE_DIR`` (no disk
cache shared between mutants), Hypothesis profile ``ci`` (derandomized).

Output: each killer's last lines, then one line ``harness.power: killed-by
NAME (exit CODE)`` (exit status 1) or ``harness.power: survived`` (exit 0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

#: The ``tests`` killer's files: fast, and each checks cagrad against eager
#: autograd or independently derived values.
TEST_FILES = (
    "tests/cagrad/test_semantics.py",
    "tests/cagrad/test_graph_task.py",
    "tests/cagrad/test_formulas.py",
    "tests/cagrad/test_key_soundness.py",
    "tests/cagrad/test_capture.py",
    "tests/cagrad/test_size_check.py",
    # added after measured runs (docs/mutation-testing.md): guarded hits of
    # segmented graphs, saved-tensor hook scopes, and C++ functions switched
    # off by a failing self-test, which no other killer reached
    "tests/cagrad/test_leaf_hooks.py",
    "tests/cagrad/test_saved_tensor_hooks.py",
    "tests/cagrad/test_native.py::test_every_function_passes_its_self_test",
    "tests/cagrad/test_native.py::test_collects_self_test_rejects_a_runner_that_disagrees",
    "tests/cagrad/test_native.py::test_collects_self_test_rejects_a_runner_with_the_right_verdict_and_wrong_outputs",
    "tests/cagrad/test_native.py::test_walks_self_test_rejects_a_walk_that_disagrees",
    # the self-tests handed readers with one defect each, what the collect and
    # walk self-tests exercise, guard_program, layout_ok, device_frees_fn
    # (survivors of the seed-0 sample in cagrad/native; about 2 s)
    "tests/cagrad/test_native_self_tests.py",
    # each self-test case that a survivor changed or dropped, against a reader
    # wrong on that case alone; guard_program.run against collect on rare
    # values; the loader thread's re-raise (about 2 s)
    "tests/cagrad/test_native_self_test_cases.py",
    # added for the capture/run survivors of the seed-0 sample: the
    # interpreter's gradient sums after a failed check, no retrace from
    # shells of a conjugate lifted tensor, custom Functions' saved tensors
    # released as the segmented run goes past them
    "tests/cagrad/test_custom_function.py::test_returning_none_then_the_interpreter_sums_two_gradients",
    "tests/cagrad/test_custom_function.py::test_returning_none_with_a_conjugate_saved_tensor_recaptures_instead_of_retracing",
    "tests/cagrad/test_memory.py::test_a_segmented_backward_frees_a_custom_functions_saved_tensors_once_past_it",
    "tests/cagrad/test_memory.py::test_a_segmented_backward_frees_each_nodes_saved_tensors_once_past_it",
    # the order leaf_hook_groups cuts a graph in (graphs built there: fast)
    "tests/cagrad/test_leaf_hook_groups.py",
    # restride plans and _conform's stride checks of segmented runs
    "tests/cagrad/test_segment_strides.py::test_a_value_crossing_segments_is_restrided_for_the_segment_that_reads_it",
    "tests/cagrad/test_opaque_layouts.py::test_an_opaque_node_in_another_layout_hits_from_the_second_backward",
    "tests/cagrad/test_opaque_layouts.py::test_strides_differing_only_in_a_dimension_of_one_element_are_the_assumed_places",
    # hit guards on rare attribute values and tensors, with and without the
    # C++ program and readers; key encoding, INT64_MAX size slots and the
    # trie's entry count; TraceShapeEnv's sites (torch 2.13.0/2.14.1)
    "tests/cagrad/test_hit_guard_values.py",
    "tests/cagrad/test_key_values.py",
    "tests/cagrad/test_trace_shape_env.py",
    # survivors of cagrad/autograd (seed-0 sample): helpers against independent
    # definitions (dense layouts, hooks only the census found, BackwardState
    # graphs); a heap of four; the fallback reason under torch.func; which
    # outputs CopySlices and generated nodes compute under inputs=; zeros
    # for a custom Function's non-differentiable output
    "tests/cagrad/test_autograd_contracts.py",
    "tests/cagrad/test_ready_queue.py::test_matches_std_priority_queue_with_ties",
    "tests/cagrad/test_torch_func.py::test_fallback_leaves_nothing_behind",
    "tests/cagrad/test_hook_parity.py::test_post_hook_of_an_opaque_node_under_autograd_grad",
    "tests/cagrad/test_hook_parity.py::test_post_hook_under_backward_with_inputs",
    "tests/cagrad/test_custom_function.py::test_non_differentiable_and_non_tensor_outputs_materialize_like_eager",
    # survivors of cagrad/capture (seed-0 sample): the inlined AOT backward's
    # hooked nodes and view-as-reshape, a BackwardState hook's result against
    # eager, shells of plain tensors only (no compile: under 1 s)
    "tests/cagrad/test_capture_contracts.py",
    # survivors of cagrad/autograd and cagrad/run (seed-0 sample, second
    # round): accumulate_grad's steal decision (strides above 256) and
    # create_graph sums; aot_inline_info on hand-built nodes; the interpreter
    # summing sparse then dense, running an aot_function backward, resuming
    # past position 256; run_hosted's callbacks; finish_whole's borrowed
    # (CUDA graph) outputs; saved tensors freed after a capturing backward;
    # the fallback detail naming a dead GradTrackingTensor (about 15 s)
    "tests/cagrad/test_accumulate.py",
    # which memory each .grad shares against eager's (graph outputs that are
    # views of grad_tensors adopted, inputs copied, overlapping outputs kept
    # apart, segmented runs' holder count; about 2 s)
    "tests/cagrad/test_grad_sharing.py",
    "tests/cagrad/test_aot_inline_info.py",
    "tests/cagrad/test_run_helpers.py",
    "tests/cagrad/test_sparse_grads.py::test_sparse_gradient_used_by_a_traced_op_is_finished_then_falls_back",
    "tests/cagrad/test_custom_function.py::test_returning_none_then_the_interpreter_runs_an_aot_backward",
    "tests/cagrad/test_custom_function.py::test_returning_none_deep_in_a_long_graph_resumes_at_that_node",
    "tests/cagrad/test_memory.py::test_saved_tensors_freed_after_backward",
    "tests/cagrad/test_torch_func.py::test_dead_wrapper_root_takes_no_hit_guard",
    # survivors of cagrad/keys (seed-0 sample): the hit guard's check of the
    # run order (graphs of more than two nodes) and of a root gradient that
    # requires grad
    "tests/cagrad/test_hit_path.py::test_another_run_order_is_not_a_guarded_hit",
    "tests/cagrad/test_hit_path.py::test_a_root_gradient_that_requires_grad_hits_through_the_guard",
    # what a backend assumed about the symbols without a lasting guard (a
    # replacement, a narrowed range) joins the size check (keys.sizes.tighten)
    "tests/cagrad/test_direct_compile.py::test_a_replacement_or_range_the_backend_records_is_checked_on_every_hit",
)

KILLERS = ("tests", "golden", "fuzz")
MARK = "harness.power:"


def command(name: str, programs: int, scratch: str) -> list[str]:
    """The argv of one killer; ``scratch`` is a folder it may write in."""
    py = sys.executable
    if name == "tests":
        return [py, "-m", "pytest", "-q", "-x", "-n", "0", *TEST_FILES]
    if name == "golden":
        return [py, "-m", "golden_graphs", "check"]
    if name == "fuzz":
        return [
            py, "-m", "fuzz", "campaign", "--budget", "1000000", "--max-programs", str(programs),
            "--round-size", str(programs), "--seed", "0", "--subjects", "cagrad[eager]", "--workers", "1",
            "--no-progress", "--shrink-seconds", "0", "--out", os.path.join(scratch, "fuzz"),
        ]  # fmt: skip
    if name.startswith("pytest:"):  # a named test file or node id: for quick runs and the tool's own tests
        return [py, "-m", "pytest", "-q", "-x", "-n", "0", name.split(":", 1)[1]]
    raise ValueError(f"unknown killer {name!r}: expected one of {', '.join(KILLERS)} or pytest:PATH")


def environment(root: str, ext_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CAGRAD_CACHE_DIR", None)
    env["PYTHONPATH"] = root
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["TORCH_EXTENSIONS_DIR"] = ext_dir
    env["CAGRAD_HYPOTHESIS_PROFILE"] = "ci"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--killers", default=",".join(KILLERS))
    parser.add_argument("--programs", type=int, default=30)
    parser.add_argument("--ext-seed", help="a built TORCH_EXTENSIONS_DIR to start each mutant from")
    parser.add_argument("--scratch", help="where per-mutant folders go (default: the system's temporary folder)")
    args = parser.parse_args(argv)
    root = os.getcwd()
    work = tempfile.mkdtemp(prefix="cagrad-power-kill-", dir=args.scratch)
    try:
        ext_dir = os.path.join(work, "ext")
        if args.ext_seed and os.path.isdir(args.ext_seed):
            shutil.copytree(args.ext_seed, ext_dir)
        else:
            os.makedirs(ext_dir)
        env = environment(root, ext_dir)
        for name in args.killers.split(","):
            proc = subprocess.run(
                command(name, args.programs, work), cwd=root, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            )  # fmt: skip
            if proc.returncode != 0:
                sys.stdout.write(proc.stdout[-3000:])
                print(f"\n{MARK} killed-by {name} (exit {proc.returncode})", flush=True)
                return 1
        print(f"{MARK} survived", flush=True)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
