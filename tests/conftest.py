"""Suite-wide pytest setup. Without CUDA, GPU tests skip, and the Triton kernels run through
the Triton interpreter: TRITON_INTERPRET must be set before any kernel module is imported
(triton reads it when a kernel is decorated), so it is set here, when the suite starts.

Tests write only to ignored or temporary folders: a run that changes the checkout's tracked or
unignored files fails, naming them. The README's screenshots are rewritten only when asked
(`--update-screenshots`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.options import UPDATE_SCREENSHOTS

REPO = Path(__file__).resolve().parents[1]
CHECKOUT_STATE = pytest.StashKey["str | None"]()

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(UPDATE_SCREENSHOTS, action="store_true",
                     help="rewrite the README's screenshots in docs/screenshots/ (the UI tests "
                          "otherwise save theirs in a temporary folder)")


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[CHECKOUT_STATE] = _checkout_state()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before, after = session.stash.get(CHECKOUT_STATE, None), _checkout_state()
    if before is None or after is None or before == after:
        return
    if session.config.getoption(UPDATE_SCREENSHOTS):
        return  # asked to rewrite docs/screenshots/
    changed = sorted(set(after.splitlines()) ^ set(before.splitlines()))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("the tests changed files of the checkout (tests may write only to ignored "
                            "or temporary folders): " + "; ".join(changed), red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _checkout_state() -> str | None:
    """`git status` of the checkout with a hash of each changed or new file (None outside git)."""
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                                capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    paths = [line[3:].split(" -> ")[-1] for line in status.splitlines()]
    hashes = subprocess.run(["git", "hash-object", "--", *paths], cwd=REPO, capture_output=True, text=True,
                            timeout=60).stdout.split() if paths else []
    return "\n".join(f"{line} {digest}" for line, digest in zip(status.splitlines(), hashes))
