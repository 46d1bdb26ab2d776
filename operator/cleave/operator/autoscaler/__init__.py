"""Per-role SLO autoscaler: signals in, desired replicas out (policy is pure)."""
