"""Copyable building blocks: each file depends on torch (and einops) only."""
