"""Path and query parameters the admin routes share: names are checked before they reach the
registry."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from loraplex.server.schemas.admin import NAME_PATTERN

NameParam = Annotated[str, Path(pattern=NAME_PATTERN)]
TenantFilter = Annotated[str | None, Query(pattern=NAME_PATTERN, description="Only this tenant's.")]
