"""The fleetserve home (FLEETSERVE_HOME) as every process of it sees it: where it is and the
settings the CLI, the SDK and the controller share (`settings`), the folder's safety, its API
token and the running controllers' server files (`folder`).

A neutral package: it imports nothing of fleetserve but `core` and `oshelpers`, so the CLI and
the SDK find, start and reach their controller without importing it (the import-linter
contract in pyproject.toml; docs/architecture.md).
"""
