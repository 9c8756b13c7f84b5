"""clusterdns.lograte: one log line per interval, counting what happened in between."""
from clusterdns.lograte import LogLimit


def test_one_line_per_interval_with_the_count_since_the_last():
    now = [100.0]
    limit = LogLimit(10.0, clock=lambda: now[0])
    assert limit.due() == 1                    # the first occurrence is reported at once
    assert [limit.due() for _ in range(3)] == [0, 0, 0]
    now[0] = 109.9
    assert limit.due() == 0
    now[0] = 110.0                             # an interval after the last line
    assert limit.due() == 5                    # the four held back and this one
    assert limit.due() == 0
    now[0] = 200.0
    assert limit.due() == 2
