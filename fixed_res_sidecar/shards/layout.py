"""Where one dataset's shards live and how their columns are named: one value for every shard job.

The datasets file (Dagster) and the command line each build a `DatasetLayout` once; the
builders, the verifier and the overlays take it whole, so a shard job's arguments are the
layout, the shard's relative path and its own options.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from fixed_res_sidecar.core.bbox import CAPTION_FRAMES, DEFAULT_BBOX_KEYS
from fixed_res_sidecar.core.resolutions import RESOLUTIONS
from fixed_res_sidecar.io.locations import Location, LocationError, check_writable


@dataclass(frozen=True)
class ResizedOutput:
    """One resized dataset: where it goes, its target area and its audit column prefix."""

    location: Location
    area: int
    audit_prefix: str

    @property
    def resolution(self) -> str:
        """ "512" / "1024" for the two fixed areas, else the area as text."""
        return next((r.name for r in RESOLUTIONS.values() if r.area == self.area), str(self.area))


def resized_output(resolution: str, location: Location | str, audit_prefix: str | None = None) -> ResizedOutput:
    """The output of one of the fixed resolutions ("512", "1024"), default audit prefix unless given."""
    fixed = RESOLUTIONS[resolution]
    location = location if isinstance(location, Location) else Location.parse(location)
    return ResizedOutput(location, fixed.area, audit_prefix or fixed.audit_prefix)


@dataclass(frozen=True)
class DatasetLayout:
    """A main dataset, what is built from it, and the column names they share.

    `resized` maps a resolution name ("512", "1024") to its output; a layout may hold one
    (`build-0-262mp`) or both. `bbox_keys` and `caption_frame` left None mean SPEC 6's defaults
    when building, and what the sidecar recorded in its build settings when verifying.
    """

    main: Location
    resized: Mapping[str, ResizedOutput] = field(default_factory=dict)
    sidecar: Location | None = None
    captions: Location | None = None  # a caption dataset with main's layout and keys; None: main's own
    reports: Location | None = None  # verifier reports and overlay pictures
    key_column: str = "image_key"
    image_column: str = "image"
    caption_column: str = "structured_description"
    bbox_keys: tuple[str, ...] | None = None
    caption_frame: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "resized", dict(self.resized))  # a copy: the caller's dict may change
        if self.bbox_keys is not None:
            object.__setattr__(self, "bbox_keys", tuple(self.bbox_keys))
            if not self.bbox_keys or not all(self.bbox_keys):
                raise ValueError("bbox_keys must name at least one non-empty JSON key")
        if self.caption_frame is not None and self.caption_frame not in CAPTION_FRAMES:
            raise ValueError(f"caption_frame must be one of {CAPTION_FRAMES}, got {self.caption_frame!r}")
        prefixes = [o.audit_prefix for o in self.resized.values()]
        if len(set(prefixes)) != len(prefixes):
            raise ValueError(f"the resized outputs need distinct audit prefixes, got {prefixes}")

    @property
    def read_only(self) -> list[Location]:
        """Nothing is ever written at, inside or above these: main, and the caption dataset."""
        return [self.main, *([self.captions] if self.captions else [])]

    def described_read_only(self) -> list[tuple[str, Location]]:
        """`read_only` with what each is, for messages."""
        described = [("the read-only main dataset", self.main)]
        if self.captions is not None:
            described.append(("the read-only caption dataset", self.captions))
        return described

    @property
    def caption_source(self) -> Location:
        return self.captions or self.main

    @property
    def building_bbox_keys(self) -> tuple[str, ...]:
        return self.bbox_keys or DEFAULT_BBOX_KEYS

    @property
    def building_caption_frame(self) -> str:
        return self.caption_frame or CAPTION_FRAMES[0]

    def sidecar_location(self) -> Location:
        """`sidecar`, for what reads or writes the crop-bbox sidecar."""
        if self.sidecar is None:
            raise ValueError("this layout has no crop-bbox sidecar location")
        return self.sidecar

    def report_location(self, kind: str) -> Location:
        """Reports of one kind (`resized_512`, `resized_1024`, `crop_bbox`, `overlays`) under `reports`."""
        if self.reports is None:
            raise ValueError("this layout has no reports location")
        return Location.parse(self.reports.child(kind))

    def outputs(self) -> dict[str, Location]:
        """Name -> location of everything written: the resized datasets, the sidecar, the reports."""
        named = {f"resized_{name}": output.location for name, output in self.resized.items()}
        if self.sidecar is not None:
            named["crop_bbox"] = self.sidecar
        if self.reports is not None:
            named["reports"] = self.reports
        return named

    def location_problems(self) -> list[tuple[str, str]]:
        """(output name, message) for every output at, inside or above an input or another output."""
        readers = self.described_read_only()
        problems = []
        outputs = list(self.outputs().items())
        for index, (name, location) in enumerate(outputs):
            earlier = [(f"the {other} output", other_location) for other, other_location in outputs[:index]]
            try:
                check_writable(location, [*readers, *earlier], what=f"{name} location")
            except LocationError as exc:
                problems.append((name, str(exc)))
        return problems

    def check_locations(self) -> None:
        """Raise LocationError naming every output that overlaps an input or another output."""
        problems = self.location_problems()
        if problems:
            raise LocationError("; ".join(message for _, message in problems))
