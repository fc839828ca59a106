"""JSON Schemas of what `-o json|yaml` prints (docs/output.md), one per output kind.

`scripts/gen_schema.py` writes them to docs/schema/v1/; a unit test regenerates them and fails
on any difference, so that a change of the output is a deliberate one. Version v1 is the REST
API's v1: within it fields may be added, never renamed or removed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import core_schema

from fleetserve.api.models import EventInfo, JobInfo, ServiceInfo
from fleetserve.sim.results import Simulation

VERSION = "v1"
DIALECT = "https://json-schema.org/draft/2020-12/schema"


class OutputSchema(GenerateJsonSchema):
    """The schema of what a model *prints*: every field is always there (model_dump writes
    each one, null or not), so every field is required."""

    def field_is_required(
        self,
        field: core_schema.ModelField | core_schema.DataclassField | core_schema.TypedDictField,
        total: bool,
    ) -> bool:
        return self.mode == "serialization" or super().field_is_required(field, total)


@dataclass(frozen=True)
class Kind:
    file: str
    type: Any
    printed_by: str


KINDS = (
    Kind("service.json", ServiceInfo, "`status NAME`, `pool status NAME` (GET /services/NAME)"),
    Kind("service-list.json", list[ServiceInfo], "`status` (GET /services)"),
    Kind("pool-list.json", list[ServiceInfo], "`pool status` (GET /pools)"),
    Kind("events.json", list[EventInfo], "`events NAME` (GET /services/NAME/events)"),
    Kind("event.json", EventInfo, "each line of `events NAME -f -o json` (JSON Lines)"),
    Kind("job-list.json", list[JobInfo], "`jobs queue` (GET /jobs)"),
    Kind("simulation.json", Simulation, "`simulate`, `pool simulate` (told apart by `kind`)"),
)


def schema_of(kind: Kind) -> dict[str, Any]:
    body = TypeAdapter(kind.type).json_schema(mode="serialization", schema_generator=OutputSchema)
    head: dict[str, Any] = {
        "$schema": DIALECT,
        "title": body.pop("title", None) or kind.file.removesuffix(".json"),
        "description": f"fleetserve output schema {VERSION}: {kind.printed_by} with "
        "-o json|yaml. Within v1 fields may be added, never renamed or removed.",
    }
    return head | body


def generate() -> dict[str, str]:
    """Each schema file's name and its exact text."""
    return {k.file: json.dumps(schema_of(k), indent=2) + "\n" for k in KINDS}
