"""Protocol 2's APOLLO comparison (benchmarks/learning/report2.py): the best APOLLO arm is picked on
validation, its margins are over each equal-memory baseline present, and the bar is 15 points."""

from benchmarks.learning import report2


def _arm(val: float, test: float, state: int = 1 << 20) -> dict:
    return {"val_token_accuracy": {"mean": val, "sd": 0.0, "n": 3},
            "test_token_accuracy": {"mean": test, "sd": 0.01, "n": 3}, "peak_optimizer_state_bytes": state}


def test_best_apollo_arm_is_picked_on_validation_and_margins_are_per_baseline():
    # apollo_eq_g2 is better on test but worse on validation: validation decides, as for the lr.
    arms = {"apollo_mini": _arm(0.70, 0.68, 1000), "apollo_eq_g2": _arm(0.60, 0.90),
            "lisa_g2_uniform": _arm(0.45, 0.46), "lora_eq_g2": _arm(0.52, 0.50)}
    out = report2.apollo({"new_skill": {"24": arms}})["new_skill/24"]
    assert out["best"] == "apollo_mini" and out["optimizer_state_bytes"] == 1000
    assert out["margins"] == {"lisa_g2_uniform": 0.68 - 0.46, "lora_eq_g2": 0.68 - 0.50}
    assert out["clears_margin"]  # 22 and 18 points, both at least 15


def test_bar_needs_every_baseline_and_rows_without_apollo_are_left_out():
    arms = {"apollo_mini": _arm(0.7, 0.60), "lisa_g2_uniform": _arm(0.4, 0.40), "lora_eq_g2": _arm(0.5, 0.50)}
    results = {"new_skill": {"24": arms, "6": {"lisa_g2_uniform": _arm(0.4, 0.4), "lora_eq_g2": _arm(0.5, 0.5)}}}
    out = report2.apollo(results)
    assert list(out) == ["new_skill/24"]
    assert not out["new_skill/24"]["clears_margin"]  # 20 points over LISA, only 10 over LoRA
    row = next(line for line in report2.markdown({"pretraining": {}, "results": {}, "depth_gap": {},
                                                  "equal_memory": {}, "sampling": {}, "apollo": out,
                                                  "mode": "apollo"}).splitlines()
               if line.startswith("| new_skill/24"))
    assert "apollo_mini" in row and "+20.0" in row and "+10.0" in row and row.endswith("| no |")
