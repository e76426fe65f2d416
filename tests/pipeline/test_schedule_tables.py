"""The tables of the interleaved and zero-bubble schedules, as ``Schedule.table()`` prints them (docs/engine.md)."""

from __future__ import annotations

import pytest

from mpi4dl_nb.pipeline.schedules import interleaved, zb1, zbv

TABLES = {
    "interleaved(2, 2, virtual_stages=2)": """\
tick | rank 0    | rank 1
     | s0,s2     | s1,s3
-----+-----------+----------
   0 | F0@s0     |
   1 | F1@s0     | F0@s1
   2 | F0@s2     | F1@s1
   3 | F1@s2     | F0@s3
   4 |           | B0@s3
   5 | B0@s2     | F1@s3
   6 |           | B1@s3
   7 | B1@s2     | B0@s1
   8 | B0@s0     | B1@s1
   9 | B1@s0     |
  10 | AR AR OPT | AR AR OPT
""",
    "zb1(3, 4)": """\
tick | rank 0 | rank 1 | rank 2
     | s0     | s1     | s2
-----+--------+--------+-------
   0 | F0     |        |
   1 | F1     | F0     |
   2 | F2     | F1     | F0
   3 |        |        | I0
   4 |        | I0     | F1
   5 | I0     | F2     | I1
   6 | W0     | I1     | F2
   7 | F3     | W0     | I2
   8 | I1     | F3     | W0
   9 | W1     | I2     | F3
  10 | I2     | W1     | I3
  11 | W2     | I3     | W1
  12 | I3     | W2     | W2
  13 | W3     | W3     | W3
  14 | AR OPT | AR OPT | AR OPT
""",
    "zbv(2, 2)": """\
tick | rank 0    | rank 1
     | s0,s3     | s1,s2
-----+-----------+----------
   0 | F0@s0     |
   1 | F1@s0     | F0@s1
   2 |           | F0@s2
   3 | F0@s3     | F1@s1
   4 | I0@s3     | F1@s2
   5 | W0@s3     | I0@s2
   6 | F1@s3     | W0@s2
   7 | I1@s3     | I0@s1
   8 | W1@s3     | I1@s2
   9 | I0@s0     | I1@s1
  10 | W0@s0     | W0@s1
  11 | I1@s0     | W1@s2
  12 | W1@s0     | W1@s1
  13 | AR AR OPT | AR AR OPT
""",
}


@pytest.mark.parametrize("call", sorted(TABLES))
def test_the_table_a_schedule_prints(call: str) -> None:
    schedule = eval(call, {"interleaved": interleaved, "zb1": zb1, "zbv": zbv})
    assert schedule.table().rstrip() == TABLES[call].rstrip()
