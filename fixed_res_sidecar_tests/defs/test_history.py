"""defs/history.py against a real PostgreSQL server that goes away: storage calls wait for it, within a budget."""

import logging
import threading
import time

import dagster as dg
import pytest

from fixed_res_sidecar.defs import history
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar_tests.fixtures.postgres import restart_postgres, stop_postgres

KEYS = DatasetKeys("tiny")
REL = "part-a.parquet"


@pytest.fixture
def private_instance(private_postgres_database, tmp_path):
    with private_postgres_database.instance(tmp_path) as instance:
        yield instance


class Waits(logging.Handler):
    """The retries' log lines; `waited` is set at the first wait."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.waited = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if self.messages[-1].startswith("storage unavailable"):
            self.waited.set()


def test_reads_wait_out_a_database_restart_and_give_up_after_their_budget(private_instance, private_postgres_server):
    """The database stops (a fast shutdown): a read with a 1 s budget fails naming the call once
    dagster-postgres' own connection retries (about 11 s) gave up; a read with the default budget
    logs its wait, and returns once the database is started again (after that wait, not on a timer)."""
    instance, server = private_instance, private_postgres_server
    instance.report_runless_asset_event(dg.AssetMaterialization(KEYS.main, partition=REL))
    waits = Waits()
    logging.getLogger(history.__name__).addHandler(waits)
    try:
        stop_postgres(server)
        with pytest.raises(
            history.EventLogUnavailable, match=r"did not answer for \d+ s \(1 attempt\(s\) of fetch_mat"
        ):
            history.storage_call(instance.fetch_materializations, dg.AssetRecordsFilter(KEYS.main), limit=1, budget=1)
        assert not waits.messages  # the budget was spent in the first attempt

        def restart_after_the_first_wait() -> None:
            waits.waited.wait(timeout=120)
            restart_postgres(server)

        restart = threading.Thread(target=restart_after_the_first_wait)
        restart.start()
        try:
            record = history.latest_materialization(instance, KEYS.main, REL)
        finally:
            restart.join()
    finally:
        logging.getLogger(history.__name__).removeHandler(waits)
    assert record is not None and record.partition_key == REL
    assert waits.messages[0].startswith("storage unavailable (attempt 1 of fetch_materializations"), waits.messages
    assert waits.messages[-1].startswith("storage answered again after"), waits.messages


def test_errors_that_are_not_an_outage_are_not_retried():
    calls = []

    def wrong() -> None:
        calls.append(time.monotonic())
        raise ValueError("a bad query")

    with pytest.raises(ValueError, match="a bad query"):
        history.storage_call(wrong)
    assert len(calls) == 1
