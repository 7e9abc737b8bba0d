"""shards/verify/fidelity.py: wrong pictures with the right structure fail the fidelity check, naming
shard, row key and score; good outputs (the build, other WebP methods, JPEG) pass."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from benchmarks.damage import DAMAGE
from fixed_res_sidecar.core.fidelity import FIDELITY_MIN_SCORE
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.parquet import verify_page_checksums
from fixed_res_sidecar.shards.resize import build_resized_shard
from fixed_res_sidecar.shards.settings import SETTINGS_KEY
from fixed_res_sidecar.shards.verify import (
    FIDELITY,
    RESIZED_CHECKS,
    SAMPLE_IMAGES,
    SHARD_COMPLETE,
    SharedRenders,
    VerifyOptions,
    verify_resized_shard,
    write_fidelity_pictures,
)
from fixed_res_sidecar.shards.verify import fidelity as fidelity_module
from fixed_res_sidecar_tests.fixtures.datasets import DAMAGED_REL as REL
from fixed_res_sidecar_tests.fixtures.datasets import (
    SidecarBuild,
    assert_failed,
    column,
    damage_images,
    valid_rows,
)


def damaged_build(sidecar_build: SidecarBuild, resolution: str, kinds: list[str]) -> dict[int, str]:
    """Damage one valid row of shard REL per kind; returns row -> kind."""
    rows = valid_rows(sidecar_build.resized(resolution), REL, sidecar_build.prefixes[resolution])
    assert len(rows) >= len(kinds)
    damages = dict(zip(rows, kinds))
    damage_images(sidecar_build, resolution, damages)
    return damages


@pytest.mark.heavy
def test_every_kind_of_damage_fails_naming_shard_key_and_score(sidecar_build):
    location, kinds = sidecar_build.r512, list(DAMAGE)
    undamaged = Path(location.child(REL)).read_bytes()
    # The shard has 8 valid rows: the ten kinds go into two damaged copies of it, checked in turn.
    for batch in (kinds[:5], kinds[5:]):
        Path(location.child(REL)).write_bytes(undamaged)
        damages = damaged_build(sidecar_build, "512", batch)
        with pq.ParquetFile(location.child(REL)) as parquet_file:
            verify_page_checksums(parquet_file, location.child(REL))  # the damage is in the pictures only
        report = sidecar_build.verify("512")
        message = assert_failed(report, FIDELITY, location, containing=f"{len(damages)} of 8 sampled images")
        # Only fidelity sees it (the other resolution's picture has another size: the sample check too).
        expected_failures = {FIDELITY, SAMPLE_IMAGES} if "wrong_resolution" in batch else {FIDELITY}
        assert {c.name for c in report.failed_checks} == expected_failures
        metadata = report.check(FIDELITY).metadata
        keys = column(location, REL, "image_key")
        failing = {f["row"]: f for f in metadata["failing"]}
        assert set(failing) == set(damages), (damages, metadata["failing"])
        for row, kind in damages.items():
            assert failing[row]["key"] == keys[row]
            assert failing[row]["score"] < FIDELITY_MIN_SCORE, (kind, failing[row])
            assert f"{failing[row]['score']:.2f} dB" in failing[row]["problem"]
        first = min(damages)
        assert repr(keys[first]) in message and f"{failing[first]['score']:.2f} dB" in message
        assert metadata["checked"] == 8 and metadata["failing_rows"] == len(damages)
        assert metadata["score_bins"]["below_-3"] == len(damages)
        assert metadata["min_score"] == min(f["score"] for f in failing.values())
        # The undamaged rows of this shard scored as a fresh build.
        assert metadata["score_bins"]["-0.25_up"] == 8 - len(damages)
    # The other shards and the other resolution are untouched and pass.
    for rel in sidecar_build.main.list_shards():
        if rel != REL:
            assert sidecar_build.verify("512", rel).passed
    assert sidecar_build.verify("1024").passed


def rebuild(sidecar_build: SidecarBuild, options: PixelOptions = PixelOptions(), rel: str = REL) -> None:
    build_resized_shard(sidecar_build.layout(), rel, options=options, threads=2)


def test_the_three_rows_of_the_reported_deploy_fail_and_the_rest_of_the_shard_passes(sidecar_build):
    damages = damaged_build(sidecar_build, "512", ["rotated_180", "channels_reversed", "black"])
    report = sidecar_build.verify("512")
    assert report.failed_checks == [report.check(FIDELITY)]  # structure is fine: only fidelity sees it
    assert {f["row"] for f in report.check(FIDELITY).metadata["failing"]} == set(damages)


@pytest.mark.parametrize(
    "options",
    [PixelOptions(webp_method=0), PixelOptions(webp_method=6), PixelOptions(output_format="jpeg")],
    ids=["webp_method_0", "webp_method_6", "jpeg"],
)
@pytest.mark.heavy
def test_outputs_of_other_encoder_settings_pass(sidecar_build, options):
    rebuild(sidecar_build, options)
    for resolution in ("512", "1024"):
        report = sidecar_build.verify(resolution, pixels=options)
        assert report.passed, [c.message for c in report.failed_checks]
        assert report.check(FIDELITY).metadata["min_score"] >= FIDELITY_MIN_SCORE


@pytest.mark.heavy
def test_sample_none_compares_every_valid_row_and_fidelity_can_be_switched_off(sidecar_build):
    report = sidecar_build.verify("1024", sample=None)
    valid = len(valid_rows(sidecar_build.r1024, REL, sidecar_build.prefixes["1024"]))
    assert report.check(FIDELITY).metadata["checked"] == valid
    assert sidecar_build.verify("1024", sample=2).check(FIDELITY).metadata["checked"] == 2
    # A window of rows is compared (rows not compared before: test_coverage.py); --sample all compares them all.
    subset = sidecar_build.verify("1024", fidelity_sample=3)
    assert subset.check(FIDELITY).metadata["checked"] == 3 and subset.check(SAMPLE_IMAGES).metadata["sampled"] == valid
    assert sidecar_build.verify("1024", sample=None, fidelity_sample=3).check(FIDELITY).metadata["checked"] == valid
    damaged_build(sidecar_build, "1024", ["black"])
    off = sidecar_build.verify("1024", fidelity=False)
    assert [c.name for c in off.checks] == list(RESIZED_CHECKS) and off.passed


@pytest.mark.heavy
def test_both_resolutions_of_a_shard_share_its_sources_and_renders(sidecar_build):
    """As the pipeline verifies a shard: the second resolution's check reads and renders nothing new,
    and every report is the same as without sharing; a sample over SHARED_ROWS keeps nothing."""
    layout, shared = sidecar_build.layout(), SharedRenders()
    alone = {r: sidecar_build.verify(r).check(FIDELITY).metadata for r in ("512", "1024")}
    together = {
        r: verify_resized_shard(layout, REL, r, VerifyOptions(), shared).check(FIDELITY).metadata for r in alone
    }
    assert together == alone and alone["512"]["checked"] == 8
    assert len(shared.sources) == 8 and set(shared.renders) == set(shared.sources)
    assert all(len(renders.images) == 1 for renders in shared.renders.values())  # one fused render per row
    # Damage in the second resolution is still seen through the shared renders.
    damages = damaged_build(sidecar_build, "1024", ["black"])
    damaged = verify_resized_shard(layout, REL, "1024", VerifyOptions(), shared).check(FIDELITY)
    assert not damaged.passed and {f["row"] for f in damaged.metadata["failing"]} == set(damages)
    large = SharedRenders()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fidelity_module, "SHARED_ROWS", 7)
        verify_resized_shard(layout, REL, "512", VerifyOptions(), large)
    assert not large.sources and not large.renders


def test_a_shard_without_recorded_settings_fails_saying_so_and_its_pictures_are_still_compared(sidecar_build):
    path = sidecar_build.r512.child(REL)
    table = pq.read_table(path)
    sources_only = {k: v for k, v in table.schema.metadata.items() if k != SETTINGS_KEY}
    pq.write_table(table.replace_schema_metadata(sources_only), path, write_page_checksum=True)
    report = sidecar_build.verify("512")
    assert_failed(report, SHARD_COMPLETE, sidecar_build.r512, containing="it records no build settings")
    assert report.failed_checks == [report.check(SHARD_COMPLETE)]  # the pictures are compared with the expected ones
    assert report.check(FIDELITY).metadata["checked"] == 8


def test_pictures_show_expected_stored_and_difference_of_each_failing_row(sidecar_build, tmp_path):
    damages = damaged_build(sidecar_build, "512", ["rotated_180", "black"])
    report = sidecar_build.verify("512")
    pictures = Location.parse(tmp_path / "pictures")
    written = write_fidelity_pictures(
        sidecar_build.layout(), REL, "512", report.check(FIDELITY), PixelOptions(), pictures
    )
    keys = column(sidecar_build.r512, REL, "image_key")
    assert len(written) == len(damages)
    for uri, row in zip(written, sorted(damages)):
        assert uri.endswith(f"nested/a/part-00001/512/{row:06d}-{keys[row]}.png")
        with Image.open(uri) as picture:
            assert picture.width == 640 and picture.height > 3 * 300  # three stacked panels
