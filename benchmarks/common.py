"""What every benchmark pipeline shares: the project's target areas and output settings, the workdir, logging."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.core.resolutions import RESOLUTIONS

# The project's defaults, so that the naive and floor pipelines make the images the fused build makes.
AREAS = tuple(resolution.area for resolution in RESOLUTIONS.values())  # 512 area first: reports index bytes so
PATCH = PixelOptions().patch_size
QUALITY = PixelOptions().quality
DEFAULT_METHOD = PixelOptions().webp_method
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "fixed-res-sidecar-bench"


def log(*parts: Any) -> None:
    """Progress goes to stderr, so that stdout holds only the report."""
    print(*parts, file=sys.stderr, flush=True)
