"""Initial registry schema: tenants, API keys, adapters, system prompts, usage, the append-only
audit log and the served base model.

Revision ID: 0001
Revises:
Create Date: 2026-01-01 00:00:00
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

_SQLITE_TRIGGERS = [
    f"CREATE TRIGGER audit_log_no_{verb.lower()} BEFORE {verb} ON audit_log "
    f"BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END"
    for verb in ("UPDATE", "DELETE")
]
_POSTGRES_TRIGGERS = [
    "CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN RAISE EXCEPTION 'audit_log is append-only'; END $$",
    "CREATE TRIGGER audit_log_no_change BEFORE UPDATE OR DELETE ON audit_log "
    "FOR EACH ROW EXECUTE FUNCTION audit_log_append_only()",
    "CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log "
    "FOR EACH STATEMENT EXECUTE FUNCTION audit_log_append_only()",
]


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("weight", sa.Float(), server_default=sa.text("1"), nullable=False),
        sa.Column("max_concurrent_requests", sa.Integer(), nullable=True),
        sa.Column("max_requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("max_tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("weight > 0", name="ck_tenants_weight_positive"),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
        sa.Column("last_used_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint(
            "(role = 'admin' AND tenant_id IS NULL) OR (role = 'tenant' AND tenant_id IS NOT NULL)",
            name="ck_api_keys_role_matches_tenant",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_api_keys_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("secret_hash", name="uq_api_keys_secret_hash"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("weights_sha256", sa.String(64), nullable=False),
        sa.Column("config_sha256", sa.String(64), nullable=False),
        sa.Column("base_model", sa.String(255), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("target_modules", _JSON, nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("num_requests_served", sa.BigInteger(), server_default=sa.text("0"),
                  nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_adapters_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_adapters"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_id_name"),
    )
    for column in ("digest", "weights_sha256", "config_sha256"):
        op.create_index(f"ix_adapters_{column}", "adapters", [column])
    op.create_table(
        "system_prompts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=True),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name="fk_system_prompts_adapter_id_adapters",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_system_prompts_tenant_id_tenants",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_system_prompts"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_system_prompts_tenant_id_name"),
    )
    op.create_index("ix_system_prompts_adapter_id", "system_prompts", ["adapter_id"])
    op.create_table(
        "usage",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("adapter", sa.String(64), nullable=False),
        sa.Column("hour", sa.DateTime(), nullable=False),
        sa.Column("num_requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_usage_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "adapter", "hour", name="pk_usage"),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", _BIG_ID, nullable=False),
        sa.Column("actor_key_id", sa.Integer(), nullable=True),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("object_type", sa.String(32), nullable=False),
        sa.Column("object_id", sa.String(160), nullable=False),
        sa.Column("details", _JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_audit_log"),
    )
    op.create_index("ix_audit_log_created_at", "audit_log", ["created_at"])
    op.create_table(
        "served_model",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("model_id", sa.String(255), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("hidden_size", sa.Integer(), nullable=False),
        sa.Column("intermediate_size", sa.Integer(), nullable=False),
        sa.Column("num_heads", sa.Integer(), nullable=False),
        sa.Column("num_kv_heads", sa.Integer(), nullable=False),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        sa.Column("max_lora_rank", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("id = 1", name="ck_served_model_single_row"),
        sa.PrimaryKeyConstraint("id", name="pk_served_model"),
    )
    is_sqlite = op.get_bind().dialect.name == "sqlite"
    for statement in _SQLITE_TRIGGERS if is_sqlite else _POSTGRES_TRIGGERS:
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.execute("DROP TRIGGER IF EXISTS audit_log_no_truncate ON audit_log")
        op.execute("DROP TRIGGER IF EXISTS audit_log_no_change ON audit_log")
        op.execute("DROP FUNCTION IF EXISTS audit_log_append_only()")
    for table in ("served_model", "audit_log", "usage", "system_prompts", "adapters", "api_keys",
                  "tenants"):
        op.drop_table(table)
