"""Rate windows: each replica's admissions per tenant and second, so that replicas sharing the
database enforce tenant limits together.

Revision ID: 0003
Revises: 0002
Create Date: 2026-03-01 00:00:00
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rate_windows",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("replica", sa.String(64), nullable=False),
        sa.Column("slot", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("num_requests", sa.BigInteger(), nullable=False),
        sa.Column("num_tokens", sa.BigInteger(), nullable=False),
        sa.Column("num_in_flight", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE",
                                name="fk_rate_windows_tenant_id_tenants"),
        sa.PrimaryKeyConstraint("tenant_id", "replica", "slot", name="pk_rate_windows"),
    )
    op.create_index("ix_rate_windows_slot", "rate_windows", ["slot"])


def downgrade() -> None:
    op.drop_index("ix_rate_windows_slot", table_name="rate_windows")
    op.drop_table("rate_windows")
