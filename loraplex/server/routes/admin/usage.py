"""Usage (tokens in and out, requests) per tenant, adapter and hour, and the audit log."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from loraplex.server.auth import AdminDep
from loraplex.server.deps import ServicesDep
from loraplex.server.routes.docs import error_responses
from loraplex.server.schemas.admin import NAME_PATTERN, AuditEntry, UsageReport, UsageRow, UsageTotals

router = APIRouter(tags=["Admin: usage and audit"])


@router.get("/usage", response_model=UsageReport, summary="Token usage per tenant, adapter and hour",
            responses=error_responses(400, 401, 403, 404))
async def get_usage(
    admin: AdminDep, services: ServicesDep,
    tenant: Annotated[str | None, Query(pattern=NAME_PATTERN, description="Only this tenant.")] = None,
    adapter: Annotated[str | None, Query(pattern=NAME_PATTERN, description="Only this adapter.")] = None,
    since: Annotated[datetime | None, Query(description="From the hour holding this time (UTC if "
                                            "no zone is given).")] = None,
    until: Annotated[datetime | None, Query(description="Hours starting before this time.")] = None,
) -> UsageReport:
    """Hourly rows and their totals. Requests finished on this server are included at once."""
    since, until = _utc(since), _utc(until)
    await run_in_threadpool(services.usage.flush)
    records = await run_in_threadpool(lambda: services.registry.usage.query(
        tenant=tenant, adapter=adapter, since=since, until=until))
    rows = [UsageRow.of(record) for record in records]
    totals = UsageTotals(
        num_requests=sum(r.num_requests for r in rows), prompt_tokens=sum(r.prompt_tokens for r in rows),
        completion_tokens=sum(r.completion_tokens for r in rows),
        total_tokens=sum(r.total_tokens for r in rows))
    return UsageReport(since=since, until=until, rows=rows, totals=totals)


@router.get("/audit", response_model=list[AuditEntry], summary="The audit log, newest first",
            responses=error_responses(400, 401, 403))
async def list_audit(
    admin: AdminDep, services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before_id: Annotated[int | None, Query(ge=1, lt=2**31, description="Page: entries older than "
                                           "this id.")] = None,
    object_type: Annotated[str | None, Query(pattern=r"^[a-z_]{1,32}$")] = None,
) -> list[AuditEntry]:
    records = await run_in_threadpool(lambda: services.registry.audit.list(
        limit=limit, before_id=before_id, object_type=object_type))
    return [AuditEntry.of(record) for record in records]


def _utc(value: datetime | None) -> datetime | None:
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)
