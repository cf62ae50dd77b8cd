"""The task stores: one module per backend, each behind the contract in ``tasks/base.py``."""

#: Seconds the Redis and memory stores keep a minute's count of ended occurrences (they keep no
#: tombstone to read them from): the dashboard charts the last hour; two keep all of it.
FINISHED_TTL = 7200
