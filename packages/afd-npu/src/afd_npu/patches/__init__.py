"""Ascend patches."""
