"""Service faults as typed columns: `services.failure_reason` held three facts that readers told
apart by guessing (from lb_pid, or a substring). Now one column each:

- `launch_stop`: why the controller stopped launching replicas of the version (a crash loop);
- `lb_error`: why the load balancer could not be started;
- `cleanup_error`: which replicas `down` could not terminate.

Rows already there are sorted by the prefixes the old code wrote ("load balancer: ...",
"could not terminate ..."; anything else was a crash loop), and failure_reason is dropped.
The downgrade puts the first one set back into failure_reason. Columns are dropped with SQL's
own DROP COLUMN (SQLite 3.35 or later), never by copying the table (see _drop).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("services") as batch:
        batch.add_column(sa.Column("launch_stop", sa.Text, nullable=True))
        batch.add_column(sa.Column("lb_error", sa.Text, nullable=True))
        batch.add_column(sa.Column("cleanup_error", sa.Text, nullable=True))
    op.execute(
        "UPDATE services SET lb_error = failure_reason WHERE failure_reason LIKE 'load balancer: %'"
    )
    op.execute(
        "UPDATE services SET cleanup_error = failure_reason "
        "WHERE failure_reason LIKE 'could not terminate %'"
    )
    op.execute(
        "UPDATE services SET launch_stop = failure_reason WHERE failure_reason IS NOT NULL "
        "AND lb_error IS NULL AND cleanup_error IS NULL"
    )
    _drop("failure_reason")


def downgrade() -> None:
    with op.batch_alter_table("services") as batch:
        batch.add_column(sa.Column("failure_reason", sa.Text, nullable=True))
    op.execute(
        "UPDATE services SET failure_reason = COALESCE(cleanup_error, lb_error, launch_stop)"
    )
    for column in ("cleanup_error", "lb_error", "launch_stop"):
        _drop(column)


def _drop(column: str) -> None:
    """ALTER TABLE ... DROP COLUMN, on SQLite too (3.35+): a batch operation would copy the
    table, drop it and rename the copy, and dropping `services` deletes every replica, event
    and version row with it (ON DELETE CASCADE)."""
    op.execute(f"ALTER TABLE services DROP COLUMN {column}")
