"""Hosts: where each load balancer and local replica runs (high availability across hosts).

A pid and a start time name a process on one host only: controllers on different hosts that
share the database adopt, probe or stop only the processes recorded on their own host
(fleetserve.infra.host). NULL: recorded before this revision, on the one host there was.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("services") as batch:
        batch.add_column(sa.Column("lb_host", sa.String(128), nullable=True))
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("host", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("host")
    with op.batch_alter_table("services") as batch:
        batch.drop_column("lb_host")
