"""fleetserve: serve any model server as a fleet of replicas behind one endpoint."""

__version__ = "0.1.0"
