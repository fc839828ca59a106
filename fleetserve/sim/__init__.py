"""`fleetserve simulate`: replay request traces through autoscaling policies, fast."""
