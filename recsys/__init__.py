"""recsys: hybrid CTR training (sparse embeddings on PS shards, dense towers on DDP)."""

import embedding_ps  # noqa: F401  (checks the installed torch / fbgemm-gpu pair on import)

__version__ = "0.1.0"
