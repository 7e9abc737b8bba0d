"""defs/ledger.py: every state of a shard and every rule about it, without Dagster (table-driven)."""

from dataclasses import dataclass, field

import pytest

from fixed_res_sidecar.defs.ledger import (
    CHECKS,
    CROP_BBOX,
    MAIN,
    Action,
    CheckRecord,
    CheckState,
    Materialization,
    ShardLedger,
    ShardState,
    resized,
    verifier,
)
from fixed_res_sidecar.shards.pipeline import Stages

EVERYTHING = Stages(resize=("512", "1024"), verify=("512", "1024"), crop=True)
VERIFY_BOTH = Stages(verify=("512", "1024"))
CROP_ONLY = Stages(crop=True)
RESIZE_ONLY = Stages(resize=("512", "1024"))


def built(storage_id: int, run: str = "build-run", **extra) -> Materialization:
    return Materialization(storage_id, run, **extra)


def passed_on(asset: str, target: int, state: CheckState = CheckState.PASSED) -> dict[str, CheckRecord]:
    return {f"{asset}:{name}": CheckRecord(state, target, target + 1) for name in CHECKS[asset]}


def complete(**changes) -> ShardLedger:
    """A shard built, verified and cropped in one run, in build order: main 1, resized 10 and 11,
    verifiers 20 and 21 (fingerprints fp-512, fp-1024), crop_bbox 30 (fp-crop), every check passed."""
    materializations = {
        MAIN: built(1, "", source="v1"),
        resized("512"): built(10, source="v1"),
        resized("1024"): built(11, source="v1"),
        verifier("512"): built(20, fingerprint="fp-512"),
        verifier("1024"): built(21, fingerprint="fp-1024"),
        CROP_BBOX: built(30, fingerprint="fp-crop"),
    }
    checks = {**passed_on(verifier("512"), 20), **passed_on(verifier("1024"), 21), **passed_on(CROP_BBOX, 30)}
    materializations.update(changes.pop("materializations", {}))
    checks.update(changes.pop("checks", {}))
    return ShardLedger("a.parquet", materializations, checks, **changes)


@dataclass
class Storage:
    """An OutputCheck that says what it is told, and records that it was asked."""

    changed_outputs: list[str] = field(default_factory=list)
    outdated_reason: str | None = None
    asked: list[str] = field(default_factory=list)

    def changed(self, fingerprints):
        self.asked.append(f"changed {sorted(fingerprints.items())}")
        return [name for name in fingerprints if name in self.changed_outputs]

    def outdated(self):
        self.asked.append("outdated")
        return self.outdated_reason


NEVER_BUILT = ShardLedger("a.parquet", {MAIN: built(1, "")})
REBUILT_UNVERIFIED = complete(materializations={resized("512"): built(40, "repair-run")})
KEYS_FAILED = complete(checks={f"{verifier('512')}:keys_match": CheckRecord(CheckState.FAILED, 20, 22)})
PASSED_ON_OLDER = complete(checks={f"{verifier('1024')}:fidelity": CheckRecord(CheckState.PASSED, 5, 6)})
PLANNED = complete(checks={f"{CROP_BBOX}:boxes_valid": CheckRecord(CheckState.PLANNED, None, 50)})
NO_CROP = complete(materializations={CROP_BBOX: None})
# A verifier rebuilt after the crop (a real verification, by another run): the crop is older than it.
VERIFIED_AFTER_CROP = complete(
    materializations={verifier("512"): built(40, "verify-run", fingerprint="fp-512")},
    checks=passed_on(verifier("512"), 40),
)
# The same verifier restated after the crop (e.g. by the automation sensor): it keeps its place (20).
RESTATED_AFTER_CROP = complete(
    materializations={
        verifier("512"): built(40, "restate-run", restates=20, built_by="build-run", fingerprint="fp-512")
    },
    checks=passed_on(verifier("512"), 40),
)
REMOVED = complete(removed_at=50)
BACK_AFTER_REMOVAL = complete(removed_at=50, materializations={MAIN: built(60, "", source="v2")})
MAIN_CHANGED = complete(materializations={MAIN: built(60, "", source="v2")})


def _ledger(value: ShardLedger) -> ShardLedger:
    """Drops the materializations a table row set to None (an asset never materialised)."""
    kept = {name: m for name, m in value.materializations.items() if m is not None}
    return ShardLedger(value.rel, kept, value.checks, value.removed_at, value.failed_verifications)


# The 512 output (built at 10) failed its verification in a later run (observation 40): it is rebuilt.
FIDELITY_FAILED = complete(
    checks={f"{verifier('512')}:fidelity": CheckRecord(CheckState.FAILED, None, 41)},
    failed_verifications={verifier("512"): built(40, "verify-run")},
)
# Its failure was about an earlier build: the output was built again since (50), so it is verified, not rebuilt.
FAILED_THEN_REBUILT = complete(
    materializations={resized("512"): built(50, "repair-run")},
    checks={f"{verifier('512')}:fidelity": CheckRecord(CheckState.FAILED, None, 41)},
    failed_verifications={verifier("512"): built(40, "verify-run")},
)
# crop_bbox (on record: 30) was built again and failed its own checks (observation 45).
CROP_FAILED = complete(
    checks={f"{CROP_BBOX}:boxes_valid": CheckRecord(CheckState.FAILED, None, 46)},
    failed_verifications={CROP_BBOX: built(45, "crop-run")},
)


@pytest.mark.parametrize(
    ("shard", "state", "unverified_512", "crop_problem"),
    [
        (NEVER_BUILT, ShardState.UNVERIFIED, "its 512 output was never built", "its 512 output was never built"),
        (complete(), ShardState.COMPLETE, None, None),
        (
            REBUILT_UNVERIFIED,
            ShardState.UNVERIFIED,
            "its 512 output was built again (run repair-r) after it was verified (run build-ru)",
            "its 512 output was built again (run repair-r) after it was verified (run build-ru)",
        ),
        (
            KEYS_FAILED,
            ShardState.FAILED,
            "its 512 verification failed keys_match (run build-ru)",
            "its 512 verification failed keys_match (run build-ru)",
        ),
        (
            PASSED_ON_OLDER,
            ShardState.UNVERIFIED,
            None,
            "its 1024 verification passed fidelity on an earlier output, not on its latest (run build-ru)",
        ),
        (
            PLANNED,
            ShardState.UNVERIFIED,
            None,
            "its crop_bbox did not finish boxes_valid: planned, no result (run build-ru)",
        ),
        (NO_CROP, ShardState.CROP_MISSING, None, "its crop_bbox was never built"),
        (
            VERIFIED_AFTER_CROP,
            ShardState.CROP_STALE,
            None,
            "its crop_bbox (run build-ru) was built before its latest 512 verification (run verify-r)",
        ),
        (RESTATED_AFTER_CROP, ShardState.COMPLETE, None, None),
        (REMOVED, ShardState.REMOVED, None, None),
        (BACK_AFTER_REMOVAL, ShardState.COMPLETE, None, None),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_every_state_and_its_reasons(shard, state, unverified_512, crop_problem):
    shard = _ledger(shard)
    assert shard.state() is state
    assert shard.unverified("512") == unverified_512
    assert shard.crop_problem() == crop_problem
    assert shard.removed == (state is ShardState.REMOVED)
    assert shard.gate() == tuple(p for p in (shard.unverified("512"), shard.unverified("1024")) if p)


def test_failed_checks_name_each_check():
    both = complete(
        checks={
            f"{verifier('512')}:keys_match": CheckRecord(CheckState.FAILED, 20),
            f"{CROP_BBOX}:boxes_valid": CheckRecord(CheckState.FAILED, 30),
        }
    )
    assert both.failed_checks() == ["crop_bbox:boxes_valid", "verify_512:keys_match"]
    assert complete().failed_checks() == [] and PLANNED.failed_checks() == []


def test_a_result_without_a_target_counts_when_recorded_after_the_materialization():
    later, earlier = CheckRecord(CheckState.PASSED, None, 25), CheckRecord(CheckState.PASSED, None, 15)
    assert later.evaluated(built(20)) and not earlier.evaluated(built(20))


@pytest.mark.parametrize(
    ("shard", "stages", "storage", "action", "reason", "asked"),
    [
        (complete(), EVERYTHING, Storage(), Action.RESTATE, "up to date, results restated (built by run build-ru)", 2),
        (
            complete(),
            EVERYTHING,
            Storage(changed_outputs=["resized_512"]),
            Action.BUILD,
            "to build: its 512 output changed since it was verified",
            1,
        ),
        (
            complete(),
            CROP_ONLY,
            Storage(changed_outputs=["crop_bbox", "resized_1024"]),
            Action.BUILD,
            "to build: its 1024 output and crop_bbox changed since it was verified",
            1,
        ),
        (
            complete(),
            VERIFY_BOTH,
            Storage(outdated_reason="its 1024 output is built with other settings"),
            Action.BUILD,
            "to build: its 1024 output is built with other settings",
            2,
        ),
        (NEVER_BUILT, EVERYTHING, Storage(), Action.BUILD, "to build: its 512 output was never built", 0),
        (
            REBUILT_UNVERIFIED,
            VERIFY_BOTH,
            Storage(),
            Action.BUILD,
            "to build: its 512 output was built again (run repair-r) after it was verified (run build-ru)",
            0,
        ),
        (
            KEYS_FAILED,
            EVERYTHING,
            Storage(),
            Action.BUILD,
            "to build: its 512 verification failed keys_match (run build-ru)",
            0,
        ),
        (NO_CROP, EVERYTHING, Storage(), Action.BUILD, "to build: its crop_bbox was never built", 0),
        (NO_CROP, VERIFY_BOTH, Storage(), Action.RESTATE, "up to date, results restated (built by run build-ru)", 2),
        (
            VERIFIED_AFTER_CROP,
            CROP_ONLY,
            Storage(),
            Action.BUILD,
            "to build: its crop_bbox (run build-ru) was built before its latest 512 verification (run verify-r)",
            0,
        ),
        (
            RESTATED_AFTER_CROP,
            CROP_ONLY,
            Storage(),
            Action.RESTATE,
            "up to date, results restated (built by run build-ru)",
            2,
        ),
        (
            complete(),
            RESIZE_ONLY,
            Storage(),
            Action.BUILD,
            "to build: only resized outputs are selected (a resized output is restated only with its verifier)",
            0,
        ),
        (
            complete(),
            Stages(resize=("512",), verify=("1024",)),
            Storage(),
            Action.BUILD,
            "to build: a resized output is selected without its verifier (verify_512)",
            0,
        ),
        (
            REBUILT_UNVERIFIED,
            CROP_ONLY,
            Storage(),
            Action.REFUSE,
            "refused: crop_bbox is gated on the verifiers: its 512 output was built again (run repair-r) after it was verified (run build-ru)",
            0,
        ),
    ],
)
def test_a_runs_decision_per_shard(shard, stages, storage, action, reason, asked):
    decision = _ledger(shard).decide(stages, True, storage)
    assert (decision.action, decision.reason) == (action, reason)
    assert len(storage.asked) == asked  # storage is asked only when the record allows a restatement


@pytest.mark.parametrize(
    ("shard", "stages", "action", "rebuild", "reason"),
    [
        (
            FIDELITY_FAILED,
            EVERYTHING,
            Action.BUILD,
            ("512",),
            "to build again: its 512 output failed fidelity when it was verified (run verify-r) after it was "
            "built (run build-ru)",
        ),
        (
            FIDELITY_FAILED,
            VERIFY_BOTH,
            Action.BUILD,
            (),
            "to verify again: its 512 output failed fidelity when it was verified (run verify-r) after it was "
            "built (run build-ru); this run does not build it, so it is verified again as it is (run the "
            "shard's job to rebuild it)",
        ),
        (
            FAILED_THEN_REBUILT,
            EVERYTHING,
            Action.BUILD,
            (),
            "to build: its 512 output was built again (run repair-r) after it was verified (run build-ru)",
        ),
        (
            CROP_FAILED,
            EVERYTHING,
            Action.BUILD,
            ("crop_bbox",),
            "to build again: its crop_bbox failed boxes_valid when it was last built (run crop-run)",
        ),
    ],
)
def test_an_output_whose_latest_verification_failed_on_its_bytes_is_built_again(shard, stages, action, rebuild, reason):
    """Verifying the same bytes again can only fail again: the next run that builds the shard rebuilds the
    output, though skip-existing finds it up to date; a run that does not build it says how to."""
    decision = shard.decide(stages, True, Storage())
    assert (decision.action, decision.rebuild, decision.reason) == (action, rebuild, reason)
    assert shard.state() is ShardState.FAILED


def test_a_fidelity_sweep_verifies_shards_whose_results_are_on_record():
    storage = Storage()
    decision = complete().decide(Stages(verify=("512", "1024"), crop=True), True, storage, sweep=True)
    assert decision.action is Action.BUILD and decision.reason.startswith("fidelity sweep: ")
    assert storage.asked == []
    assert complete().decide(VERIFY_BOTH, True, storage).action is Action.RESTATE  # without the sweep


def test_skip_existing_off_always_builds_and_a_shard_gone_from_main_is_skipped():
    storage = Storage()
    assert complete().decide(EVERYTHING, False, storage).reason == "to build: skip-existing is off"
    skipped = complete().decide(EVERYTHING, True, storage, in_main=False)
    assert skipped.action is Action.SKIP and "not a shard of the main dataset" in skipped.reason
    assert storage.asked == []


def test_the_gate_is_the_ledgers_only_when_the_run_does_not_verify_both_resolutions():
    storage = Storage()
    assert REBUILT_UNVERIFIED.decide(EVERYTHING, True, storage).gate is None  # gated on this run's reports
    assert REBUILT_UNVERIFIED.decide(VERIFY_BOTH, True, storage).gate is None  # no crop
    partial = REBUILT_UNVERIFIED.decide(Stages(resize=("1024",), verify=("1024",), crop=True), True, storage)
    assert partial.action is Action.BUILD and partial.gate == (REBUILT_UNVERIFIED.unverified("512"),)
    assert complete().decide(CROP_ONLY, False, storage).gate == ()  # verified on record: the crop may run
    # The resolution a run verifies itself is gated by its own report, not by the record.
    own = REBUILT_UNVERIFIED.decide(Stages(verify=("512",), crop=True), True, storage)
    assert own.action is Action.BUILD and own.gate == ()


def test_a_restated_fingerprint_set_covers_what_the_stages_vouch_for():
    assert complete().verified_fingerprints(VERIFY_BOTH) == {"resized_512": "fp-512", "resized_1024": "fp-1024"}
    assert complete().verified_fingerprints(Stages(verify=("1024",))) == {"resized_1024": "fp-1024"}
    assert complete().verified_fingerprints(CROP_ONLY) == {
        "resized_512": "fp-512",
        "resized_1024": "fp-1024",
        "crop_bbox": "fp-crop",
    }


def test_a_restatement_keeps_its_place_and_names_the_run_that_built_it():
    again = built(50, "third-run", restates=20, built_by="build-run")
    assert again.order == 20 and again.is_restatement and again.builder == "build-run"
    assert built(20).order == 20 and not built(20).is_restatement and built(20).builder == "build-run"


def test_stale_when_main_changed_since_the_outputs_were_built():
    assert complete().stale() is None
    assert MAIN_CHANGED.stale() == "main's shard changed since its 512 output was built (run build-ru)"
    assert NEVER_BUILT.stale() is None


def test_updates_keep_the_newer_record():
    shard = complete()
    assert shard.with_materialization(resized("512"), built(5, "old-run")) is shard  # older: ignored
    newer = shard.with_materialization(resized("512"), built(40, "repair-run"))
    assert newer.latest(resized("512")).storage_id == 40 and newer.unverified("512") is not None
    assert shard.with_removal(50).removed and shard.with_removal(50).with_removal(40).removed_at == 50
    failed = shard.with_check("verify_512:keys_match", CheckRecord(CheckState.FAILED, 20, 23))
    assert failed.state() is ShardState.FAILED and shard.state() is ShardState.COMPLETE


# crop_bbox failed (45), then a verification was done again (50): the crop is built again from it.
CROP_FAILED_THEN_VERIFIED = complete(
    materializations={verifier("512"): built(50, "verify-run", fingerprint="fp-512")},
    checks={**passed_on(verifier("512"), 50), f"{CROP_BBOX}:boxes_valid": CheckRecord(CheckState.FAILED, None, 46)},
    failed_verifications={CROP_BBOX: built(45, "crop-run")},
)
ONLY_512_BUILT = ShardLedger("a.parquet", {MAIN: built(1, "", source="v1"), resized("512"): built(10, source="v1")})


@pytest.mark.parametrize(
    ("shard", "follow_up"),
    [
        (NEVER_BUILT, ()),
        (complete(), ()),
        (REBUILT_UNVERIFIED, (verifier("512"), CROP_BBOX)),  # verified, then cropped by the same run
        (FAILED_THEN_REBUILT, (verifier("512"), CROP_BBOX)),  # the failure was about an earlier build
        (ONLY_512_BUILT, (verifier("512"),)),  # the 1024 output gates the crop
        (NO_CROP, (CROP_BBOX,)),
        (VERIFIED_AFTER_CROP, (CROP_BBOX,)),
        (CROP_FAILED_THEN_VERIFIED, (CROP_BBOX,)),
        (RESTATED_AFTER_CROP, ()),  # a restatement keeps its place: the crop is not older than it
        (KEYS_FAILED, ()),  # the operator's: verifying the same bytes again can only fail again
        (FIDELITY_FAILED, ()),
        (CROP_FAILED, ()),
        (PASSED_ON_OLDER, ()),  # the latest verification did not pass: no crop
        (PLANNED, ()),
        (REMOVED, ()),
    ],
)
def test_what_follows_a_run_for_each_state(shard, follow_up):
    assert _ledger(shard).follow_up() == follow_up


@pytest.mark.parametrize(
    "shard", [complete(), NEVER_BUILT, REMOVED, RESTATED_AFTER_CROP, PLANNED, FIDELITY_FAILED, CROP_FAILED]
)
def test_a_ledger_survives_its_json(shard):
    again = ShardLedger.from_json(shard.rel, shard.to_json())
    assert again.materializations == shard.materializations and again.removed_at == shard.removed_at
    assert again.failed_verifications == shard.failed_verifications
    assert {n: (c.state, c.target, c.event) for n, c in again.checks.items()} == {
        n: (c.state, c.target, c.event) for n, c in shard.checks.items()
    }
    assert again.state() is shard.state()


def test_storage_is_compared_with_what_the_record_vouches_for():
    as_verified = {"resized_512": "fp-512", "resized_1024": "fp-1024", "crop_bbox": "fp-crop"}
    assert complete().storage_problems(as_verified) == {}
    gone = complete().storage_problems({**as_verified, "resized_512": None})
    assert gone == {"resized_512": "its 512 output is gone from storage (verified by run build-ru)"}
    changed = complete().storage_problems({**as_verified, "crop_bbox": "fp-other"})["crop_bbox"]
    assert changed.startswith("its crop_bbox on storage is not the object verified by run build-ru")
    assert "(verified fp-crop, now fp-other)" in changed
    # What the record does not vouch for is not compared: an output rebuilt since it was verified (the
    # shard is unverified anyway), and an output a listing did not cover.
    assert REBUILT_UNVERIFIED.storage_problems({**as_verified, "resized_512": None}) == {}
    assert complete().storage_problems({"resized_1024": "fp-1024"}) == {}
    assert NEVER_BUILT.storage_problems({name: None for name in as_verified}) == {}
