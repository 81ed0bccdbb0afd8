"""The served base model record: `loraplex serve` writes it at start, uploads are validated
against it without loading the model."""

from __future__ import annotations

from dataclasses import asdict

from sqlalchemy import select

from loraplex.adapter_format import BaseModelShape
from loraplex.registry.audit import record_audit
from loraplex.registry.database import Database
from loraplex.registry.records import ServedModelRecord
from loraplex.registry.registry_errors import BaseModelUnknownError, InvalidInputError
from loraplex.registry.tables import ServedModel

_ROW_ID = 1


class ServedModelService:
    def __init__(self, db: Database) -> None:
        self._db = db

    def get(self) -> ServedModelRecord | None:
        with self._db.read() as session:
            row = session.get(ServedModel, _ROW_ID)
            return None if row is None else _record(row)

    def require(self) -> ServedModelRecord:
        """The recorded model, or BaseModelUnknownError."""
        record = self.get()
        if record is None:
            raise BaseModelUnknownError(
                "no served base model is recorded in the registry, so the adapter cannot be "
                "checked against it; start `loraplex serve` once (it records its model)"
            )
        return record

    def set(self, model_id: str, shape: BaseModelShape, max_lora_rank: int, *,
            actor: int | None = None) -> ServedModelRecord:
        """Record the model being served (replacing any earlier record)."""
        if not model_id or len(model_id) > 255:
            raise InvalidInputError("model id must be 1 to 255 characters", param="model_id")
        fields = asdict(shape)
        if not all(isinstance(v, int) and v > 0 for v in fields.values()) or max_lora_rank < 1:
            raise InvalidInputError(f"invalid base model shape {shape} or rank {max_lora_rank}")
        with self._db.write() as session:
            row = session.scalar(select(ServedModel).where(ServedModel.id == _ROW_ID))
            before = None if row is None else _record(row)
            if row is None:
                row = ServedModel(id=_ROW_ID, model_id=model_id, max_lora_rank=max_lora_rank,
                                  **fields)
                session.add(row)
            else:
                row.model_id, row.max_lora_rank = model_id, max_lora_rank
                for name, value in fields.items():
                    setattr(row, name, value)
            session.flush()
            record = _record(row)
            if before is None or (before.model_id, before.shape, before.max_lora_rank) != (
                    model_id, shape, max_lora_rank):
                record_audit(session, actor, "served_model.set", "served_model", model_id,
                             fields | {"max_lora_rank": max_lora_rank})
            return record


def _record(row: ServedModel) -> ServedModelRecord:
    shape = BaseModelShape(
        num_layers=row.num_layers, hidden_size=row.hidden_size,
        intermediate_size=row.intermediate_size, num_heads=row.num_heads,
        num_kv_heads=row.num_kv_heads, head_dim=row.head_dim,
    )
    return ServedModelRecord(model_id=row.model_id, shape=shape,
                             max_lora_rank=row.max_lora_rank, updated_at=row.updated_at)
