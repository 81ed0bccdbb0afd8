"""Command-line options of the test suite (no dependencies: the GPU machines import this too)."""

UPDATE_SCREENSHOTS = "--update-screenshots"
"""Rewrite the README's screenshots in docs/screenshots/ instead of a temporary folder."""
