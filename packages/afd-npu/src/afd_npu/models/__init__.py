"""Ascend model wrappers."""
