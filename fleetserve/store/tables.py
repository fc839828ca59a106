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
    Column("failure_reason", Text),
    Column("purge", Boolean, nullable=False, default=False),
    # Rollouts (migration 0002): active_version is what new replicas launch with; the stable
    # version serves until a rollout completes; previous_version is what `rollback` returns to.
    Column("stable_version", Integer),
    Column("previous_version", Integer),
    Column("update_mode", String(16)),
    Column("traffic_percent", Integer),  # a canary's share of requests, until `promote`
    # Migration 0003: the secret the LB's admin API requires (and its wake-up call carries).
    Column("lb_secret", String(128)),
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
    Column("scale_down", Boolean, nullable=False, default=False),
    Column("purge", Boolean, nullable=False, default=False),
    # Migration 0004: where the replica runs and whether it is a spot instance.
    Column("zone", String(64)),
    Column("spot", Boolean, nullable=False, default=False),
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

# Migration 0003: facts about the store itself ("home_id", "home_path").
meta = Table(
    "meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)
