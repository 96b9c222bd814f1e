"""`sweep.py`'s committed record (`runs.jsonl`): seed ranges, and a record written with other settings is refused.

The real resume, with real runs, is in tests/system/test_mismatch_sweep.py (`test_resume_from_the_committed_record`).
"""

import json

import pytest
import sweep  # benchmarks/sanity (pytest's pythonpath)


def test_parse_seeds_ranges():
    assert sweep.parse_seeds("20-23") == [20, 21, 22, 23]
    assert sweep.parse_seeds("0,1,5-7,1") == [0, 1, 5, 6, 7]
    assert sweep.parse_seeds("3") == [3]
    assert sweep.parse_args(["--seeds", "20-99"]).seed_list == list(range(20, 100))


def test_settings_id_follows_the_settings():
    base = sweep.parse_args(["--levels", "none", "--methods", "dppo_tv"])
    assert sweep.settings_id(base) == sweep.settings_id(sweep.parse_args(["--levels", "noise=0.3", "--seeds", "7"]))
    assert sweep.settings_id(base) != sweep.settings_id(sweep.parse_args(["--steps", "32"]))
    assert sweep.settings_id(base) != sweep.settings_id(sweep.parse_args(["--mismatch-seed", "1"]))


def test_record_from_other_settings_is_refused(tmp_path):
    args = sweep.parse_args(["--levels", "none", "--methods", "dppo_tv", "--seeds", "0"])
    row = {"level": "none", "method": "dppo_tv", "seed": 0, "collapsed": False}
    path = tmp_path / sweep.RECORD
    path.write_text(json.dumps({"settings_id": sweep.settings_id(args), **row}) + "\n")
    assert sweep.read_record(str(path), sweep.settings_id(args)) == {("none", "dppo_tv", 0): row}
    other = sweep.settings_id(sweep.parse_args(["--steps", "2"]))
    with pytest.raises(SystemExit, match="other settings"):
        sweep.read_record(str(path), other)
    # A fresh sweep into a folder whose record holds its runs must be told to resume, not silently start over.
    with pytest.raises(SystemExit, match="--resume"):
        sweep.main(["--levels", "none", "--methods", "dppo_tv", "--seeds", "0", "--output-dir", str(tmp_path)])


def test_a_half_written_run_file_is_not_finished(tmp_path):
    """A run file caught mid-write (an older worker writing in place) is read again later, never recorded half."""
    out = tmp_path / "none__dppo_tv__0.json"
    out.write_text('{"method": "dppo_tv", "seed": 0, "curv')
    job = {"level": "none", "method": "dppo_tv", "seed": 0, "out": str(out)}
    assert sweep.job_row(job) is None
    record: dict = {}
    sweep.sync_record([job], str(tmp_path / sweep.RECORD), "0" * 16, record)
    assert record == {} and (tmp_path / sweep.RECORD).read_text() == ""
