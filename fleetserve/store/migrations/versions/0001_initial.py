"""Initial schema: services, versions, replicas, events, policy_state.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "services",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("phase", sa.String(32), nullable=False),
        sa.Column("active_version", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("lb_port", sa.Integer),
        sa.Column("lb_admin_port", sa.Integer),
        sa.Column("lb_pid", sa.Integer),
        sa.Column("lb_create_time", sa.Float),
        sa.Column("next_replica_id", sa.Integer, nullable=False),
        sa.Column("failure_reason", sa.Text),
        sa.Column("purge", sa.Boolean, nullable=False),
    )
    op.create_table(
        "versions",
        sa.Column(
            "service",
            sa.String(64),
            sa.ForeignKey("services.name", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("version", sa.Integer, primary_key=True),
        sa.Column("yaml_text", sa.Text, nullable=False),
        sa.Column("spec_json", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "replicas",
        sa.Column("service", sa.String(64), primary_key=True),
        sa.Column("replica_id", sa.Integer, primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("infra", sa.String(32), nullable=False),
        sa.Column("launch_token", sa.String(64), nullable=False),
        sa.Column("handle", sa.Text),
        sa.Column("endpoint", sa.String(256)),
        sa.Column("port", sa.Integer),
        sa.Column("exit_code", sa.Integer),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("launched_at", sa.Float),
        sa.Column("started_at", sa.Float),
        sa.Column("first_ready_at", sa.Float),
        sa.Column("probe_failing_since", sa.Float),
        sa.Column("terminated_at", sa.Float),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("scale_down", sa.Boolean, nullable=False),
        sa.Column("purge", sa.Boolean, nullable=False),
        sa.ForeignKeyConstraint(["service"], ["services.name"], ondelete="CASCADE"),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "service",
            sa.String(64),
            sa.ForeignKey("services.name", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("replica_id", sa.Integer),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("status_from", sa.String(32)),
        sa.Column("status_to", sa.String(32)),
        sa.Column("message", sa.Text, nullable=False),
    )
    op.create_index("ix_events_service_at", "events", ["service", "at"])
    op.create_table(
        "policy_state",
        sa.Column(
            "service",
            sa.String(64),
            sa.ForeignKey("services.name", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("policy", sa.String(64), primary_key=True),
        sa.Column("state_json", sa.Text, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("policy_state")
    op.drop_index("ix_events_service_at", table_name="events")
    op.drop_table("events")
    op.drop_table("replicas")
    op.drop_table("versions")
    op.drop_table("services")
