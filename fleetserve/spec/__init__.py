"""Typed models of the SkyServe-compatible service YAML, and their loading."""

from fleetserve.spec.loader import load_spec, load_spec_file, parse_spec
from fleetserve.spec.models import ServiceTask

__all__ = ["ServiceTask", "load_spec", "load_spec_file", "parse_spec"]
