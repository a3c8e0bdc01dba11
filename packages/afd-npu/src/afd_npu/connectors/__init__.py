"""Ascend connectors."""
