"""`-o/--output table|json|yaml` of the read commands (docs/output.md).

json and yaml print the REST API's response body for the same call (each model's
`model_dump(mode="json")`) to stdout and nothing else; progress and warnings go to stderr.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any

import typer
import yaml
from pydantic import BaseModel


class OutputFormat(StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"


OutputOption = Annotated[
    OutputFormat,
    typer.Option(
        "-o",
        "--output",
        case_sensitive=False,
        help="table (default), json or yaml: json/yaml print the REST API's body "
        "(schemas: docs/schema/v1, see docs/output.md)",
    ),
]

INTERVAL_MIN, INTERVAL_MAX = 0.5, 3600.0


def check_interval(value: float | None) -> float | None:
    """--interval: seconds between refreshes, within 0.5..3600 (NaN and infinities refused)."""
    if value is not None and not (math.isfinite(value) and INTERVAL_MIN <= value <= INTERVAL_MAX):
        raise typer.BadParameter(
            f"{value:g}: seconds between refreshes, {INTERVAL_MIN:g}..{INTERVAL_MAX:g}"
        )
    return value


def to_data(value: BaseModel | Sequence[BaseModel]) -> Any:
    """What the REST API answers for `value`: a model's JSON form, or a list of them."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return [v.model_dump(mode="json") for v in value]


def dumps(data: Any, fmt: OutputFormat) -> str:
    """One document: indented JSON, or YAML in the fields' order; ends with a newline."""
    if fmt is OutputFormat.json:
        return json.dumps(data, indent=2) + "\n"
    if fmt is OutputFormat.yaml:
        return str(yaml.safe_dump(data, sort_keys=False))
    raise ValueError(f"{fmt.value} is not a machine-readable format")


def stream_item(data: Any, fmt: OutputFormat) -> str:
    """One item of a followed stream: a JSON Lines line, or one YAML document (`---`)."""
    if fmt is OutputFormat.json:
        return json.dumps(data) + "\n"
    return "---\n" + dumps(data, fmt)


def emit(value: BaseModel | Sequence[BaseModel], fmt: OutputFormat) -> None:
    write(dumps(to_data(value), fmt))


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def quiet_broken_pipe() -> None:
    """The reader went away (`... | head`): print nothing more, not even at exit."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
