"""The load balancer: its own process per service, a streaming reverse proxy to READY replicas."""
