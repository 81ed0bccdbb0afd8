"""Adapters know their family: lora, dora, ia3 or flora (existing rows are LoRA).

Revision ID: 0002
Revises: 0001
Create Date: 2026-02-01 00:00:00
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("family", sa.String(16), nullable=False, server_default="lora"))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("family")
