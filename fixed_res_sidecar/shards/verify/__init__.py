"""The SPEC 7 verifier: per-shard checks of the resized outputs and of the crop-bbox sidecar.

`report` holds the report types and the reading both verifiers share, `resized` the checks of
a resized shard (and the crop sidecar's gate on them), `fidelity` its check that the sampled
images show the right picture, `coverage` which rows it compares (a window of rows not compared
before), `sidecar` the checks of a sidecar shard.
"""

from fixed_res_sidecar.shards.verify.coverage import COVERAGE_STAT, Coverage, previous_coverage
from fixed_res_sidecar.shards.verify.fidelity import FIDELITY, SharedRenders, write_fidelity_pictures
from fixed_res_sidecar.shards.verify.report import (
    KEYS_MATCH,
    SHARD_COMPLETE,
    CheckResult,
    ReportError,
    ShardReport,
    failed_outputs,
    load_report,
    report_rel,
    still_failed,
    write_report,
)
from fixed_res_sidecar.shards.verify.resized import (
    AUDIT_CONSISTENT,
    RESIZED_CHECKS,
    SAMPLE_IMAGES,
    GateError,
    VerifyOptions,
    require_verified,
    resized_verification_problems,
    verify_resized_shard,
)
from fixed_res_sidecar.shards.verify.sidecar import (
    BOXES_REDERIVED,
    BOXES_VALID,
    CROP_BBOX_CHECKS,
    META_MATCHES_AUDIT,
    SIDECAR_COLUMNS,
    verify_crop_bbox_shard,
)

__all__ = [
    "AUDIT_CONSISTENT",
    "BOXES_REDERIVED",
    "BOXES_VALID",
    "COVERAGE_STAT",
    "CROP_BBOX_CHECKS",
    "FIDELITY",
    "KEYS_MATCH",
    "META_MATCHES_AUDIT",
    "RESIZED_CHECKS",
    "SAMPLE_IMAGES",
    "SHARD_COMPLETE",
    "SIDECAR_COLUMNS",
    "CheckResult",
    "Coverage",
    "GateError",
    "ReportError",
    "ShardReport",
    "SharedRenders",
    "VerifyOptions",
    "failed_outputs",
    "load_report",
    "previous_coverage",
    "report_rel",
    "require_verified",
    "resized_verification_problems",
    "still_failed",
    "verify_crop_bbox_shard",
    "verify_resized_shard",
    "write_fidelity_pictures",
    "write_report",
]
