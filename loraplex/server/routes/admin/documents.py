"""Registered documents: add, list, get, delete. Requests include them by name (`documents`),
or hold their text (found in the prompt); the engine computes each one's KV once per adapter and
reuses it wherever it lands (CacheBlend)."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from starlette.concurrency import run_in_threadpool

from loraplex.registry.records import DocumentRecord
from loraplex.server.auth import AdminDep
from loraplex.server.deps import ServicesDep
from loraplex.server.routes.admin.params import NameParam, TenantFilter
from loraplex.server.routes.docs import error_responses
from loraplex.server.schemas.admin import Document, DocumentCreate
from loraplex.server.services import Services

router = APIRouter(prefix="/documents", tags=["Admin: documents"])


async def _document(services: Services, record: DocumentRecord) -> Document:
    return Document.of(record, await services.codec.count(record.text))


@router.get("", response_model=list[Document], summary="List documents",
            responses=error_responses(401, 403, 404))
async def list_documents(admin: AdminDep, services: ServicesDep,
                         tenant: TenantFilter = None) -> list[Document]:
    records = await run_in_threadpool(services.registry.documents.list, tenant)
    return [await _document(services, record) for record in records]


@router.post("", response_model=Document, status_code=status.HTTP_201_CREATED,
             summary="Add a document", responses=error_responses(400, 401, 403, 404, 409))
async def add_document(body: DocumentCreate, admin: AdminDep, services: ServicesDep) -> Document:
    """A named document of a tenant. Its KV is computed the first time a request includes it."""
    record = await run_in_threadpool(lambda: services.registry.documents.add(
        body.tenant, body.name, body.text, actor=admin.key_id))
    services.documents.forget()
    return await _document(services, record)


@router.get("/{tenant}/{name}", response_model=Document, summary="Get a document",
            responses=error_responses(401, 403, 404))
async def get_document(tenant: NameParam, name: NameParam, admin: AdminDep,
                       services: ServicesDep) -> Document:
    return await _document(services, await run_in_threadpool(services.registry.documents.get, tenant, name))


@router.delete("/{tenant}/{name}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response,
               summary="Delete a document", responses=error_responses(401, 403, 404))
async def delete_document(tenant: NameParam, name: NameParam, admin: AdminDep,
                          services: ServicesDep) -> Response:
    """Its cached KV blocks are left to the prefix cache, which evicts them as it needs room."""
    await run_in_threadpool(lambda: services.registry.documents.delete(tenant, name, actor=admin.key_id))
    services.documents.forget()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
