"""Worker pools: the jobs submitted to them (queued, running and finished ones are rows).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128)),
        sa.Column("batch", sa.Integer, nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("num_jobs", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("run", sa.Text, nullable=False),
        sa.Column("envs_json", sa.Text, nullable=False),
        sa.Column("slots", sa.Float, nullable=False),
        sa.Column("worker_id", sa.Integer),
        sa.Column("launch_token", sa.String(64), nullable=False),
        sa.Column("handle", sa.Text),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("exit_code", sa.Integer),
        sa.Column("reason", sa.Text),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("ended_at", sa.Float),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_index("ix_jobs_pool_status", "jobs", ["pool", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_pool_status", "jobs")
    op.drop_table("jobs")
