"""The datasets file: which main datasets the Dagster layer builds, and how.

One YAML file (the file named by the environment variable `SIDECAR_DATASETS`, else
`datasets.yaml` in the current folder) lists the datasets. It is validated with pydantic
when the definitions load, and refused as a whole, before any work, with one line per
problem naming the dataset and the field:

    datasets.yaml: dataset 'laion', field 'outputs.resized_512': output location
    /data/laion/main/x is at, inside or above the main dataset /data/laion/main; ...

Shape (every field but `name` and `main_prefix` has a default; see datasets.yaml):

    defaults:            # optional: merged into every dataset (a dataset's own values win)
      run_resources: {cpu: 2, memory_gb: 8}
    datasets:
      - name: sample                         # asset key prefix, group, partitions and job names
        main_prefix: sidecar-demo/main/sample   # read only: a folder or s3://bucket/prefix
        output_root: sidecar-demo/out        # or give every entry of `outputs` explicitly
        outputs:
          resized_512: ...                   # default <output_root>/0_262mp_version_all_in_one/<name>
          resized_1024: ...                  # default <output_root>/1_05mp_version_all_in_one/<name>
          crop_bbox: ...                     # default <output_root>/crop_bbox_sidecar/<name>
          reports: ...                       # default <output_root>/verifier_reports/<name>
        key_column: image_key
        ...

Defaults come from the code that uses them, not from literals here: the pixel settings
(patch_size, square, output_format, quality, webp_method, background, limits) from
`core.pixel_settings.PixelOptions`, the audit prefixes and resized dataset folders from
`core.resolutions.RESOLUTIONS`. A dataset that does not set one follows the code's default.
The bounds of the pixel settings and the output formats come from there too
(`core.pixel_settings.SETTING_BOUNDS`, `OUTPUT_FORMATS`): the file refuses exactly what the
pipeline and the command line refuse.

Relative local paths are taken relative to the folder holding the datasets file.
"""

import logging
import os
import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fixed_res_sidecar.core.bbox import CAPTION_FRAMES, DEFAULT_BBOX_KEYS
from fixed_res_sidecar.core.pixel_settings import BACKGROUND_CHANNEL, OUTPUT_FORMATS, SETTING_BOUNDS, PixelOptions
from fixed_res_sidecar.core.resolutions import RESOLUTIONS
from fixed_res_sidecar.io.locations import Location, LocationError, check_writable
from fixed_res_sidecar.shards.layout import DatasetLayout, ResizedOutput, resized_output
from fixed_res_sidecar.shards.verify import VerifyOptions

DATASETS_ENV = "SIDECAR_DATASETS"
DEFAULT_SHARDS_PER_RUN = 8  # measured: docs/performance.md, "Dagster at scale" (benchmarks --dagster-scale)
DEFAULT_DATASETS_FILE = "datasets.yaml"  # in the current folder, when SIDECAR_DATASETS is not set

# Dagster job, sensor and group names allow [A-Za-z0-9_]; asset keys and partition set names
# are derived from the dataset name too, so it is held to that and must start with a letter.
NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,62}$")
OUTPUT_NAMES = ("resized_512", "resized_1024", "crop_bbox", "reports")
DEFAULT_OUTPUT_FOLDERS = {
    "resized_512": RESOLUTIONS["512"].dataset_folder,
    "resized_1024": RESOLUTIONS["1024"].dataset_folder,
    "crop_bbox": "crop_bbox_sidecar",
    "reports": "verifier_reports",
}
# Every pixel setting defaults to the pipeline's own default (core.pixel_settings.PixelOptions), so a
# change of default there (e.g. the WebP method) reaches every dataset that does not set it.
_PIXEL_DEFAULTS = PixelOptions()


def _pixel_setting(name: str) -> Any:
    """The field of a numeric pixel setting: the pipeline's default, and its bound (SETTING_BOUNDS) for pydantic."""
    constraints: dict[str, Any] = SETTING_BOUNDS[name].field_constraints()  # Field's keyword arguments
    return Field(getattr(_PIXEL_DEFAULTS, name), **constraints)


class ConfigError(ValueError):
    """A datasets file that must not be used; the message names each dataset and field at fault."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _resolve_location(value: Any, info: ValidationInfo) -> str:
    """A location as given: s3:// URIs as they are, local paths made absolute (config-relative)."""
    if not isinstance(value, (str, os.PathLike)):
        # ValueError, not TypeError: pydantic turns only ValueError into a field error.
        raise ValueError(f"must be a local path or an s3:// URI, got {value!r}")
    text = os.fspath(value).strip()
    if not text:
        raise ValueError("must not be empty")
    if "://" not in text:
        base = (info.context or {}).get("base_dir")
        path = Path(text).expanduser()
        if not path.is_absolute() and base is not None:
            text = str(Path(base) / path)
    try:
        return Location.parse(text).uri
    except LocationError as exc:
        raise ValueError(str(exc)) from None


class OutputsConfig(_Strict):
    """Where each output dataset of one main dataset goes."""

    resized_512: str | None = None
    resized_1024: str | None = None
    crop_bbox: str | None = None
    reports: str | None = None  # verifier JSON reports and overlay pictures

    @field_validator(*OUTPUT_NAMES, mode="before")
    @classmethod
    def _location(cls, value: Any, info: ValidationInfo) -> str | None:
        return None if value is None else _resolve_location(value, info)


class LimitsConfig(_Strict):
    """Per-row source limits (SPEC 3): a row over a limit is audited with its error code."""

    max_source_pixels: int = _pixel_setting("max_source_pixels")
    max_aspect_ratio: float = _pixel_setting("max_aspect_ratio")
    min_source_side: int = _pixel_setting("min_source_side")


class RunResources(_Strict):
    """What one shard run needs; becomes run tags that run launchers and queues read."""

    cpu: float = Field(default=1, gt=0)
    memory_gb: float = Field(default=4, gt=0)


class SensorConfig(_Strict):
    """The shard discovery sensor of one dataset."""

    interval_seconds: int = Field(default=60, ge=5)
    default_status: Literal["running", "stopped"] = "stopped"
    # New shards added (and runs requested) per tick; the next tick continues from the cursor.
    max_new_shards_per_tick: int = Field(default=2000, ge=1, le=100_000)


class AutomationConfig(_Strict):
    """The automation sensor of one dataset (defs/automation.py): a verifier after a rebuilt shard, crop_bbox
    after a later verification."""

    # Seconds between its ticks: how soon a follow-up run starts after the run it follows.
    interval_seconds: int = Field(default=30, ge=5)


def _cron(value: str) -> str:
    if len(value.split()) != 5:
        raise ValueError(f"must be a cron schedule of five fields (minute hour day month weekday), got {value!r}")
    return value


class AuditConfig(_Strict):
    """When the dataset audit runs: on a schedule, and after the dataset's runs end (defs/audit_triggers.py)."""

    cron: str = "0 * * * *"  # hourly
    after_runs: bool = True  # within a minute of every run of the dataset that ends

    @field_validator("cron")
    @classmethod
    def _schedule(cls, value: str) -> str:
        return _cron(value)


class FidelitySweepConfig(_Strict):
    """The fidelity sweep (defs/fidelity_sweep.py): every hour, shards verified again, each verification
    comparing rows not compared before, within a CPU budget. Off until turned on."""

    default_status: Literal["running", "stopped"] = "stopped"
    cpu_seconds_per_hour: float = Field(default=600, gt=0)  # verifier CPU the sweep may spend per hour


class DatasetConfig(_Strict):
    """One main dataset and everything built from it."""

    name: str
    main_prefix: str
    key_column: str = "image_key"
    image_column: str = "image"
    caption_column: str = "structured_description"
    caption_prefix: str | None = None  # a caption dataset with the main's layout and keys
    caption_frame: Literal["oriented", "raw"] = "oriented"
    bbox_keys: tuple[str, ...] = DEFAULT_BBOX_KEYS
    output_root: str | None = None
    outputs: OutputsConfig = OutputsConfig()
    audit_prefix_512: str = RESOLUTIONS["512"].audit_prefix
    audit_prefix_1024: str = RESOLUTIONS["1024"].audit_prefix
    patch_size: int = _pixel_setting("patch_size")
    square: bool = _PIXEL_DEFAULTS.square
    output_format: str = _PIXEL_DEFAULTS.output_format  # one of core.pixel_settings.OUTPUT_FORMATS
    quality: int = _pixel_setting("quality")
    webp_method: int = _pixel_setting("webp_method")
    background: tuple[int, int, int] | None = _PIXEL_DEFAULTS.background  # composite transparency on this colour
    limits: LimitsConfig = LimitsConfig()
    threads_per_shard: int = Field(default=1, ge=1, le=256)
    # Shards one run builds (a backfill's runs and the discovery sensor's): fewer runs, less overhead
    # per shard; the shards of a run are built in parallel within run_resources.cpu.
    shards_per_run: int = Field(default=DEFAULT_SHARDS_PER_RUN, ge=1, le=1000)
    run_resources: RunResources = RunResources()
    sensor: SensorConfig = SensorConfig()
    automation: AutomationConfig = AutomationConfig()
    audit: AuditConfig = AuditConfig()
    fidelity_sweep: FidelitySweepConfig = FidelitySweepConfig()
    verify_sample: int = Field(default=32, ge=0)  # images decoded per shard and resolution
    # Rows compared with their source per verification, at most verify_sample: a window of rows not compared
    # before (docs/fidelity.md, "Rolling coverage and the sweep").
    fidelity_sample: int = Field(default=VerifyOptions().fidelity_sample or 8, ge=1)
    overlay_sample: int = Field(default=3, ge=0, le=50)  # overlay pictures drawn per shard (under reports)
    overlay_embed: int = Field(default=1, ge=0, le=10)  # of those, pictures inlined in the crop_bbox materialization

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError(
                f"{value!r} cannot name Dagster assets, groups, jobs and sensors: use letters, digits and "
                "underscores, starting with a letter (at most 63 characters)"
            )
        return value

    @field_validator("main_prefix", "output_root", "caption_prefix", mode="before")
    @classmethod
    def _location(cls, value: Any, info: ValidationInfo) -> str | None:
        return None if value is None else _resolve_location(value, info)

    @field_validator("key_column", "image_column", "caption_column", "audit_prefix_512", "audit_prefix_1024")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("bbox_keys")
    @classmethod
    def _bbox_keys(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or any(not k for k in value):
            raise ValueError("must name at least one non-empty JSON key")
        return value

    @field_validator("background")
    @classmethod
    def _colour(cls, value: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        if value is not None and not all(BACKGROUND_CHANNEL.admits(c) for c in value):
            raise ValueError(f"must be three values, each {BACKGROUND_CHANNEL.description}, got {list(value)}")
        return value

    @model_validator(mode="after")
    def _fill_outputs(self) -> "DatasetConfig":
        given = self.outputs.model_dump()
        missing = [name for name in OUTPUT_NAMES if given[name] is None]
        if missing:
            if self.output_root is None:
                raise ValueError(
                    f"outputs {missing} have no location: give them under 'outputs', or give 'output_root'"
                )
            root = Location.parse(self.output_root)
            for name in missing:
                given[name] = Location.parse(root.child(f"{DEFAULT_OUTPUT_FOLDERS[name]}/{self.name}")).uri
            object.__setattr__(self, "outputs", OutputsConfig.model_validate(given))
        if self.audit_prefix_512 == self.audit_prefix_1024:
            raise ValueError("audit_prefix_512 and audit_prefix_1024 must differ")
        return self

    @field_validator("caption_frame")
    @classmethod
    def _caption_frame(cls, value: str) -> str:
        if value not in CAPTION_FRAMES:  # the Literal above must follow core.bbox
            raise ValueError(f"must be one of {CAPTION_FRAMES}")
        return value

    @field_validator("output_format")
    @classmethod
    def _output_format(cls, value: str) -> str:
        if value not in OUTPUT_FORMATS:
            raise ValueError(f"must be one of {sorted(OUTPUT_FORMATS)}, got {value!r}")
        return value

    # -- what the Dagster layer uses --------------------------------------------------------

    @cached_property
    def layout(self) -> DatasetLayout:
        # _fill_outputs gave every output a location
        assert self.outputs.crop_bbox is not None and self.outputs.reports is not None
        return DatasetLayout(
            Location.parse(self.main_prefix),
            {
                name: resized_output(name, getattr(self.outputs, f"resized_{name}"), self.audit_prefix(name))
                for name in RESOLUTIONS
            },
            sidecar=Location.parse(self.outputs.crop_bbox),
            captions=Location.parse(self.caption_prefix) if self.caption_prefix else None,
            reports=Location.parse(self.outputs.reports),
            key_column=self.key_column,
            image_column=self.image_column,
            caption_column=self.caption_column,
            bbox_keys=self.bbox_keys,
            caption_frame=self.caption_frame,
        )

    @property
    def main(self) -> Location:
        return self.layout.main

    def main_problem(self) -> str | None:
        """Why this dataset's main cannot be listed at all, known without a request: a local folder
        that does not exist (listed, it would look empty, and every known shard removed), or a path that
        is not a folder (a file given for its folder)."""
        path = Path(self.main.path)
        if self.main.is_s3 or path.is_dir():
            return None
        what = "is a file, not a folder" if path.is_file() else "is not a folder" if path.exists() else "does not exist"
        return (
            f"dataset {self.name!r}, field 'main_prefix': {self.main.uri} {what} (a local main dataset "
            "is a folder of Parquet shards; for the repository's sample, run `sidecar-ops demo` first)"
        )

    def audit_prefix(self, resolution: str) -> str:
        return getattr(self, f"audit_prefix_{resolution}")

    def output(self, name: str) -> Location:
        """`resized_512`, `resized_1024`, `crop_bbox` or `reports`."""
        return self.layout.outputs()[name]

    def resized(self, resolution: str) -> ResizedOutput:
        """The resized output of resolution "512" or "1024": location, target area, audit prefix."""
        return self.layout.resized[resolution]

    def pixel_options(self) -> PixelOptions:
        return PixelOptions.from_values({**self.model_dump(), **self.limits.model_dump()})

    def verify_options(self) -> VerifyOptions:
        return VerifyOptions(
            pixels=self.pixel_options(), sample=self.verify_sample, fidelity_sample=self.fidelity_sample
        )


class SidecarConfig(_Strict):
    """The whole datasets file."""

    defaults: dict[str, Any] = Field(default_factory=dict)
    datasets: list[DatasetConfig] = Field(min_length=1)

    def dataset(self, name: str) -> DatasetConfig:
        for dataset in self.datasets:
            if dataset.name == name:
                return dataset
        raise KeyError(f"no dataset named {name!r}; the config has {[d.name for d in self.datasets]}")


# -- loading -------------------------------------------------------------------------------


def datasets_file() -> Path:
    """The datasets file in use: `$SIDECAR_DATASETS`, else `datasets.yaml` in the current folder."""
    return Path(os.environ.get(DATASETS_ENV) or DEFAULT_DATASETS_FILE).expanduser().resolve()


def load_config(path: str | os.PathLike | None = None) -> SidecarConfig:
    """Read and validate a datasets file; raises ConfigError naming every dataset and field at fault."""
    file = Path(path).expanduser().resolve() if path is not None else datasets_file()
    try:
        raw = yaml.load(file.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader
    except FileNotFoundError:
        raise ConfigError(
            f"{file}: no such datasets file; set {DATASETS_ENV} to the datasets file to use "
            "(or run from the folder holding datasets.yaml)"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML: {exc}") from None
    return parse_config(raw, base_dir=file.parent, source=str(file))


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML forbids it; PyYAML would
    silently keep the last value). A value merged in with `<<:` may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key!r} is given twice (lines {first_line[key]} and {line})",
                        key_node.start_mark,
                    )
                first_line[key] = line
            except TypeError:  # an unhashable key: the safe loader refuses it itself
                continue
        return super().construct_mapping(node, deep=deep)


def load_code_location_config() -> SidecarConfig:
    """The datasets file as the code location loads it: a file that is not valid is refused whole.

    A dataset whose local main folder does not exist is not invalid configuration (a mount may come
    late, the demo may not have run yet): it loads with the others and fails alone, visibly. A
    warning names it at load, and each tick of its discovery sensor fails with `main_problem`,
    until the folder exists; then it works without reloading the code location.
    """
    config = load_config()
    for dataset in config.datasets:
        if problem := dataset.main_problem():
            # Logged: `dagster dev`, its code server and `dagster definitions validate` show it (they hide warnings).
            logging.getLogger(__name__).warning(f"{datasets_file()}: {problem}; the other datasets load as usual")
    return config


def parse_config(raw: Any, base_dir: str | os.PathLike | None = None, source: str = "datasets config") -> SidecarConfig:
    """Validate an already parsed datasets document (relative paths against `base_dir`)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: expected a mapping with a 'datasets' list, got {type(raw).__name__}")
    raw = dict(raw)
    defaults = raw.get("defaults") or {}
    datasets = raw.get("datasets")
    if isinstance(defaults, Mapping) and isinstance(datasets, list):
        raw["datasets"] = [_merged(defaults, d) if isinstance(d, Mapping) else d for d in datasets]
    context = {"base_dir": str(base_dir) if base_dir is not None else os.getcwd()}
    try:
        config = SidecarConfig.model_validate(raw, context=context)
    except ValidationError as exc:
        raise ConfigError(_format_errors(source, raw, exc)) from None
    problems = _cross_checks(config)
    if problems:
        raise ConfigError(f"{source}: invalid configuration:\n" + "\n".join(f"  {p}" for p in problems))
    return config


def _merged(defaults: Mapping[str, Any], dataset: Mapping[str, Any]) -> dict[str, Any]:
    """`dataset` over `defaults`, one level of nested mappings deep (outputs, limits, sensor, ...)."""
    merged = dict(defaults)
    for key, value in dataset.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _dataset_label(raw: Mapping[str, Any], index: int) -> str:
    try:
        entry = raw["datasets"][index]
        name = entry.get("name") if isinstance(entry, Mapping) else None
    except (KeyError, IndexError, TypeError):
        name = None
    return f"dataset {name!r}" if isinstance(name, str) and name else f"dataset #{index + 1} (no valid name)"


def _format_errors(source: str, raw: Mapping[str, Any], exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        loc = list(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if len(loc) >= 2 and loc[0] == "datasets" and isinstance(loc[1], int):
            where = _dataset_label(raw, loc[1])
            field = ".".join(str(p) for p in loc[2:]) or "(the entry itself)"
            lines.append(f"{where}, field {field!r}: {message}")
        else:
            lines.append(f"field {'.'.join(str(p) for p in loc) or '(top level)'!r}: {message}")
    return f"{source}: invalid configuration:\n" + "\n".join(f"  {line}" for line in lines)


def _cross_checks(config: SidecarConfig) -> list[str]:
    """Checks across fields and datasets: names, and every output against every input and output."""
    problems = []
    seen: dict[str, int] = {}
    for index, dataset in enumerate(config.datasets):
        if dataset.name in seen:
            problems.append(
                f"dataset {dataset.name!r}, field 'name': the name is used by datasets #{seen[dataset.name] + 1} "
                f"and #{index + 1}; names must be unique (they name asset keys, groups and partitions)"
            )
        seen.setdefault(dataset.name, index)
        for name, message in dataset.layout.location_problems():
            problems.append(f"dataset {dataset.name!r}, field 'outputs.{name}': {message}")
    # Across datasets: nothing is written into another dataset's main, captions or outputs.
    for index, dataset in enumerate(config.datasets):
        others = []
        for other in config.datasets[:index] + config.datasets[index + 1 :]:
            others += [
                (f"{what} of dataset {other.name!r}", location) for what, location in other.layout.described_read_only()
            ]
        for other in config.datasets[:index]:  # each pair of outputs once
            others += [
                (f"outputs.{name} of dataset {other.name!r}", location)
                for name, location in other.layout.outputs().items()
            ]
        for name, output in dataset.layout.outputs().items():
            try:
                check_writable(output, others, what="the output")
            except LocationError as exc:
                problems.append(f"dataset {dataset.name!r}, field 'outputs.{name}': {exc}")
    return problems
