import warnings

import pytest

from lisaft.console import LisaftWarning, first_line, warn


@pytest.mark.parametrize("error, line", [
    (ValueError("bad value\nmore detail"), "bad value"),
    (ValueError("\n  \nsecond line is the first with text"), "second line is the first with text"),
    (KeyError(), "KeyError"),
    (OSError(""), "OSError"),
])
def test_first_line_is_one_line_even_of_an_empty_message(error, line):
    assert first_line(error) == line


def test_warn_goes_through_the_warnings_module():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("checkpoint skipped")
    assert [(w.category, str(w.message)) for w in caught] == [(LisaftWarning, "checkpoint skipped")]
