import pytest

from fixed_res_sidecar.cli.common import UsageError, main_shards, usage_error
from fixed_res_sidecar.io.locations import Location


def test_usage_error_prints_and_returns_2(capsys):
    assert usage_error("bad flag") == 2
    assert capsys.readouterr().err == "sidecar-ops: error: bad flag\n"


def test_an_empty_main_dataset_is_a_usage_error(tmp_path):
    (tmp_path / "notes.txt").write_text("no shards here")
    with pytest.raises(UsageError, match="no \\*.parquet shards under"):
        main_shards(Location.parse(tmp_path))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.parquet").write_bytes(b"")
    assert main_shards(Location.parse(tmp_path)) == ["a/x.parquet"]
