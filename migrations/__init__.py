"""Placeholder package: filled by the work on its issue."""
