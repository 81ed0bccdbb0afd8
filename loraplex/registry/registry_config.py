"""Registry settings: one frozen object, resolved once at the edge (CLI, server start) from
flags and the environment, then passed down."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DATA_DIR_ENV = "LORAPLEX_DATA_DIR"
DATABASE_URL_ENV = "LORAPLEX_DATABASE_URL"
DEFAULT_DATA_DIR = "./loraplex-data"
SQLITE_FILE_NAME = "registry.db"


@dataclass(frozen=True)
class RegistryConfig:
    data_dir: Path
    """Folder holding the blob store and, by default, the SQLite registry. Absolute."""
    database_url: str | None = None
    """SQLAlchemy URL (`sqlite:///...` or `postgresql+psycopg://...`); None means SQLite at
    `<data_dir>/registry.db`."""
    busy_timeout_s: float = 30.0
    """How long an SQLite writer waits for the write lock before failing."""
    connect_timeout_s: float = 5.0
    """How long opening a PostgreSQL connection may take (a server that accepts and never
    answers: stuck, or cut off by the network) before the database counts as unavailable.
    Whole seconds, at least 1 (libpq's unit); a `connect_timeout` in the URL wins."""
    max_upload_bytes: int = 1 << 30
    """Largest adapter weights file accepted."""
    max_temp_age_s: float = 24 * 3600.0
    """reconcile() removes a temporary upload file once it is this old (or at once when the
    process that wrote it on this host is gone)."""

    @classmethod
    def resolve(
        cls,
        data_dir: str | os.PathLike[str] | None = None,
        database_url: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> RegistryConfig:
        """Flags win over the environment (`LORAPLEX_DATA_DIR`, `LORAPLEX_DATABASE_URL`), which
        wins over the defaults."""
        env = os.environ if environ is None else environ
        folder = data_dir or env.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
        url = database_url or env.get(DATABASE_URL_ENV) or None
        return cls(data_dir=Path(folder).expanduser().resolve(), database_url=url)

    @property
    def url(self) -> str:
        """The database URL actually used."""
        return self.database_url or f"sqlite:///{self.data_dir / SQLITE_FILE_NAME}"

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"
