"""Length-grouped, shardable caption batches over a feature store (paper Sec. 4.3)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from sat_model.data.tables import load_references
from sat_model.data.vocab import build_vocab
from sat_model.train.batching import (
    BatchingError,
    CaptionDataset,
    LengthGroupedBatchSampler,
    load_caption_dataset,
    mirror_draws,
    mirror_tokens,
)
from tests.factories import write_captions

L, D = 6, 4


def _lengths(n: int = 103, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 9, size=n)


def write_feature_store(path: Path, ids: list[str], feats: np.ndarray) -> None:
    """A feature store per ARCHITECTURE.md: image_id + fixed_size_list<float16>[L*D]."""
    flat = pa.array(feats.reshape(-1).astype(np.float16), type=pa.float16())  # (N*L*D,)
    column = pa.FixedSizeListArray.from_arrays(flat, L * D)  # (N,) of L*D
    meta = {
        "name": "random",
        "layer": "none",
        "input_size": "32",
        "num_locations": str(L),
        "annotation_dim": str(D),
        "grid_h": "2",
        "grid_w": "3",
        "weights_sha256": "0" * 64,
        "format_version": "1",
    }
    schema = pa.schema([("image_id", pa.string()), ("features", column.type)], metadata=meta)
    table = pa.table({"image_id": ids, "features": column}, schema=schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_table(table)


def _open_store(path: Path):
    features = pytest.importorskip(
        "sat_model.features.store", reason="sat_model.features.store not landed"
    )
    return features.FeatureStore(path)


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
def test_every_batch_holds_captions_of_one_length(num_replicas: int) -> None:
    lengths = _lengths()
    for rank in range(num_replicas):
        sampler = LengthGroupedBatchSampler(
            lengths, 8, seed=1, num_replicas=num_replicas, rank=rank
        )
        for batch in sampler.batches(epoch=2):
            assert len(set(lengths[batch].tolist())) == 1
            assert 1 <= len(batch) <= 8


@pytest.mark.parametrize("num_replicas", [2, 3, 4, 7])
def test_shards_are_disjoint_complete_and_equal_in_count(num_replicas: int) -> None:
    lengths = _lengths()
    shards = [
        LengthGroupedBatchSampler(lengths, 8, seed=5, num_replicas=num_replicas, rank=r).batches(1)
        for r in range(num_replicas)
    ]
    assert len({len(s) for s in shards}) == 1
    seen = Counter(i for shard in shards for batch in shard for i in batch)
    assert sorted(seen) == list(range(len(lengths)))  # complete
    assert set(seen.values()) == {1}  # disjoint
    global_list = LengthGroupedBatchSampler(
        lengths, 8, seed=5, num_replicas=num_replicas
    ).global_batches(1)
    assert sorted(map(tuple, global_list)) == sorted(tuple(b) for s in shards for b in s)


def test_shards_step_equally_even_when_captions_are_fewer_than_ranks() -> None:
    lengths = np.array([5, 6, 7])  # three single-caption lengths over four ranks
    shards = [
        LengthGroupedBatchSampler(lengths, 4, num_replicas=4, rank=r).batches(0) for r in range(4)
    ]
    assert [len(s) for s in shards] == [1, 1, 1, 1]
    assert {i for s in shards for b in s for i in b} == {0, 1, 2}


def test_batch_order_is_deterministic_per_epoch_and_changes_between_epochs() -> None:
    lengths = _lengths()
    a = LengthGroupedBatchSampler(lengths, 8, seed=11)
    b = LengthGroupedBatchSampler(lengths, 8, seed=11)
    assert a.batches(3) == b.batches(3)
    assert a.batches(3) != a.batches(4)
    assert a.batches(3) != LengthGroupedBatchSampler(lengths, 8, seed=12).batches(3)


def test_single_rank_batch_count_is_sum_of_per_length_ceilings() -> None:
    lengths = np.array([3] * 17 + [4] * 8 + [5] * 1)
    # ceil(17/8) + ceil(8/8) + ceil(1/8) = 3 + 1 + 1
    assert len(LengthGroupedBatchSampler(lengths, 8).batches(0)) == 5


def test_rank_outside_replicas_is_refused() -> None:
    with pytest.raises(BatchingError, match="rank 2"):
        LengthGroupedBatchSampler([3, 4], 2, num_replicas=2, rank=2)


def test_collate_gives_float32_annotations_and_padded_long_captions(tmp_path: Path) -> None:
    feats = np.random.default_rng(0).standard_normal((3, L, D)).astype(np.float16)
    write_feature_store(tmp_path / "train.arrow", ["a", "b", "c"], feats)
    store = _open_store(tmp_path / "train.arrow")
    ds = CaptionDataset(store, [2, 0], [[1, 7, 8, 2], [1, 9, 2]])
    batch = ds.collate([0, 1])
    assert batch.annotations.dtype == torch.float32
    assert batch.annotations.shape == (2, L, D)
    np.testing.assert_array_equal(batch.annotations.numpy(), feats[[2, 0]].astype(np.float32))
    assert batch.captions.dtype == torch.long
    assert batch.captions.tolist() == [[1, 7, 8, 2], [1, 9, 2, 0]]
    assert batch.lengths.tolist() == [4, 3]


def test_dataset_skips_captions_without_features_and_keeps_the_rest(tmp_path: Path) -> None:
    feats = np.zeros((2, L, D), dtype=np.float16)
    write_feature_store(tmp_path / "train.arrow", ["a", "b"], feats)
    write_captions(
        tmp_path / "captions.parquet",
        [
            ("a", "train", 0, "a red circle"),
            ("b", "train", 0, "a blue square"),
            ("gone", "train", 0, "a green circle"),
            ("v", "val", 0, "a red square"),
        ],
    )
    vocab = build_vocab([["a", "red", "circle", "blue", "square"]], 1, 100, 20)
    ds, skipped = load_caption_dataset(
        tmp_path / "captions.parquet", "train", _open_store(tmp_path / "train.arrow"), vocab
    )
    assert len(ds) == 2
    assert [(s.image_id, s.reason) for s in skipped] == [("gone", "image has no features")]
    assert ds.captions[0] == tuple(vocab.encode_caption(["a", "red", "circle"]))


def test_dataset_with_no_usable_caption_fails_loudly(tmp_path: Path) -> None:
    write_feature_store(tmp_path / "train.arrow", ["a"], np.zeros((1, L, D), np.float16))
    write_captions(tmp_path / "captions.parquet", [("z", "train", 0, "a cat")])
    vocab = build_vocab([["a", "cat"]], 1, 100, 20)
    with pytest.raises(BatchingError, match="no usable 'train' caption"):
        load_caption_dataset(
            tmp_path / "captions.parquet", "train", _open_store(tmp_path / "train.arrow"), vocab
        )


def test_references_are_grouped_per_image_in_caption_order(tmp_path: Path) -> None:
    write_captions(
        tmp_path / "captions.parquet",
        [
            ("b", "val", 1, "second of b"),
            ("a", "val", 0, "only a"),
            ("b", "val", 0, "first of b"),
            ("t", "train", 0, "not val"),
        ],
    )
    refs = load_references(tmp_path / "captions.parquet", "val")
    assert refs == {"a": ["only a"], "b": ["first of b", "second of b"]}


def _mirrored_dataset(tmp_path: Path, mirrored_ids: list[str] | None = None):
    """Two photos, their stores (the mirrored one holds other values) and three captions."""
    rng = np.random.default_rng(4)
    feats, mirrored = rng.standard_normal((2, 2, L, D)).astype(np.float16)
    write_feature_store(tmp_path / "train.arrow", ["a", "b"], feats)
    write_feature_store(tmp_path / "train_mirrored.arrow", mirrored_ids or ["a", "b"], mirrored)
    write_captions(
        tmp_path / "captions.parquet",
        [
            ("a", "train", 0, "a dog left of a tree"),
            ("b", "train", 0, "a man turns right"),
            ("a", "train", 1, "a dog on the left and a cat on the right"),
        ],
    )
    words = ["a", "dog", "left", "of", "tree", "man", "turns", "right", "on", "the", "and", "cat"]
    vocab = build_vocab([words], 1, 100, 20)
    ds, _ = load_caption_dataset(
        tmp_path / "captions.parquet",
        "train",
        _open_store(tmp_path / "train.arrow"),
        vocab,
        _open_store(tmp_path / "train_mirrored.arrow"),
    )
    return ds, vocab, feats, mirrored


def test_mirrored_items_take_the_mirrored_photo_and_swap_left_and_right(tmp_path: Path) -> None:
    ds, vocab, feats, mirrored = _mirrored_dataset(tmp_path)
    batch = ds.collate([0, 1, 2], mirror=[True, False, True])
    # rows 0 and 2 are photo a mirrored, row 1 photo b as it is
    expected = np.stack([mirrored[0], feats[1], mirrored[0]]).astype(np.float32)
    np.testing.assert_array_equal(batch.annotations.numpy(), expected)
    words = [
        vocab.decode(row[1 : int(n) - 1])
        for row, n in zip(batch.captions.tolist(), batch.lengths, strict=True)
    ]
    assert words == [
        ["a", "dog", "right", "of", "a", "tree"],
        ["a", "man", "turns", "right"],
        ["a", "dog", "on", "the", "right", "and", "a", "cat", "on", "the", "left"],
    ]
    assert batch.image_indices.tolist() == [0, 1, 0]  # the same photo, either way
    plain = ds.collate([0, 1, 2])  # no mirror asked: every item as it is
    np.testing.assert_array_equal(plain.annotations.numpy(), feats[[0, 1, 0]].astype(np.float32))
    assert vocab.decode(plain.captions[0, 1:7].tolist()) == ["a", "dog", "left", "of", "a", "tree"]


def test_a_mirrored_store_of_other_photos_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BatchingError, match="re-run the extract stage"):
        _mirrored_dataset(tmp_path, mirrored_ids=["b", "a"])


def test_mirroring_without_a_mirrored_store_is_refused(tmp_path: Path) -> None:
    write_feature_store(tmp_path / "train.arrow", ["a"], np.zeros((1, L, D), np.float16))
    ds = CaptionDataset(_open_store(tmp_path / "train.arrow"), [0], [[1, 5, 2]])
    with pytest.raises(BatchingError, match="without mirrored photos"):
        ds.collate([0], mirror=[True])


def test_mirror_tokens_swaps_only_left_and_right() -> None:
    assert mirror_tokens(["the", "left", "hand", "is", "right", "of", "a", "leftover"]) == (
        ["the", "right", "hand", "is", "left", "of", "a", "leftover"]
    )


def test_mirror_draws_depend_on_seed_and_epoch_only_and_hit_the_chance() -> None:
    draws = mirror_draws(20_000, 0.3, seed=2, epoch=5)
    assert draws.dtype == bool and draws.shape == (20_000,)
    np.testing.assert_array_equal(draws, mirror_draws(20_000, 0.3, seed=2, epoch=5))
    assert (draws != mirror_draws(20_000, 0.3, seed=2, epoch=6)).any()
    assert (draws != mirror_draws(20_000, 0.3, seed=3, epoch=5)).any()
    assert abs(draws.mean() - 0.3) < 0.02  # binomial sd ~0.003
    assert not mirror_draws(100, 0.0, seed=0, epoch=1).any()
    assert mirror_draws(100, 1.0, seed=0, epoch=1).all()
