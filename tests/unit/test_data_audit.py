"""`lisaft data RECIPE`, the data audit: its counts against arithmetic done here on the shipped
quickstart data and tokenizer, the loss tokens marked in what it shows, unknown tokens counted,
and data that would train on nothing refused by it and by `lisaft train` alike."""

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.data.audit import nearest_rank

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart"
RECIPE = str(QUICKSTART.parent / "quickstart.yaml")
runner = CliRunner()


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer")


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def audit(*sets: str, examples: int = 3) -> dict:
    args = ["data", RECIPE, "--json", "--examples", str(examples)]
    for s in sets:
        args += ["--set", s]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def refusal(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_counts_match_arithmetic_on_the_quickstart_eval_set(tok):
    max_len = 14  # cuts some of the 12-18 token examples, and drops the ones whose prompt fills it
    report = audit(f"data.train={QUICKSTART / 'eval.jsonl'}", "data.eval=null", f"data.max_seq_len={max_len}")
    rows = [json.loads(line) for line in (QUICKSTART / "eval.jsonl").read_text().splitlines()]
    prompts, answers = [], []
    for r in rows:
        text = f"### Instruction:\n{r['instruction']}" + (f"\n\n### Input:\n{r['input']}" if r["input"] else "")
        prompts.append([tok.bos_token_id] + ids(tok, text + "\n\n### Response:\n"))
        answers.append(ids(tok, r["output"]) + [tok.eos_token_id])
    lengths = np.array([len(p) + len(a) for p, a in zip(prompts, answers)])
    loss = np.array([max(0, min(n, max_len) - len(p)) for n, p in zip(lengths, prompts)])
    kept = loss > 0
    (split,) = report["splits"]
    seq = split["sequences"]["examples"]
    assert split["rows"] == seq["count"] == len(rows) and split["dropped"] == seq["no_loss"] == int((~kept).sum())
    assert seq["tokens_p50"] == int(np.percentile(lengths, 50, method="inverted_cdf"))
    assert seq["tokens_p95"] == int(np.percentile(lengths, 95, method="inverted_cdf"))
    assert seq["tokens_max"] == lengths.max()
    assert seq["truncated"] == split["truncated"] == int((lengths > max_len).sum()) > 0
    assert seq["truncated_share"] == pytest.approx((lengths > max_len).mean())
    assert seq["trained_tokens"] == np.minimum(lengths, max_len)[kept].sum()
    assert seq["loss_tokens"] == loss.sum()
    assert seq["loss_share"] == pytest.approx(loss.sum() / np.minimum(lengths, max_len)[kept].sum())
    # EOS is the last token: it survives the cut only in the examples that were not cut.
    assert seq["stop_examples"] == int((lengths <= max_len).sum())
    assert seq["unk_tokens"] == 0 and report["tokenizer"] == {"eos": "</s>", "unk": "<unk>"}
    assert report["packing"] is None
    packed = audit(f"data.train={QUICKSTART / 'eval.jsonl'}", "data.eval=null", f"data.max_seq_len={max_len}",
                   "data.packing=true", examples=0)["packing"]
    # Every kept example is whole in one row: the rows hold exactly the trained tokens.
    assert packed["examples"] == kept.sum() and packed["rows"] >= math.ceil(seq["trained_tokens"] / max_len)
    assert packed["fill"] * packed["rows"] * max_len == pytest.approx(seq["trained_tokens"])


def test_nearest_rank_is_the_inverted_cdf_percentile():
    for n in (1, 2, 3, 19, 20, 21, 100):
        values = sorted(int(v) for v in np.random.default_rng(n).integers(0, 1000, n))
        for q in (50, 95, 100):
            assert nearest_rank(values, q) == int(np.percentile(values, q, method="inverted_cdf")), (n, q)


def test_the_examples_shown_mark_exactly_the_tokens_that_carry_loss(tmp_path):
    rows = [{"instruction": "Reverse", "input": "abc", "output": "cba"}]
    report = audit(f"data.train={write_jsonl(tmp_path / 'd.jsonl', rows)}", "data.eval=null")
    (ex,) = report["examples"]
    assert [s["loss"] for s in ex["segments"]] == [False, True]
    assert ex["segments"][0]["text"] == "<s>### Instruction:\nReverse\n\n### Input:\nabc\n\n### Response:\n"
    assert ex["segments"][1]["text"] == "cba</s>" and ex["loss_tokens"] == 4 and ex["row"] == "line 1"
    text = runner.invoke(app, ["data", RECIPE, "--set", f"data.train={tmp_path / 'd.jsonl'}",
                               "--set", "data.eval=null"]).stdout
    shown = text.split("--- line 1: 12 tokens, 4 carry loss\n")[1]
    assert shown.startswith("<s>### Instruction:\nReverse") and shown.endswith("### Response:\n[[cba</s>]]\n")
    assert shown.count("[[") == 1


def test_chat_marks_assistant_turns_and_the_turn_end(tmp_path):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "and"}, {"role": "assistant", "content": "ok"}]
    report = audit(f"data.train={write_jsonl(tmp_path / 'c.jsonl', [{'messages': chat}])}", "data.eval=null",
                   "data.format=chat")
    (ex,) = report["examples"]
    assert [s["text"] for s in ex["segments"] if s["loss"]] == ["yo</s>", "ok</s>"]
    assert "hi" in ex["segments"][0]["text"] and not ex["segments"][0]["loss"]
    seq = report["splits"][0]["sequences"]["examples"]
    assert seq["loss_tokens"] == 6 and seq["stop_examples"] == 1


def test_chat_that_loses_every_assistant_turn_is_refused_by_data_and_by_train(tmp_path):
    long_user = [{"messages": [{"role": "user", "content": "please reverse the string " + "ab" * k},
                               {"role": "assistant", "content": "ba"}]} for k in range(3)]
    data = write_jsonl(tmp_path / "chat.jsonl", long_user)
    sets = ["--set", f"data.train={data}", "--set", "data.eval=null", "--set", "data.format=chat",
            "--set", "data.max_seq_len=24"]
    line = refusal(["data", RECIPE, *sets])
    assert "chat.jsonl" in line and "nothing to train on" in line and "data.max_seq_len=24" in line
    run = tmp_path / "run"
    assert refusal(["train", RECIPE, *sets, "--set", f"training.output_dir={run}"]) == line
    assert not run.exists()
    # An existing run is left as it was, --overwrite or not (the data is refused before step 1).
    run.mkdir()
    (run / "recipe.yaml").write_text("kept")
    assert refusal(["train", RECIPE, *sets, "--set", f"training.output_dir={run}", "--overwrite"]) == line
    assert [p.name for p in run.iterdir()] == ["recipe.yaml"] and (run / "recipe.yaml").read_text() == "kept"


def test_examples_left_without_loss_are_flagged_by_line(tmp_path):
    rows = [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": "ok"}]}
            for u in ("hi", "a long question that fills the whole window", "yo")]
    data = write_jsonl(tmp_path / "c.jsonl", rows)
    result = runner.invoke(app, ["data", RECIPE, "--json", "--set", f"data.train={data}", "--set", "data.eval=null",
                                 "--set", "data.format=chat", "--set", "data.max_seq_len=24"])
    assert result.exit_code == 0 and "dropped 1 of 3 examples" in result.stderr and "turn): line 2" in result.stderr
    report = json.loads(result.stdout)
    split = report["splits"][0]
    assert split["dropped"] == split["sequences"]["examples"]["no_loss"] == 1 and split["dropped_rows"] == [2]
    assert [ex["dropped"] for ex in report["examples"]] == [False, True, False]
    assert not any(s["loss"] for s in report["examples"][1]["segments"])


def test_unknown_tokens_are_counted_warned_of_and_refused_when_they_are_all(tmp_path, tok):
    rows = [{"instruction": "Copy", "input": "x", "output": "çaé"},
            {"instruction": "Copy", "input": "y", "output": "y"}]
    unk = sum(ids(tok, r["output"]).count(tok.unk_token_id) for r in rows)
    assert unk == 2  # the quickstart tokenizer has no ç or é
    data = write_jsonl(tmp_path / "u.jsonl", rows)
    result = runner.invoke(app, ["data", RECIPE, "--json", "--set", f"data.train={data}", "--set", "data.eval=null"])
    assert result.exit_code == 0, result.output
    seq = json.loads(result.stdout)["splits"][0]["sequences"]["examples"]
    assert seq["unk_tokens"] == unk and seq["unk_share"] == pytest.approx(unk / seq["loss_tokens"])
    assert "unknown token <unk>" in result.stderr and "line 1" in result.stderr and "line 2" not in result.stderr
    # Answers the tokenizer cannot write at all: only EOS would be learned as itself.
    only_unk = write_jsonl(tmp_path / "only.jsonl", [{"instruction": "Copy", "input": "x", "output": "çé"}])
    line = refusal(["data", RECIPE, "--set", f"data.train={only_unk}", "--set", "data.eval=null"])
    assert "only.jsonl" in line and "nothing to train on" in line and "unknown token <unk>" in line


def test_training_warns_of_unknown_tokens_through_the_same_check(tmp_path, tok):
    from lisaft.config.schema import DataSection
    from lisaft.data.examples import load_splits

    data = write_jsonl(tmp_path / "u.jsonl", [{"instruction": "Copy", "input": "x", "output": "éé"}] * 2
                       + [{"instruction": "Copy", "input": "y", "output": "y"}])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        load_splits(DataSection(train=data, format="instruction"), tok, seed=0)
    assert any("4 of 8 loss tokens (50.0%) are the tokenizer's unknown token" in str(w.message) for w in seen)


def test_preference_pairs_show_prompt_and_both_answers_and_count_each(tmp_path, tok):
    rows = [{"prompt": "Reverse abc", "chosen": "cba", "rejected": "abcdefghij"},
            {"prompt": "Reverse ab", "chosen": "ba", "rejected": "ab"}]
    prompt = 1 + len(ids(tok, rows[0]["prompt"]))  # BOS first
    chosen, rejected = prompt + len(ids(tok, "cba")) + 1, prompt + len(ids(tok, "abcdefghij")) + 1
    max_len = chosen + 2  # the first pair's rejected answer is cut, its chosen one is not
    assert rejected > max_len
    report = audit(f"data.train={write_jsonl(tmp_path / 'p.jsonl', rows)}", "data.eval=null",
                   "data.format=preference", "preference.loss=simpo", f"data.max_seq_len={max_len}")
    split = report["splits"][0]
    assert split["sequences"]["chosen"]["tokens_max"] == chosen
    assert split["sequences"]["rejected"]["tokens_max"] == rejected
    assert split["truncated"] == 1 and split["sequences"]["rejected"]["truncated"] == 1
    assert split["sequences"]["chosen"]["truncated"] == 0 and split["same_answers"] == 0
    first = report["examples"][0]
    assert first["prompt"] == "<s>Reverse abc"
    assert [s["text"] for s in first["chosen"]["segments"]] == ["cba</s>"]
    assert first["rejected"]["segments"] == [{"text": tok.decode(ids(tok, "abcdefghij")[:max_len - prompt]),
                                              "loss": True}]
    assert first["rejected"]["truncated"] and first["rejected"]["tokens"] == max_len


def test_a_pair_shows_the_tokens_at_its_split_and_a_spaced_prompt_is_warned_of(tmp_path, tok):
    """Prompt and answers are tokenized apart: --examples shows the tokens either side of the split,
    and a string prompt ending in whitespace (a token of its own there) is warned of, naming the row."""
    rows = [{"prompt": "Reverse abc ", "chosen": "cba", "rejected": "abc"},
            {"prompt": "Reverse ab", "chosen": "ba", "rejected": "ab"}]
    args = ["data", RECIPE, "--examples", "1", "--set", f"data.train={write_jsonl(tmp_path / 'p.jsonl', rows)}",
            "--set", "data.eval=null", "--set", "data.format=preference", "--set", "preference.loss=simpo"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    warned = [line for line in result.output.splitlines() if "end with whitespace" in line]
    assert len(warned) == 1 and "1 of 2 string prompts" in warned[0] and "line 1" in warned[0], result.output
    end = tok.convert_ids_to_tokens(ids(tok, "Reverse abc "))[-3:]
    answers = {k: (tok.convert_ids_to_tokens(ids(tok, rows[0][k])) + [tok.eos_token])[:3]
               for k in ("chosen", "rejected")}
    assert end[-1] == " "  # the prompt's space, a token before the answer's first
    assert (f"--- the split as tokens: {' '.join(map(repr, end))} | chosen {' '.join(map(repr, answers['chosen']))} | "
            f"rejected {' '.join(map(repr, answers['rejected']))}") in result.output, result.output
    assert json.loads(runner.invoke(app, [*args, "--json"]).stdout)["examples"][0]["boundary"] == {
        "prompt": end, **answers}


def test_pairs_whose_answers_are_the_same_once_cut_are_refused(tmp_path):
    rows = [{"prompt": "Say", "chosen": "hello there", "rejected": "hello world"}]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    line = refusal(["data", RECIPE, "--set", f"data.train={data}", "--set", "data.eval=null",
                    "--set", "data.format=preference", "--set", "preference.loss=simpo", "--set", "data.max_seq_len=8"])
    assert "p.jsonl" in line and "nothing to train on" in line and "same" in line


def test_the_docs_example_is_what_the_command_prints(monkeypatch):
    doc = (QUICKSTART.parents[1] / "docs" / "data.md").read_text()
    command, *shown = doc.split("    $ lisaft data ", 1)[1].split("\n\nThe checks", 1)[0].splitlines()
    shown = [line[4:] for line in shown]
    monkeypatch.chdir(QUICKSTART.parent)
    printed = runner.invoke(app, ["data", *command.split()]).stdout.replace(str(QUICKSTART.parent), "...")
    # The docs leave out the eval split's lines.
    cut = shown.index("data.eval: ...")
    lines = printed.splitlines()
    assert lines[:cut] == shown[:cut] and lines[cut].startswith("data.eval: ")
    assert lines[-(len(shown) - cut - 1):] == shown[cut + 1:]


def test_a_grpo_recipe_audits_its_prompts_against_the_room_left_and_the_columns_its_rewards_read(tmp_path, tok):
    """Prompts longer than data.max_seq_len - max_completion_length are named with the length they
    need; each reward function's named columns are counted against the train rows."""
    prompts = ["ab", "abcd efgh", "abcd efgh ijk"]
    rows = [{"prompt": prompts[0], "answer": "ba"}, {"prompt": prompts[1], "answer": "x"}, {"prompt": prompts[2]}]
    (tmp_path / "rw.py").write_text("def graded(prompts, completions, answer, level=None, **kw):\n"
                                    "    return [0.0] * len(completions)\n")
    lengths = [1 + len(ids(tok, p)) for p in prompts]  # BOS, then the prompt
    completion = 8
    max_len = lengths[1] + completion  # the second fits exactly, the third does not
    assert lengths[1] < lengths[2] < max_len  # and the third still leaves room for part of one
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(json.dumps({
        "model": {"config": str(QUICKSTART / "config.json"), "tokenizer": str(QUICKSTART / "tokenizer")},
        "data": {"train": write_jsonl(tmp_path / "p.jsonl", rows), "format": "prompts", "max_seq_len": max_len},
        "grpo": {"reward_funcs": ["exact_match", "rw.py:graded"], "num_generations": 2,
                 "max_completion_length": completion},
        "training": {"batch_size": 2, "max_steps": 1, "output_dir": "run"}}))
    result = runner.invoke(app, ["data", str(recipe), "--json", "--examples", "0"])
    assert result.exit_code == 0, result.output
    g = json.loads(result.stdout)["grpo"]
    assert g["prompt_limit"] == lengths[1]
    assert g["splits"][0] | {"columns": None} == {
        "key": "data.train", "rows": 3, "longest": lengths[2], "over_limit": 1, "over_rows": [3],
        "over_where": "line 3", "columns": None}
    exact, graded = g["rewards"]
    assert (exact["name"], exact["optional"], exact["missing"]["answer"]["rows"]) == ("exact_match", ["answer"], 1)
    assert (graded["required"], graded["optional"]) == (["answer"], ["level"])
    assert graded["missing"]["level"] == {"rows": 3, "where": "lines 1, 2 and 3"}
    text = runner.invoke(app, ["data", str(recipe), "--examples", "0"]).output
    assert (f"1 of 3 prompts are longer (line 3), the longest {lengths[2]} tokens: `lisaft train` refuses them; "
            f"raise data.max_seq_len to at least {lengths[2] + completion}") in " ".join(text.split())
    assert "reward graded reads `level`: 3 of 3 train rows have none" in " ".join(text.split())
    assert "grpo" not in audit("data.eval=null", examples=0)  # an SFT recipe has no GRPO part
