"""`lisaft generate` prompts a model exactly as training laid out the prompt part of an example."""

from pathlib import Path

import pytest

from lisaft.batches import IGNORE_INDEX
from lisaft.data import build_examples
from lisaft.errors import LisaftError
from lisaft.generate import prompt_and_reference, resolve_target
from lisaft.rows import Rows

TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def _trained_prompt(tokenizer, fmt, row):
    ex = build_examples(Rows([row], "data.train", "test", "line"), fmt, tokenizer)[0]
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
    ids, reference = prompt_and_reference(tokenizer, fmt, row, "row 1")
    assert ids == prompt
    assert reference == answer
    assert tokenizer.decode(response, skip_special_tokens=True) == answer


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

    from lisaft.generate import _load

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    with pytest.raises(LisaftError, match=r"model: cannot load the tokenizer: "):
        _load(tmp_path / "model")
