"""The `fleetserve` command line (typer + rich), built on the SDK only."""
