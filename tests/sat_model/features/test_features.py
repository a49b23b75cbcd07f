"""The feature store: round trip, atomic write, memory-mapped reads, clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from sat_model.features.spec import EncoderSpec
from sat_model.features.store import (
    FeatureStore,
    FeatureStoreError,
    FeatureWriter,
    channel_statistics,
)

META = EncoderSpec(
    name="random",
    layer="conv2",
    input_size=32,
    num_locations=4,
    annotation_dim=3,
    grid_h=2,
    grid_w=2,
    weights_sha256="random-seed-0",
)


def _features(n: int, offset: int = 0) -> np.ndarray:
    # small integers are exact in float16, so equality below is exact
    return (np.arange(n * 12).reshape(n, 4, 3) + offset * 12).astype(np.float32)  # (n, L, D)


def _write(path: Path, batches: int = 3, per_batch: int = 2) -> list[str]:
    ids = []
    with FeatureWriter(path, META) as writer:
        for b in range(batches):
            batch_ids = [f"img{b * per_batch + j}" for j in range(per_batch)]
            writer.write(batch_ids, _features(per_batch, b * per_batch))
            ids += batch_ids
    return ids


def test_round_trip_keeps_ids_order_values_dtype_and_metadata(tmp_path: Path) -> None:
    ids = _write(tmp_path / "train.arrow")
    store = FeatureStore(tmp_path / "train.arrow")
    assert store.ids == ids and len(store) == 6
    assert store.spec == META
    expected = _features(6)
    for i in range(6):
        assert store[i].dtype == np.float16 and store[i].shape == (4, 3)
        np.testing.assert_array_equal(store[i], expected[i])
    assert store.index_of("img4") == 4
    np.testing.assert_array_equal(store[-1], expected[5])


def test_get_batch_gathers_rows_across_record_batches(tmp_path: Path) -> None:
    _write(tmp_path / "train.arrow")
    store = FeatureStore(tmp_path / "train.arrow")
    batch = store.get_batch([5, 0, 3])
    assert batch.shape == (3, 4, 3) and batch.dtype == np.float16
    np.testing.assert_array_equal(batch, _features(6)[[5, 0, 3]])


def test_file_follows_the_architecture_contract_schema(tmp_path: Path) -> None:
    _write(tmp_path / "train.arrow")
    with pa.memory_map(str(tmp_path / "train.arrow")) as source:
        schema = pa.ipc.open_file(source).schema
    assert schema.field("image_id").type == pa.string()
    assert schema.field("features").type == pa.list_(pa.float16(), 12)
    # the keys, text values and order of every store written since issue #18: the file's bytes,
    # and so DVC's hash of data/features, depend on them
    assert [(k.decode(), v.decode()) for k, v in schema.metadata.items()] == [
        ("name", "random"),
        ("layer", "conv2"),
        ("input_size", "32"),
        ("num_locations", "4"),
        ("annotation_dim", "3"),
        ("grid_h", "2"),
        ("grid_w", "2"),
        ("weights_sha256", "random-seed-0"),
        ("format_version", "1"),
    ]
    assert FeatureStore(tmp_path / "train.arrow").format_version == 1


def test_rows_are_views_into_the_mapping_not_copies(tmp_path: Path) -> None:
    _write(tmp_path / "train.arrow", batches=4, per_batch=500)
    before = pa.total_allocated_bytes()
    store = FeatureStore(tmp_path / "train.arrow")
    total = float(sum(store[i].astype(np.float32).sum() for i in range(len(store))))
    assert total > 0
    assert not store[0].flags.owndata and not store[0].flags.writeable
    # the file holds 2000 × 12 float16 (48 kB); a copying reader would allocate at least that
    assert pa.total_allocated_bytes() - before < 4_000


def test_exception_while_writing_leaves_no_file_and_no_partial(tmp_path: Path) -> None:
    path = tmp_path / "train.arrow"
    with pytest.raises(RuntimeError, match="interrupted"), FeatureWriter(path, META) as writer:
        writer.write(["a", "b"], _features(2))
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_partial_file_is_hidden_until_close(tmp_path: Path) -> None:
    path = tmp_path / "train.arrow"
    writer = FeatureWriter(path, META)
    writer.write(["a"], _features(1))
    visible = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert visible == [] and not path.exists()
    writer.close()
    assert [p.name for p in tmp_path.iterdir()] == ["train.arrow"]


def test_writer_rejects_features_of_the_wrong_shape(tmp_path: Path) -> None:
    with (
        FeatureWriter(tmp_path / "x.arrow", META) as writer,
        pytest.raises(ValueError, match="shape"),
    ):
        writer.write(["a"], np.zeros((1, 5, 3)))


def test_truncated_file_gives_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "train.arrow"
    _write(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(FeatureStoreError, match=r"train\.arrow is truncated or corrupt"):
        FeatureStore(path)


def test_a_file_that_is_not_arrow_gives_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "val.arrow"
    path.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(FeatureStoreError, match=r"val\.arrow"):
        FeatureStore(path)


def test_an_arrow_file_without_feature_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.arrow"
    table = pa.table({"x": [1, 2]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(FeatureStoreError, match="not a feature store"):
        FeatureStore(path)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FeatureStoreError, match="feature file not found"):
        FeatureStore(tmp_path / "test.arrow")


def test_channel_statistics_equal_numpy_over_every_location(tmp_path: Path) -> None:
    _write(tmp_path / "f.arrow")  # 6 images (L=4, D=3), read back in chunks of 4
    store = FeatureStore(tmp_path / "f.arrow")
    mean, std = channel_statistics(store, chunk=4)
    flat = _features(6).reshape(-1, 3).astype(np.float64)  # (images*L, D)
    np.testing.assert_allclose(mean, flat.mean(0), rtol=1e-6)
    np.testing.assert_allclose(std, flat.std(0), rtol=1e-6)


def test_a_store_gives_back_the_built_encoders_spec_less_its_normalisation(
    tmp_path: Path,
) -> None:
    from dataclasses import replace

    from sat_model.features.encoders import build_encoder

    spec = build_encoder("random", input_size=32).spec
    with FeatureWriter(tmp_path / "f.arrow", spec) as writer:
        writer.write(["a"], np.zeros((1, spec.L, spec.D)))
    # mean and std are the network's, given back when it is rebuilt: the store does not hold them
    assert FeatureStore(tmp_path / "f.arrow").spec == replace(spec, mean=None, std=None)


def test_a_store_written_with_the_pre_issue_18_metadata_names_is_read(tmp_path: Path) -> None:
    old = {"encoder": "random", "layer": "conv2", "input_size": "32", "L": "4", "D": "3"}
    old |= {"grid_h": "2", "grid_w": "2", "weights_sha256": "random-seed-0", "format_version": "1"}
    column = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(12), pa.float16()), 12)
    schema = pa.schema([("image_id", pa.string()), ("features", column.type)], metadata=old)
    path = tmp_path / "old.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_table(pa.table({"image_id": ["a"], "features": column}, schema=schema))
    assert FeatureStore(path).spec == META
