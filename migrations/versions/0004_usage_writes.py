"""Usage writes: the id of each usage write, stored in the write's own transaction, so that a
write retried after a lost answer (the COMMIT reached the database, its answer did not come
back) is not counted twice.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27 00:00:00
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "usage_writes",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("written_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_usage_writes"),
    )
    op.create_index("ix_usage_writes_written_at", "usage_writes", ["written_at"])


def downgrade() -> None:
    op.drop_index("ix_usage_writes_written_at", table_name="usage_writes")
    op.drop_table("usage_writes")
