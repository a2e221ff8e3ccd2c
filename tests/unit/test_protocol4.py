"""The fourth learning protocol's pure parts: the equal-memory LoRA rank, the order of its runs
and picking up where it stopped, its on-policy data, reusing protocol 3's base scores, and its
table (benchmarks/learning/protocol4.py, run4.py, report4.py)."""

import json

from benchmarks.learning import protocol3 as p3
from benchmarks.learning import protocol4 as p4
from benchmarks.learning import report4
from benchmarks.learning.run4 import seed_base

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)


def test_lora_rank_gives_lisa_g4s_trainable_parameters():
    r = p4.method_spec("lora_eq_g4", SMOLLM2)["lora"]["rank"]
    per_rank = p3.lora_params_per_rank(SMOLLM2)
    assert abs(r * per_rank - p3.lisa_trainable_params(SMOLLM2, 4)) <= per_rank / 2
    assert p4.method_spec("lisa_g4", SMOLLM2)["lisa"]["active_layers"] == 4
    assert p4.METHODS["lora_eq_g4"]["lora"]["rank"] == "equal_params_lisa_g4"  # the table is not edited


def _run(objective, start, method, lr, seed, val=0.5):
    return {"objective": objective, "start": start, "method": method, "arm": method, "lr": lr, "seed": seed,
            "val": {"exact": val, "nll": 1.0}, "test": {"exact": val, "lenient": val}, "instructions_nll": 1.5,
            "facts": 0.9, "train_s": 100.0, **({"rewards": [0.1] * 5 + [0.5] * 5} if objective == "grpo" else {})}


def _done(runs):
    return {p4.run_name(r["objective"], r["start"], r["method"], r["lr"], r["seed"]): r for r in runs}


def _runs(plan, val=None):
    return [_run(o, s, m, lr, seed, val=lr if val is None else val) for o, s, m, lr, seed in plan]


def test_plan_runs_each_methods_first_cells_together_then_every_cell_then_the_grid_edges_and_seeds():
    first = p4.plan({})
    lisa = p4.GRPO_GRIDS["lisa_g4"][1], p4.GRIDS["lisa_g4"][1]
    assert first[:3] == [("grpo", "sft", "lisa_g4", lisa[0], 0), ("dpo", "base", "lisa_g4", lisa[1], 0),
                         ("kto", "base", "lisa_g4", lisa[1], 0)]  # the cheapest method's first cells
    assert p4.GRPO_GRIDS["full"][1] < p4.GRIDS["full"][1]  # GRPO's own, lower grid
    cells = len(p4.CELLS) * len(p4.METHODS)
    assert len(first) == cells * 3  # the seed-0 sweep, the middle lrs leading
    stage1 = _runs(first[:cells])
    grid = p4.plan(_done(stage1))
    assert all(lr != p4.grid(o, m)[1] and seed == 0 for o, _, m, lr, seed in grid)
    sweep = stage1 + _runs(grid)  # the best: the top of every grid, so one lr beyond it
    edges = p4.plan(_done(sweep))
    assert ("kto", "base", "full", 9e-5, 0) in edges and len(edges) == cells
    seeds = p4.plan(_done(sweep + _runs(edges)))
    assert ("kto", "base", "full", 9e-5, 1) in seeds and ("kto", "base", "full", 9e-5, 2) in seeds
    assert len(seeds) == cells * 2
    assert p4.plan(_done(sweep + _runs(edges) + _runs(seeds))) == []
    middle_best = _runs(first) + _runs(grid, val=0.0)  # the middle wins: no edge, seeds at once
    assert ("grpo", "sft", "full", 3e-6, 1) in p4.plan(_done(middle_best))


def test_first_runs_one_cells_whole_protocol_before_the_others():
    cell = ("grpo", "sft")
    sweep, rest = p4.plan({}, cell)[:9], p4.plan({}, cell)[9:]
    assert {(o, s) for o, s, *_ in sweep} == {cell} and cell not in {(o, s) for o, s, *_ in rest}
    assert sorted(sweep + rest) == sorted(p4.plan({}))  # the others' after it
    assert sweep[:3] == [(*cell, m, p4.GRPO_GRIDS[m][1], 0) for m in p4.METHODS]  # the middles lead
    seeds = p4.plan(_done(_runs(sweep, val=0.5)), cell)[:6]  # all tie: the middle, run first, is picked: no edge
    assert {(o, s, seed) for o, s, _, _, seed in seeds} == {(*cell, 1), (*cell, 2)}
    rest = p4.plan(_done(_runs(sweep, val=0.5) + _runs(seeds, val=0.5)), cell)
    assert rest == p4.plan(_done(_runs(sweep, val=0.5) + _runs(seeds, val=0.5)))  # then the protocol's own order
    assert cell not in {(o, s) for o, s, *_ in rest}


def test_a_grpo_cell_whose_middle_run_never_scored_skips_its_sweep_but_not_its_seeds():
    cell = ("grpo", "base")
    sweep = p4.plan({}, cell)[:9]
    middles = _runs(sweep[:3])
    for r in middles[1:]:  # LoRA's and full fine-tuning's rewards were 0 in every step
        r["rewards"] = [0.0] * 30
    rest = p4.plan(_done(middles), cell)
    assert {(m, lr) for o, s, m, lr, seed in rest if (o, s) == cell} == \
        {("lisa_g4", lr) for lr in p4.GRPO_GRIDS["lisa_g4"] if lr != p4.GRPO_GRIDS["lisa_g4"][1]}
    seeds = p4.plan(_done(middles + _runs(rest[:2], val=0.0)), cell)[:6]
    assert {(m, lr, seed) for _, _, m, lr, seed in seeds} == {
        (m, p4.GRPO_GRIDS[m][1], seed) for m in p4.METHODS for seed in (1, 2)}  # seeds sample anew
    no_steps = _run(*cell, "full", p4.GRPO_GRIDS["full"][1], 0)
    no_steps["rewards"] = []
    assert not p4.unmoved(_done([no_steps]), *cell, "full")
    assert not p4.unmoved(_done([_run("dpo", "base", "full", p4.GRIDS["full"][1], 0)]), "dpo", "base", "full")


def test_grpos_reward_is_the_held_out_scores_exact_test():
    completions = [[{"role": "assistant", "content": text}] for text in ("180", " 180\n", "180.", "Sum: 180", "18")]
    assert p4.exact_sum([None] * 5, completions, ["180"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    from lisaft.config.grpo import GrpoSection
    from lisaft.grpo.rewards import load_rewards

    assert load_rewards(GrpoSection(reward_funcs=[p4.SETTINGS["grpo_reward"]]))[0].func is p4.exact_sum


def test_onpolicy_rows_take_the_wrong_answers_only_up_to_the_limit():
    pairs, feedback = p4.onpolicy_rows([(37, 48), (10, 11), (20, 30), (40, 41)],
                                       ["37 + 48 = 75.", "21", "", "The sum is 81"], limit=1)
    assert len(pairs) == 1 and pairs[0]["prompt"] == [{"role": "user", "content": "What is 37 + 48?"}]
    assert pairs[0]["chosen"][0]["content"] == "85" and pairs[0]["rejected"][0]["content"] == "37 + 48 = 75."
    assert [(f["completion"][0]["content"], f["label"]) for f in feedback] == [("85", True), ("37 + 48 = 75.", False)]
    assert len(p4.onpolicy_rows([(37, 48), (40, 41)], ["75", "The sum is 81"], limit=9)[0]) == 2


def test_protocol3s_base_scores_are_reused_only_when_scored_alike(tmp_path):
    theirs = tmp_path / "p3" / "base.json"
    theirs.parent.mkdir()
    theirs.write_text(json.dumps({"settings": dict(p3.SETTINGS, n_test=7)}))
    seed_base(tmp_path / "a", p4.SETTINGS, theirs)
    assert not (tmp_path / "a" / "base.json").exists()
    theirs.write_text(json.dumps({"settings": p3.SETTINGS}))
    seed_base(tmp_path / "a", p4.SETTINGS, theirs)
    assert (tmp_path / "a" / "base.json").read_text() == theirs.read_text()


def test_table_gives_the_picked_lr_its_seeds_and_grpos_reward(tmp_path):
    scores = {"test": {"exact": 0.0, "lenient": 0.1}, "instructions_nll": 1.0}
    (tmp_path / "base.json").write_text(json.dumps(scores))
    (tmp_path / "start-sft.json").write_text(json.dumps(dict(scores, facts=0.8)))
    (tmp_path / "runs").mkdir()
    runs = [_run("grpo", "sft", "full", 1e-5, 0, val=0.2), _run("grpo", "sft", "full", 3e-5, 0, val=0.6),
            _run("grpo", "sft", "full", 3e-5, 1, val=0.4), _run("dpo", "base", "lisa_g4", 3e-5, 0)]
    for name, r in _done(runs).items():
        (tmp_path / "runs" / f"{name}.json").write_text(json.dumps(r))
    table = report4.table(tmp_path)
    assert "Start `sft`: held-out exact 0.0%" in table and "facts 80.0%" in table
    assert "| grpo | sft | full | 3e-05 (1e-05, 3e-05) | 2 | 50.0 ± 14.1 |" in table
    assert "0.10 ± 0.00 → 0.50 ± 0.00" in table
    assert "| dpo | base | lisa_g4 | 3e-05 (3e-05) | 1 | 50.0 | 50.0 | 1.500 | 90.0 | – → – |" in table


def test_a_runs_threads_reach_its_recipe(tmp_path):
    """--threads: the recipe's training.threads, which the session applies (its `auto` would take
    every core, so two processes would each run on both)."""
    from benchmarks.learning.arms import lisaft_recipe

    job = {"arm": "grpo", "seed": 0, "lr": 1e-5, "threads": 1, "tokenizer": "m", "settings": {
        "steps": 2, "batch_size": 2, "max_seq_len": 32, "warmup_steps": 0, "interval_steps": 2}}
    recipe = lisaft_recipe(job, p4.method_spec("lisa_g4", SMOLLM2), {"name_or_path": "m"}, tmp_path, 2, 1e-5)
    assert recipe.training.threads == 1
