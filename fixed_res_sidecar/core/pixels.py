"""The per-image pixel pipeline (SPEC section 4): encoded bytes in, encoded bytes and audit out.

One call decodes a source image once and renders every requested target area from that
decode. Pure: no storage, no Dagster, no global state beyond a small cache of colour
transforms (a memory budget is passed in). Bad input never raises; it becomes an invalid `AuditRecord` with an error code.

How one image goes through (`process_image`), and where each step lives:

1. Open lazily and read only the header (core/decoding.py): format, mode, size, frame count
   (capped at MAX_COUNTED_FRAMES), EXIF orientation. The source limits (pixel count, smallest
   side, aspect ratio, encoder side limit) are checked here, before any pixel is decoded. A
   single-scan JPEG is opened so that compressed data cut short is reported (`decode_stream`).
2. Decode once, holding the estimated decode memory from the shard's budget when one is
   given (`decode_memory_estimate`). A JPEG is decoded with shrink-on-load (`draft`) when
   every output is small enough that the reduced decode still holds at least its resolution.
3. Normalise the mode (core/colour.py): palette, 1-bit, 16-bit and odd modes become L, LA, RGB,
   RGBA or CMYK; a fully opaque alpha is dropped; real alpha is premultiplied once for resampling.
4. Per output, largest first (core/render.py): one Lanczos resample of the crop box in the raw
   (unrotated) frame, from the decoded image or, for a much smaller output, from a larger output
   already made; then, on the small output, colour conversion to sRGB, alpha handling and the
   EXIF transpose; then encode with the settings of core/pixel_settings.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from PIL import Image

from .audit import AuditRecord, ErrorCode
from .colour import PREMULTIPLIED, UnsupportedMode, colour_conversion, normalise_mode
from .decoding import (
    DRAFT_FORMATS,
    apply_draft,
    decode_memory_estimate,
    decode_stream,
    draft_factor,
    exif_readable_before_decode,
    frame_count,
    open_image,
    too_many_pixels,
)
from .errors import describe_exception
from .geometry import Geometry, geometry
from .memory import MemoryBudget
from .orientation import oriented_size, read_orientation
from .pixel_settings import ENCODER_MAX_SIDE, PixelOptions, is_integer
from .render import Decoded, Intermediates, encode_output, finish, resample


@dataclass
class ImageResult:
    record: AuditRecord  # every field filled as SPEC 5 says
    image: bytes | None  # encoded output, None when record.valid is False or nothing was encoded
    # The finished image the encoder would be given, kept instead of encoding when `encode` is False.
    finished: Image.Image | None = None


class _RowError(Exception):
    """A per-row failure with its audit error code (and the output geometry when known)."""

    def __init__(self, code: ErrorCode, detail: str, target: Geometry | None = None) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.target = target


def process_image(
    data: bytes | None,
    areas: Sequence[int],
    options: PixelOptions,
    budget: MemoryBudget | None = None,
    encode: bool = True,
) -> list[ImageResult]:
    """One decode feeds every target area; returns one result per area, same order.

    `encode=False` keeps each valid result's finished image (`finished`) and encodes nothing: the
    verifier's reference pixels, which a lossless encode and decode would only give back unchanged
    (`out_bytes` is then None).

    Never raises for bad input: every failure is an invalid result carrying an error code,
    a detail text and whatever is known about the source. Raises ValueError for areas that
    are not positive integers (bad configuration).

    With a `budget` (shared by the threads of one shard), the image holds its estimated decode
    memory (`decode_memory_estimate`, from the header) from decoding until its outputs are
    made, waiting while other images hold too much; an image whose estimate exceeds the whole
    budget is `too_large` without being decoded.
    """
    areas = list(areas)
    bad_areas = [area for area in areas if not is_integer(area) or area <= 0]
    if bad_areas:  # configuration, not data: refuse loudly rather than fail every row
        raise ValueError(f"target areas must be positive integers, got {bad_areas}")
    known = AuditRecord()  # filled in as the source reveals itself; copied into each result
    try:
        source = _open(data, known, options)
        plans = [_plan(area, known, options) for area in areas]
        if not any(isinstance(plan, Geometry) for plan in plans):
            return [_invalid(known, plan) for plan in plans if isinstance(plan, _RowError)]  # that is, every plan
        draft = _planned_draft(source, plans, options)
        try:
            with _reserved(budget, decode_memory_estimate(source.image, draft)):
                decoded = _decode(source, known, draft)
                if source.orientation_read_late:
                    plans = [_plan(area, known, options) for area in areas]
                return _render_all(decoded, plans, known, options, encode)
        except _RowError as err:
            # Checks run in pipeline order: an output already refused keeps its own reason.
            return [_invalid(known, plan if isinstance(plan, _RowError) else err) for plan in plans]
    except _RowError as err:
        return [_invalid(known, err) for _ in areas]
    except Exception as exc:  # last line of defence: a bad row must never stop a shard
        err = _RowError(ErrorCode.DECODE_ERROR, describe_exception(exc))
        return [_invalid(known, err) for _ in areas]


@contextmanager
def _reserved(budget: MemoryBudget | None, nbytes: int) -> Iterator[None]:
    if budget is None:
        yield
        return
    if nbytes > budget.total:
        mib = 2**20
        raise _RowError(
            ErrorCode.TOO_LARGE,
            f"decoding needs about {nbytes / mib:,.0f} MiB, more than the shard's decode memory budget of "
            f"{budget.total / mib:,.0f} MiB (set by the task's memory)",
        )
    with budget.reserve(nbytes):
        yield


@dataclass
class _Source:
    image: Image.Image
    raw_size: tuple[int, int]  # as stored, before EXIF orientation
    orientation: int | None  # None until read
    orientation_read_late: bool = False  # read only after decoding (PNG keeps EXIF after the pixels)


def _open(data: bytes | None, known: AuditRecord, options: PixelOptions) -> _Source:
    if data is None or len(data) == 0:
        raise _RowError(ErrorCode.MISSING_IMAGE, "image bytes are null" if data is None else "image bytes are empty")
    try:
        image = open_image(decode_stream(data))
    except Image.DecompressionBombError as exc:
        raise _RowError(ErrorCode.TOO_LARGE, describe_exception(exc)) from None
    except Exception as exc:
        raise _RowError(ErrorCode.DECODE_ERROR, describe_exception(exc)) from None

    raw_w, raw_h = image.size
    known.src_format = image.format
    known.src_mode = image.mode
    known.n_frames, frames_note = frame_count(image, data)
    known.error_detail = frames_note  # a note on a valid row; an error replaces it
    source = _Source(image, (raw_w, raw_h), None)
    if exif_readable_before_decode(image):
        _set_orientation(source, known, read_orientation(image))
    else:
        known.src_width, known.src_height = raw_w, raw_h  # until the orientation is known

    if raw_w <= 0 or raw_h <= 0:
        raise _RowError(ErrorCode.DECODE_ERROR, f"image header gives an empty size {raw_w}x{raw_h}")
    # All three limits are invariant under EXIF rotation, so the raw size is enough.
    too_many = too_many_pixels(raw_w, raw_h, options.max_source_pixels)
    if too_many:
        raise _RowError(ErrorCode.TOO_LARGE, too_many)
    if min(raw_w, raw_h) < options.min_source_side:
        raise _RowError(
            ErrorCode.TOO_SMALL,
            f"source is {raw_w}x{raw_h}, its smaller side is below min_source_side={options.min_source_side}",
        )
    aspect = max(raw_w / raw_h, raw_h / raw_w)
    if aspect > options.max_aspect_ratio:
        limit = options.max_aspect_ratio
        raise _RowError(
            ErrorCode.ASPECT_RATIO,
            f"source is {raw_w}x{raw_h}, aspect ratio {aspect:.4g} exceeds max_aspect_ratio={limit:g}",
        )
    return source


def _set_orientation(source: _Source, known: AuditRecord, orientation: int) -> None:
    source.orientation = orientation
    known.exif_orientation = orientation
    known.src_width, known.src_height = oriented_size(source.raw_size, orientation)


def _plan(area: int, known: AuditRecord, options: PixelOptions) -> Geometry | _RowError:
    """The geometry of one output, or why it cannot be made. Needs no pixels."""
    assert known.src_width is not None and known.src_height is not None  # _open has set the source's size
    target = geometry(known.src_width, known.src_height, area, options.patch_size, options.square)
    limit = ENCODER_MAX_SIDE[options.output_format]
    tw, th = target.target_size
    if max(tw, th) > limit:
        return _RowError(
            ErrorCode.TOO_LARGE,
            f"output {tw}x{th} exceeds the {options.output_format} encoder limit of {limit} px per side",
            target,
        )
    return target


def _planned_draft(source: _Source, plans: list, options: PixelOptions) -> int:
    """The JPEG shrink-on-load factor to ask for (1: none), from the largest output's scale."""
    if not (options.draft and source.image.format in DRAFT_FORMATS and source.orientation is not None):
        return 1
    return draft_factor(max(plan.scale for plan in plans if isinstance(plan, Geometry)))


def _decode(source: _Source, known: AuditRecord, draft: int) -> Decoded:
    image = source.image
    draft_scale = apply_draft(image, draft) if draft > 1 else 1
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise _RowError(ErrorCode.TOO_LARGE, describe_exception(exc)) from None
    except Exception as exc:
        raise _RowError(ErrorCode.DECODE_ERROR, describe_exception(exc)) from None

    orientation = source.orientation
    if orientation is None:
        orientation = read_orientation(image)
        _set_orientation(source, known, orientation)
        source.orientation_read_late = True

    try:
        pixels = normalise_mode(image)
        colour = colour_conversion(image.info.get("icc_profile") or None, pixels.mode)
    except UnsupportedMode as exc:
        raise _RowError(ErrorCode.UNSUPPORTED, str(exc)) from None
    except Exception as exc:
        raise _RowError(ErrorCode.UNSUPPORTED, describe_exception(exc)) from None
    if pixels.mode in PREMULTIPLIED:
        # Resample with premultiplied alpha so transparent pixels do not bleed their colour.
        # Done once here rather than by Image.resize once per output.
        pixels = pixels.convert(PREMULTIPLIED[pixels.mode])
    return Decoded(pixels, source.raw_size, draft_scale, orientation, colour)


def _render_all(
    decoded: Decoded, plans: list, known: AuditRecord, options: PixelOptions, encode: bool
) -> list[ImageResult]:
    """One result per plan, same order; the largest outputs are made first so they can feed smaller ones."""
    results: list[ImageResult | None] = [None] * len(plans)
    intermediates: Intermediates = []
    by_scale = sorted(
        (i for i, plan in enumerate(plans) if isinstance(plan, Geometry)), key=lambda i: plans[i].scale, reverse=True
    )
    for i in by_scale:
        results[i] = _render(decoded, plans[i], known, options, intermediates, encode)
    return [result if result is not None else _invalid(known, plan) for result, plan in zip(results, plans)]


def _render(
    decoded: Decoded,
    target: Geometry,
    known: AuditRecord,
    options: PixelOptions,
    intermediates: Intermediates,
    encode: bool,
) -> ImageResult:
    try:
        resampled = resample(decoded, target, intermediates)
        finished, note = finish(resampled, decoded, options)
    except Exception as exc:
        return _invalid(known, _RowError(ErrorCode.UNSUPPORTED, describe_exception(exc), target))
    try:
        encoded = encode_output(finished, options) if encode else None
    except Exception as exc:
        return _invalid(known, _RowError(ErrorCode.ENCODE_ERROR, describe_exception(exc), target))
    record = _with_geometry(replace(known), target)
    record.valid = True
    record.error = None
    record.error_detail = "; ".join(n for n in (record.error_detail, note) if n) or None
    if encoded is None:
        return ImageResult(record, None, finished)
    record.out_bytes = len(encoded)
    return ImageResult(record, encoded)


def _invalid(known: AuditRecord, err: _RowError) -> ImageResult:
    record = replace(known, valid=False, error=err.code.value, error_detail=err.detail, out_bytes=None)
    if err.target is not None:
        record = _with_geometry(record, err.target)
    return ImageResult(record, None)


def _with_geometry(record: AuditRecord, target: Geometry) -> AuditRecord:
    record.width, record.height = target.target_size
    box = target.crop_box
    record.crop_x0, record.crop_y0, record.crop_x1, record.crop_y1 = box.x0, box.y0, box.x1, box.y1
    record.scale = target.scale
    return record
