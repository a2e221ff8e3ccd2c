"""The estimator's advice is re-validated through config/compat.py before it is printed: no
change it offers makes a recipe `lisaft train` refuses (training.on_nonfinite: skip once drew
APOLLO-Mini with the step in backward, which compat refuses)."""

import pytest

from lisaft.config.compat import first_exclusion
from lisaft.memory.advice import advice, leanest
from lisaft.memory.catalogue import resolve_model
from lisaft.memory.estimate import compute
from lisaft.memory.settings import settings_for_config


@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_every_change_advised_is_a_recipe_compat_accepts(on_nonfinite):
    s = settings_for_config(resolve_model("llama-3.1-8b")[0], {
        "data.max_seq_len": 2048, "lisa.enabled": False, "training.on_nonfinite": on_nonfinite}, "llama-3.1-8b")
    est = compute(s)
    assert not est.fits
    changes = [*advice(est, 32), leanest(s, 32)]
    assert changes
    for c in changes:
        assert first_exclusion(s.with_keys(c.overrides).recipe) is None, c.overrides
    in_backward = [c for c in changes if c.overrides.get("optimizer.in_backward")]
    assert bool(in_backward) == (on_nonfinite == "stop")  # offered where compat allows it, only there
