"""lisaft: full-quality fine-tuning of 7-8B causal LMs on one 24 GB GPU."""

__version__ = "0.1.0"
