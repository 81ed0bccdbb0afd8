"""The install command for machines where nothing can be downloaded (the lent GPU machines):
`pip install --no-deps --no-build-isolation --no-index -e .` builds with the environment's own
setuptools. kernels/, migrations/ and admin_ui/ sit at the top of the repository and are the
packages loraplex.kernels, loraplex.migrations and loraplex.admin_ui: in a built wheel, and in
the source tree itself (links in loraplex/), so that they import wherever Python finds
loraplex, installed or run from a checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OFFLINE = ["--no-deps", "--no-build-isolation", "--no-index"]


def test_the_offline_install_builds_a_complete_package(tmp_path: Path) -> None:
    """Built from a copy of the checkout's files (the checkout's own build/ folder would lend the
    wheel stale files): it holds every file of loraplex/, the linked folders included."""
    source = tmp_path / "source"
    files = _copy_checkout(source)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", *OFFLINE, "--wheel-dir", str(tmp_path),
                            str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("loraplex-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    for module in ("kernels/reference.py", "kernels/decode_attention.py", "migrations/env.py",
                   "migrations/script.py.mako", "admin_ui/index.html", "engine/llm_engine.py"):
        assert f"loraplex/{module}" in names, module
    package = [name for name in files if name.startswith("loraplex/") and not (REPO / name).is_symlink()]
    assert len(package) > 100 and not set(package) - names, sorted(set(package) - names)
    assert len(names) == len(archive.namelist())  # each file once
    assert _import_from(tmp_path / "site", tmp_path) == tmp_path / "site" / "loraplex" / "kernels"


def test_a_checkout_imports_as_it_is(tmp_path: Path) -> None:
    """With the repository on the path and nothing installed (PYTHONPATH=. on a bare machine,
    or pytest from the repository root), loraplex.kernels is the top-level kernels/."""
    assert _import_from(REPO, tmp_path).resolve() == REPO / "kernels"


def _copy_checkout(out: Path) -> list[str]:
    """Copy the files git sees in the checkout (tracked or new, not ignored; links as links) into
    `out`; return their names."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    files = [name for name in listed if name and ((REPO / name).exists() or (REPO / name).is_symlink())]
    for name in files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, out / name, follow_symlinks=False)
    return files


def _import_from(path: Path, cwd: Path) -> Path:
    """The folder loraplex.kernels is imported from, with `path` first on the path and this
    environment's packages after it, but none of its .pth hooks (no editable install)."""
    paths = [str(path), sysconfig.get_paths()["purelib"]]
    probe = (f"import sys; sys.path[:0] = {paths!r}; "
             "import loraplex.kernels, loraplex.kernels.reference, loraplex.migrations, loraplex.admin_ui; "
             "from loraplex.engine.llm_engine import LLMEngine; from loraplex.server import create_app; "
             "import loraplex.cli.serve, loraplex.quickstart; print(loraplex.kernels.__path__[0])")
    imported = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True,
                              timeout=120, cwd=cwd)
    assert imported.returncode == 0, imported.stderr
    return Path(imported.stdout.strip())
