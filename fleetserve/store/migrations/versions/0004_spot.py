"""Spot placement: each replica's zone and whether it is a spot instance.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("zone", sa.String(64), nullable=True))
        batch.add_column(sa.Column("spot", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("spot")
        batch.drop_column("zone")
