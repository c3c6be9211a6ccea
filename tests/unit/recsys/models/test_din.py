"""DIN (#17 item 4): attention shapes and masking, truncation, the sequence lookup against a dense
plain-torch reference, and DIN's forward against a reference written out by hand."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch import nn

from data.batch import Batch, KeyedJagged
from embedding_ps.wire.config import TableConfig
from recsys.config import ConfigError, ModelConfig, load_config
from recsys.models import DIN, AttentionUnit, SequenceSparseArch, build_model, plan_sequences, plan_tables
from recsys.models.sequence import truncate_batch, truncate_lists

V, D = 30, 4
CONFIG = Path(__file__).resolve().parents[4] / "configs" / "din.toml"


def din(softmax: bool = False, num_dense: int = 2, seed: int = 0, **kw) -> DIN:
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="din", sequence_features={"hist": "item"}, attention_mlp=(5,), top_mlp=(8,),
                      attention_softmax=softmax, **kw)
    # features (ctx, item, hist): hist = 2 is the list, item = 1 its candidate
    return build_model(cfg, num_dense=num_dense, num_sparse=3, embedding_dim=D, sequences=((2, 1),))


def din_inputs(B: int = 6, L: int = 5, seed: int = 1, lengths: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths if lengths is not None else torch.randint(0, L + 1, (B,), generator=g).tolist())
    mask = torch.arange(L).unsqueeze(0) < lens.unsqueeze(1)                               # [B, L]
    rows = torch.randn(B, 1, L, D, generator=g) * mask[:, None, :, None]                 # [B, 1, L, D]
    return torch.randn(B, 2, generator=g), torch.randn(B, 3, D, generator=g), rows, mask[:, None]


# -- attention unit and model ------------------------------------------------------------------------


@pytest.mark.parametrize("softmax", [False, True])
def test_attention_shapes_and_padding_gets_no_weight(softmax: bool) -> None:
    torch.manual_seed(0)
    unit = AttentionUnit(D, (6, 3), softmax=softmax)
    q, keys = torch.randn(5, D), torch.randn(5, 7, D)
    mask = torch.arange(7).unsqueeze(0) < torch.tensor([0, 1, 3, 7, 2]).unsqueeze(1)      # [5, 7]
    interest, w = unit(q, keys, mask)
    assert interest.shape == (5, D) and w.shape == (5, 7)
    assert torch.all(w[~mask] == 0) and torch.all(interest[0] == 0)      # padding: weight 0; length 0: no interest
    if softmax:
        torch.testing.assert_close(w[1:].sum(1), torch.ones(4))
    # whatever the padded keys hold, nothing changes, and they get no gradient
    keys2 = keys.clone().requires_grad_(True)
    noisy = torch.where(mask.unsqueeze(2), keys2, 1e3 * torch.randn(5, 7, D))
    i2, w2 = unit(q, noisy, mask)
    torch.testing.assert_close(i2, interest)
    torch.testing.assert_close(w2, w)
    i2.sum().backward()
    assert torch.all(keys2.grad[~mask] == 0) and keys2.grad[mask].abs().sum() > 0


@pytest.mark.parametrize("softmax", [False, True])
@torch.no_grad()
def test_din_forward_equals_a_hand_written_reference(softmax: bool) -> None:
    model = din(softmax).eval()
    dense, pooled, rows, mask = din_inputs(lengths=[0, 1, 5, 3, 2, 4])
    unit = model.attention[0]
    lin = [m for m in unit.mlp.layers if isinstance(m, nn.Linear)][0]
    out = []
    for b in range(6):                                    # one example, one position at a time
        q = pooled[b, 1]
        scores = []
        for l in range(5):
            k = rows[b, 0, l]
            h = torch.relu(lin.weight @ torch.cat([q, k, q - k, q * k]) + lin.bias)
            scores.append(float(unit.out.weight[0] @ h + unit.out.bias[0]))
        real = [l for l in range(5) if mask[b, 0, l]]
        if softmax and real:
            e = torch.tensor([scores[l] for l in real]).exp()
            weights = dict(zip(real, (e / e.sum()).tolist()))
        else:
            weights = {l: scores[l] for l in real}
        interest = sum((weights[l] * rows[b, 0, l] for l in real), torch.zeros(D))
        x = torch.cat([dense[b], interest, pooled[b, 0], pooled[b, 1]])     # hist's pooled bag left out
        out.append(model.mlp_out(model.mlp(x.unsqueeze(0)))[0, 0])
    got = model(dense, pooled, None, rows, mask)
    torch.testing.assert_close(got, torch.stack(out), rtol=1e-5, atol=1e-5)


def test_din_shapes_norms_and_errors() -> None:
    for norm in ("none", "batch", "layer"):
        out = din(norm=norm)(*din_inputs()[:2], None, *din_inputs()[2:])
        assert out.shape == (6,) and torch.isfinite(out).all()
    assert din(num_dense=0)(torch.zeros(6, 0), *din_inputs()[1:2], None, *din_inputs()[2:]).shape == (6,)
    with pytest.raises(ValueError, match="behavior rows"):
        din()(*din_inputs()[:2])
    dense, pooled, rows, mask = din_inputs(lengths=[0] * 6)                 # no history at all
    assert torch.isfinite(din(softmax=True)(dense, pooled, None, rows, mask)).all()
    with pytest.raises(ValueError, match="pair"):
        build_model(ModelConfig(arch="din", sequence_features={"hist": "item"}), num_dense=0, num_sparse=3,
                    embedding_dim=D, sequences=((2, 5),))


def test_din_loss_decreases_when_the_label_depends_on_the_history() -> None:
    model = din()
    dense, pooled, rows, mask = din_inputs(B=64, L=6, seed=3)
    labels = ((rows[:, 0] * pooled[:, 1:2]).sum((1, 2)) > 0).float()       # needs the attention path
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense, pooled, None, rows, mask), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


# -- truncation ---------------------------------------------------------------------------------------


def test_truncation_keeps_the_most_recent_ids() -> None:
    # keys (item, hist), B = 3: hist bags [1, 2, 3, 4, 5], [], [6, 7]; items untouched
    kj = KeyedJagged(("item", "hist"), torch.tensor([10, 11, 12, 1, 2, 3, 4, 5, 6, 7]),
                     torch.tensor([1, 1, 1, 5, 0, 2], dtype=torch.int32))
    cut = truncate_lists(kj, [1], 3)
    assert cut.values.tolist() == [10, 11, 12, 3, 4, 5, 6, 7]
    assert cut.lengths.tolist() == [1, 1, 1, 3, 0, 2] and cut.lengths.dtype == torch.int32
    assert truncate_lists(kj, [1], 5) is kj                                   # nothing longer: unchanged
    batch = Batch(dense=torch.zeros(3, 0), sparse=kj, labels=torch.zeros(3),
                  weights=torch.arange(10, dtype=torch.float32))
    cut_b = truncate_batch(batch, [1], 2)
    assert cut_b.sparse.values.tolist() == [10, 11, 12, 4, 5, 6, 7]
    assert cut_b.weights.tolist() == [0, 1, 2, 6, 7, 8, 9]                    # weights cut alike


# -- the sequence lookup against a dense reference --------------------------------------------------


class DictStore:
    """Dense [V, D] rows per table; pushes recorded (the EmbeddingStore calls the sparse arch makes)."""

    def __init__(self, tables: dict[int, torch.Tensor]) -> None:
        self.tables, self.pushed = tables, {}

    def pull_many_async(self, tables, ids, step=None) -> Future:
        f: Future = Future()
        f.set_result(torch.cat([self.tables[t][i].clone() for t, i in zip(tables, ids)]))
        return f

    def push_many_async(self, tables, ids, grads, step=None) -> Future:
        for t, i, g in zip(tables, ids, grads.split([x.numel() for x in ids])):
            self.pushed[t] = (i.clone(), g.clone())
        f: Future = Future()
        f.set_result(None)
        return f


def test_sequence_lookup_and_row_grads_match_a_dense_reference() -> None:
    g = torch.Generator().manual_seed(0)
    B, L = 5, 3
    keys = ("ctx", "item", "hist")
    hist = [[1, 2, 3, 4], [], [5], [7, 7, 8], [9, 1, 2, 3, 6, 4]]            # oldest first; 7 twice
    lengths = [1] * B + [1] * B + [len(h) for h in hist]
    ctx = torch.randint(0, V, (B,), generator=g)
    item = torch.tensor([4, 2, 5, 7, 20])
    values = torch.cat([ctx, item, torch.tensor([i for h in hist for i in h], dtype=torch.int64)])
    batch = Batch(dense=torch.zeros(B, 0), sparse=KeyedJagged(keys, values, torch.tensor(lengths, dtype=torch.int32)),
                  labels=torch.zeros(B))
    tables = (TableConfig(name="ctx", dim=D), TableConfig(name="item", dim=D))
    plans = plan_tables(keys, tables, {"hist": "item"}, {}, {})
    arch = SequenceSparseArch(plans, plan_sequences(keys, {"hist": "item"}), max_len=L)
    dense_tables = {0: torch.randn(V, D, generator=g), 1: torch.randn(V, D, generator=g)}
    store = DictStore(dense_tables)
    lookup = arch.lookup(batch, store)
    pooled, _ = lookup.wait()
    behaviors, mask = arch.behaviors(lookup)                                  # [B, 1, L, D], [B, 1, L]
    assert len(lookup.rows) == 1                                              # one pull: one leaf for both tables
    # reference: the last L ids of each list, left-aligned, zeros after
    E = {t: w.clone().requires_grad_(True) for t, w in dense_tables.items()}
    kept = [h[-L:] for h in hist]
    ref_mask = torch.tensor([[l < len(k) for l in range(L)] for k in kept])
    ref = torch.stack([torch.stack([E[1][k[l]] if l < len(k) else torch.zeros(D) for l in range(L)]) for k in kept])
    ref_pooled = torch.stack([E[0][ctx], E[1][item], torch.stack([E[1][k].sum(0) for k in kept])], 1)
    assert torch.equal(mask[:, 0], ref_mask)
    torch.testing.assert_close(behaviors[:, 0], ref.detach())
    torch.testing.assert_close(pooled, ref_pooled.detach())
    # row gradients through both uses (pooled and per position) equal the dense reference's
    up_seq, up_pool = torch.randn(B, 1, L, D, generator=g), torch.randn(B, 3, D, generator=g)
    ((behaviors * up_seq).sum() + (pooled * up_pool).sum()).backward()
    ((ref.unsqueeze(1) * up_seq).sum() + (ref_pooled * up_pool).sum()).backward()
    lookup.push()
    for t in (0, 1):
        ids, grads = store.pushed[t]
        dense_grad = torch.zeros(V, D).index_add_(0, ids, grads)
        torch.testing.assert_close(dense_grad, E[t].grad)
    assert sorted(store.pushed[1][0].tolist()) == [2, 3, 4, 5, 6, 7, 8, 20]     # 1 and 9, cut off, are not pulled


# -- config -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, match", [
    (["model.arch=din", "model.sequence_features={}"], "needs model.sequence_features"),
    (["model.arch=dlrm"], "only used by din"),
    (["model.max_seq_len=0"], "model.max_seq_len must be >= 1"),
    (["model.attention_mlp=[0]"], "model.attention_mlp sizes"),
    (["model.sequence_features={hist = 'hist'}"], "must name a candidate feature"),
    (["model.sequence_features={hist = 'nope'}"], r"model.sequence_features.hist: 'nope' is not in data.sparse_columns"),
    (["model.feature_tables={hist = 'ctx'}"], "model.feature_tables.hist"),
    (["data.weight_columns={hist = 'w'}"], "data.weight_columns.hist: a sequence feature"),
])
def test_config_errors_name_the_key(override: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(CONFIG, override)


def test_din_config_loads_and_lists_read_their_candidates_table() -> None:
    cfg = load_config(CONFIG)
    from recsys.models import build_sparse_arch
    arch = build_sparse_arch(cfg)
    assert isinstance(arch, SequenceSparseArch) and arch.max_len == cfg.model.max_seq_len
    item_plan = next(p for p in arch.plans if p.name == "item")
    assert [cfg.data.sparse_columns[f] for f in item_plan.features] == ["item", "hist"]
    # with [ps.table_defaults], no table of its own is made for the list
    cfg2 = load_config(CONFIG, ["ps.table_defaults={dim = 16}"])
    assert [t.name for t in cfg2.ps.tables] == ["ctx", "item"]


def test_gen_data_offers_the_sequence_preset() -> None:
    from recsys.cli import build_parser

    args = build_parser().parse_args(["gen-data", "--preset", "sequence", "--rows", "10", "--out", "x"])
    assert args.preset == "sequence"
