"""`python -m fleetserve` is the `fleetserve` command."""

from fleetserve.cli.main import main

main()
