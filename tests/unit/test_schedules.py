import math

import pytest

from lisaft.schedules import lr_at


def test_warmup_then_cosine_to_floor():
    kw = dict(peak_lr=1.0, max_steps=110, name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(109, **kw) == pytest.approx(0.1)
    mid = lr_at(10 + 99 // 2, **kw)
    assert 0.1 < mid < 1.0
    lrs = [lr_at(s, **kw) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_linear_and_constant():
    assert lr_at(0, peak_lr=2.0, max_steps=5, name="linear") == 2.0
    assert lr_at(4, peak_lr=2.0, max_steps=5, name="linear") == pytest.approx(0.0)
    assert lr_at(2, peak_lr=2.0, max_steps=5, name="linear") == pytest.approx(1.0)
    assert all(lr_at(s, peak_lr=3.0, max_steps=5, name="constant") == 3.0 for s in range(5))


def test_pure_function_of_step():
    kw = dict(peak_lr=1e-3, max_steps=50, name="cosine", warmup_steps=5)
    assert [lr_at(s, **kw) for s in range(50)] == [lr_at(s, **kw) for s in range(50)]
    assert math.isclose(lr_at(5, **kw), 1e-3)
