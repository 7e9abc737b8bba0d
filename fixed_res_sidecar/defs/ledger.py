"""The shard ledger: what the Dagster instance knows of one shard, and every rule about it.

Pure: plain values in, answers out; no Dagster call, no storage. `history.read_ledgers` fills
ledgers from the instance (and the dataset audit keeps them up to date incrementally); the shard
step, its crop gate, the audit, the scale benchmark and the tests ask the ledger. Each rule is
stated here once:

- build order: a materialization's `order` is its storage id, or for a restatement the order of
  the build it restates (a restatement says "unchanged since", so it keeps that place);
- verified at a resolution: the verifier materialised after the resized output it verifies, and
  every one of its checks passed on that very materialization;
- crop current: both resolutions verified, crop_bbox materialised after both verifications, and
  every sidecar check passed on it;
- failed: a check whose latest result failed;
- failed on its current bytes: the latest verification of an output (a verifier's, or crop_bbox's own
  checks) failed after the output was built: verifying the same bytes again can only fail again, so
  the next run that builds the shard rebuilds that output (`Decision.rebuild`);
- removed: main's latest word on the shard is that a complete listing no longer has it;
- changed on storage: an output verified (or a crop current) that storage no longer holds, or holds
  as another object than the one its checks passed on;
- stale: main's shard changed since the resized outputs were built from it;
- a run's decision per shard: build, restate, skip or refuse, with the reason in plain words.
- what follows a run (`follow_up`): the verifier of an output built after its verification, and
  crop_bbox once both resolutions are verified (on record, or by that follow-up run).

A failed verification is recorded as an observation of its asset, not a materialization (the asset
then reads Failed in every view, like any asset whose run failed): the ledger keeps the latest one
per asset (`failed_verifications`).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol

from fixed_res_sidecar.core.resolutions import RESOLUTION_NAMES
from fixed_res_sidecar.shards.pipeline import Stages
from fixed_res_sidecar.shards.verify import CROP_BBOX_CHECKS, RESIZED_CHECKS

MAIN = "main"
CROP_BBOX = "crop_bbox"


def resized(resolution: str) -> str:
    return f"resized_{resolution}"


def verifier(resolution: str) -> str:
    return f"verify_{resolution}"


# Every asset a shard has, in graph order, and the checks each carries.
SHARD_ASSETS: tuple[str, ...] = (
    *(resized(r) for r in RESOLUTION_NAMES),
    *(verifier(r) for r in RESOLUTION_NAMES),
    CROP_BBOX,
)
CHECKS: dict[str, tuple[str, ...]] = {
    **{verifier(r): RESIZED_CHECKS for r in RESOLUTION_NAMES},
    CROP_BBOX: CROP_BBOX_CHECKS,
}


class CheckState(StrEnum):
    """The latest word on one check of one shard."""

    PASSED = "passed"
    FAILED = "failed"
    PLANNED = "planned, no result"  # by a run still going, or one that ended without evaluating it
    NEVER = "never ran"


@dataclass(frozen=True)
class Materialization:
    """The latest materialization of one asset for one shard."""

    storage_id: int
    run_id: str
    restates: int | None = None  # the order of the build this restates (None: it is a build)
    built_by: str | None = None  # the run that built what a restatement restates
    fingerprint: str | None = None  # a verifier's or crop_bbox's: the output object it checked
    source: str | None = None  # main's: its data version; a resized output's: main's version it was built from

    @property
    def order(self) -> int:
        """Its place in the build order (the one notion of "after")."""
        return self.restates if self.restates is not None else self.storage_id

    @property
    def is_restatement(self) -> bool:
        return self.restates is not None

    @property
    def builder(self) -> str:
        """The run that built the object this materialization describes."""
        return self.built_by if self.is_restatement and self.built_by else self.run_id

    def described(self) -> str:
        return f"run {self.builder[:8]}"


@dataclass(frozen=True)
class CheckRecord:
    """The latest result of one check of one shard, and the materialization it evaluated."""

    state: CheckState
    target: int | None = None  # storage id of the materialization it evaluated (None: not said)
    event: int = 0  # storage id of its latest event
    description: str | None = None

    def evaluated(self, materialization: Materialization) -> bool:
        """Whether this result is about `materialization` (not an older one of the same asset)."""
        if self.target is not None:
            return self.target == materialization.storage_id
        return self.event > materialization.storage_id  # results recorded without a target: after it


NEVER_RAN = CheckRecord(CheckState.NEVER)


class Action(StrEnum):
    """What a run does with one shard."""

    BUILD = "build"  # run the selected stages (a stage may still find its output up to date)
    RESTATE = "restate"  # nothing to do: record the results on record again
    SKIP = "skip"  # no longer in main: nothing built, nothing fails
    REFUSE = "refuse"  # only crop_bbox selected, and the gate refuses it


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # in plain words, for the run's log
    # When the run crops without verifying both resolutions itself: why the record refuses the crop for
    # the resolutions the run does not verify (empty: verified on record; the run's own reports gate the
    # others). None when the run verifies both itself, or does not crop.
    gate: tuple[str, ...] | None = None
    # Outputs to build again although they look up to date ("512", "1024", "crop_bbox"): their latest
    # verification failed on the bytes they hold now.
    rebuild: tuple[str, ...] = ()


class OutputCheck(Protocol):
    """What a decision asks of storage, answered by the shard step (one stat or footer read each)."""

    def changed(self, fingerprints: Mapping[str, str | None]) -> list[str]:
        """The outputs ("resized_512", "crop_bbox") no longer the objects with these fingerprints."""
        ...

    def outdated(self) -> str | None:
        """Why an output the stages would write is missing, damaged or not built from the current
        main shard and settings; None when all are up to date."""
        ...


class ShardState(StrEnum):
    """Where one shard stands, for the dataset audit (the first that applies)."""

    REMOVED = "removed from main, outputs kept"
    FAILED = "failed"
    CROP_STALE = "crop_bbox older than its verification"
    CROP_MISSING = "verified, no crop_bbox"
    UNVERIFIED = "not built or verified yet"
    COMPLETE = "complete"


@dataclass(frozen=True)
class ShardLedger:
    """What the instance knows of one shard: the latest materialization of each asset, the latest
    result of each check, and whether main still has it."""

    rel: str
    materializations: Mapping[str, Materialization] = field(default_factory=dict)  # asset name -> latest
    checks: Mapping[str, CheckRecord] = field(default_factory=dict)  # "verify_512:keys_match" -> latest
    removed_at: int | None = None  # storage id of main's latest "removed" observation
    # asset name ("verify_512", "crop_bbox") -> the latest observation recording that its verification failed
    failed_verifications: Mapping[str, Materialization] = field(default_factory=dict)

    # -- reading ---------------------------------------------------------------------------

    def latest(self, asset: str) -> Materialization | None:
        return self.materializations.get(asset)

    def check(self, asset: str, name: str) -> CheckRecord:
        return self.checks.get(f"{asset}:{name}", NEVER_RAN)

    # -- the rules -------------------------------------------------------------------------

    @property
    def removed(self) -> bool:
        main = self.latest(MAIN)
        return self.removed_at is not None and (main is None or self.removed_at > main.storage_id)

    def failed_checks(self) -> list[str]:
        """The checks ("verify_512:keys_match") whose latest result failed."""
        return sorted(name for name, record in self.checks.items() if record.state is CheckState.FAILED)

    def unverified(self, resolution: str) -> str | None:
        """Why the shard's output at `resolution` is not verified; None when it is."""
        output, verification = self.latest(resized(resolution)), self.latest(verifier(resolution))
        if output is None:
            return f"its {resolution} output was never built"
        if failure := self.failed_since_built(resolution):  # a failed verification is no materialization
            return failure
        if verification is None:
            return f"its {resolution} output was never verified"
        if verification.order < output.order:
            return (
                f"its {resolution} output was built again ({output.described()}) after it was verified "
                f"({verification.described()})"
            )
        return self._checks_problem(verifier(resolution), verification)

    def crop_problem(self) -> str | None:
        """Why the shard's crop_bbox is not current; None when it is."""
        if gate := self.gate():
            return gate[0]
        crop = self.latest(CROP_BBOX)
        if crop is None:
            return "its crop_bbox was never built"
        return self.crop_stale() or self._checks_problem(CROP_BBOX, crop)

    def crop_stale(self) -> str | None:
        """Why the shard's crop_bbox is older than one of its verifications; None when it is not (or has none)."""
        crop = self.latest(CROP_BBOX)
        for resolution in RESOLUTION_NAMES:
            verification = self.latest(verifier(resolution))
            if crop is not None and verification is not None and crop.order < verification.order:
                return (
                    f"its crop_bbox ({crop.described()}) was built before its latest {resolution} verification "
                    f"({verification.described()})"
                )
        return None

    def _checks_problem(self, asset: str, materialization: Materialization) -> str | None:
        """Why the checks of `asset` did not all pass on its latest materialization; None when they did."""
        for name in CHECKS[asset]:
            record = self.check(asset, name)
            if record.state is CheckState.FAILED:
                return f"{_subject(asset)} failed {name} ({self._failure_run(asset) or materialization.described()})"
            if record.state is not CheckState.PASSED:
                return f"{_subject(asset)} did not finish {name}: {record.state.value} ({materialization.described()})"
            if not record.evaluated(materialization):
                return f"{_subject(asset)} passed {name} on an earlier output, not on its latest ({materialization.described()})"
        return None

    def _failure_run(self, asset: str) -> str | None:
        failure = self.failed_verifications.get(asset)
        return failure.described() if failure is not None else None

    def failed_since_built(self, output: str) -> str | None:
        """Why `output` ("512", "1024" or "crop_bbox") must be built again although it may look up to
        date: its latest verification failed after it was built, on the bytes it holds now (verifying
        them again can only fail again). None when it did not."""
        asset = CROP_BBOX if output == CROP_BBOX else verifier(output)
        failure = self.failed_verifications.get(asset)
        if failure is None:
            return None
        verified = self.latest(asset)
        if verified is not None and verified.storage_id > failure.storage_id:
            return None  # verified again since, and passed
        failed = ", ".join(name.split(":", 1)[1] for name in self.failed_checks() if name.startswith(f"{asset}:"))
        what = f"failed {failed}" if failed else "failed"
        if output == CROP_BBOX:
            return f"its crop_bbox {what} when it was last built ({failure.described()})"
        built = self.latest(resized(output))
        if built is None or failure.storage_id < built.order:
            return None  # the failure is about an earlier build of it
        return f"its {output} output {what} when it was verified ({failure.described()}) after it was built ({built.described()})"

    def gate(self, verified_now: Sequence[str] = ()) -> tuple[str, ...]:
        """Why crop_bbox must not be built from what is on record (SPEC 7's gate); empty when both
        resolutions are verified. `verified_now`: resolutions a run verifies itself (its own reports
        gate those, whatever the record says)."""
        return tuple(problem for r in RESOLUTION_NAMES if r not in verified_now and (problem := self.unverified(r)))

    def storage_problems(self, stored: Mapping[str, str | None]) -> dict[str, str]:
        """Output -> why storage does not hold what was verified: `stored` maps an output ("resized_512",
        "crop_bbox") to the stamp a listing shows for it now (None: not there). Compared only where the
        record vouches for the output (verified, crop current) and says which object it checked."""
        vouched = {resized(r): self.latest(verifier(r)) for r in RESOLUTION_NAMES if self.unverified(r) is None}
        if self.crop_problem() is None:
            vouched[CROP_BBOX] = self.latest(CROP_BBOX)
        problems = {}
        for name, checked in vouched.items():
            if checked is None or checked.fingerprint is None or name not in stored:
                continue
            what = "its crop_bbox" if name == CROP_BBOX else f"its {name.removeprefix('resized_')} output"
            now = stored[name]
            if now is None:
                problems[name] = f"{what} is gone from storage (verified by {checked.described()})"
            elif now != checked.fingerprint:
                problems[name] = (
                    f"{what} on storage is not the object verified by {checked.described()} "
                    f"(verified {checked.fingerprint}, now {now})"
                )
        return problems

    def stale(self) -> str | None:
        """Why the resized outputs describe an older main shard; None when they do not (or nothing says)."""
        main = self.latest(MAIN)
        for resolution in RESOLUTION_NAMES:
            output = self.latest(resized(resolution))
            if main is None or output is None or main.source is None or output.source is None:
                continue
            if output.source != main.source:
                return f"main's shard changed since its {resolution} output was built ({output.described()})"
        return None

    def state(self) -> ShardState:
        """Where the shard stands (the first state that applies, in ShardState's order)."""
        if self.removed:
            return ShardState.REMOVED
        if self.failed_checks():
            return ShardState.FAILED
        if self.gate():
            return ShardState.UNVERIFIED
        if self.crop_stale():
            return ShardState.CROP_STALE
        if self.latest(CROP_BBOX) is None:
            return ShardState.CROP_MISSING
        return ShardState.COMPLETE if self.crop_problem() is None else ShardState.UNVERIFIED

    def follow_up(self) -> tuple[str, ...]:
        """The assets the automation sensor builds next for this shard, in graph order (empty: none).

        A verifier whose output was built after its latest verification (not when a verification failed
        on the bytes the output holds now: verifying them again can only fail again); crop_bbox when
        both resolutions are then verified (on record, or by the same run) and it is missing, older than
        a verification, or about to be (a verifier runs first), unless it failed after its latest
        verification (building it from the same inputs can only fail again)."""
        if self.removed:
            return ()
        verify = []
        for resolution in RESOLUTION_NAMES:
            output, verification = self.latest(resized(resolution)), self.latest(verifier(resolution))
            if output is None or self.failed_since_built(resolution):
                continue
            if verification is None or verification.order < output.order:
                verify.append(resolution)
        verifiers = tuple(verifier(r) for r in verify)
        if self.gate(verify):
            return verifiers
        if verify:
            return (*verifiers, CROP_BBOX)
        crop, failure = self.latest(CROP_BBOX), self.failed_verifications.get(CROP_BBOX)
        verified = max(m.order for r in RESOLUTION_NAMES if (m := self.latest(verifier(r))) is not None)
        if failure is not None and failure.storage_id > verified and self.failed_since_built(CROP_BBOX):
            return ()
        return (CROP_BBOX,) if crop is None or self.crop_stale() else ()

    def verified_fingerprints(self, stages: Stages) -> dict[str, str | None]:
        """The outputs a restatement of `stages` vouches for, with the fingerprint each had when checked."""
        outputs = {resized(r): self.latest(verifier(r)) for r in (RESOLUTION_NAMES if stages.crop else stages.verify)}
        fingerprints = {name: m.fingerprint if m else None for name, m in outputs.items()}
        if stages.crop:
            crop = self.latest(CROP_BBOX)
            fingerprints[CROP_BBOX] = crop.fingerprint if crop else None
        return fingerprints

    def selected(self, stages: Stages) -> list[str]:
        """The assets `stages` materialise, in graph order."""
        return [
            *(resized(r) for r in stages.resize),
            *(verifier(r) for r in stages.verify),
            *([CROP_BBOX] if stages.crop else []),
        ]

    def decide(
        self, stages: Stages, skip_existing: bool, outputs: OutputCheck, in_main: bool = True, sweep: bool = False
    ) -> Decision:
        """What a run selecting `stages` does with this shard, and why.

        An output whose latest verification failed on its current bytes is built again (`rebuild`)
        when the run builds it. Restated only when every selected result is on record and passed on
        the latest materializations (in build order), the outputs are still the objects that were
        checked (`outputs.changed`), and they are up to date (`outputs.outdated`): storage is asked
        only then. `sweep`: a fidelity sweep, whose verifications compare rows not compared before.
        """
        gate = self.gate(stages.verify) if stages.crop and set(stages.verify) != set(RESOLUTION_NAMES) else None
        if not in_main:
            return Decision(Action.SKIP, "skipped: not a shard of the main dataset (any more); its outputs are kept")
        if not (stages.resize or stages.verify) and gate:
            return Decision(Action.REFUSE, f"refused: crop_bbox is gated on the verifiers: {'; '.join(gate)}", gate)
        failed = {o: why for o in (*RESOLUTION_NAMES, CROP_BBOX) if (why := self.failed_since_built(o))}
        rebuild = tuple(o for o in (*stages.resize, *([CROP_BBOX] if stages.crop else [])) if o in failed)
        if rebuild:
            reason = "; ".join(failed[o] for o in rebuild)
            return Decision(Action.BUILD, f"to build again: {reason}", gate, rebuild)
        if failed and (stale := [o for o in failed if o in stages.verify]):
            output = stale[0]
            reason = (
                f"{failed[output]}; this run does not build it, so it is verified again as it is "
                f"(run the shard's job to rebuild it)"
            )
            return Decision(Action.BUILD, f"to verify again: {reason}", gate)
        if sweep and stages.verify:
            return Decision(Action.BUILD, "fidelity sweep: its verification compares rows not compared before", gate)
        build = self._why_build(stages, skip_existing)
        if build is None:
            changed = outputs.changed(self.verified_fingerprints(stages))
            if changed:
                build = f"its {_named(changed)} changed since it was verified"
            elif problem := outputs.outdated():
                build = problem
        if build is not None:
            return Decision(Action.BUILD, f"to build: {build}", gate)
        builders = sorted({m.builder[:8] for name in self.selected(stages) if (m := self.latest(name))})
        return Decision(Action.RESTATE, f"up to date, results restated (built by run {', '.join(builders)})", gate)

    def _why_build(self, stages: Stages, skip_existing: bool) -> str | None:
        """Why the record alone does not let `stages` be restated; None when it does."""
        if not skip_existing:
            return "skip-existing is off"
        if not (stages.verify or stages.crop):
            return "only resized outputs are selected (a resized output is restated only with its verifier)"
        if not set(stages.resize) <= set(stages.verify):
            missing = ", ".join(verifier(r) for r in stages.resize if r not in stages.verify)
            return f"a resized output is selected without its verifier ({missing})"
        for resolution in stages.verify:
            if problem := self.unverified(resolution):
                return problem
        if stages.crop:
            return self.crop_problem()
        return None

    # -- keeping it up to date (the audit applies events as it reads them) -----------------

    def with_materialization(self, asset: str, materialization: Materialization) -> "ShardLedger":
        """This ledger with `materialization` as the latest of `asset`, unless it holds a newer one."""
        held = self.latest(asset)
        if held is not None and held.storage_id >= materialization.storage_id:
            return self
        return replace(self, materializations={**self.materializations, asset: materialization})

    def with_check(self, name: str, record: CheckRecord) -> "ShardLedger":
        return replace(self, checks={**self.checks, name: record})

    def with_failed_verification(self, asset: str, observation: Materialization) -> "ShardLedger":
        """This ledger with `observation` as the latest failed verification of `asset`, unless it holds a newer one."""
        held = self.failed_verifications.get(asset)
        if held is not None and held.storage_id >= observation.storage_id:
            return self
        return replace(self, failed_verifications={**self.failed_verifications, asset: observation})

    def with_removal(self, storage_id: int) -> "ShardLedger":
        if self.removed_at is not None and self.removed_at >= storage_id:
            return self
        return replace(self, removed_at=storage_id)

    # -- compact JSON (the audit keeps 100,000 of them) --------------------------------------

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = {
            "m": {
                name: [m.storage_id, m.run_id, m.restates, m.built_by, m.fingerprint, m.source]
                for name, m in self.materializations.items()
            },
            "c": {name: [c.state.value, c.target, c.event] for name, c in self.checks.items()},
        }
        if self.removed_at is not None:
            value["r"] = self.removed_at
        if self.failed_verifications:
            value["f"] = {name: [m.storage_id, m.run_id] for name, m in self.failed_verifications.items()}
        return value

    @classmethod
    def from_json(cls, rel: str, value: Mapping[str, Any]) -> "ShardLedger":
        return cls(
            rel,
            {name: Materialization(*fields) for name, fields in value.get("m", {}).items()},
            {
                name: CheckRecord(CheckState(s), target, event)
                for name, (s, target, event) in value.get("c", {}).items()
            },
            value.get("r"),
            {name: Materialization(storage_id, run_id) for name, (storage_id, run_id) in value.get("f", {}).items()},
        )


def _subject(asset: str) -> str:
    """An asset's verification in words: "its 512 verification", "its crop_bbox"."""
    return f"its {asset.removeprefix('verify_')} verification" if asset.startswith("verify_") else f"its {asset}"


def _named(outputs: Sequence[str]) -> str:
    words = [f"{name.removeprefix('resized_')} output" if name.startswith("resized_") else name for name in outputs]
    return " and ".join(words)
