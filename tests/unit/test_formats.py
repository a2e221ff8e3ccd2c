"""One object per data format: the registry holds exactly data.format's values, each with what
training, `lisaft generate` and the estimator ask of it."""

from typing import get_args

from lisaft.config.schema import DataSection
from lisaft.data.formats import FORMATS, data_format
from lisaft.data.formats.base import DataFormat


def test_the_registry_is_the_schemas_list_of_formats_in_its_order():
    assert tuple(FORMATS) == get_args(DataSection.model_fields["format"].annotation)


def test_each_format_is_one_object_that_says_what_it_reads():
    for name, fmt in FORMATS.items():
        assert isinstance(fmt, DataFormat) and fmt.name == name and data_format(name) is fmt
        assert fmt.describe().startswith(f"{name}: ") and "`" in fmt.describe()
        assert fmt.sequences_per_example in (1, 2)
        row = fmt.command_line_row("hello", None)
        assert "hello" in str(row)
    assert data_format("preference").sequences_per_example == 2
    assert data_format("text").sequences_per_example == 1
