"""What a shard's materializations show besides their numbers: where the shard is and its size, its
overlay pictures and the pictures of rows failing fidelity (inline, as the UI renders markdown)."""

import base64

import dagster as dg

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.core.overlay import embeddable
from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.pipeline import ShardOutcome


def text_or_null(value: str | None) -> dg.MetadataValue:
    return dg.MetadataValue.null() if value is None else dg.MetadataValue.text(value)


def shard_metadata(location: Location, rel: str) -> dict[str, dg.MetadataValue]:
    size = location.size(rel)
    return {
        "dagster/uri": dg.MetadataValue.path(location.child(rel)),
        "bytes": dg.MetadataValue.int(size if size is not None else 0),
    }


def overlay_metadata(overlays: Location, outcome: ShardOutcome, embed: int) -> dict[str, dg.MetadataValue]:
    """The shard's overlay pictures: inline ones (WebP data URIs) and links to every full-size one."""
    if outcome.overlay_problem:
        return {"overlays": dg.MetadataValue.text(f"overlay pictures could not be drawn: {outcome.overlay_problem}")}
    if not outcome.overlays:
        return {}
    metadata: dict[str, dg.MetadataValue] = {
        "overlays": dg.MetadataValue.md(overlay_markdown(overlays, outcome.overlays, embed))
    }
    link = overlays.link(outcome.overlays[0].removeprefix(overlays.uri.rstrip("/") + "/"))
    metadata["overlay_full_size"] = dg.MetadataValue.url(link) if overlays.is_s3 else dg.MetadataValue.path(link)
    return metadata


def fidelity_picture_metadata(dataset: DatasetConfig, pictures: list[str] | str | None) -> dict[str, dg.MetadataValue]:
    """Expected | stored | difference pictures of a shard's rows failing fidelity, shown like the overlays:
    every one of them inline (at most the verifier's MAX_PROBLEMS rows; a local path is no use in a browser)."""
    if not pictures:
        return {}
    if isinstance(pictures, str):
        return {"pictures": dg.MetadataValue.text(f"comparison pictures could not be drawn: {pictures}")}
    location = dataset.layout.report_location("fidelity")
    return {"pictures": dg.MetadataValue.md(overlay_markdown(location, pictures, len(pictures)))}


def overlay_markdown(location: Location, uris: list[str], limit: int) -> str:
    """Overlay pictures as markdown: the first `limit` inline (data URIs), and a link to every full-size one."""
    lines = []
    root = location.uri.rstrip("/") + "/"
    for uri in uris[:limit]:
        rel = uri.removeprefix(root)
        try:
            picture = base64.b64encode(embeddable(location.read_bytes(rel))).decode("ascii")
            lines.append(f"**{rel}**\n\n![{rel}](data:image/webp;base64,{picture})\n")
        except Exception as exc:  # noqa: BLE001 - a picture that cannot be shown must not fail the asset
            lines.append(f"**{rel}**: cannot be shown ({describe_exception(exc, max_chars=300)})\n")
    lines.append("Full-size pictures:\n" + "\n".join(_picture_link(location, uri.removeprefix(root)) for uri in uris))
    return "\n".join(lines)


def _picture_link(location: Location, rel: str) -> str:
    link = location.link(rel)
    return f"- [{rel}]({link})" if link.startswith(("https://", "http://")) else f"- `{link}`"
