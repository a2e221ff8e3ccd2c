"""`lisaft generate` reads a run as `lisaft train` read it: a chat run with ShareGPT columns and role
names takes its own eval file, and a checkpoint of the run generates what the final model does."""

import json
import random
import re
import shutil

import pytest
from typer.testing import CliRunner

from lisaft.checkpoint.checkpointer import MARKER
from lisaft.cli import app
from lisaft.train import train

SHAREGPT = {"conversations": "messages", "from": "role", "value": "content"}


def _conversation(rng: random.Random) -> dict:
    s = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
    return {"conversations": [{"from": "human", "value": s}, {"from": "gpt", "value": s[::-1]}]}


@pytest.fixture(scope="module")
def chat_run(shared_tiny_run):
    rng = random.Random(0)
    for name, n in (("chat-train", 32), ("chat-eval", 4)):
        rows = [_conversation(rng) for _ in range(n)]
        (shared_tiny_run.dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = shared_tiny_run(
        "chat.yaml",
        data={"train": "chat-train.jsonl", "eval": "chat-eval.jsonl", "format": "chat", "columns": SHAREGPT,
              "roles": {"human": "user", "gpt": "assistant"}},
        training={"max_steps": 4, "save_every": 2, "eval_every": 0, "output_dir": "chat-run"},
    )
    assert train(recipe, show=False) == 0
    return shared_tiny_run.dir / "chat-run"


def _generate(*args: str):
    return CliRunner().invoke(app, ["generate", *map(str, args), "--max-new-tokens", "4"])


def _answers(result) -> list[dict]:
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines()]


def test_a_sharegpt_chat_run_takes_its_own_eval_file(chat_run):
    eval_file = chat_run.parent / "chat-eval.jsonl"
    answers = _answers(_generate(chat_run, "--input-file", eval_file, "--json"))
    rows = [json.loads(line) for line in eval_file.read_text().splitlines()]
    assert [a["prompt"] for a in answers] == rows  # the rows as the file holds them
    assert [a["reference"] for a in answers] == [r["conversations"][-1]["value"] for r in rows]


def test_a_checkpoint_generates_what_the_final_model_does(chat_run):
    eval_file = chat_run.parent / "chat-eval.jsonl"
    final = _answers(_generate(chat_run / "final", "--input-file", eval_file, "--json"))
    step4 = _answers(_generate(chat_run / "checkpoints" / "step-000004", "--input-file", eval_file, "--json"))
    assert step4 == final  # the run's last checkpoint holds the weights final/ was written from
    step2 = _answers(_generate(chat_run / "checkpoints" / "step-000002", "--input-file", eval_file, "--json"))
    assert [a["reference"] for a in step2] == [a["reference"] for a in final]


def test_a_bad_row_names_its_file_and_line(chat_run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps(_conversation(random.Random(1)))
    bad.write_text(f"{good}\n\n{json.dumps({'conversation': []})}\n")
    result = _generate(chat_run, "--input-file", bad)
    assert result.exit_code != 0
    assert "KeyError" not in result.output and "Traceback" not in result.output
    assert re.search(rf"{re.escape(str(bad))}: line 3: missing field 'messages'", result.output), result.output


@pytest.mark.parametrize("where", ["checkpoints/step-3", "checkpoints"])
def test_a_missing_checkpoint_names_the_ones_there(chat_run, where):
    result = _generate(chat_run / where, "--prompt", "abc")
    assert result.exit_code != 0
    assert "complete checkpoints of the run: step-000002, step-000004" in result.output, result.output


def test_an_fsdp_checkpoint_of_the_layout_before_dcp_is_refused_in_one_line(chat_run, tmp_path):
    # training.fsdp once wrote shards/rank-R.safetensors (no DCP metadata); only a resume reads them.
    run = tmp_path / "run"
    shutil.copytree(chat_run, run, ignore=shutil.ignore_patterns("final"))
    ckpt = run / "checkpoints" / "step-000004"
    shutil.rmtree(ckpt / "weights")
    (ckpt / "shards").mkdir()
    (ckpt / "shards" / "rank-0.safetensors").write_bytes(b"")
    files = {str(f.relative_to(ckpt)): f.stat().st_size for f in sorted(ckpt.rglob("*"))
             if f.is_file() and f.name != MARKER}
    (ckpt / MARKER).write_text(json.dumps({"step": 4, "files": files}))  # complete, as training wrote it
    result = _generate(ckpt, "--prompt", "abc")
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "before torch.distributed.checkpoint" in lines[0], result.output


def test_a_checkpoints_model_holds_that_checkpoints_weights(chat_run):
    from safetensors.torch import load_file

    from lisaft.generate.target import load_model, resolve_target

    models = {}
    for step in ("step-000002", "step-000004"):
        ckpt = chat_run / "checkpoints" / step
        state = load_model(resolve_target(ckpt, None)).state_dict()
        saved = {k: v for f in (ckpt / "weights").glob("*.safetensors") for k, v in load_file(f).items()}
        assert saved and all(state[k].cpu().equal(v) for k, v in saved.items()), step
        models[step] = saved
    # LISA trained some layers between the two: the checkpoints are told apart.
    assert any(not v.equal(models["step-000004"][k]) for k, v in models["step-000002"].items())


def test_input_that_a_chat_prompt_ignores_gets_a_note(chat_run):
    result = _generate(chat_run, "--prompt", "abc", "--input", "def")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("warning: ")]
    assert len(notes) == 1 and re.fullmatch(r"warning: --input is ignored for chat prompts .*--prompt", notes[0]), \
        result.output


def test_a_run_without_final_points_to_its_newest_checkpoint(chat_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(chat_run, run, ignore=shutil.ignore_patterns("final"))
    result = _generate(run, "--prompt", "abc")
    assert result.exit_code != 0
    assert f"try its newest checkpoint: lisaft generate {run / 'checkpoints' / 'step-000004'}" in result.output, \
        result.output


def test_a_garbled_weights_header_is_one_line(chat_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(chat_run, run, ignore=shutil.ignore_patterns("final"))
    ckpt = run / "checkpoints" / "step-000004"
    weights = ckpt / "weights" / "head.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = b"\xff" * 8  # the header's length: the same size, so the checkpoint still looks complete
    weights.write_bytes(bytes(data))
    result = _generate(ckpt, "--prompt", "abc")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "cannot read its weights" in lines[0], result.output
