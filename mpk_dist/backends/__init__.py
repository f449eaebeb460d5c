"""Placeholder package: filled in by its issue."""
