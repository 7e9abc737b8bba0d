"""The two fixed resolutions and their conventional names (SPEC 1)."""

from dataclasses import dataclass

from fixed_res_sidecar.core.geometry import AREA_512, AREA_1024


@dataclass(frozen=True)
class Resolution:
    name: str  # "512" or "1024": how columns, metadata and flags refer to it
    area: int  # target image area in pixels
    audit_prefix: str  # default prefix of its audit columns
    dataset_folder: str  # conventional folder of its output dataset


RESOLUTION_512 = Resolution("512", AREA_512, "0_26mp_process", "0_262mp_version_all_in_one")
RESOLUTION_1024 = Resolution("1024", AREA_1024, "1_05mp_process", "1_05mp_version_all_in_one")
RESOLUTIONS: dict[str, Resolution] = {r.name: r for r in (RESOLUTION_512, RESOLUTION_1024)}
RESOLUTION_NAMES: tuple[str, ...] = tuple(RESOLUTIONS)  # ("512", "1024"), as asset names and flags spell them


def area_for_audit_prefix(audit_prefix: str) -> int | None:
    """The target area a default audit prefix stands for (None for a custom prefix)."""
    return next((r.area for r in RESOLUTIONS.values() if r.audit_prefix == audit_prefix), None)
