"""Mutation testing of cagrad's core (cosmic-ray, the ``power`` extra):
``python -m harness.power run``; docs/mutation-testing.md."""
