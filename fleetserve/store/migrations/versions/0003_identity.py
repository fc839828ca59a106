"""Store identity and load-balancer secrets: a `meta` table (the home id and the home path the
database belongs to), each service's LB admin secret, and one service per LB port.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )
    with op.batch_alter_table("services") as batch:
        batch.add_column(sa.Column("lb_secret", sa.String(128), nullable=True))
        batch.create_unique_constraint("uq_services_lb_port", ["lb_port"])


def downgrade() -> None:
    with op.batch_alter_table("services") as batch:
        batch.drop_constraint("uq_services_lb_port", type_="unique")
        batch.drop_column("lb_secret")
    op.drop_table("meta")
