"""Pure decision code: input a snapshot, the policy's state and `now`; output decisions."""
