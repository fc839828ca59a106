"""Rollouts: the version that serves (stable), the one before it, the update mode and a canary
share.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("services") as batch:
        batch.add_column(sa.Column("stable_version", sa.Integer, nullable=True))
        batch.add_column(sa.Column("previous_version", sa.Integer, nullable=True))
        batch.add_column(sa.Column("update_mode", sa.String(16), nullable=True))
        batch.add_column(sa.Column("traffic_percent", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("services") as batch:
        batch.drop_column("traffic_percent")
        batch.drop_column("update_mode")
        batch.drop_column("previous_version")
        batch.drop_column("stable_version")
