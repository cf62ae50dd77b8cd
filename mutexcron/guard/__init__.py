"""One guarded run of a job: the guard, batched claims, the hand-off, catch-up, fire-time identity, views of other holders."""
