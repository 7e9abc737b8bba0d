"""shards/overlay.py: which rows get overlay pictures, and where the pictures go."""

from pathlib import Path

import pytest
from PIL import Image

from fixed_res_sidecar.io.locations import Location, LocationError
from fixed_res_sidecar.shards.crop_bbox import build_crop_bbox_shard
from fixed_res_sidecar.shards.overlay import write_overlays
from fixed_res_sidecar_tests.fixtures.datasets import DAMAGED_REL as REL
from fixed_res_sidecar_tests.fixtures.datasets import column, rewrite_shard


def test_pictures_of_sampled_rows_go_under_the_shard_stem(sidecar_build, tmp_path):
    overlays = Location.parse(tmp_path / "overlays")
    for rel in sidecar_build.main.list_shards():
        written = write_overlays(sidecar_build.layout(), rel, overlays, sample=4)
        assert len(written) == 4
        assert written == write_overlays(sidecar_build.layout(), rel, overlays, sample=4)  # the same rows every run
        for path in written:
            assert Path(path).parent == tmp_path / "overlays" / rel.removesuffix(".parquet")
            assert Image.open(path).format == "PNG"


def test_overlays_are_not_drawn_for_rows_whose_resize_was_invalid(sidecar_build, tmp_path):
    # Without captions no row has crop boxes: overlays fall back to rows valid at both resolutions.
    rewrite_shard(sidecar_build.main, REL, lambda t: t.drop_columns(["structured_description"]))
    build_crop_bbox_shard(sidecar_build.layout(), REL)
    written = write_overlays(sidecar_build.layout(), REL, Location.parse(tmp_path / "overlays"), sample=100)
    drawn = sorted(int(Path(path).name.split("-")[0]) for path in written)
    valid_512 = column(sidecar_build.r512, REL, "0_26mp_process_valid")
    valid_1024 = column(sidecar_build.r1024, REL, "1_05mp_process_valid")
    valid = [i for i, (a, b) in enumerate(zip(valid_512, valid_1024)) if a and b]
    assert drawn == valid and len(valid) < 10


def test_pictures_never_land_in_main(sidecar_build):
    with pytest.raises(LocationError):
        write_overlays(sidecar_build.layout(), REL, Location.parse(Path(sidecar_build.main.path, "overlays")), sample=1)
    assert not Path(sidecar_build.main.path, "overlays").exists()
