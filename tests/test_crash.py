"""Crash safety: SIGKILL writers, readers and attachers at random instants."""
import pytest
from helpers import crash_harness


@pytest.mark.slow
def test_kill_loop_never_tears_hangs_or_leaks():
    report = crash_harness.run(rounds=200, n_writers=3, seed=1)
    print(report.line())
    assert report.rounds == 200 and report.kills == 200
    assert report.torn_windows == 0 and report.hangs == 0, report.errors[:5]
    assert not report.errors, report.errors[:5]
    assert report.windows_verified > 200 * 8
