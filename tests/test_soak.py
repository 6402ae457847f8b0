"""A bounded soak; the figures are printed (run pytest with -s), never asserted as timings."""
import pytest
from helpers import soak


@pytest.mark.slow
def test_soak_verifies_everything_and_readers_do_not_grow():
    result = soak.run(seconds=60)
    print(soak.describe(result))
    assert result["exit_codes"] == [0] * 6
    assert result["windows_verified"] > 0 and result["steps_written"] > 0
    for start, end in result["reader_rss_kib"]:
        assert end - start < 16 * 1024, f"reader private memory grew from {start} to {end} KiB"
