"""One PS shard: the request loop (loop.py) and server (server.py), push/pull ordering per mode
(gates.py), the shard's state (state.py) of tables (table.py) with their optimizers (optim.py,
kernels.py, decay.py), copy-on-write saves (cow.py, saver.py) and the saved-shard format
(snapshot.py, npyfile.py, the only reader and namer of saved-shard files)."""
