import numpy as np
import torch

from islands.data import load_digits, load_text
from islands.data.loader import ShardSampler, WindowLoader


def test_stdlib_corpus_split_is_deterministic_and_disjoint():
    a, b = load_text(), load_text()
    assert len(a.train) > 1_000_000 and len(a.val) > 10_000
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)


def test_text_file_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 200)
    (tmp_path / "b.txt").write_text("other text " * 200)
    c = load_text(str(tmp_path))
    assert c.files == 2 and len(c.train) > 0 and len(c.val) > 0
    single = load_text(str(tmp_path / "a.txt"))
    assert len(single.train) + len(single.val) == len("hello world " * 200)


def test_windows_are_next_byte_pairs():
    data = np.arange(1000, dtype=np.uint8)
    x, y = WindowLoader(data, context=16, batch=4, shard=0, shards=1, seed=0).next()
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal((x + 1) % 256, y)


def test_shards_are_disjoint():
    data = np.arange(200, dtype=np.uint8)
    seen = []
    for shard in range(2):
        loader = WindowLoader(data, context=9, batch=10, shard=shard, shards=2, seed=0)
        seen.append(set(loader.next()[0][:, 0].tolist()))
    assert not seen[0] & seen[1]


def test_resumed_loader_continues_where_it_stopped():
    data = np.random.default_rng(1).integers(0, 255, 5000).astype(np.uint8)
    ref = WindowLoader(data, 32, 8, 1, 2, seed=3)
    run = WindowLoader(data, 32, 8, 1, 2, seed=3)
    for _ in range(13):  # cross an epoch boundary (78 windows per shard / 8)
        ref.next(), run.next()
    state = run.state_dict()
    resumed = WindowLoader(data, 32, 8, 1, 2, seed=3)
    resumed.load_state_dict(state)
    for _ in range(5):
        a, b = ref.next(), resumed.next()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert state["epoch"] == 1


def test_sampler_covers_each_item_once_per_epoch():
    s = ShardSampler(37, seed=0, shard=0)
    assert sorted(s.take(37).tolist()) == list(range(37))
    assert s.state_dict() == {"epoch": 1, "cursor": 0}


def test_digits_ships_with_sklearn():
    d = load_digits()
    assert d.x_train.shape[1] == 64 and len(d.y_train) + len(d.y_val) == 1797
    assert d.x_train.min() >= 0.0 and d.x_train.max() <= 1.0


def test_digits_read_from_sklearns_csv_equal_sklearns_own_loader():
    from sklearn.datasets import load_digits as sklearn_digits

    from islands.data.corpus import digits_arrays

    data, target = digits_arrays()
    ref = sklearn_digits()
    assert np.array_equal(data, ref.data) and data.dtype == ref.data.dtype
    assert np.array_equal(target, ref.target)


def test_loading_digits_does_not_import_sklearn():
    import subprocess
    import sys

    code = "import sys; from islands.data import load_digits; load_digits(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
