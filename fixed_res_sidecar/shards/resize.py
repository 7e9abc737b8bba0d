"""Build the resized shards of one main shard (SPEC 2, 4, 5).

One decode per image feeds every requested resolution (the fused build). The main
shard is streamed by row group, images are resized on a thread pool with a bounded
number in flight, row order is kept, and each output is written atomically.

Memory: the images a shard decodes at once share one budget, DECODE_MEMORY_SHARE of the
task's memory (`--task-memory-gb`, or a dataset's `run_resources.memory_gb`): an image
waits until its estimated decode memory fits beside the others in flight, and one that
alone needs more than the whole budget is audited `too_large` (core/pixels.py). The rest
of the task's memory is for the process itself and the Parquet row groups it reads and writes.
After a large image, freed memory is handed back to the system (`_release_freed_memory`), so
the process's memory follows the budget rather than the sum of the largest images each
thread ever decoded.
"""

import contextlib
import ctypes
import dataclasses
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fixed_res_sidecar.core.audit import (
    AuditRecord,
    ErrorCode,
    audit_arrays,
    audit_columns,
)
from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.core.image_cell import BYTES_FIELD, is_image_type, output_image_type
from fixed_res_sidecar.core.memory import MemoryBudget
from fixed_res_sidecar.core.pixel_settings import PixelOptions, library_versions, pipeline_settings
from fixed_res_sidecar.core.pixels import ImageResult, process_image
from fixed_res_sidecar.io.parquet import ShardError, open_shard
from fixed_res_sidecar.shards.layout import DatasetLayout, ResizedOutput
from fixed_res_sidecar.shards.settings import FAILED_VERIFICATION, encode_settings, resized_sources, staleness

OUTPUT_ROW_GROUP_ROWS = 64  # about 10-30 MB of WebP per row group at 1024-area
SOURCE_BATCH_ROWS = 8  # source images turned into Python bytes at a time
# Bump when a code change alters output bytes or columns: skip-existing then rebuilds. Not the
# package version, which would rebuild billions of images for unrelated releases.
# 2: page checksums; 3: audit columns read from a header are int64.
RESIZE_OUTPUT_VERSION = 3
DEFAULT_TASK_MEMORY_GB = 4.0
DECODE_MEMORY_SHARE = 0.5  # of the task's memory, for decoded images in flight
GIB = 2**30
# After a row that decoded about this many bytes, freed memory is handed back (see _release_freed_memory).
RELEASE_AFTER_DECODED_BYTES = 64 * 2**20
# Rows refused before any pixel was decoded.
NOT_DECODED = frozenset(
    code.value for code in (ErrorCode.MISSING_IMAGE, ErrorCode.TOO_LARGE, ErrorCode.TOO_SMALL, ErrorCode.ASPECT_RATIO)
)


@dataclass
class OutputSummary:
    audit_prefix: str
    uri: str
    status: str  # "built" or "skipped"
    reason: str | None = None  # why it was built when skip-existing was on (shards/settings.py staleness)
    valid: int = 0
    error_counts: dict[str, int] = field(default_factory=dict)


@dataclass
class ShardResult:
    rel: str
    rows: int
    outputs: list[OutputSummary]
    seconds: float
    sources: dict[str, Any] = field(default_factory=dict)  # the fingerprints its outputs record (settings.py)

    @property
    def built(self) -> bool:
        return any(o.status == "built" for o in self.outputs)

    @property
    def status_text(self) -> str:
        parts = [f"{o.status} {o.audit_prefix}" for o in self.outputs]
        return f"{', '.join(parts)} ({self.rows} rows, {self.seconds:.1f} s)"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_settings(output: ResizedOutput, options: PixelOptions, key_column: str, image_column: str) -> dict[str, Any]:
    """Everything that decides an output shard's bytes (compared by skip-existing)."""
    return {
        "target_area": output.area,
        "audit_prefix": output.audit_prefix,
        "key_column": key_column,
        "image_column": image_column,
        **pipeline_settings(),
        **dataclasses.asdict(options),
        "versions": {"resize_output": RESIZE_OUTPUT_VERSION, **library_versions()},
    }


@dataclass(frozen=True)
class ResizeTargets:
    """Which resized outputs of a layout one shard's build writes: those of `resolutions` (None: all of
    them), less those that skip-existing finds up to date (SPEC 2), except the resolutions in `rebuild`
    (their verifier failed them: repairing failed shards, `shards.verify.still_failed`)."""

    resolutions: tuple[str, ...] | None = None
    skip_existing: bool = False
    rebuild: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Any sequence given (a list of command-line values) is kept as a tuple: the targets stay frozen.
        if self.resolutions is not None:
            object.__setattr__(self, "resolutions", tuple(self.resolutions))
        object.__setattr__(self, "rebuild", tuple(self.rebuild))


def build_resized_shard(
    layout: DatasetLayout,
    rel: str,
    *,
    targets: ResizeTargets = ResizeTargets(),
    options: PixelOptions = PixelOptions(),
    threads: int = 1,
    memory_gb: float = DEFAULT_TASK_MEMORY_GB,
    on_rows: Callable[[int], None] | None = None,
) -> ShardResult:
    """Resize every image of `main/rel` into the resized outputs of `layout` that `targets` name,
    from one decode per image; returns what was done.

    `memory_gb` is the memory of the task running this shard; its images decode within
    `decode_budget_bytes(memory_gb)` (see the module's docstring)."""
    started = time.monotonic()
    names = targets.resolutions if targets.resolutions is not None else layout.resized
    outputs = [layout.resized[name] for name in names]
    if not outputs:
        raise ValueError("at least one output is required")
    layout.check_locations()
    source = _open_main_shard(layout, rel)
    rows = source.metadata.num_rows
    sources = resized_sources(layout, rel, source)
    settings = {o: build_settings(o, options, layout.key_column, layout.image_column) for o in outputs}
    skip_existing = targets.skip_existing
    reasons = {o: staleness(o.location, rel, rows, settings[o], sources) if skip_existing else None for o in outputs}
    for name in targets.rebuild:
        output = layout.resized[name]
        if skip_existing and output in reasons and reasons[output] is None:
            reasons[output] = FAILED_VERIFICATION
    todo = [o for o in outputs if not skip_existing or reasons[o] is not None]
    summaries = {
        o: OutputSummary(o.audit_prefix, o.location.child(rel), "built" if o in todo else "skipped", reasons[o])
        for o in outputs
    }
    if todo:
        plan = _OutputPlan(todo, settings, sources, summaries)
        rendering = _Rendering(options, threads, MemoryBudget(decode_budget_bytes(memory_gb)))
        _build(source, layout, rel, plan, rendering, on_rows)
    return ShardResult(rel, rows, [summaries[o] for o in outputs], time.monotonic() - started, sources)


def decode_budget_bytes(memory_gb: float) -> int:
    """The bytes of decoded images one shard may hold at once, for a task of `memory_gb` GiB."""
    if not memory_gb > 0:
        raise ValueError(f"memory_gb must be positive, got {memory_gb!r}")
    return max(1, int(memory_gb * GIB * DECODE_MEMORY_SHARE))


def _open_main_shard(layout: DatasetLayout, rel: str) -> pq.ParquetFile:
    source = open_shard(layout.main, rel, "main", columns=[layout.key_column, layout.image_column])
    image_type = source.schema_arrow.field(layout.image_column).type
    if not is_image_type(image_type):
        raise ShardError(
            f"main shard {layout.main.child(rel)}: image column {layout.image_column!r} has type {image_type}, "
            "expected bytes"
        )
    return source


@dataclass(frozen=True)
class _OutputPlan:
    """The outputs one build writes, what each records in its footer (its build settings and the
    sources' fingerprints), and the summaries their rows are counted in."""

    outputs: list[ResizedOutput]
    settings: dict[ResizedOutput, dict[str, Any]]
    sources: dict[str, Any]
    summaries: dict[ResizedOutput, OutputSummary]


@dataclass(frozen=True)
class _Rendering:
    """How a build renders its rows: the pixel options, its threads, and the decode memory budget they share."""

    options: PixelOptions
    threads: int
    budget: MemoryBudget


def _build(
    source: pq.ParquetFile,
    layout: DatasetLayout,
    rel: str,
    plan: _OutputPlan,
    rendering: _Rendering,
    on_rows: Callable[[int], None] | None,
) -> None:
    key_column, image_column = layout.key_column, layout.image_column
    key_field = source.schema_arrow.field(key_column)
    main_image_field = source.schema_arrow.field(image_column)
    image_field = main_image_field.with_type(output_image_type(main_image_field.type))
    areas = [o.area for o in plan.outputs]
    rows = _iter_rows(source, key_column, image_column)
    with contextlib.ExitStack() as stack:
        writers = []
        for output in plan.outputs:
            schema = pa.schema([key_field, image_field, *audit_columns(output.audit_prefix)])
            schema = schema.with_metadata(encode_settings(plan.settings[output], plan.sources))
            tmp = stack.enter_context(output.location.write_atomic(rel, protect=layout.read_only))
            writer = pq.ParquetWriter(
                tmp,
                schema,
                # WebP bytes do not compress: spend no CPU on them, zstd on the rest.
                compression={name: "NONE" if name == image_column else "ZSTD" for name in schema.names},
                use_dictionary=[key_column],
                write_statistics=[key_column],
                write_page_checksum=True,  # readers verify every page they read (a damaged file fails)
            )
            stack.callback(writer.close)
            writers.append(writer)
        threads = rendering.threads
        pool = stack.enter_context(ThreadPoolExecutor(threads)) if threads > 1 else None
        results = _ordered_map(
            pool,
            lambda row: _process_row(row[1], areas, rendering.options, rendering.budget),
            rows,
            4 * max(1, threads),
        )
        # The buffer holds outputs, keys and struct side fields only: source bytes are dropped
        # as soon as their row is processed, so memory is bounded by rows in flight.
        buffer: list[tuple[Any, Any, list[ImageResult]]] = []
        for (key, _, side_fields), per_area in results:
            buffer.append((key, side_fields, per_area))
            if len(buffer) >= OUTPUT_ROW_GROUP_ROWS:
                _flush(buffer, plan, writers, key_field, image_field, on_rows)
        _flush(buffer, plan, writers, key_field, image_field, on_rows)
        # Closing happens before write_atomic publishes: ExitStack unwinds in reverse order.


def _iter_rows(source: pq.ParquetFile, key_column: str, image_column: str) -> Iterator[tuple[pa.Array, Any, Any]]:
    """(key, image bytes, struct side fields) per row, one row group in memory at a time.

    The key is a one-row slice of the key column, never decoded: keys are copied as they are
    (a text column may hold bytes that are not UTF-8).

    Reading row group by row group keeps pyarrow's pre-buffering (combined S3 reads) to one
    group; small batches keep few source images as Python bytes at once. Side fields are the
    struct's other fields ({bytes, path} layout: the path), or None for a plain bytes column
    or a null struct.
    """
    columns = [key_column, image_column]
    for row_group in range(source.metadata.num_row_groups):
        batches = source.iter_batches(
            batch_size=SOURCE_BATCH_ROWS, row_groups=[row_group], columns=columns, use_threads=False
        )
        for batch in batches:
            keys = batch.column(0)
            for row, cell in enumerate(batch.column(1).to_pylist()):
                key = keys.slice(row, 1)
                if isinstance(cell, dict):
                    data = cell.pop(BYTES_FIELD, None)
                    yield key, data, cell
                else:
                    yield key, cell, None


def _ordered_map(pool, fn, items: Iterable, max_in_flight: int) -> Iterator[tuple[Any, Any]]:
    """(item, fn(item)) in input order, with at most `max_in_flight` items submitted."""
    if pool is None:
        for item in items:
            yield item, fn(item)
        return
    pending: deque = deque()
    for item in items:
        pending.append((item, pool.submit(fn, item)))
        if len(pending) >= max_in_flight:
            first, future = pending.popleft()
            yield first, future.result()
    while pending:
        first, future = pending.popleft()
        yield first, future.result()


def _process_row(
    data: bytes | None, areas: list[int], options: PixelOptions, budget: MemoryBudget
) -> list[ImageResult]:
    try:
        results = process_image(data, areas, options, budget)
    except Exception as exc:  # noqa: BLE001 - process_image should not raise; if it does, the row is still audited
        detail = describe_exception(exc)
        return [ImageResult(AuditRecord(error=ErrorCode.DECODE_ERROR.value, error_detail=detail), None) for _ in areas]
    record = results[0].record
    decoded = record.error not in NOT_DECODED
    if decoded and (record.src_width or 0) * (record.src_height or 0) * 4 >= RELEASE_AFTER_DECODED_BYTES:
        _release_freed_memory()
    return results


def _find_malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


_MALLOC_TRIM = _find_malloc_trim() if sys.platform.startswith("linux") else None


def _release_freed_memory() -> None:
    """Hand memory freed by a large image back to the system (glibc's malloc_trim; elsewhere, nothing).

    glibc keeps what a thread frees in that thread's arena: after a 196 MP image (1.6 GB) on
    one thread, the next one on another thread took 1.6 GB more, and four decoded one after
    the other within the budget on 4 threads still peaked at 3.1 GiB (1.6 GiB with this). A
    trim takes tens of milliseconds, against seconds for such an image.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _flush(buffer, plan: _OutputPlan, writers, key_field, image_field, on_rows) -> None:
    if not buffer:
        return
    keys = pa.concat_arrays([key for key, _, _ in buffer])
    for index, (output, writer) in enumerate(zip(plan.outputs, writers)):
        results = [per_area[index] for _, _, per_area in buffer]
        images = _image_array([side for _, side, _ in buffer], [r.image for r in results], image_field.type)
        records = [r.record for r in results]
        columns = {key_field.name: keys, image_field.name: images, **audit_arrays(output.audit_prefix, records)}
        writer.write_table(pa.table(columns, schema=writer.schema))
        summary = plan.summaries[output]
        for record in records:
            if record.valid:
                summary.valid += 1
            else:
                summary.error_counts[record.error] = summary.error_counts.get(record.error, 0) + 1
    if on_rows is not None:
        on_rows(len(buffer))
    buffer.clear()


def _image_array(side_fields: list[Any], encoded: list[bytes | None], dtype: pa.DataType) -> pa.Array:
    if not pa.types.is_struct(dtype):
        return pa.array(encoded, type=dtype)
    # Hugging Face Image layout: keep the struct, replace the bytes, keep the other fields.
    values = []
    for side, data in zip(side_fields, encoded):
        if side is None:
            values.append(None if data is None else {BYTES_FIELD: data})
        else:
            values.append({**side, BYTES_FIELD: data})
    return pa.array(values, type=dtype)
