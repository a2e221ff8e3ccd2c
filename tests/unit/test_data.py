"""Data loading, formats and masking, packing, splits, and the resumable data order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lisaft.config.schema import DataSection
from lisaft.data.collate import IGNORE_INDEX, collate
from lisaft.data.examples import DataWarning, load_splits, render_instruction_prompt
from lisaft.data.order import DataOrder, eval_index_batches
from lisaft.errors import LisaftError

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QUICKSTART / "tokenizer"))


@pytest.fixture
def no_datasets_cache(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return datasets


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def response_ids(ex) -> list[int]:
    return [l for l in ex["labels"] if l != IGNORE_INDEX]


def split(tmp_path, rows, **kw):
    kw.setdefault("format", "instruction")
    return DataSection(train=write_jsonl(tmp_path / "train.jsonl", rows), **kw)


INSTR = [
    {"instruction": "Reverse", "input": "abc", "output": "cba"},
    {"instruction": "Say hi", "output": "hi there"},
    {"instruction": "Uppercase", "input": "", "output": "XY"},
]


# --- formats and masking ----------------------------------------------------------------------


def test_instruction_masks_everything_but_output_and_eos(tmp_path, tok):
    train, evals = load_splits(split(tmp_path, INSTR), tok, seed=0)
    assert evals is None and len(train) == 3
    for row, ex in zip(INSTR, train):
        prompt = [tok.bos_token_id] + enc(tok, render_instruction_prompt(row["instruction"], row.get("input")))
        response = enc(tok, row["output"]) + [tok.eos_token_id]
        assert ex["input_ids"] == prompt + response
        assert ex["labels"] == [IGNORE_INDEX] * len(prompt) + response


def test_instruction_template_leaves_out_empty_input():
    assert "### Input:" not in render_instruction_prompt("Uppercase", "")
    assert render_instruction_prompt("Reverse", "abc") == (
        "### Instruction:\nReverse\n\n### Input:\nabc\n\n### Response:\n"
    )


def test_text_has_loss_everywhere_and_ends_in_eos(tmp_path, tok):
    section = split(tmp_path, [{"text": "hello world"}], format="text")
    (ex,), _ = load_splits(section, tok, seed=0)
    assert ex["input_ids"] == [tok.bos_token_id] + enc(tok, "hello world") + [tok.eos_token_id]
    assert ex["labels"] == ex["input_ids"]


CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_chat_loss_only_on_assistant_turns(tmp_path, tok):
    section = split(tmp_path, [{"messages": CHAT}], format="chat")
    (ex,), _ = load_splits(section, tok, seed=0)
    full = tok.apply_chat_template(CHAT, tokenize=False)
    assert ex["input_ids"] == enc(tok, full)  # the template's own BOS, nothing added twice
    assert ex["input_ids"].count(tok.bos_token_id) == 1
    # Labelled positions form exactly the two assistant turns: content and the closing EOS.
    runs, cur = [], []
    for t, l in zip(ex["input_ids"], ex["labels"]):
        if l == IGNORE_INDEX:
            if cur:
                runs.append(cur)
            cur = []
        else:
            assert l == t
            cur.append(t)
    runs.append(cur)
    assert runs == [enc(tok, "hello") + [tok.eos_token_id], enc(tok, "4") + [tok.eos_token_id]]


def test_chat_appends_eos_when_template_leaves_turn_open(tmp_path, tok):
    import copy

    open_tok = copy.deepcopy(tok)
    open_tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
        "{% if add_generation_prompt %}assistant: {% endif %}"
    section = split(tmp_path, [{"messages": CHAT[1:3]}], format="chat")
    (ex,), _ = load_splits(section, open_tok, seed=0)
    assert ex["input_ids"][-1] == tok.eos_token_id
    assert response_ids(ex) == enc(tok, "hello\n") + [tok.eos_token_id]


def test_chat_without_template_is_an_error(tmp_path, tok):
    import copy

    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(LisaftError, match="no chat template"):
        load_splits(split(tmp_path, [{"messages": CHAT}], format="chat"), bare, seed=0)


# --- truncation, dropping, packing ----------------------------------------------------------


def test_truncation_cuts_at_the_end_and_warns(tmp_path, tok):
    rows = [{"text": "abcdefghijklmnop"}, {"text": "ab"}]
    with pytest.warns(DataWarning, match=r"train.jsonl: 1 of 2 examples were longer .* \(line 1\)$"):
        train, _ = load_splits(split(tmp_path, rows, format="text", max_seq_len=8), tok, seed=0)
    assert [len(ex["input_ids"]) for ex in train] == [8, 4]
    assert train[0]["input_ids"] == [tok.bos_token_id] + enc(tok, "abcdefg")


@pytest.mark.filterwarnings("ignore:.*were longer than:lisaft.data.examples.DataWarning")
def test_examples_without_response_left_are_dropped_with_a_count(tmp_path, tok):
    rows = [{"instruction": "Reverse", "input": "abcdefghij" * 3, "output": "x"}] + INSTR[:1]
    with pytest.warns(DataWarning, match=r"train.jsonl: dropped 1 of 2 .*: line 1$"):
        train, _ = load_splits(split(tmp_path, rows, max_seq_len=20), tok, seed=0)
    assert len(train) == 1 and response_ids(train[0]) == enc(tok, "cba") + [tok.eos_token_id]


@pytest.mark.filterwarnings("ignore:.*were longer than:lisaft.data.examples.DataWarning")
def test_dropped_examples_are_named_by_line_a_few_at_most(tmp_path, tok):
    long = {"instruction": "Reverse", "input": "abcdefghij" * 3, "output": "x"}
    rows = [long, INSTR[0], long, long, INSTR[0], long, long, long, long]
    with pytest.warns(DataWarning, match=r"dropped 7 of 9 .*: lines 1, 3, 4, 6, 7 and 2 more$"):
        load_splits(split(tmp_path, rows, max_seq_len=20), tok, seed=0)
    (tmp_path / "two").mkdir()
    with pytest.warns(DataWarning, match=r"dropped 2 of 3 .*: lines 1 and 3$"):
        load_splits(split(tmp_path / "two", rows[:3], max_seq_len=20), tok, seed=0)


@pytest.mark.filterwarnings("ignore::lisaft.data.examples.DataWarning")
def test_eval_is_not_packed(tmp_path, tok):
    ev = write_jsonl(tmp_path / "eval.jsonl", INSTR)
    section = split(tmp_path, INSTR * 4, eval=ev, packing=True, max_seq_len=16)
    _, evals = load_splits(section, tok, seed=0)
    assert len(evals) == 3 and any(len(ex["input_ids"]) != 16 for ex in evals)


# --- eval splits ------------------------------------------------------------------------------


def test_eval_fraction_split_is_seeded_and_disjoint(tmp_path, tok):
    rows = [{"text": f"row {i}"} for i in range(50)]
    section = split(tmp_path, rows, format="text", eval_fraction=0.2)
    key = lambda exs: {tuple(ex["input_ids"]) for ex in exs}  # noqa: E731
    t1, e1 = load_splits(section, tok, seed=3)
    t2, e2 = load_splits(section, tok, seed=3)
    t3, e3 = load_splits(section, tok, seed=4)
    assert len(e1) == 10 and len(t1) == 40
    assert key(e1) == key(e2) and key(t1) == key(t2)
    assert not key(e1) & key(t1) and len(key(e1) | key(t1)) == 50
    assert key(e3) != key(e1)


def test_eval_file_is_loaded(tmp_path, tok):
    ev = write_jsonl(tmp_path / "eval.jsonl", INSTR[:2])
    train, evals = load_splits(split(tmp_path, INSTR, eval=ev), tok, seed=0)
    assert len(train) == 3 and len(evals) == 2


def test_quickstart_data_loads(tok):
    section = DataSection(
        train=str(QUICKSTART / "train.jsonl"), eval=str(QUICKSTART / "eval.jsonl"), format="instruction",
        max_seq_len=64,
    )
    train, evals = load_splits(section, tok, seed=0)
    assert len(train) > 1000 and len(evals) > 100
    assert all(tok.unk_token_id not in ex["input_ids"] for ex in train + evals)
    train_prompts = {tuple(t for t, l in zip(ex["input_ids"], ex["labels"]) if l == IGNORE_INDEX) for ex in train}
    eval_prompts = {tuple(t for t, l in zip(ex["input_ids"], ex["labels"]) if l == IGNORE_INDEX) for ex in evals}
    assert not train_prompts & eval_prompts


# --- bad input ------------------------------------------------------------------------------


def test_missing_field_names_file_and_line(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(INSTR[0]) + "\n\n" + json.dumps({"instruction": "x"}) + "\n")
    with pytest.raises(LisaftError, match=r"data\.train: .*train\.jsonl: line 3: missing field 'output'"):
        load_splits(DataSection(train=str(path), format="instruction"), tok, seed=0)


def test_wrong_type_names_file_and_line(tmp_path, tok):
    section = split(tmp_path, [INSTR[0], {"instruction": "Add", "output": 5}])
    with pytest.raises(LisaftError, match=r"train\.jsonl: line 2: field 'output' must be a string"):
        load_splits(section, tok, seed=0)


@pytest.mark.parametrize("messages", [None, "hi", [{"role": "user"}], [{"role": "user", "content": 3}]])
def test_bad_messages_name_the_line(tmp_path, tok, messages):
    row = {"messages": messages} if messages is not None else {"text": "x"}
    section = split(tmp_path, [{"messages": CHAT}, row], format="chat")
    with pytest.raises(LisaftError, match=r"train\.jsonl: line 2: .*messages"):
        load_splits(section, tok, seed=0)


def test_invalid_json_line(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(LisaftError, match=r"train\.jsonl: line 2: not valid JSON"):
        load_splits(DataSection(train=str(path)), tok, seed=0)


@pytest.mark.parametrize("line, problem", [
    ('{"text": "ab', "Unterminated string starting at column 10)"),
    ('{"text": "a"', "the line ends before its JSON object does; was the file cut short?)"),
    ('{"text": "a" "b"}', "Expecting ',' delimiter at column 14)"),
])
def test_a_bad_json_line_says_where_in_whole_words(tmp_path, tok, line, problem):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n' + line)
    with pytest.raises(LisaftError) as e:
        load_splits(DataSection(train=str(path)), tok, seed=0)
    assert str(e.value) == f"data.train: {path}: line 2: not valid JSON ({problem}"


def test_missing_files_name_the_key_and_path(tmp_path, tok):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(LisaftError, match=r"^data\.train: .*nope\.jsonl: no such file"):
        load_splits(DataSection(train=missing), tok, seed=0)
    ok = write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}])
    with pytest.raises(LisaftError, match=r"^data\.eval: .*nope\.jsonl: no such file"):
        load_splits(DataSection(train=ok, eval=missing), tok, seed=0)


def test_empty_dataset_is_an_error(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    path.write_text("\n")
    with pytest.raises(LisaftError, match="empty"):
        load_splits(DataSection(train=str(path)), tok, seed=0)


def test_unsupported_file_type(tmp_path, tok):
    path = tmp_path / "train.txt"
    path.write_text("hello\n")
    with pytest.raises(LisaftError, match="unsupported file type"):
        load_splits(DataSection(train=str(path)), tok, seed=0)


# --- other sources ----------------------------------------------------------------------------


def test_json_array_file(tmp_path, tok):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(INSTR))
    train, _ = load_splits(DataSection(train=str(path), format="instruction"), tok, seed=0)
    assert len(train) == 3


def test_csv_keeps_numbers_as_text_and_names_rows(tmp_path, tok, no_datasets_cache):
    path = tmp_path / "train.csv"
    path.write_text("instruction,input,output\nAdd,1+2,3\nAdd,,40\n")
    train, _ = load_splits(DataSection(train=str(path), format="instruction"), tok, seed=0)
    assert [response_ids(ex) for ex in train] == [enc(tok, "3") + [2], enc(tok, "40") + [2]]
    bad = tmp_path / "bad.csv"
    bad.write_text("instruction,output\nAdd,3\nAdd,\n")
    with pytest.raises(LisaftError, match=r"bad\.csv: row 2: field 'output' is empty \(null\)"):
        load_splits(DataSection(train=str(bad), format="instruction"), tok, seed=0)


def test_parquet_and_saved_folder(tmp_path, tok, no_datasets_cache):
    datasets = no_datasets_cache
    ds = datasets.Dataset.from_list(INSTR)
    ds.to_parquet(str(tmp_path / "train.parquet"))
    datasets.DatasetDict(train=ds, validation=ds.select([0])).save_to_disk(str(tmp_path / "saved"))
    from_parquet, _ = load_splits(
        DataSection(train=str(tmp_path / "train.parquet"), format="instruction"), tok, seed=0)
    from_disk, evals = load_splits(
        DataSection(train=str(tmp_path / "saved"), eval=str(tmp_path / "saved"), format="instruction"), tok, seed=0)
    assert from_parquet == from_disk and len(from_disk) == 3 and len(evals) == 1


def test_hub_name_offline_is_one_clear_error(tok, no_datasets_cache, monkeypatch):
    monkeypatch.setattr(no_datasets_cache.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(LisaftError, match=r"^data\.train: 'someorg/somedata' is not a local file .*hub"):
        load_splits(DataSection(train="someorg/somedata"), tok, seed=0)


# --- order, batches, collate ----------------------------------------------------------------


def drain(order: DataOrder, n: int) -> list[list[int]]:
    return [order.next_indices() for _ in range(n)]


def test_order_is_deterministic_and_epochs_are_permutations():
    a, b = DataOrder(10, 3, seed=7), DataOrder(10, 3, seed=7)
    batches = drain(a, 9)
    assert batches == drain(b, 9)
    assert all(len(x) == 3 for x in batches)
    for epoch in range(3):  # 3 full batches per epoch; the 10th example waits for the next one
        seen = [i for x in batches[3 * epoch:3 * epoch + 3] for i in x]
        assert len(set(seen)) == 9 and set(seen) <= set(range(10))
    assert batches[:3] != batches[3:6]
    assert drain(DataOrder(10, 3, seed=8), 3) != batches[:3]


def test_resume_mid_epoch_continues_exactly():
    ref = DataOrder(20, 4, seed=1)
    expected = drain(ref, 12)
    first = DataOrder(20, 4, seed=1)
    drain(first, 7)
    state = json.loads(json.dumps(first.state_dict()))
    assert all(isinstance(v, int) for v in state.values())
    resumed = DataOrder(20, 4, seed=1)
    resumed.load_state_dict(state)
    assert drain(resumed, 5) == expected[7:]


def test_resume_refuses_a_different_dataset_size():
    state = DataOrder(20, 4, seed=1).state_dict()
    with pytest.raises(LisaftError, match="20 training examples"):
        DataOrder(21, 4, seed=1).load_state_dict(state)


def test_two_ranks_see_what_one_process_with_double_batch_sees():
    single = drain(DataOrder(23, 6, seed=5), 10)
    r0 = drain(DataOrder(23, 3, seed=5, rank=0, world_size=2), 10)
    r1 = drain(DataOrder(23, 3, seed=5, rank=1, world_size=2), 10)
    assert [a + b for a, b in zip(r0, r1)] == single
    # GRPO's ranks take the whole global batch (and their share of it themselves), in the same state.
    whole, shard = (DataOrder(23, 3, seed=5, rank=1, world_size=2, whole=w) for w in (True, False))
    assert drain(whole, 10) == single and drain(shard, 10) == r1 and whole.state_dict() == shard.state_dict()


def test_dataset_smaller_than_one_batch():
    with pytest.raises(LisaftError, match="smaller than one batch"):
        DataOrder(5, 3, seed=0, world_size=2)


def test_eval_index_batches_cover_everything_once():
    assert eval_index_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert eval_index_batches(0, 3) == []


def test_collate_right_pads():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


# --- column mapping, roles, template, hub splits, permissions ------------------------------------


def test_prompt_completion_columns_map_to_instruction_output(tmp_path, tok):
    rows = [{"prompt": r["instruction"], "context": r.get("input", ""), "completion": r["output"]} for r in INSTR]
    mapped, _ = load_splits(split(tmp_path, rows, columns={"prompt": "instruction", "context": "input",
                                                             "completion": "output"}), tok, seed=0)
    (tmp_path / "ref").mkdir()
    direct, _ = load_splits(split(tmp_path / "ref", INSTR), tok, seed=0)
    assert mapped == direct


def test_sharegpt_conversations_with_from_value_and_role_names(tmp_path, tok):
    share = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
             for m in CHAT]
    section = split(tmp_path, [{"conversations": share}], format="chat",
                    columns={"conversations": "messages", "from": "role", "value": "content"},
                    roles={"human": "user", "gpt": "assistant"})
    (ex,), _ = load_splits(section, tok, seed=0)
    (tmp_path / "ref").mkdir()
    (ref,), _ = load_splits(split(tmp_path / "ref", [{"messages": CHAT}], format="chat"), tok, seed=0)
    assert ex == ref


@pytest.mark.parametrize("role", ["bot", "model", "Assistant"])
def test_an_unknown_role_names_the_role_and_the_line(tmp_path, tok, role):
    bad = [dict(m) for m in CHAT]
    bad[-1]["role"] = role
    section = split(tmp_path, [{"messages": CHAT}, {"messages": bad}], format="chat")
    with pytest.raises(LisaftError, match=rf"train.jsonl: line 2: messages\[{len(CHAT) - 1}\] has role "
                                          rf"'{role}'.*data.roles"):
        load_splits(section, tok, seed=0)


@pytest.mark.parametrize("role, hint", [
    ("human", "e.g. {human: user}"), ("gpt", "e.g. {gpt: assistant}"), ("Model", "e.g. {Model: assistant}"),
    ("speaker_b", "to the role it plays: {speaker_b: user}, {speaker_b: assistant} or {speaker_b: system}"),
])
def test_an_unknown_role_is_hinted_at_the_role_it_plays(tmp_path, tok, role, hint):
    """A user's turn mapped to assistant would put the loss on the user's words."""
    bad = [dict(m) for m in CHAT]
    bad[1]["role"] = role
    section = split(tmp_path, [{"messages": bad}], format="chat")
    with pytest.raises(LisaftError) as e:
        load_splits(section, tok, seed=0)
    assert str(e.value).endswith("map it with data.roles, " + hint)


def test_instruction_template_is_used_for_the_prompt(tmp_path, tok):
    template = "Q: {instruction} {input}\nA: "
    (ex, *_), _ = load_splits(split(tmp_path, INSTR, template=template), tok, seed=0)
    prompt = render_instruction_prompt("Reverse", "abc", template)
    assert prompt == "Q: Reverse abc\nA: "
    n_prompt = len([tok.bos_token_id] + enc(tok, prompt))
    assert ex["input_ids"][:n_prompt] == [tok.bos_token_id] + enc(tok, prompt)
    assert response_ids(ex) == enc(tok, "cba") + [tok.eos_token_id]


@pytest.mark.parametrize("template, needle", [
    ("{input}", "must contain {instruction}"),
    ("{instruction} {output}", "unknown field {output}"),
    ("{instruction", "not a valid template"),
])
def test_bad_template_is_a_recipe_error(template, needle):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=needle):
        DataSection(train="x.jsonl", template=template)


def test_hub_dataset_subset_and_split_reach_datasets(tmp_path, tok, no_datasets_cache, monkeypatch):
    """No hub here: load_dataset is replaced to see what lisaft asks of it; a saved DatasetDict
    shows the split being picked by data.train_split."""
    from datasets import Dataset, DatasetDict

    asked = []

    def load_dataset(ref, subset):
        asked.append((ref, subset))
        return DatasetDict({"train": Dataset.from_list(INSTR[:1]), "test": Dataset.from_list(INSTR)})

    monkeypatch.setattr(no_datasets_cache, "load_dataset", load_dataset)
    train, evals = load_splits(DataSection(train="org/data", eval="org/data", subset="en", eval_split="test",
                                           format="instruction"), tok, seed=0)
    assert asked == [("org/data", "en")] * 2 and (len(train), len(evals)) == (1, 3)

    DatasetDict({"train": Dataset.from_list(INSTR[:1]), "other": Dataset.from_list(INSTR)}).save_to_disk(
        str(tmp_path / "saved"))
    train, _ = load_splits(DataSection(train=str(tmp_path / "saved"), format="instruction",
                                       train_split="other"), tok, seed=0)
    assert len(train) == 3
    with pytest.raises(LisaftError, match="data.train_split: .* has no split 'nope'; it has other, train"):
        load_splits(DataSection(train=str(tmp_path / "saved"), format="instruction", train_split="nope"),
                    tok, seed=0)


def test_unreadable_data_file_is_a_permission_error(tmp_path, tok):
    from _unprivileged import lisaft_error_as_unprivileged, open_dir

    path = open_dir(tmp_path) / "train.jsonl"
    write_jsonl(path, INSTR)
    path.chmod(0)
    message = lisaft_error_as_unprivileged(lambda: load_splits(DataSection(train=str(path)), tok, seed=0))
    assert message == f"data.train: {path}: permission denied; make it readable (chmod a+r) or point " \
                      "data.train to a copy you can read"
