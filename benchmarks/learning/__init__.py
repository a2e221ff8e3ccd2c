"""The learning benchmark's parts (benchmarks/learning_bench.py is the command): `measure` scores a
model and reads memory, `arms` trains one arm at one learning rate and seed, `report` turns the runs
into the summary, the markdown table and the plots."""
