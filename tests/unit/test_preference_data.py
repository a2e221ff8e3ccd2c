"""data.format preference: pairs that share their prompt's tokens, scored on their answers only."""

import warnings
from pathlib import Path

import pytest

from lisaft.data.collate import IGNORE_INDEX
from lisaft.data.digest import examples_digest
from lisaft.data.examples import build_examples
from lisaft.data.formats import data_format
from lisaft.data.formats.base import DataWarning
from lisaft.data.read import Rows, rename_columns
from lisaft.errors import LisaftError
from lisaft.generate.command import prompt_and_reference

TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "tokenizer"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def _pairs(tok, *rows, columns=None):
    return build_examples(rename_columns(Rows(list(rows), "data.train", "t.jsonl", "line"), columns or {}),
                          "preference", tok)


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _scored(seq):
    return [t for t, label in zip(seq["input_ids"], seq["labels"]) if label != IGNORE_INDEX]


def test_strings_are_bos_prompt_then_answer_and_eos(tok):
    (pair,) = _pairs(tok, {"prompt": "Reverse abc", "chosen": "cba", "rejected": "abc"})
    prompt = [tok.bos_token_id] + _enc(tok, "Reverse abc")
    for k, answer in (("chosen", "cba"), ("rejected", "abc")):
        seq = pair[k]
        assert seq["input_ids"] == prompt + _enc(tok, answer) + [tok.eos_token_id]
        assert seq["labels"][:len(prompt)] == [IGNORE_INDEX] * len(prompt)
        assert _scored(seq) == _enc(tok, answer) + [tok.eos_token_id]


def test_conversations_score_the_assistant_answer_and_whole_ones_split_at_the_shared_turns(tok):
    user = {"role": "user", "content": "abc"}
    good, bad = {"role": "assistant", "content": "cba"}, {"role": "assistant", "content": "bca"}
    (split,) = _pairs(tok, {"prompt": [user], "chosen": [good], "rejected": [bad]})
    (whole,) = _pairs(tok, {"prompt": "abc", "chosen": [user, good], "rejected": [user, bad]})
    (repeat,) = _pairs(tok, {"prompt": [user], "chosen": [user, good], "rejected": [user, bad]})
    assert split == whole == repeat
    chat = build_examples(Rows([{"messages": [user, good]}], "data.train", "t", "line"), "chat", tok)[0]
    assert split["chosen"] == chat  # spans found as the chat format finds them
    assert split["chosen"]["input_ids"][:5] == split["rejected"]["input_ids"][:5]
    assert tok.decode(_scored(split["rejected"]), skip_special_tokens=True).strip() == "bca"


def test_columns_rename_the_fields(tok):
    row = {"question": "Reverse abc", "good": "cba", "bad": "abc"}
    (pair,) = _pairs(tok, row, columns={"question": "prompt", "good": "chosen", "bad": "rejected"})
    assert _scored(pair["chosen"]) == _enc(tok, "cba") + [tok.eos_token_id]


@pytest.mark.parametrize("row, words", [
    ({"prompt": "p", "chosen": "", "rejected": "x"}, "line 1: the chosen answer is empty"),
    ({"prompt": "p", "chosen": "x", "rejected": " "}, "line 1: the rejected answer is empty"),
    ({"prompt": "p", "chosen": "x", "rejected": "x"}, "line 1: chosen and rejected are the same answer"),
    ({"prompt": "p", "chosen": "x"}, "line 1: missing field 'rejected'"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "line 1: chosen and rejected are the same"),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
     "line 1: no prompt"),
])
def test_bad_rows_are_refused_naming_the_row(tok, row, words):
    with pytest.raises(LisaftError, match=words) as e:
        _pairs(tok, row)
    assert "t.jsonl" in str(e.value) and "\n" not in str(e.value)


USER, GOOD = {"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}
NULL = "line 1: field 'rejected' is empty \\(null\\); give it a value$"


@pytest.mark.parametrize("row, words", [
    ({"chosen": [USER, GOOD], "rejected": [USER, GOOD]}, "line 1: chosen and rejected are the same conversation$"),
    ({"chosen": [USER], "rejected": [USER, GOOD]},
     "line 1: the chosen conversation has no assistant turn after the prompt's 1 turn: nothing to score$"),
    ({"prompt": [USER], "chosen": [USER], "rejected": [GOOD]},
     "line 1: the chosen conversation has no assistant turn after the prompt's 1 turn"),
    ({"prompt": [USER], "chosen": [GOOD], "rejected": None}, NULL),
    ({"prompt": "p", "chosen": "x", "rejected": None}, NULL),
    ({"prompt": [USER, {"role": "assistant", "content": "Sure,"}], "chosen": [GOOD],
      "rejected": [{"role": "assistant", "content": "no"}]},
     "line 1: the prompt ends with an assistant turn \\(a prefill\\), which lisaft does not continue"),
])
def test_conversational_refusals_name_the_fault(tok, row, words):
    with pytest.raises(LisaftError, match=words) as e:
        _pairs(tok, row)
    assert "answer is empty" not in str(e.value) and "data.columns" not in str(e.value)


def test_truncation_cuts_answers_never_the_prompt_and_counts_them(tok):
    rows = Rows([{"prompt": "Reverse abc", "chosen": "cba" * 20, "rejected": "x"},
                 {"prompt": "Sort", "chosen": "a", "rejected": "b"}], "data.train", "t.jsonl", "line")
    fmt = data_format("preference")
    pairs = fmt.examples(rows, tok, None, {})
    prompt = pairs[0]["chosen"]["labels"].index(next(label for label in pairs[0]["chosen"]["labels"]
                                                      if label != IGNORE_INDEX))
    with pytest.warns(DataWarning, match=r"1 of 2 pairs were longer than data.max_seq_len=20.*line 1\)"):
        fitted = fmt.fit(pairs, 20, rows)
    assert len(fitted[0]["chosen"]["input_ids"]) == 20 and fitted[0]["rejected"] == pairs[0]["rejected"]
    assert fitted[0]["chosen"]["input_ids"][:prompt] == pairs[0]["chosen"]["input_ids"][:prompt]
    assert fitted[1] == pairs[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(LisaftError, match=r"line 1: the prompt fills data.max_seq_len=3"):
            fmt.fit(pairs, 3, rows)


def test_the_digest_covers_both_answers(tok):
    a = _pairs(tok, {"prompt": "p", "chosen": "x", "rejected": "y"})
    b = _pairs(tok, {"prompt": "p", "chosen": "x", "rejected": "z"})
    assert examples_digest(a) != examples_digest(b)


def test_generate_prompts_with_the_trained_prompt(tok):
    row = {"prompt": "Reverse abc", "chosen": "cba", "rejected": "abc"}
    (pair,) = _pairs(tok, row)
    ids, reference, _ = prompt_and_reference(tok, "preference", Rows([row], "--input-file", "f", "line"), 0)
    assert ids == pair["chosen"]["input_ids"][:len(ids)] and reference == "cba"
    assert pair["chosen"]["labels"][len(ids)] != IGNORE_INDEX
    user = {"role": "user", "content": "abc"}
    talk = {"prompt": "abc", "chosen": [user, {"role": "assistant", "content": "cba"}],
            "rejected": [user, {"role": "assistant", "content": "x"}]}
    (pair,) = _pairs(tok, talk)
    ids, reference, _ = prompt_and_reference(tok, "preference", Rows([{"chosen": talk["chosen"]}], "f", "f", "line"), 0)
    assert ids == pair["chosen"]["input_ids"][:len(ids)] and reference == "cba"
