"""Tests of the harness: oracle, subjects, stacks, models, bench."""
