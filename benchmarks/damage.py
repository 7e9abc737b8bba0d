"""Wrong pictures with the right structure: the damage the fidelity check must catch.

Each kind takes a stored output (decoded) and returns the picture a broken release or a bad
deploy could have written in its place. The benchmark measures their fidelity scores
(`python -m benchmarks --fidelity`) and the tests write them into real output shards
(re-encoded at the same size and format, page checksums valid). Both use this one list.
"""

from collections.abc import Callable

from PIL import Image

CROP_SHIFT = 0.04  # of the width (or height, for a tall image): "a crop shifted by a few percent"
HEAVY_QUALITY = 5  # re-compression quality (the shard's own format)


def rotated_180(image: Image.Image, **_) -> Image.Image:
    return image.transpose(Image.Transpose.ROTATE_180)


def flipped_horizontally(image: Image.Image, **_) -> Image.Image:
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)


def flipped_vertically(image: Image.Image, **_) -> Image.Image:
    return image.transpose(Image.Transpose.FLIP_TOP_BOTTOM)


def channels_reversed(image: Image.Image, **_) -> Image.Image:
    """RGB stored as BGR (alpha, if any, kept)."""
    bands = image.convert("RGBA" if "A" in image.getbands() else "RGB").split()
    return Image.merge("RGBA" if len(bands) == 4 else "RGB", (bands[2], bands[1], bands[0], *bands[3:]))


def black(image: Image.Image, **_) -> Image.Image:
    return Image.new("RGB", image.size, (0, 0, 0))


def constant(image: Image.Image, **_) -> Image.Image:
    """One flat colour: the picture's own mean (a blank that even has the right brightness)."""
    mean = image.convert("RGB").resize((1, 1), Image.Resampling.BOX).getpixel((0, 0))
    return Image.new("RGB", image.size, mean)


def crop_shifted(image: Image.Image, **_) -> Image.Image:
    """The crop window moved by CROP_SHIFT along the longer side (the exposed edge repeats its last pixels)."""
    width, height = image.size
    if width >= height:
        shift = max(1, round(width * CROP_SHIFT))
        return _extend(image.crop((shift, 0, width, height)), image.size)
    shift = max(1, round(height * CROP_SHIFT))
    return _extend(image.crop((0, shift, width, height)), image.size)


def _extend(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """`image` in the top-left of `size`, the strip left over filled with its own last column (or row)."""
    canvas = image.resize(size, Image.Resampling.NEAREST)  # the strip gets nearby pixels
    canvas.paste(image, (0, 0))
    return canvas


def wrong_row(image: Image.Image, *, other: Image.Image, **_) -> Image.Image:
    """Another row's output of the same shard, resized to this row's size."""
    return other.resize(image.size, Image.Resampling.LANCZOS)


def wrong_resolution(image: Image.Image, *, other_resolution: Image.Image, **_) -> Image.Image:
    """The same row's output of the other resolution, as it is (another size)."""
    return other_resolution


DAMAGE: dict[str, Callable[..., Image.Image]] = {
    "rotated_180": rotated_180,
    "flipped_horizontally": flipped_horizontally,
    "flipped_vertically": flipped_vertically,
    "channels_reversed": channels_reversed,
    "black": black,
    "constant": constant,
    "crop_shifted": crop_shifted,
    "wrong_row": wrong_row,
    "wrong_resolution": wrong_resolution,
    "heavy_recompression": lambda image, **_: image,  # the picture stays; the encoder quality drops
}


def encode_damaged(name: str, image: Image.Image, fmt: str, quality: int, **others) -> bytes:
    """Damage `name` applied to `image`, encoded in `fmt` ("webp", "jpeg", "png") at `quality`
    (HEAVY_QUALITY for heavy_recompression)."""
    import io

    damaged = DAMAGE[name](image, **others)
    if fmt == "jpeg" and damaged.mode not in ("RGB", "L"):
        damaged = damaged.convert("RGB")
    quality = HEAVY_QUALITY if name == "heavy_recompression" else quality
    out = io.BytesIO()
    if fmt == "png":
        damaged.save(out, "PNG")
    else:
        damaged.save(out, {"webp": "WEBP", "jpeg": "JPEG"}[fmt], quality=quality)
    return out.getvalue()
