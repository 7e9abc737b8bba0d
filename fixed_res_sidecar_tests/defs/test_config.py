"""The datasets file: defaults, relative paths, and bad configuration refused with dataset and field named."""

import dataclasses
import importlib.util
from pathlib import Path

import dagster as dg
import pytest
import yaml

from fixed_res_sidecar.core import pixel_settings
from fixed_res_sidecar.core.geometry import AREA_512, AREA_1024
from fixed_res_sidecar.core.pixel_settings import BACKGROUND_CHANNEL, OUTPUT_FORMATS, SETTING_BOUNDS, PixelOptions
from fixed_res_sidecar.core.resolutions import RESOLUTIONS
from fixed_res_sidecar.defs import config as config_module
from fixed_res_sidecar.defs.config import (
    DATASETS_ENV,
    ConfigError,
    datasets_file,
    load_config,
    parse_config,
)
from fixed_res_sidecar.defs.names import RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar_tests.fixtures import REPO_ROOT
from fixed_res_sidecar_tests.fixtures.pixels import bound_edges


def entry(**fields) -> dict:
    base = {"name": "laion", "main_prefix": "/data/laion/main", "output_root": "/data/laion/out"}
    base.update(fields)
    return base


def refused(*datasets, **top) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config({"datasets": list(datasets), **top}, source="datasets.yaml")
    return str(info.value)


REPO_DATASETS_FILE = REPO_ROOT / "datasets.yaml"


def test_repo_sample_config_loads_with_paths_relative_to_the_file():
    config = load_config(REPO_DATASETS_FILE)
    sample = config.dataset("sample")
    repo = REPO_ROOT
    assert sample.main.uri == str(repo / "sidecar-demo" / "main" / "sample")
    assert sample.output("resized_512").uri == str(repo / "sidecar-demo/out/0_262mp_version_all_in_one/sample")
    assert sample.output("reports").uri == str(repo / "sidecar-demo/out/verifier_reports/sample")


def test_env_var_chooses_the_datasets_file(tmp_path, monkeypatch):
    file = tmp_path / "mine.yaml"
    file.write_text(yaml.safe_dump({"datasets": [entry(name="mine", main_prefix="m", output_root="o")]}))
    monkeypatch.setenv(DATASETS_ENV, str(file))
    assert datasets_file() == file
    config = load_config()
    assert config.dataset("mine").main.uri == str(tmp_path / "m")
    monkeypatch.delenv(DATASETS_ENV)
    monkeypatch.chdir(tmp_path)  # without the variable: datasets.yaml in the current folder
    assert datasets_file() == tmp_path / "datasets.yaml"
    with pytest.raises(ConfigError, match=f"no such datasets file; set {DATASETS_ENV}"):
        load_config()


def test_defaults_outputs_and_pixel_options():
    config = parse_config(
        {
            "defaults": {"quality": 90, "limits": {"max_aspect_ratio": 4}, "run_resources": {"cpu": 2}},
            "datasets": [
                entry(),
                entry(
                    name="coco",
                    main_prefix="s3://bucket/coco/main",
                    output_root=None,
                    outputs={
                        "resized_512": "s3://bucket/coco/512",
                        "resized_1024": "s3://bucket/coco/1024",
                        "crop_bbox": "s3://bucket/coco/crop",
                        "reports": "s3://bucket/coco/reports",
                    },
                    quality=80,
                    limits={"min_source_side": 64},
                ),
            ],
        }
    )
    laion, coco = config.datasets
    assert laion.output("resized_512").uri == "/data/laion/out/0_262mp_version_all_in_one/laion"
    assert laion.output("resized_1024").uri == "/data/laion/out/1_05mp_version_all_in_one/laion"
    assert laion.output("crop_bbox").uri == "/data/laion/out/crop_bbox_sidecar/laion"
    assert laion.resized("512").area == AREA_512 and laion.resized("1024").area == AREA_1024
    assert (
        laion.resized("512").audit_prefix == "0_26mp_process" and laion.resized("1024").audit_prefix == "1_05mp_process"
    )
    options = laion.pixel_options()
    assert (options.quality, options.max_aspect_ratio, options.patch_size, options.output_format) == (90, 4, 32, "webp")
    assert laion.run_resources.cpu == 2 and laion.run_resources.memory_gb == 4
    # A dataset's own values win over the defaults, nested sections merge one level deep.
    assert coco.quality == 80
    assert (coco.limits.min_source_side, coco.limits.max_aspect_ratio) == (64, 4)
    assert coco.output("resized_1024").uri == "s3://bucket/coco/1024"
    assert coco.layout.report_location("overlays").uri == "s3://bucket/coco/reports/overlays"


@pytest.mark.parametrize(
    "output",
    ["/data/laion/main", "/data/laion/main/resized", "/data/laion", "/"],
    ids=["at", "inside", "above", "root"],
)
def test_output_at_inside_or_above_main_is_refused_naming_dataset_and_field(output):
    message = refused(entry(outputs={"resized_1024": output}))
    assert "dataset 'laion', field 'outputs.resized_1024'" in message
    assert "/data/laion/main" in message and "read-only" in message


def test_s3_output_inside_main_is_refused():
    message = refused(entry(main_prefix="s3://b/ds/main", output_root="s3://b/ds/main/out"))
    for field in ("resized_512", "resized_1024", "crop_bbox", "reports"):
        assert f"dataset 'laion', field 'outputs.{field}'" in message


def test_outputs_that_overlap_each_other_or_the_captions_are_refused():
    message = refused(
        entry(
            caption_prefix="/data/laion/captions",
            outputs={
                "crop_bbox": "/data/laion/out/0_262mp_version_all_in_one/laion/crop",
                "reports": "/data/laion/captions/r",
            },
        )
    )
    assert "field 'outputs.crop_bbox'" in message and "the resized_512 output" in message
    assert "field 'outputs.reports'" in message and "caption dataset" in message


def test_output_inside_another_datasets_main_or_outputs_is_refused():
    message = refused(
        entry(name="a", main_prefix="/d/a/main", output_root="/d/a/out"),
        entry(
            name="b",
            main_prefix="/d/b/main",
            output_root=None,
            outputs={
                "resized_512": "/d/a/main/x",
                "resized_1024": "/d/a/out",
                "crop_bbox": "/d/b/c",
                "reports": "/d/b/r",
            },
        ),
    )
    assert "dataset 'b', field 'outputs.resized_512'" in message and "main dataset of dataset 'a'" in message
    assert "dataset 'b', field 'outputs.resized_1024'" in message and "of dataset 'a'" in message


def test_duplicate_names_are_refused():
    message = refused(entry(), entry(main_prefix="/other/main", output_root="/other/out"))
    assert "dataset 'laion', field 'name'" in message and "unique" in message


@pytest.mark.parametrize("name", ["my-data", "9lives", "with space", "a/b", "", "x" * 64])
def test_names_dagster_cannot_use_are_refused(name):
    message = refused(entry(name=name))
    assert "field 'name'" in message


@pytest.mark.parametrize(
    "fields, field, words",
    [
        ({"quality": 101}, "quality", "less than or equal to 100"),
        ({"webp_method": 7}, "webp_method", "less than or equal to 6"),
        ({"patch_size": 0}, "patch_size", "greater than 0"),
        ({"output_format": "gif"}, "output_format", "webp"),
        ({"limits": {"max_aspect_ratio": 0.5}}, "limits.max_aspect_ratio", "greater than or equal to 1"),
        ({"limits": {"max_source_pixels": -1}}, "limits.max_source_pixels", "greater than 0"),
        ({"background": [0, 0, 300]}, "background", "0..255"),
        ({"run_resources": {"cpu": 0}}, "run_resources.cpu", "greater than 0"),
        ({"sensor": {"interval_seconds": 1}}, "sensor.interval_seconds", "greater than or equal to 5"),
        ({"sensor": {"default_status": "on"}}, "sensor.default_status", "running"),
        ({"automation": {"interval_seconds": 4}}, "automation.interval_seconds", "greater than or equal to 5"),
        ({"verify_sample": -1}, "verify_sample", "greater than or equal to 0"),
        ({"caption_frame": "upside_down"}, "caption_frame", "oriented"),
        ({"bbox_keys": []}, "bbox_keys", "at least one"),
        ({"qualty": 90}, "qualty", "Extra inputs are not permitted"),
        ({"main_prefix": "http://example.com/x"}, "main_prefix", "only local paths and s3://"),
        ({"main_prefix": "s3://b/x/../y"}, "main_prefix", "'..'"),
        ({"audit_prefix_1024": "0_26mp_process"}, "(the entry itself)", "must differ"),
        ({"output_root": None}, "(the entry itself)", "output_root"),
    ],
)
def test_bad_fields_are_refused_naming_dataset_and_field(fields, field, words):
    message = refused(entry(**fields))
    assert f"dataset 'laion', field '{field}'" in message
    assert words in message


@pytest.mark.parametrize("name", list(SETTING_BOUNDS))
def test_pixel_settings_are_refused_exactly_at_the_cores_bounds(name):
    """The file's limits are core.pixel_settings.SETTING_BOUNDS: what the pipeline and the command line
    accept, it accepts, and it refuses the rest before any work."""
    limits = name in LIMIT_FIELDS
    field = f"limits.{name}" if limits else name

    def dataset(value) -> dict:
        return entry(limits={name: value}) if limits else entry(**{name: value})

    inside, outside = bound_edges(SETTING_BOUNDS[name])
    for value in inside:
        options = parse_config({"datasets": [dataset(value)]}).datasets[0].pixel_options()
        assert getattr(options, name) == value
    for value in outside:
        assert f"dataset 'laion', field '{field}'" in refused(dataset(value)), value


def test_patch_size_4097_and_formats_are_the_cores():
    assert "dataset 'laion', field 'patch_size'" in refused(entry(patch_size=4097))
    assert parse_config({"datasets": [entry(patch_size=4096)]}).datasets[0].patch_size == 4096
    for output_format in OUTPUT_FORMATS:
        assert (
            parse_config({"datasets": [entry(output_format=output_format)]}).datasets[0].output_format == output_format
        )
    assert f"must be one of {sorted(OUTPUT_FORMATS)}" in refused(entry(output_format="gif"))
    inside, outside = bound_edges(BACKGROUND_CHANNEL)
    for value in inside:
        assert parse_config({"datasets": [entry(background=[value] * 3)]}).datasets[0].background == (value,) * 3
    for value in outside:
        assert "dataset 'laion', field 'background" in refused(entry(background=[0, value, 0])), value


def test_every_problem_is_listed_at_once():
    message = refused(entry(quality=500), entry(name="b-c", main_prefix="/x", output_root="/y"))
    assert "dataset 'laion', field 'quality'" in message
    assert "dataset 'b-c', field 'name'" in message


def test_a_dataset_without_a_usable_name_is_still_located():
    message = refused({"main_prefix": "/m", "output_root": "/o"})
    assert "dataset #1 (no valid name), field 'name'" in message


def test_file_problems_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="no such datasets file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("datasets: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("datasets: []\n")
    with pytest.raises(ConfigError, match="field 'datasets'"):
        load_config(empty)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just text\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(scalar)


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        # The second `quality` silently won: 80, not the 95 the reader sees first.
        ("datasets:\n  - name: a\n    main_prefix: /m\n    output_root: /o\n    quality: 95\n    quality: 80\n",
         "quality", (5, 6)),
        ("datasets:\n  - name: a\n    main_prefix: /m\n    output_root: /o\n"
         "    sensor: {interval_seconds: 60, interval_seconds: 5}\n", "interval_seconds", (5, 5)),
        ("datasets:\n  - {name: a, main_prefix: /m, output_root: /o}\n"
         "datasets:\n  - {name: b, main_prefix: /n, output_root: /p}\n", "datasets", (1, 3)),
    ],
    ids=["dataset field", "nested mapping", "top level"],
)  # fmt: skip
def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path, text, key, lines):
    """Reported: a duplicate key in the datasets file was accepted, the last value silently winning."""
    datasets = tmp_path / "datasets.yaml"
    datasets.write_text(text)
    with pytest.raises(
        ConfigError, match=rf"{datasets}: .*key '{key}' is given twice \(lines {lines[0]} and {lines[1]}\)"
    ):
        load_config(datasets)


def test_a_value_merged_in_with_a_yaml_merge_key_may_still_be_overridden(tmp_path):
    datasets = tmp_path / "datasets.yaml"
    datasets.write_text(
        "defaults: &common {quality: 90, main_prefix: /m}\n"
        "datasets:\n  - <<: *common\n    name: a\n    output_root: /o\n    quality: 80\n"
    )
    assert load_config(datasets).datasets[0].quality == 80


def test_relative_local_paths_resolve_against_the_file_not_the_cwd(tmp_path, monkeypatch):
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "d.yaml").write_text(yaml.safe_dump({"datasets": [entry(main_prefix="../data/main", output_root="out")]}))
    monkeypatch.chdir(Path("/"))
    dataset = load_config(folder / "d.yaml").datasets[0]
    assert dataset.main.uri == str(tmp_path / "data" / "main")
    assert dataset.output("crop_bbox").uri == str(folder / "out" / "crop_bbox_sidecar" / "laion")


PIXEL_FIELDS = {f.name for f in dataclasses.fields(PixelOptions)} - {"draft"}
LIMIT_FIELDS = {"max_source_pixels", "max_aspect_ratio", "min_source_side"}


def test_unset_pixel_settings_are_the_pipelines_defaults():
    laion = parse_config({"datasets": [entry()]}).datasets[0]
    assert laion.pixel_options() == PixelOptions()


def test_pixel_defaults_follow_core_pixels_when_it_changes(monkeypatch):
    """The config has no pixel defaults of its own: a new PixelOptions default (say the WebP method) reaches it."""

    @dataclasses.dataclass(frozen=True)
    class NewDefaults(PixelOptions):
        webp_method: int = 6
        quality: int = 90
        patch_size: int = 16
        max_aspect_ratio: float = 4.0

    monkeypatch.setattr(pixel_settings, "PixelOptions", NewDefaults)
    spec = importlib.util.spec_from_file_location("config_with_new_defaults", config_module.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    options = fresh.parse_config({"datasets": [entry()]}).datasets[0].pixel_options()
    assert options == NewDefaults()
    assert (options.webp_method, options.quality, options.patch_size, options.max_aspect_ratio) == (6, 90, 16, 4.0)


def test_repo_datasets_file_pins_no_pixel_default():
    raw = yaml.safe_load(REPO_DATASETS_FILE.read_text())
    for dataset in raw["datasets"]:
        assert not (PIXEL_FIELDS - LIMIT_FIELDS) & set(dataset), "pixel settings in datasets.yaml pin a default"
        assert not LIMIT_FIELDS & set(dataset.get("limits") or {})
    text = REPO_DATASETS_FILE.read_text()
    assert (
        f"# webp_method: {PixelOptions().webp_method} " in text
        and "default" in text.split("# webp_method:")[1].split("\n")[0]
    )


def test_audit_prefixes_areas_and_folders_come_from_core_resolutions():
    laion = parse_config({"datasets": [entry()]}).datasets[0]
    for name, resolution in RESOLUTIONS.items():
        output = laion.resized(name)
        assert (output.area, output.audit_prefix) == (resolution.area, resolution.audit_prefix)
        assert output.location.uri == f"/data/laion/out/{resolution.dataset_folder}/laion"
    assert DatasetKeys("laion").resized("1024") == dg.AssetKey(["laion", "resized_1024"])
    assert tuple(RESOLUTIONS) == RESOLUTION_NAMES
    with pytest.raises(ValueError, match="unknown resolution '2048'"):
        DatasetKeys("laion").verify("2048")


def test_a_local_main_prefix_that_is_a_file_is_named_a_file_not_missing(tmp_path):
    """Reported: the warning for a main path that is a file said it "does not exist"."""
    shard = tmp_path / "part-0.parquet"
    shard.write_bytes(b"PAR1")
    config = parse_config({"datasets": [entry(main_prefix=str(shard), output_root=str(tmp_path / "out"))]})
    problem = config.datasets[0].main_problem()
    assert problem is not None and f"{shard} is a file, not a folder" in problem
    assert "does not exist" not in problem
    missing = parse_config({"datasets": [entry(main_prefix=str(tmp_path / "gone"), output_root=str(tmp_path / "o"))]})
    assert f"{tmp_path / 'gone'} does not exist" in (missing.datasets[0].main_problem() or "")
