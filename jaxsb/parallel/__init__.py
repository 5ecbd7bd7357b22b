"""Sequence-parallel execution of plans."""
