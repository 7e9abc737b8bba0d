"""Partition keys are shard paths; the ones Dagster cannot carry are refused with the reason."""

import dagster as dg
import pytest

from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar.defs.partitions import (
    ADD_CHUNK,
    add_requests,
    partition_key_problem,
    shard_partitions,
)


@pytest.mark.parametrize("rel", ["part-00000.parquet", "2026/12/part 1.parquet", "a=b/ü/x.parquet", "x..y.parquet"])
def test_usual_shard_paths_are_keys(rel):
    assert partition_key_problem(rel) is None


@pytest.mark.parametrize(
    "rel, reason",
    [
        ("a,b.parquet", "','"),
        ("a...b.parquet", "'...'"),
        ("x/[1].parquet", "'['"),
        ("tab\there.parquet", "control character"),
        ("new\nline.parquet", "control character"),
        ("", "empty"),
        ("x" * 2000, "characters long"),
    ],
)
def test_keys_dagster_cannot_carry_are_refused_with_the_reason(rel, reason):
    problem = partition_key_problem(rel)
    assert problem is not None and reason in problem and "partition key" in problem


def test_one_partitions_definition_per_dataset():
    a, b = shard_partitions(DatasetKeys("a")), shard_partitions(DatasetKeys("b"))
    assert isinstance(a, dg.DynamicPartitionsDefinition)
    assert (a.name, b.name) == ("a_shards", "b_shards")


def test_adds_are_chunked_at_10k_keys():
    keys = [f"s{i:06d}.parquet" for i in range(2 * ADD_CHUNK + 5)]
    requests = add_requests(shard_partitions(DatasetKeys("big")), keys)
    assert [len(r.partition_keys) for r in requests] == [ADD_CHUNK, ADD_CHUNK, 5]
    assert all(r.partitions_def_name == "big_shards" for r in requests)
    assert [k for r in requests for k in r.partition_keys] == keys


def test_100k_partitions_are_added_and_read_back(tmp_path):
    keys = [f"{i // 1000:03d}/part-{i:06d}.parquet" for i in range(100_000)]
    with dg.instance_for_test() as instance:
        for request in add_requests(shard_partitions(DatasetKeys("big")), keys):
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        stored = instance.get_dynamic_partitions("big_shards")
    assert len(stored) == 100_000 and set(stored) == set(keys)
