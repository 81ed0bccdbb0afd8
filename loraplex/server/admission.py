"""The admission of a generation request, as a dependency: once the key names a tenant, the
request counts against the server's and the tenant's limits (or is refused with 429/503) before
anything else is done for it: before its body is validated, its model looked up or its prompt
tokenized. So a request refused later (a bad parameter, a prompt that cannot fit, an unknown
adapter) still took a slot and a request of the tenant's minute. The admission ends when the
response has been sent (a stream included), if the job did not end it first."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends

from loraplex.server.auth import TenantDep
from loraplex.server.deps import ServicesDep
from loraplex.server.http_errors import RateLimitError, ServiceUnavailableError
from loraplex.server.limits import Admission


async def admit_request(principal: TenantDep, services: ServicesDep) -> AsyncIterator[Admission]:
    if services.is_draining:
        services.metrics.reject("draining")
        raise ServiceUnavailableError("this server is shutting down; retry (another replica will "
                                      "answer)", retry_after_s=services.config.retry_after_s,
                                      code="server_draining")
    tenant = await services.principals.tenant_of(principal.tenant)
    services.tenant_weights.sync(tenant)
    try:
        admission = services.limiter.admit(tenant)
    except RateLimitError:
        services.metrics.reject("rate_limit")
        raise
    except ServiceUnavailableError:
        services.metrics.reject("overloaded")
        raise
    try:
        yield admission
    finally:
        admission.release()


AdmissionDep = Annotated[Admission, Depends(admit_request, scope="request")]
"""The request's admission (it also authenticates: a tenant's key)."""
