"""The third learning protocol's pure parts: its data, the equal-memory ranks, the order of its
runs and picking up where it stopped, and its table (benchmarks/learning/protocol3.py)."""

import json

import pytest

from benchmarks.learning import protocol3 as p3
from benchmarks.learning import report3
from scripts import make_smollm2_data as gen

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)


def test_the_shipped_data_is_what_the_script_writes(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["make_smollm2_data", "--out", str(tmp_path)])
    gen.main()
    shipped = p3.REPO / "recipes" / "smollm2"
    for name in ("train.jsonl", "eval.jsonl", "preference.jsonl", "prompts.jsonl"):
        assert (tmp_path / name).read_text() == (shipped / name).read_text(), name


def test_splits_are_disjoint_and_the_recipes_come_first():
    s = gen.splits(p3.SPLITS)
    seen = [set(v) for v in s.values()]
    assert sum(map(len, seen)) == len(set().union(*seen)) == sum(p3.SPLITS.values())
    assert s["train"] == gen.splits({"train": 400})["train"]  # held-out splits never shift the recipe's


def test_instructions_are_at_least_200_distinct_and_fixed():
    a, b = gen.instructions(), gen.instructions()
    assert a == b and len(set(a)) == len(a) >= 200


def test_facts_accept_the_word_or_its_digits_only():
    assert gen.fact_right("The capital of France is Paris.", "Paris")
    assert gen.fact_right("A week has 7 days.", "seven")
    assert not gen.fact_right("Lyon", "Paris")


def test_layer_and_embedding_counts_match_a_real_llama_with_grouped_query_attention():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(SMOLLM2, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=2, head_dim=8, vocab_size=100)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert p3.layer_params(cfg) == layer
    assert p3.layer_params(cfg) * 2 + p3.embedding_params(cfg) == sum(p.numel() for p in model.parameters())


def test_equal_memory_ranks_on_smollm2():
    lisa = p3.lisa_trainable_params(SMOLLM2, 2)
    r = p3.arm_spec("lora_eq_g2", SMOLLM2)["lora"]["rank"]
    per_rank = p3.lora_params_per_rank(SMOLLM2)
    assert abs(r * per_rank - lisa) <= per_rank / 2  # the nearest rank to LISA γ=2's parameters
    assert p3.arm_spec("dora_eq_g2", SMOLLM2)["lora"] == {"rank": r, "dora": True}
    apollo = p3.arm_spec("apollo_eq_g2", SMOLLM2)["optimizer"]
    assert apollo["name"] == "apollo" and 1 <= apollo["rank"] < SMOLLM2["hidden_size"]
    assert p3.ARMS["lora_eq_g2"][0]["lora"]["rank"] == "equal_state_lisa_g2"  # the table is not edited


def _run(arm: str, lr: float, seed: int, val: float = 0.5) -> dict:
    return {"arm": arm, "lr": lr, "seed": seed, "val": {"exact": val, "nll": 1.0},
            "test": {"exact": val, "lenient": val}, "instructions_nll": 1.5, "facts": 0.9, "train_s": 100.0}


def _done(runs: list[dict]) -> dict:
    return {p3.run_name(r["arm"], r["lr"], r["seed"]): r for r in runs}


def test_plan_sweeps_the_middle_first_then_the_grid_then_the_edges_then_the_seeds():
    first = p3.plan({})
    assert first[0] == ("lisa_g4", 1e-4, 0)  # the SFT recipe's run
    assert [t[0] for t in first[:len(p3.ARMS)]] == list(p3.ARMS)
    sweep = [_run(arm, lr, 0, val=lr) for arm, (_, grid) in p3.ARMS.items() for lr in grid]  # best: top lr
    edges = p3.plan(_done(sweep))
    assert ("full", 3e-4, 0) in edges and not any(a == "full_cpu_offload" for a, _, _ in edges)
    beyond = [_run(arm, lr, seed, val=0.0) for arm, lr, seed in edges]
    seeds = p3.plan(_done(sweep + beyond))
    assert ("full", 1e-4, 1) in seeds and ("full", 1e-4, 2) in seeds
    assert not any(a == "full_cpu_offload" for a, _, _ in seeds)  # one run: compared with full's
    rest = [_run(arm, lr, seed) for arm, lr, seed in seeds]
    assert p3.plan(_done(sweep + beyond + rest)) == []


def test_best_lr_breaks_ties_on_validation_nll():
    a, b = _run("full", 1e-5, 0, 0.5), _run("full", 3e-5, 0, 0.5)
    b["val"]["nll"] = 0.5
    assert p3.best_lr([a, b]) == 3e-5


@pytest.mark.parametrize("text, number", [("85", 85), ("37 + 48 = 85.", 85), ("1,024", 1024), ("none", None)])
def test_last_number(text, number):
    assert p3.last_number(text) == number


def test_report_reads_the_run_files(tmp_path):
    (tmp_path / "runs").mkdir()
    base = {"test": {"exact": 0.0, "lenient": 0.4}, "instructions_nll": 1.2, "facts_kept": [["q", "w"]],
            "facts_candidates": 50}
    (tmp_path / "base.json").write_text(json.dumps(base))
    for r in (_run("full", 1e-5, 0, 0.2), _run("full", 3e-5, 0, 0.6), _run("full", 3e-5, 1, 0.8)):
        (tmp_path / "runs" / f"{p3.run_name(r['arm'], r['lr'], r['seed'])}.json").write_text(json.dumps(r))
    report3.write(tmp_path)
    md = (tmp_path / "learning3.md").read_text()
    assert "| full | 3e-05 (1e-05, 3e-05) | 2 | 70.0 ± 14.1 |" in md


def test_the_offload_check_compares_with_full_at_the_same_lr_and_seed(tmp_path):
    (tmp_path / "runs").mkdir()
    a, b = _run("full", 3e-5, 0), _run("full_cpu_offload", 3e-5, 0)
    for r in (a, b):
        r["train_loss_last"] = 0.25
        (tmp_path / "runs" / f"{p3.run_name(r['arm'], r['lr'], r['seed'])}.json").write_text(json.dumps(r))
    assert "the same scores and last loss as full's" in report3.offload_check(tmp_path)
    b["facts"] = 0.5
    (tmp_path / "runs" / f"{p3.run_name(b['arm'], b['lr'], b['seed'])}.json").write_text(json.dumps(b))
    assert "differs from full's" in report3.offload_check(tmp_path)


def test_greedy_answers_batched_are_the_one_by_one_answers():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.learning.run3 import greedy_answers
    from lisaft.config.schema import ModelSection
    from lisaft.model.load import load_tokenizer

    tok = load_tokenizer(ModelSection(config="unused", tokenizer=str(p3.REPO / "recipes" / "quickstart" / "tokenizer")))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128))
    prompts = ["abc", "abd", "hello there", "x"]
    together = greedy_answers(model, tok, prompts, 6)
    assert together == [greedy_answers(model, tok, [p], 6)[0] for p in prompts]
    assert any(together) and all(tok.eos_token not in a for a in together)


def test_two_processes_never_run_the_same_run_and_a_dead_ones_claim_is_taken_over(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    assert p3.claim(tmp_path, "a") and not p3.claim(tmp_path, "a")  # ours, alive
    claims = tmp_path / "work" / "claims"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (claims / "b").write_text(dead.stdout.strip())
    assert p3.claim(tmp_path, "b") and (claims / "b").read_text() == str(os.getpid())

    (claims / "b").unlink()
    (claims / "a").write_text(str(os.getppid()))  # "a" is another live process's
    ran = []

    def run_one(run):
        ran.append(run)
        record = {"test": {"exact": 0.5, "lenient": 0.5}, "instructions_nll": 1.0, "facts": 1.0, "train_s": 1.0}
        (tmp_path / "runs").mkdir(exist_ok=True)
        (tmp_path / "runs" / f"{run}.json").write_text(json.dumps(record))
        return record

    def other_finishes_a(_s):  # while this process waits, the other one writes its run
        (tmp_path / "runs" / "a.json").write_text(json.dumps({"other": True}))
        (claims / "a").unlink()

    monkeypatch.setattr(p3.time, "sleep", other_finishes_a)
    plan = lambda done: [r for r in ("a", "b", "c") if r not in done]  # noqa: E731
    p3.run_until_done(tmp_path, plan, run_one, str, lambda out: None, None, wait_s=0)
    assert ran == ["b", "c"] and json.loads((tmp_path / "runs" / "a.json").read_text()) == {"other": True}
    assert not any(claims.iterdir())  # every claim released
