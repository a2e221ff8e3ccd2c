"""data.format feedback: TRL's unpaired format, standard and conversational, scored on the
completion only, with its label kept through the cut and in the data's digest."""

from pathlib import Path

import pytest

from lisaft.data.collate import IGNORE_INDEX
from lisaft.data.digest import examples_digest
from lisaft.data.examples import build_examples
from lisaft.data.formats import data_format
from lisaft.data.read import Rows
from lisaft.errors import LisaftError

TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "tokenizer"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def _rows(tok, *rows):
    return build_examples(Rows(list(rows), "data.train", "t.jsonl", "line"), "feedback", tok)


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_strings_are_bos_prompt_then_completion_and_eos_with_the_label(tok):
    good, bad = _rows(tok, {"prompt": "Reverse abc", "completion": "cba", "label": True},
                      {"prompt": "Reverse abc", "completion": "abc", "label": False})
    prompt = [tok.bos_token_id] + _enc(tok, "Reverse abc")
    assert good["input_ids"] == prompt + _enc(tok, "cba") + [tok.eos_token_id]
    assert good["labels"] == [IGNORE_INDEX] * len(prompt) + _enc(tok, "cba") + [tok.eos_token_id]
    assert good["desirable"] is True and bad["desirable"] is False


def test_a_conversation_scores_the_assistant_turn_as_a_preference_pair_does(tok):
    user, answer = {"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}
    (row,) = _rows(tok, {"prompt": [user], "completion": [answer], "label": True})
    pair = build_examples(Rows([{"prompt": [user], "chosen": [answer], "rejected": [user | {"role": "assistant"}]}],
                               "data.train", "t", "line"), "preference", tok)[0]
    assert {k: row[k] for k in ("input_ids", "labels")} == pair["chosen"]


@pytest.mark.parametrize("row, words", [
    ({"prompt": "p", "completion": "c", "label": "yes"}, "field 'label' must be true"),
    ({"prompt": "p", "completion": "c"}, "missing field 'label'"),
    ({"prompt": "p", "completion": " ", "label": True}, "the completion is empty"),
])
def test_a_bad_row_is_refused_naming_it(tok, row, words):
    with pytest.raises(LisaftError, match=words) as e:
        _rows(tok, row)
    assert "line 1" in str(e.value)


def test_the_label_survives_the_cut_and_is_in_the_digest(tok):
    rows = Rows([{"prompt": "Reverse abc", "completion": "cba" * 20, "label": False}], "data.train", "t", "line")
    fmt = data_format("feedback")
    examples = fmt.examples(rows, tok, None, {})
    with pytest.warns(Warning, match="cut at the end"):
        (cut,) = fmt.fit(examples, 8, rows)
    assert len(cut["input_ids"]) == 8 and cut["desirable"] is False
    flipped = [{**examples[0], "desirable": True}]
    assert examples_digest(examples) != examples_digest(flipped)
