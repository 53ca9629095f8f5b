import pytest
import torch
from torch import nn

from leanstate._tools.ranks import forked
from leanstate.checkpoint import load_checkpoint, save_checkpoint
from leanstate.embedding import KeyedJaggedTensor, KVEmbeddingBag, KVEmbeddingBagCollection
from leanstate.reference.row_format import header_words, unpack_metadata
from tests.harness import FakeClock

D, VOCAB = 8, 50


def batch(step, bags=6, per_bag=5, vocab=VOCAB):
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (bags * per_bag,), generator=generator)
    offsets = torch.arange(0, bags * per_bag, per_bag)
    upstream = torch.randn(bags, D, generator=generator)
    return ids, offsets, upstream


def dense_copy(bag, mode="sum"):
    """An nn.EmbeddingBag holding the store's initial rows for ids 0..VOCAB-1."""
    table = nn.EmbeddingBag(VOCAB, D, mode=mode)
    with torch.no_grad():
        table.weight.copy_(bag.store.get(torch.arange(VOCAB), width=D))
    return table


# per_sample_weights exists for sum pooling only, as in nn.EmbeddingBag
@pytest.mark.parametrize("mode, weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_pooled_outputs_match_nn_embedding_bag(mode, weighted):
    bag = KVEmbeddingBag(VOCAB, D, mode=mode, seed=4)
    table = dense_copy(bag, mode)
    ids, offsets, _ = batch(0)
    weights = torch.rand(len(ids)) if weighted else None
    got, want = bag(ids, offsets, weights), table(ids, offsets, per_sample_weights=weights)
    if weighted:  # torch's kernel fuses the multiply and the add; leanstate rounds each (spec)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)
    assert len(bag.store) == 0  # forward reads initial rows without inserting them


def test_padding_ids_add_nothing_and_do_not_count_in_the_mean():
    bag = KVEmbeddingBag(VOCAB, D, mode="mean")
    table = dense_copy(bag, "mean")
    ids = torch.tensor([1, -1, 2, -1, -1, 3])
    got = bag(ids, torch.tensor([0, 3, 5]))
    expected = table(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 2]))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_rows_after_backward_match_torch_sgd(weight_decay):
    bag = KVEmbeddingBag(VOCAB, D, optimizer="sgd", lr=0.3, weight_decay=weight_decay)
    table = dense_copy(bag)
    optimizer = torch.optim.SGD(table.parameters(), lr=0.3, weight_decay=weight_decay)
    for step in range(3):
        ids, offsets, upstream = batch(step)
        (bag(ids, offsets) * upstream).sum().backward()
        optimizer.zero_grad()
        (table(ids, offsets) * upstream).sum().backward()
        # torch's dense SGD would decay untouched rows too; the fused update touches only these
        touched = torch.unique(ids)
        grad = table.weight.grad[touched].clone()
        table.weight.grad.zero_()
        table.weight.grad[touched] = grad
        with torch.no_grad():
            before = table.weight.clone()
            optimizer.step()
            untouched = torch.ones(VOCAB, dtype=torch.bool)
            untouched[touched] = False
            table.weight[untouched] = before[untouched]
        # torch's SGD fuses lr * g into the subtraction; leanstate rounds each step (spec)
        got, want = bag.store.get(touched, width=D), table.weight[touched].detach()
        torch.testing.assert_close(
            got, want, rtol=1e-6, atol=1e-7, msg=lambda m, step=step: f"step {step}: {m}"
        )


def restated(optimizer, steps, lr, eps=1e-8, betas=(0.9, 0.999), weight_decay=0.0):
    """The update rules written out in plain torch on a dense table (spec/embedding.md)."""
    bag = KVEmbeddingBag(VOCAB, D, optimizer=optimizer)
    weight = bag.store.get(torch.arange(VOCAB), width=D).clone()
    momentum = torch.zeros(VOCAB)
    m, v = torch.zeros(VOCAB, D), torch.zeros(VOCAB, D)
    for t in range(1, steps + 1):
        ids, offsets, upstream = batch(t - 1)
        w = weight.clone().requires_grad_(True)
        (nn.functional.embedding_bag(ids, w, offsets, mode="sum") * upstream).sum().backward()
        rows = torch.unique(ids)
        g = w.grad[rows] + weight_decay * weight[rows]
        if optimizer == "rowwise_adagrad":
            momentum[rows] += (g * g).mean(dim=1)
            weight[rows] -= lr * g / (momentum[rows].sqrt()[:, None] + eps)
        else:
            b1, b2 = betas
            m[rows] = b1 * m[rows] + (1 - b1) * g
            v[rows] = b2 * v[rows] + (1 - b2) * g * g
            m_hat, v_hat = m[rows] / (1 - b1**t), v[rows] / (1 - b2**t)
            weight[rows] -= lr * m_hat / (v_hat.sqrt() + eps)
    return weight, momentum, m, v


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adagrad_and_adam_match_a_plain_torch_restatement(optimizer, weight_decay):
    bag = KVEmbeddingBag(VOCAB, D, optimizer=optimizer, lr=0.05, weight_decay=weight_decay)
    for step in range(4):
        ids, offsets, upstream = batch(step)
        (bag(ids, offsets) * upstream).sum().backward()
    weight, momentum, m, v = restated(optimizer, 4, lr=0.05, weight_decay=weight_decay)
    keys = bag.store.keys()
    torch.testing.assert_close(bag.store.get(keys, width=D), weight[keys], rtol=0, atol=1e-6)
    state = bag.store.get(keys, width_offset=D, width=2 * D if optimizer == "adam" else 1)
    if optimizer == "adam":
        torch.testing.assert_close(state[:, :D], m[keys], rtol=0, atol=1e-6)
        torch.testing.assert_close(state[:, D:], v[keys], rtol=0, atol=1e-6)
    else:
        torch.testing.assert_close(state[:, 0], momentum[keys], rtol=0, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_offloading_on_and_off_train_identically(optimizer):
    on = KVEmbeddingBag(VOCAB, D, optimizer=optimizer, lr=0.1, clock=FakeClock())
    off = KVEmbeddingBag(
        VOCAB,
        D,
        optimizer=optimizer,
        lr=0.1,
        optimizer_offloading=False,
        return_whole_row=False,
        clock=FakeClock(),
    )
    for step in range(5):
        ids, offsets, upstream = batch(step)
        for bag in (on, off):
            (bag(ids, offsets) * upstream).sum().backward()
    keys = on.store.keys()
    assert torch.equal(keys, off.store.keys())
    assert torch.equal(on.store.get(keys, width=D), off.store.get(keys, width=D))
    assert on.state_dict()["_extra_state"] == off.state_dict()["_extra_state"] == 5
    for name, view in on.state_dict().items():
        if name not in ("weight", "_extra_state"):
            assert torch.equal(view.narrow(0, 0, len(view)), off.state_dict()[name].narrow(0, 0, len(view)))


@pytest.mark.parametrize("optimizer, state", [("rowwise_adagrad", 1), ("adam", 12)])
def test_the_state_lives_after_the_padded_weight(optimizer, state):
    """With D = 6 the weight takes pad4(6) = 8 columns; the state starts at column 8."""
    bag = KVEmbeddingBag(VOCAB, 6, optimizer=optimizer, lr=0.1, clock=FakeClock())
    (bag(torch.tensor([3]), torch.tensor([0])) * torch.randn(1, 6)).sum().backward()
    row = bag.store.get(torch.tensor([3]))[0]
    assert bag.store.layout.state_offset - bag.store.layout.header_elems == 8
    assert torch.count_nonzero(row[6:8]) == 0  # the weight's padding stays zero
    assert torch.count_nonzero(row[8 : 8 + state]) > 0  # the state was written there
    assert torch.equal(
        bag.state_dict()[next(iter(bag.fields))].narrow(0, 0, 1)[0],
        row[8 : 8 + bag.fields[next(iter(bag.fields))][1]],
    )


def test_return_whole_row_needs_offloading():
    with pytest.raises(ValueError, match="return_whole_row=True needs optimizer_offloading=True"):
        KVEmbeddingBag(VOCAB, D, optimizer_offloading=False)


def test_state_dict_holds_whole_rows_and_read_only_optimizer_views():
    bag = KVEmbeddingBag(VOCAB, D, optimizer="rowwise_adagrad", lr=0.1, clock=FakeClock())
    ids, offsets, upstream = batch(0)
    (bag(ids, offsets) * upstream).sum().backward()
    state = bag.state_dict()
    weight, momentum = state["weight"], state["momentum1"]
    assert weight.whole_rows and weight.shape == (len(bag.store), bag.store.layout.width)
    assert header_words(weight.narrow(0, 0, len(weight)))[:, 0].tolist() == bag.store.keys().tolist()
    assert momentum.read_only and momentum.shape == (len(bag.store), 1)
    fresh = KVEmbeddingBag(VOCAB, D, optimizer="rowwise_adagrad", lr=0.1)
    fresh.load_state_dict(state)
    keys = bag.store.keys()
    assert torch.equal(fresh.store.get_rows(keys), bag.store.get_rows(keys))
    with pytest.raises(RuntimeError, match='Missing key.*"momentum1"'):  # nn.Module's strict check
        fresh.load_state_dict({"weight": weight})
    assert fresh.load_state_dict({"weight": weight}, strict=False).missing_keys == [
        "momentum1",
        "_extra_state",
    ]


def test_collection_takes_torchrec_shaped_input():
    user, item = KVEmbeddingBag(VOCAB, D, seed=1), KVEmbeddingBag(VOCAB, D, mode="mean", seed=2)
    collection = KVEmbeddingBagCollection({"user": user, "item": item})
    values = torch.tensor([1, 2, 3, 4, 5, 6])
    lengths = torch.tensor([2, 1, 0, 3])  # user: bags [1,2] [3]; item: [] [4,5,6]
    out = collection(KeyedJaggedTensor(["user", "item"], values, lengths=lengths))
    assert torch.equal(out["user"], user(torch.tensor([1, 2, 3]), torch.tensor([0, 2])))
    assert torch.equal(out["item"], item(torch.tensor([4, 5, 6]), torch.tensor([0, 0])))
    with_other = collection(  # a key no table reads is skipped, as TorchRec does
        KeyedJaggedTensor(
            ["user", "other", "item"],
            torch.tensor([1, 2, 3, 98, 99, 4, 5, 6]),
            lengths=torch.tensor([2, 1, 1, 1, 0, 3]),
        )
    )
    assert with_other.keys() == ["user", "item"] and torch.equal(with_other["item"], out["item"])


def _train_half(optimizer: str, offloading: bool, backend: str, path: str, phase: str) -> None:
    """In a process of its own: steps 0-2 and a save, or a load and steps 3-5 (rows to ``path``.rows)."""
    bag = make(optimizer, offloading, backend)
    if phase == "load":
        extra = load_checkpoint(path, bag.checkpoint_tables())
        bag.load_extra_state(extra)
        start, end = 3, 6
    else:
        start, end = 0, 3
    for step in range(start, end):
        ids, offsets, upstream = batch(step)
        (bag(ids, offsets) * upstream).sum().backward()
    if phase == "save":
        save_checkpoint(path, bag.checkpoint_tables(), extra=bag.extra_state())
    else:
        keys = bag.store.keys()
        rows = [bag.store.get_rows(keys)]
        if bag.state_store is not None:
            rows.append(bag.state_store.get_rows(keys))
        torch.save(rows, path + ".rows")


def make(optimizer, offloading, backend):
    return KVEmbeddingBag(
        VOCAB,
        D,
        optimizer=optimizer,
        lr=0.05,
        optimizer_offloading=offloading,
        return_whole_row=offloading,
        clock=FakeClock(),
        backend=backend,
    )


@pytest.mark.parametrize(
    "optimizer, offloading, backend",
    [
        ("adam", True, "reference"),
        ("rowwise_adagrad", False, "reference"),
        ("adam", True, "numba"),
        ("sgd", True, "numba"),
    ],
)
def test_resume_in_a_fresh_process_equals_training_straight_through(tmp_path, optimizer, offloading, backend):
    path = str(tmp_path / "ckpt")

    def run(phase):  # a fresh process (forked from a server that imported torch, not this one)
        process = forked(_train_half).Process(
            target=_train_half, args=(optimizer, offloading, backend, path, phase)
        )
        process.start()
        process.join()
        assert process.exitcode == 0, f"the {phase} process failed (its traceback is above)"

    run("save")
    run("load")
    resumed = torch.load(path + ".rows", weights_only=True)
    straight = make(optimizer, offloading, backend)
    for step in range(6):
        ids, offsets, upstream = batch(step)
        (straight(ids, offsets) * upstream).sum().backward()
    keys = straight.store.keys()
    expected = [straight.store.get_rows(keys)]
    if straight.state_store is not None:
        expected.append(straight.state_store.get_rows(keys))
    for got, want in zip(resumed, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # rows, state, timestamps, counts
    counts = unpack_metadata(header_words(expected[0])[:, 1])[1]
    assert counts.max() > 1  # rows were updated in several steps


def test_checkpoint_tables_round_trip_through_save_and_load(tmp_path):
    bag = make("rowwise_adagrad", True, "reference")
    ids, offsets, upstream = batch(0)
    (bag(ids, offsets) * upstream).sum().backward()
    save_checkpoint(tmp_path / "ck", bag.checkpoint_tables(), extra=bag.extra_state())
    fresh = make("rowwise_adagrad", True, "reference")
    tables = fresh.checkpoint_tables()
    fresh.load_extra_state(load_checkpoint(tmp_path / "ck", tables))
    assert tables["momentum1"].ignored_writes == len(bag.store)
    keys = bag.store.keys()
    assert torch.equal(fresh.store.get_rows(keys), bag.store.get_rows(keys)) and fresh.optimizer_step == 1


@pytest.mark.parametrize("backend", sorted(__import__("leanstate")._backends.available("embedding")))
@pytest.mark.parametrize("two_d", [False, True])
def test_per_sample_weights_get_nn_embedding_bags_gradient(backend, two_d):
    """d out[b] / d w_i is the row of id i (mode sum), read before the update; padding gets 0."""
    bag = KVEmbeddingBag(100, 6, lr=0.1, optimizer="rowwise_adagrad", backend=backend)
    initial = bag.store.get(torch.arange(100)).float()[:, :6].clone()
    if two_d:
        ids = torch.tensor([[3, 7, 3], [50, -1, 9]])
        offsets, kept_offsets = None, torch.tensor([0, 3])
    else:
        ids, offsets, kept_offsets = (
            torch.tensor([3, 7, 3, 50, -1, 9]),
            torch.tensor([0, 2, 5]),
            torch.tensor([0, 2, 4]),
        )
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = bag(ids, offsets, per_sample_weights=weights)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * upstream).sum().backward()
    peer = nn.EmbeddingBag(100, 6, mode="sum")
    peer.weight.data.copy_(initial)
    theirs = weights.detach().clone().requires_grad_()
    keep = ids.reshape(-1) >= 0
    want = peer(ids.reshape(-1)[keep], kept_offsets, per_sample_weights=theirs.reshape(-1)[keep])
    (want * upstream).sum().backward()
    torch.testing.assert_close(out.detach(), want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights.grad, theirs.grad, rtol=1e-6, atol=1e-6)
    assert float(weights.grad.reshape(-1)[4]) == 0.0  # the padding id
    assert bag.optimizer_step == 1  # and the rows were still updated


@pytest.mark.parametrize("backend", sorted(__import__("leanstate")._backends.available("embedding")))
def test_the_backward_stamps_the_optimizer_state_rows_headers(backend):
    """Without offloading, the state store's rows get the same stamps as the reference's."""
    clock = FakeClock(900)
    bags = {
        name: KVEmbeddingBag(
            None,
            4,
            optimizer="rowwise_adagrad",
            optimizer_offloading=False,
            return_whole_row=False,
            backend=name,
            clock=clock,
        )  # fmt: skip
        for name in ("reference", backend)
    }
    for step in range(2):
        clock.now = 900 + 10 * step
        for bag in bags.values():
            bag(torch.tensor([5, 7, 5]), torch.tensor([0, 2])).sum().backward()
    ids = torch.tensor([5, 7, 9])
    want, got = (bags[n].state_store.metadata(ids) for n in ("reference", backend))
    assert torch.equal(got, want), (got, want)
    for part in ("store", "state_store"):  # the weights and the separate state, updated alike
        mine, theirs = (getattr(bags[n], part).get(ids) for n in (backend, "reference"))
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7, msg=part)
    stamp, count, used = unpack_metadata(got)
    assert used.tolist() == [True, True, False] and bool((count[:2] > 0).all())
