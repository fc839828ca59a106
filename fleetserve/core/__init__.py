"""Core values shared by every layer: errors, statuses, ids, the clock."""
