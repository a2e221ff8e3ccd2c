"""benchmarks/quickstart_bench.py's summary of a run: eval accuracy by step and exact answers."""

from benchmarks.quickstart_bench import summarise


def test_summary_reads_eval_records_and_counts_exact_answers():
    records = [{"step": 10, "loss": 2.0}, {"step": 0, "eval_loss": 4.6, "eval_token_accuracy": 0.01849},
               {"step": 800, "eval_loss": 0.1, "eval_token_accuracy": 0.99651}]
    answers = [{"exact": i % 3 != 0} for i in range(30)]
    s = summarise(records, answers)
    assert s["eval_token_accuracy_pct"] == {"0": 1.8, "800": 99.7}
    assert (s["exact"], s["answers"], s["exact_of_first_20"]) == (20, 30, 13)
