"""Build the crop-bbox sidecar of one main shard (SPEC 6).

Inputs, read column by column and streamed in batches (never the images): the key and
caption columns of the main shard (or of a caption dataset with the same layout and keys),
and the key and audit columns of the 512 and 1024 resized shards. The geometry comes from
the audits, so nothing is decoded. Output: the key column, the two crop captions and
`bbox_resize_meta`, row for row, written atomically.

A main shard without the caption column is not an error: every row's caption is then
`missing` (both crop columns null, the meta says so). A configured caption dataset must
have the column.
"""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fixed_res_sidecar.core.audit import AuditRecord, audit_columns, read_audit_records
from fixed_res_sidecar.core.bbox import (
    CROP_BBOX_VERSION,
    CROP_COLUMNS,
    META_COLUMN,
    AuditInconsistent,
    BoxCounts,
    CaptionStatus,
    RowResult,
    crop_captions_for_row,
)
from fixed_res_sidecar.core.keys import key_text, raw_key_values
from fixed_res_sidecar.core.resolutions import RESOLUTIONS
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.parquet import ShardError, iter_batches, open_shard, text_as_bytes
from fixed_res_sidecar.shards.layout import DatasetLayout
from fixed_res_sidecar.shards.settings import (
    encode_settings,
    read_settings,
    sidecar_sources,
    staleness,
)

BATCH_ROWS = 4096  # rows read per step; only keys, captions and audit numbers are held
OUTPUT_ROW_GROUP_ROWS = 16384


@dataclass
class CropBboxResult:
    rel: str
    status: str  # "built" or "skipped"
    rows: int
    # "captions": rows per caption status; "512" / "1024": rows the resize marked invalid
    # ("invalid_rows") plus box counts over the shard (total, inside, clipped, outside, malformed).
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: float = 0.0
    caption_column_missing: bool = False  # the main shard has no caption column: every caption is missing
    reason: str | None = None  # why it was built when skip-existing was on (shards/settings.py staleness)

    @property
    def built(self) -> bool:
        return self.status == "built"

    @property
    def status_text(self) -> str:
        if not self.built:
            return f"skipped ({self.rows} rows, up to date)"
        parts = []
        for name in RESOLUTIONS:
            c = self.counts[name]
            parts.append(
                f"{name}: {c['total']} boxes ({c['inside']} inside, {c['clipped']} clipped, "
                f"{c['outside']} outside, {c['malformed']} malformed), {c['invalid_rows']} invalid rows"
            )
        captions = self.counts["captions"]
        no_column = " (the main shard has no caption column)" if self.caption_column_missing else ""
        return (
            f"built ({self.rows} rows, {self.seconds:.1f} s; captions: {captions['ok']} ok, "
            f"{captions['missing']} missing{no_column}, {captions['invalid_json']} invalid; {'; '.join(parts)})"
        )


def crop_bbox_settings(layout: DatasetLayout, resized_settings: dict[str, Any]) -> dict[str, Any]:
    """Everything that decides the sidecar's bytes; skip-existing compares it.

    The resized shards' own recorded settings are included: when a resized shard is rebuilt
    differently (another patch size, a square crop), its sidecar is stale and gets rebuilt.
    """
    return {
        "kind": "crop_bbox",
        "version": CROP_BBOX_VERSION,
        "key_column": layout.key_column,
        "caption_column": layout.caption_column,
        "caption_location": layout.captions.uri if layout.captions else None,
        "audit_prefixes": {name: output.audit_prefix for name, output in layout.resized.items()},
        "bbox_keys": list(layout.building_bbox_keys),
        "caption_frame": layout.building_caption_frame,
        "resized_settings": resized_settings,
    }


@dataclass
class _Input:
    """One input shard and the columns read from it (the key column first)."""

    role: str  # "main", "caption", "resized 512", "resized 1024"
    uri: str  # of the shard
    shard: pq.ParquetFile
    columns: list[str]


def _open_input(role: str, location: Location, rel: str, columns: list[str], rows: int | None = None) -> _Input:
    return _Input(role, location.child(rel), open_shard(location, rel, role, columns=columns, rows=rows), columns)


class _Tally:
    """Shard totals for the result: caption statuses, invalid rows and boxes per resolution."""

    def __init__(self) -> None:
        self.captions = {status.value: 0 for status in CaptionStatus}
        self.invalid_rows = dict.fromkeys(RESOLUTIONS, 0)
        self.boxes = {name: BoxCounts() for name in RESOLUTIONS}

    def add(self, row: RowResult, audits: dict[str, AuditRecord]) -> None:
        self.captions[row.caption_status] += 1
        for name in RESOLUTIONS:
            if not audits[name].valid:
                self.invalid_rows[name] += 1
            counts = row.counts[name]
            if counts is not None:
                self.boxes[name].merge(counts)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "captions": dict(self.captions),
            **{name: {"invalid_rows": self.invalid_rows[name], **self.boxes[name].as_dict()} for name in RESOLUTIONS},
        }


def build_crop_bbox_shard(
    layout: DatasetLayout,
    rel: str,
    *,
    skip_existing: bool = False,
    gate: Callable[[str], None] | None = None,
) -> CropBboxResult:
    """Write `sidecar/rel`: the crop captions and `bbox_resize_meta` of every row of `main/rel`.

    Raises ShardError, naming the shard, when an input shard is missing, unreadable, lacks a
    column, or disagrees with the main shard in row count or keys. Nothing is written then (a
    mismatch found while streaming aborts the atomic write). A main shard without the caption
    column gives every row the caption status `missing`; a caption dataset without it is an error.

    `gate(rel)`, when given, runs once the inputs are open and the shard is not skipped as up
    to date, before anything is written; it raises (e.g. verify.GateError) to refuse the build.
    """
    started = time.monotonic()
    output = layout.sidecar
    if output is None or set(layout.resized) != set(RESOLUTIONS):
        raise ValueError(f"the crop sidecar needs a sidecar location and the resized outputs {list(RESOLUTIONS)}")
    layout.check_locations()
    key_column, caption_column = layout.key_column, layout.caption_column

    # The caption comes from the main shard unless a caption dataset is configured; a main
    # shard without the caption column has no captions (every row `missing`).
    main_input = _open_input("main", layout.main, rel, [key_column])
    captions_in_main = layout.captions is None and caption_column in main_input.shard.schema_arrow.names
    if captions_in_main:
        main_input.columns.append(caption_column)
    rows = main_input.shard.metadata.num_rows
    inputs = [main_input]
    if layout.captions is not None:
        inputs.append(_open_input("caption", layout.captions, rel, [key_column, caption_column], rows))
    for name in RESOLUTIONS:
        resized = layout.resized[name]
        audit_names = [f.name for f in audit_columns(resized.audit_prefix)]
        inputs.append(_open_input(f"resized {name}", resized.location, rel, [key_column, *audit_names], rows))
    caption_input: _Input | None = None  # None: no captions at all
    if layout.captions is not None:
        caption_input = inputs[1]
    elif captions_in_main:
        caption_input = main_input
    resized_inputs = dict(zip(RESOLUTIONS, inputs[-2:]))

    settings = crop_bbox_settings(layout, {name: read_settings(i.shard) for name, i in resized_inputs.items()})
    sources = sidecar_sources(layout, rel, main_input.shard)
    reason = staleness(output, rel, rows, settings, sources) if skip_existing else None
    if skip_existing and reason is None:
        return CropBboxResult(rel, "skipped", rows, seconds=time.monotonic() - started)
    if gate is not None:
        gate(rel)

    schema = pa.schema(
        [
            main_input.shard.schema_arrow.field(key_column),
            *(pa.field(CROP_COLUMNS[name], pa.string()) for name in RESOLUTIONS),
            pa.field(META_COLUMN, pa.string(), nullable=False),
        ],
        metadata=encode_settings(settings, sources),
    )
    tally = _Tally()
    main_uri = layout.main.child(rel)
    bbox_keys, caption_frame = layout.building_bbox_keys, layout.building_caption_frame
    with (
        output.write_atomic(rel, protect=[*layout.read_only, *(o.location for o in layout.resized.values())]) as tmp,
        pq.ParquetWriter(tmp, schema, compression="zstd", write_page_checksum=True) as writer,
    ):
        pending: list[pa.RecordBatch] = []
        pending_rows = row_offset = 0
        for batches in _aligned([iter_batches(i.shard, i.columns, i.uri, BATCH_ROWS) for i in inputs]):
            by_role = {i.role: batch for i, batch in zip(inputs, batches)}
            keys = by_role["main"].column(0)
            for source in inputs[1:]:
                _check_keys(keys, by_role[source.role].column(0), row_offset, main_uri, source)
            audits = {
                name: read_audit_records(pa.Table.from_batches([by_role[i.role]]), layout.resized[name].audit_prefix)
                for name, i in resized_inputs.items()
            }
            # As bytes: a caption that is not UTF-8 is that row's invalid_json (core.bbox.parse_caption).
            stored = by_role[caption_input.role].column(1) if caption_input else None
            captions = text_as_bytes(stored).to_pylist() if stored is not None else [None] * len(keys)
            try:
                columns = _crop_columns(keys, captions, audits, bbox_keys, caption_frame, tally)
            except AuditInconsistent as exc:
                audit_uris = ", ".join(i.uri for i in resized_inputs.values())
                raise ShardError(f"resized shards {audit_uris}, rows from {row_offset}: {exc}") from exc
            pending.append(pa.record_batch(columns, schema=schema))
            pending_rows += len(keys)
            row_offset += len(keys)
            if pending_rows >= OUTPUT_ROW_GROUP_ROWS:
                writer.write_table(pa.Table.from_batches(pending, schema), row_group_size=OUTPUT_ROW_GROUP_ROWS)
                pending, pending_rows = [], 0
        if pending:
            writer.write_table(pa.Table.from_batches(pending, schema), row_group_size=OUTPUT_ROW_GROUP_ROWS)
        if row_offset != rows:  # the footers agreed with each other, so a file is corrupt
            raise ShardError(f"{main_uri}: read {row_offset} rows, its footer says {rows}")
    return CropBboxResult(
        rel,
        "built",
        rows,
        tally.as_dict(),
        time.monotonic() - started,
        caption_column_missing=caption_input is None,
        reason=reason,
    )


def _crop_columns(
    keys: pa.Array,
    captions: list,
    audits: dict[str, list[AuditRecord]],
    bbox_keys: tuple[str, ...],
    caption_frame: str,
    tally: _Tally,
) -> list[pa.Array]:
    """The sidecar columns for one batch of rows: key, crop 512, crop 1024, meta."""
    crops: dict[str, list[str | None]] = {name: [] for name in RESOLUTIONS}
    metas = []
    for i, caption in enumerate(captions):
        row_audits = {name: audits[name][i] for name in RESOLUTIONS}
        try:
            row = crop_captions_for_row(caption, row_audits, bbox_keys, caption_frame)
        except AuditInconsistent as exc:
            (key,) = raw_key_values(keys.slice(i, 1))
            raise AuditInconsistent(f"key {key_text(key)!r}: {exc}") from exc
        tally.add(row, row_audits)
        for name in RESOLUTIONS:
            crops[name].append(row.crops[name])
        metas.append(row.meta_json())
    return [keys, *(pa.array(crops[name], pa.string()) for name in RESOLUTIONS), pa.array(metas, pa.string())]


def _aligned(sources: list[Iterator[pa.RecordBatch]]) -> Iterator[list[pa.RecordBatch]]:
    """Batches from every source covering the same rows (their row-group boundaries differ)."""
    held: list[pa.RecordBatch | None] = [None] * len(sources)
    while True:
        for i, source in enumerate(sources):
            while (batch := held[i]) is None or batch.num_rows == 0:
                held[i] = next(source, None)
                if held[i] is None:
                    break
        if all(batch is None for batch in held):
            return
        present = [batch for batch in held if batch is not None]
        if len(present) < len(held):
            raise ShardError("an input shard ended before the others (its footer row count is wrong)")
        n = min(batch.num_rows for batch in present)
        yield [batch.slice(0, n) for batch in present]
        held = [batch.slice(n) for batch in present]


def _check_keys(expected: pa.Array, actual: pa.Array, row_offset: int, main_uri: str, source: _Input) -> None:
    what = f"{source.role} shard {source.uri}"
    if not actual.type.equals(expected.type):
        try:
            actual = actual.cast(expected.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise ShardError(
                f"{what}: key column type {actual.type} does not match the main shard's {expected.type}"
            ) from exc
    if actual.equals(expected):
        return
    for i, (want, got) in enumerate(zip(raw_key_values(expected), raw_key_values(actual))):
        if want != got:
            raise ShardError(
                f"{what}: key at row {row_offset + i} is {key_text(got)!r}, the main shard {main_uri} has "
                f"{key_text(want)!r}"
            )
    raise ShardError(f"{what}: keys differ from the main shard {main_uri} near row {row_offset}")
