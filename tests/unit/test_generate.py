"""`lisaft generate` prompts a model exactly as training laid out the prompt part of an example."""

from pathlib import Path

import pytest

from lisaft.data.collate import IGNORE_INDEX
from lisaft.data.examples import build_examples
from lisaft.data.read import Rows, rename_columns
from lisaft.errors import LisaftError
from lisaft.generate.command import prompt_and_reference, read_prompts
from lisaft.generate.target import resolve_target

TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def _trained_prompt(tokenizer, fmt, row, template=None, roles=None, columns=None):
    rows = rename_columns(Rows([row], "data.train", "test", "line"), columns or {})
    ex = build_examples(rows, fmt, tokenizer, template, roles)[0]
    first_loss = next(i for i, l in enumerate(ex["labels"]) if l != IGNORE_INDEX)
    return ex["input_ids"][:first_loss], ex["input_ids"][first_loss:]


@pytest.mark.parametrize("fmt, row, answer", [
    ("instruction", {"instruction": "Reverse", "input": "abc", "output": "cba"}, "cba"),
    ("instruction", {"instruction": "Say hi", "output": "hi"}, "hi"),
    ("chat", {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"},
                           {"role": "assistant", "content": "cba"}]}, "cba"),
])
def test_prompt_is_the_trained_prompt(tokenizer, fmt, row, answer):
    prompt, response = _trained_prompt(tokenizer, fmt, row)
    ids, reference, _ = prompt_and_reference(tokenizer, fmt, Rows([row], "--input-file", "f", "line"), 0)
    assert ids == prompt
    assert reference == answer
    assert tokenizer.decode(response, skip_special_tokens=True) == answer


SHAREGPT = {"conversations": "messages", "from": "role", "value": "content"}


@pytest.mark.parametrize("fmt, row, data, answer", [
    ("chat", {"conversations": [{"from": "human", "value": "abc"}, {"from": "gpt", "value": "cba"}]},
     {"columns": SHAREGPT, "roles": {"human": "user", "gpt": "assistant"}}, "cba"),
    ("instruction", {"prompt": "Reverse", "context": "abc", "completion": "cba"},
     {"columns": {"prompt": "instruction", "context": "input", "completion": "output"},
      "template": "Q: {instruction} {input}\nA: "}, "cba"),
])
def test_a_file_row_is_read_through_the_runs_columns_roles_and_template(tokenizer, tmp_path, fmt, row, data, answer):
    import json

    file = tmp_path / "eval.jsonl"
    file.write_text(json.dumps(row) + "\n")
    prompt, _ = _trained_prompt(tokenizer, fmt, row, data.get("template"), data.get("roles"), data["columns"])
    rows, given = read_prompts(None, None, file, fmt, None, data["columns"])
    assert given == [row]
    ids, reference, _ = prompt_and_reference(tokenizer, fmt, rows, 0, data.get("template"), data.get("roles"))
    assert (ids, reference) == (prompt, answer)


def test_a_row_missing_its_field_is_named_by_file_and_line(tokenizer, tmp_path):
    file = tmp_path / "eval.jsonl"
    file.write_text('{"instruction": "Say hi"}\n\n{"input": "x"}\n')
    rows, _ = read_prompts(None, None, file, "instruction", None)
    assert prompt_and_reference(tokenizer, "instruction", rows, 0)[1] is None
    with pytest.raises(LisaftError, match=rf"^--input-file: {file}: line 3: missing field 'instruction'"):
        prompt_and_reference(tokenizer, "instruction", rows, 1)


def test_run_folder_resolves_to_final_and_its_format(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (run / "recipe.yaml").write_text(
        "model: {config: c.json, tokenizer: t}\ndata: {train: x.jsonl, format: chat}\n"
        "training: {max_steps: 1, output_dir: run}\n")
    for path in (run, run / "final"):
        target = resolve_target(path, None)
        assert target.model_dir == run / "final" and target.format == "chat"
    assert resolve_target(run, "text").format == "text"


def test_unfinished_run_is_one_clear_error(tmp_path):
    (tmp_path / "recipe.yaml").write_text("x: 1\n")
    with pytest.raises(LisaftError, match="no final/ model yet"):
        resolve_target(tmp_path, None)


def test_a_model_folder_without_a_tokenizer_blames_the_tokenizer(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lisaft.generate.target import Target, load_tokenizer

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    with pytest.raises(LisaftError, match=r"model: cannot load the tokenizer: "):
        load_tokenizer(Target(tmp_path / "model", "text", "--format"))
