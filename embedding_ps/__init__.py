"""embedding_ps: hash-sharded parameter-server shards, sparse optimizers, ZeroMQ server and client."""

from embedding_ps.versions import check_torch_fbgemm

check_torch_fbgemm()   # torch and fbgemm-gpu are an ABI-locked pair: say which versions are needed
