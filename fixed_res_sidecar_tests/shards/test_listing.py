"""shards/listing.py: shard counts, bytes and missing shards of a dataset and its outputs."""

from pathlib import Path

from fixed_res_sidecar.shards.listing import dataset_summary


def test_dataset_summary_counts_shards_and_bytes(sidecar_build):
    summary = dataset_summary(
        sidecar_build.main, {"512": sidecar_build.r512, "1024": sidecar_build.r1024, "sidecar": sidecar_build.sidecar}
    )
    main_files = sorted(Path(sidecar_build.main.path).rglob("*.parquet"))
    assert summary["main"] == {
        "location": sidecar_build.main.uri,
        "shards": len(main_files),
        "total_bytes": sum(p.stat().st_size for p in main_files),
    }
    for name, location in (
        ("512", sidecar_build.r512),
        ("1024", sidecar_build.r1024),
        ("sidecar", sidecar_build.sidecar),
    ):
        output = summary["outputs"][name]
        files = sorted(Path(location.path).rglob("*.parquet"))
        assert output["shards"] == 3 and output["total_bytes"] == sum(p.stat().st_size for p in files)
        assert output["missing"] == [] and output["extra"] == []
