import pytest

from lisaft.config.hub import can_only_be_path


@pytest.mark.parametrize("ref", ["meta-llama/Llama-3.1-8B", "gpt2", "tatsu-lab/alpaca"])
def test_hub_ids_are_name_or_org_slash_name(ref):
    assert not can_only_be_path(ref) and not can_only_be_path(ref, data_file=True)


@pytest.mark.parametrize("ref", ["./model", "../m", "/models/llama", "~/m", "a/b/c", "dir\\model"])
def test_anything_else_can_only_be_a_path(ref):
    assert can_only_be_path(ref)


def test_a_data_reference_with_a_file_suffix_is_a_path():
    assert can_only_be_path("train.jsonl", data_file=True) and can_only_be_path("org/rows.csv", data_file=True)
    assert not can_only_be_path("train.jsonl")  # a model reference: the suffix says nothing
