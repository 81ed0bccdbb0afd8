"""The install command for machines where nothing can be downloaded (the lent GPU machines):
`pip install --no-deps --no-build-isolation --no-index .` builds with the environment's own
setuptools and installs a package in which kernels/, migrations/ and admin_ui/ are importable
as loraplex.kernels, loraplex.migrations and loraplex.admin_ui, wherever Python runs from."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OFFLINE = ["--no-deps", "--no-build-isolation", "--no-index"]


def test_the_offline_install_builds_a_complete_package(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", *OFFLINE, "--wheel-dir", str(tmp_path),
                            str(REPO)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("loraplex-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    for module in ("kernels/reference.py", "kernels/decode_attention.py", "migrations/env.py",
                   "migrations/script.py.mako", "admin_ui/index.html", "engine/llm_engine.py"):
        assert f"loraplex/{module}" in names, module
    probe = ("import loraplex.kernels, loraplex.kernels.reference, loraplex.migrations; "
             "from loraplex.engine.llm_engine import LLMEngine; print(loraplex.kernels.__file__)")
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == str(tmp_path / "site" / "loraplex" / "kernels" / "__init__.py")
