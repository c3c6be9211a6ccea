"""The trainer's side of the PS: `PSClient` (client.py) plans a batch's requests (plan.py), sends
them over ZeroMQ (transport.py) or shared memory, and may keep rows in a row cache (cache.py,
rowcache.py). Imports `wire` and the top-level helpers, never `shard` (tests/unit/test_layers.py)."""
