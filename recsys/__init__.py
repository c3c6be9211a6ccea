"""recsys: hybrid CTR training (sparse embeddings on PS shards, dense towers on DDP)."""

from embedding_ps.versions import check_torch_fbgemm

check_torch_fbgemm()

__version__ = "0.1.0"
