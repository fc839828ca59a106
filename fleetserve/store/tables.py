"""The schema. Every fact is a plain column (no pickles); JSON only for the spec and handles."""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    Column,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

services = Table(
    "services",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("phase", String(32), nullable=False),
    Column("active_version", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("lb_port", Integer),
    Column("lb_admin_port", Integer),
    Column("lb_pid", Integer),
    Column("lb_create_time", Float),
    Column("next_replica_id", Integer, nullable=False, default=1),
    # Migration 0008: the service's faults, one column each (they were one failure_reason):
    # launches stopped (a crash loop), the LB could not start, `down` could not terminate.
    Column("launch_stop", Text),
    Column("lb_error", Text),
    Column("cleanup_error", Text),
    Column("purge", Boolean, nullable=False, default=False),
    # Rollouts (migration 0002): active_version is what new replicas launch with; the stable
    # version serves until a rollout completes; previous_version is what `rollback` returns to.
    Column("stable_version", Integer),
    Column("previous_version", Integer),
    Column("update_mode", String(16)),
    Column("traffic_percent", Integer),  # a canary's share of requests, until `promote`
    # Migration 0003: the secret the LB's admin API requires (and its wake-up call carries).
    Column("lb_secret", String(128)),
    # Migration 0007: the host its LB process runs on (fleetserve.infra.host); NULL: this one.
    Column("lb_host", String(128)),
    UniqueConstraint("lb_port", name="uq_services_lb_port"),  # one service per LB port
)

versions = Table(
    "versions",
    metadata,
    Column(
        "service",
        String(64),
        ForeignKey("services.name", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("version", Integer, primary_key=True),
    Column("yaml_text", Text, nullable=False),
    Column("spec_json", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)

replicas = Table(
    "replicas",
    metadata,
    Column("service", String(64), primary_key=True),
    Column("replica_id", Integer, primary_key=True),
    Column("version", Integer, nullable=False),
    Column("status", String(32), nullable=False),
    Column("reason", Text),
    Column("infra", String(32), nullable=False),
    Column("launch_token", String(64), nullable=False),
    Column("handle", Text),
    Column("endpoint", String(256)),
    Column("port", Integer),
    Column("exit_code", Integer),
    Column("created_at", Float, nullable=False),
    Column("launched_at", Float),
    Column("started_at", Float),
    Column("first_ready_at", Float),
    Column("probe_failing_since", Float),
    Column("terminated_at", Float),
    Column("updated_at", Float, nullable=False),
    Column("purge", Boolean, nullable=False, default=False),
    # Migration 0004: where the replica runs and whether it is a spot instance.
    Column("zone", String(64)),
    Column("spot", Boolean, nullable=False, default=False),
    # Migration 0007: the host a local replica's processes run on; NULL: this one (or an
    # infra whose replicas are not processes of a controller's host, such as Ray).
    Column("host", String(128)),
    # Migration 0009: why it is being (or was) stopped, a core.types.TerminationCause value;
    # NULL until it is. It replaced the boolean scale_down ("delete the row afterwards"),
    # which is now derived from it (core.types.deletes_row).
    Column("termination_cause", String(16)),
    ForeignKeyConstraint(["service"], ["services.name"], ondelete="CASCADE"),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("service", String(64), ForeignKey("services.name", ondelete="CASCADE"), nullable=False),
    Column("replica_id", Integer),
    Column("at", Float, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("status_from", String(32)),
    Column("status_to", String(32)),
    Column("message", Text, nullable=False),
    Index("ix_events_service_at", "service", "at"),
)

policy_state = Table(
    "policy_state",
    metadata,
    Column(
        "service",
        String(64),
        ForeignKey("services.name", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("policy", String(64), primary_key=True),
    Column("state_json", Text, nullable=False),
    Column("updated_at", Float, nullable=False),
)

# Migration 0005: jobs submitted to worker pools. Not tied to the pool's row: a job's record
# outlives the pool (its history), and job ids are never reused.
jobs = Table(
    "jobs",
    metadata,
    Column("job_id", Integer, primary_key=True, autoincrement=True),
    Column("pool", String(64), nullable=False),
    Column("name", String(128)),
    Column("batch", Integer, nullable=False),  # the first job id of its `jobs launch`
    Column("rank", Integer, nullable=False),  # SKYPILOT_JOB_RANK
    Column("num_jobs", Integer, nullable=False),  # SKYPILOT_NUM_JOBS
    Column("status", String(16), nullable=False),
    Column("run", Text, nullable=False),
    Column("envs_json", Text, nullable=False),
    Column("slots", Float, nullable=False),  # the share of a worker it needs (packing)
    Column("worker_id", Integer),
    Column("launch_token", String(64), nullable=False),
    Column("handle", Text),
    Column("attempts", Integer, nullable=False),  # starts so far (a lost worker requeues it)
    Column("exit_code", Integer),
    Column("reason", Text),
    Column("created_at", Float, nullable=False),
    Column("started_at", Float),
    Column("ended_at", Float),
    Column("updated_at", Float, nullable=False),
    Index("ix_jobs_pool_status", "pool", "status"),
)

# Migration 0003: facts about the store itself ("home_id", "home_path").
meta = Table(
    "meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

# Migration 0006: the active controller's lease (fleetserve.store.leader).
leader = Table(
    "leader",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("holder", String(128), nullable=False),
    Column("generation", Integer, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("address", String(256), nullable=False),
    Column("renewed_at", Float, nullable=False),
)
