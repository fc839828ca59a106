"""The control plane: one reconciler per service, the action executor, probes, recovery."""
