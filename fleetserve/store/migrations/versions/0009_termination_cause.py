"""Why a replica is stopped, as a typed column: `replicas.scale_down` (a boolean meaning "delete
the row once it is stopped") becomes `replicas.termination_cause`, a core.types.TerminationCause
value from which the row's deletion is derived (core.types.deletes_row).

Rows already there: scale_down set means a cause that removes the row, told apart by the words
the old code wrote in `reason` (the ones its metrics read): "service shutting down" is
service_down, "terminated by user" is user, "replaced by version N" is rollout, anything else
scale_down. scale_down unset on a row stopped by the controller (SHUTTING_DOWN, or ended so)
means a failure, or a preemption for PREEMPTED; rows never stopped get NULL.

The downgrade puts scale_down back (true for every cause that removes the row). Columns are
dropped with SQL's own DROP COLUMN (SQLite 3.35 or later), never by copying the table: a
batch operation would drop `replicas` and rename a copy (see 0008's _drop).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# core.types.TerminationCause's values, as this migration knows them (not imported: a
# migration must keep meaning what it meant when it was written).
_ROW_GOES = ("scale_down", "rollout", "user", "service_down", "host_lost")


def upgrade() -> None:
    op.add_column("replicas", sa.Column("termination_cause", sa.String(16), nullable=True))
    op.execute(
        "UPDATE replicas SET termination_cause = CASE "
        "WHEN reason = 'service shutting down' THEN 'service_down' "
        "WHEN reason = 'terminated by user' THEN 'user' "
        "WHEN reason LIKE 'replaced by version %' THEN 'rollout' "
        "ELSE 'scale_down' END WHERE scale_down"
    )
    op.execute(
        "UPDATE replicas SET termination_cause = 'preemption' "
        "WHERE NOT scale_down AND status = 'PREEMPTED'"
    )
    op.execute(
        "UPDATE replicas SET termination_cause = 'failure' WHERE NOT scale_down AND status IN "
        "('SHUTTING_DOWN', 'FAILED', 'FAILED_PROBING', 'FAILED_INITIAL_DELAY', 'FAILED_CLEANUP')"
    )
    op.execute("ALTER TABLE replicas DROP COLUMN scale_down")


def downgrade() -> None:
    op.add_column(
        "replicas",
        sa.Column("scale_down", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    causes = ", ".join(f"'{c}'" for c in _ROW_GOES)
    op.execute(f"UPDATE replicas SET scale_down = true WHERE termination_cause IN ({causes})")
    op.execute("ALTER TABLE replicas DROP COLUMN termination_cause")
