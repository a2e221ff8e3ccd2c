"""data.packing in a real run: the start line, the padding count, eval unchanged by packing,
exact resume over the same rows, and a resume over data that packs differently refused."""

import json

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.metrics.log import read_metrics

runner = CliRunner()
PACKED = {"packing": True, "max_seq_len": 64}


def _records(run, key):
    return [r for r in read_metrics(run / "metrics.jsonl") if key in r]


def _weights(run):
    out = {}
    for f in sorted((run / "final").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_a_packed_run_says_what_packing_did_and_counts_padding(tiny_run):
    recipe = tiny_run(data=PACKED, training={"max_steps": 2, "eval_every": 0})
    result = runner.invoke(app, ["train", str(recipe)])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("packing:"))
    assert line.startswith("packing: 96 examples in ") and "% of positions real" in line
    records = _records(tiny_run.dir / "run", "loss")
    assert all(r["tokens_per_s"] > 0 for r in records)
    # The count the step logs is each micro-batch's rows padded to its longest, row by row; the
    # same rows, drawn again from a session of the same recipe, give the count to expect.
    from lisaft.config.schema import load_recipe
    from lisaft.train import build_session

    session = build_session(load_recipe(recipe), tiny_run.dir / "count")
    expected = []
    for _ in records:
        rows = [session.train_examples[i]["input_ids"] for i in session.order.next_indices()]
        expected.append(sum(max(map(len, rows)) - len(r) for r in rows))
    assert sum(expected) > 0  # a count stuck at 0 would fail
    assert [r["padding_positions"] for r in records] == expected


def test_eval_is_the_same_with_packing_on_or_off(tiny_run):
    from lisaft.train import train

    common = {"training": {"max_steps": 1, "eval_every": 1}}
    assert train(tiny_run("plain.yaml", **common), overrides=["training.output_dir=plain"], show=False) == 0
    assert train(tiny_run("packed.yaml", data=PACKED, **common), overrides=["training.output_dir=packed"],
                 show=False) == 0
    plain, packed = (_records(tiny_run.dir / name, "eval_loss") for name in ("plain", "packed"))
    assert plain[0]["step"] == packed[0]["step"] == 0
    assert plain[0] == packed[0]  # the same untrained model, the same unpacked eval


def test_a_packed_run_resumes_bit_identically_and_refuses_changed_data(tiny_run):
    from lisaft.train import train
    from lisaft.train.commands import resume

    common = {"data": PACKED, "training": {"max_steps": 6, "eval_every": 3}}
    assert train(tiny_run("ref.yaml", **common), overrides=["training.output_dir=ref"], show=False) == 0
    assert train(tiny_run("cut.yaml", **common), overrides=["training.output_dir=cut"], show=False,
                 _stop_at=4) != 0
    # Same lengths, other tokens: the row count is unchanged, only the packing digest tells.
    train_file = tiny_run.dir / "train.jsonl"
    original = train_file.read_text()
    rows = [json.loads(x) for x in original.splitlines()]
    out = rows[0]["output"]
    rows[0]["output"] = "j" * len(out) if set(out) != {"j"} else "i" * len(out)
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = runner.invoke(app, ["resume", str(tiny_run.dir / "cut")])
    assert result.exit_code != 0 and "digest" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    train_file.write_text(original)
    assert resume(tiny_run.dir / "cut", show=False) == 0
    ref, cut = tiny_run.dir / "ref", tiny_run.dir / "cut"
    assert [r["loss"] for r in _records(ref, "loss")] == [r["loss"] for r in _records(cut, "loss")]
    wa, wb = _weights(ref), _weights(cut)
    assert all(wa[k].equal(wb[k]) for k in wa)


def test_the_step_flattens_micro_batches_for_a_varlen_kernel(tiny_run, monkeypatch):
    # flash-attn cannot be installed here: a reference varlen attention (per-segment sdpa over
    # cu_seq_lens) stands in for it, and the step is told the model's kernel is varlen.
    from transformers import AttentionInterface

    from lisaft.config.schema import load_recipe
    from lisaft.train import build_session, train_step
    from lisaft.train.evaluate import evaluate
    from tests.unit.test_packed_attention import _varlen_reference

    recipe = tiny_run(data=PACKED, training={"grad_accum_steps": 2})
    padded = build_session(load_recipe(recipe), tiny_run.dir / "padded")
    flat = build_session(load_recipe(recipe), tiny_run.dir / "flat")
    seen: list = []
    AttentionInterface.register("lisaft_varlen_reference", _varlen_reference(seen))
    flat.model.set_attn_implementation("lisaft_varlen_reference")
    a = train_step(padded, 0)
    # The token objective makes the step's and the eval's batches (train/objectives/tokens.py).
    monkeypatch.setattr("lisaft.train.objectives.tokens.varlen_attention", lambda model: True)
    b = train_step(flat, 0)
    assert seen and all(call["cu_seq_lens_q"] is not None for call in seen)
    assert b.padding == 0 < a.padding and b.tokens == a.tokens
    assert abs(b.loss - a.loss) <= 1e-5 * a.loss
    ea, eb = evaluate(padded), evaluate(flat)
    assert abs(eb["eval_loss"] - ea["eval_loss"]) <= 1e-5 * ea["eval_loss"]
    assert eb["eval_token_accuracy"] == ea["eval_token_accuracy"]


def test_one_packed_step_equals_one_unpacked_step_over_the_same_examples(tiny_run):
    from lisaft.config.schema import load_recipe
    from lisaft.data.order import DataOrder
    from lisaft.train import build_session, train_step

    common = {"lisa": {"enabled": False}, "training": {"max_steps": 1, "batch_size": 96, "eval_every": 0}}
    unpacked = build_session(load_recipe(tiny_run("plain.yaml", **common)), tiny_run.dir / "plain")
    packed_recipe = tiny_run("packed.yaml", data=PACKED, **{**common, "training": {"max_steps": 1, "batch_size": 1}})
    packed = build_session(load_recipe(packed_recipe), tiny_run.dir / "packed",
                           tokenizer=unpacked.tokenizer, train_examples=unpacked.train_examples)
    rows = len(packed.train_examples)
    assert rows < 96
    before = {n: p.detach().clone() for n, p in unpacked.model.named_parameters()}
    packed.order = DataOrder(rows, rows, seed=0)  # one step over every row: all 96 examples
    a, b = train_step(unpacked, 0), train_step(packed, 0)
    assert b.tokens == a.tokens and b.padding < a.padding
    assert abs(b.loss - a.loss) <= 1e-5 * a.loss
    # AdamW's first update is about lr x g/|g| per element: where a gradient element is at float
    # noise level the two runs' updates may differ by a little of lr (tests/unit/
    # test_packed_attention.py checks the weights at 1e-5 with plain SGD).
    lr = packed.recipe.optimizer.lr
    for (name, wa), wb in zip(unpacked.model.named_parameters(), packed.model.parameters()):
        assert not torch.equal(wa, before[name]), name
        assert (wa - wb).abs().max() <= 1e-3 * lr, name
