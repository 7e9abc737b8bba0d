"""The floor pipeline: only the work no pipeline can avoid, the cheapest decode and the WebP encodes.

The pixels handed to the encoder are made outside the floor's timer, with the project's
crop box and Lanczos resize, so that the encoder gets the same content as in the fused build.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterable

from PIL import Image

from benchmarks.common import AREAS, PATCH, QUALITY
from fixed_res_sidecar.core.decoding import DRAFT_FORMATS, draft_factor
from fixed_res_sidecar.core.geometry import Geometry, geometry
from fixed_res_sidecar.core.orientation import oriented_size, read_orientation, to_upright
from fixed_res_sidecar.core.pixel_settings import REDUCING_GAP, RESAMPLE

PHASES = ("decode", "encode")


def cheapest_decode(data: bytes) -> tuple[Image.Image, int, list[Geometry]]:
    """Decode with the largest JPEG draft that still holds the 1024 output's resolution (the core's rule)."""
    image = Image.open(io.BytesIO(data))
    orientation = read_orientation(image)
    width, height = oriented_size(image.size, orientation)
    plans = [geometry(width, height, area, PATCH) for area in AREAS]
    if image.format in DRAFT_FORMATS:
        factor = draft_factor(max(plan.scale for plan in plans))
        if factor > 1:
            image.draft("RGB", (image.width // factor, image.height // factor))
    image.load()
    return image, orientation, plans


def resized_outputs(image: Image.Image, orientation: int, plans: list[Geometry]) -> list[Image.Image]:
    """Upright RGB outputs (Lanczos of the crop box) from a decoded, possibly drafted, raw image."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    image = to_upright(image, orientation)
    outputs = []
    for plan in plans:
        # The crop box is in full-size upright pixels; a draft decoded fewer.
        fx = image.width / plan.src_size[0]
        fy = image.height / plan.src_size[1]
        box = plan.crop_box
        box = (box.x0 * fx, box.y0 * fy, box.x1 * fx, box.y1 * fy)
        outputs.append(image.resize(plan.target_size, RESAMPLE, box=box, reducing_gap=REDUCING_GAP))
    return outputs


def encode_webp(image: Image.Image, method: int) -> bytes:
    out = io.BytesIO()
    image.save(out, "WEBP", quality=QUALITY, method=method)
    return out.getvalue()


def warm_up(data: bytes, method: int) -> None:
    image, orientation, plans = cheapest_decode(data)
    for output in resized_outputs(image, orientation, plans):
        encode_webp(output, method)


def run(images: Iterable[bytes], method: int) -> dict:
    """The floor over a shard's images: wall and CPU time of the decode and encode phases, output bytes per area."""
    wall, cpu = dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0)
    totals = [0] * len(AREAS)
    n = 0
    for data in images:
        n += 1
        c, w = time.process_time(), time.perf_counter()
        image, orientation, plans = cheapest_decode(data)
        wall["decode"] += time.perf_counter() - w
        cpu["decode"] += time.process_time() - c
        outputs = resized_outputs(image, orientation, plans)  # untimed: not part of the floor
        del image
        c, w = time.process_time(), time.perf_counter()
        encoded = [encode_webp(output, method) for output in outputs]
        wall["encode"] += time.perf_counter() - w
        cpu["encode"] += time.process_time() - c
        for i, data_out in enumerate(encoded):
            totals[i] += len(data_out)
    return {
        "wall": sum(wall.values()),
        "cpu": sum(cpu.values()),
        "phase_wall": wall,
        "phase_cpu": cpu,
        "images": n,
        "valid": n,
        "bytes": totals,
    }
