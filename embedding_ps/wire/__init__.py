"""What clients and shards agree on: the wire protocol (protocol.py), id -> shard hashing
(sharding.py), the PS and table config (config.py), token authentication (auth.py) and the
shared-memory segment format both sides map (shm.py). Imports nothing of `client` or `shard`."""
