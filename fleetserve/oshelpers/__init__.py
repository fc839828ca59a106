"""This machine's operating system, as every fleetserve process uses it: private files and
logs (`files`), TCP ports (`ports`), processes and which home they belong to (`procs`), and
what the kernel lets this user do with networks (`netcaps`).

A neutral package: it imports nothing of fleetserve but `fleetserve.core`, so the CLI, the
SDK, the controller, the API and the infras share these helpers without importing each other
(docs/architecture.md).
"""
