import pytest

from lisaft.optim.lr_schedule import lr_at


def test_warmup_then_cosine_to_floor():
    kw = dict(peak_lr=1.0, max_steps=110, name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    # The floor is reached one step after the last, so the last step still trains.
    assert 0.1 < lr_at(109, **kw) < lr_at(108, **kw) and lr_at(110, **kw) == pytest.approx(0.1)
    mid = lr_at(10 + 99 // 2, **kw)
    assert 0.1 < mid < 1.0
    lrs = [lr_at(s, **kw) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_linear_and_constant():
    assert lr_at(0, peak_lr=2.0, max_steps=5, name="linear") == 2.0
    assert lr_at(4, peak_lr=2.0, max_steps=5, name="linear") == pytest.approx(0.4)
    assert lr_at(5, peak_lr=2.0, max_steps=5, name="linear") == pytest.approx(0.0)
    assert lr_at(2, peak_lr=2.0, max_steps=5, name="linear") == pytest.approx(1.2)
    assert all(lr_at(s, peak_lr=3.0, max_steps=5, name="constant") == 3.0 for s in range(5))


def test_schedule_follows_its_plan_and_saves_it():
    from lisaft.config.schema import SchedulerSection
    from lisaft.optim.lr_schedule import Plan, Schedule

    section = SchedulerSection(name="cosine", warmup_steps=5, min_lr_ratio=0.1)
    schedule = Schedule(1e-3, section, horizon=50)
    kw = dict(peak_lr=1e-3, max_steps=50, name="cosine", warmup_steps=5, min_lr_ratio=0.1)
    assert [schedule.lr(s) for s in range(60)] == [lr_at(s, **kw) for s in range(60)]
    assert schedule.lr(49) > 1e-4 and schedule.lr(50) == pytest.approx(1e-4) and schedule.lr(55) == pytest.approx(1e-4)
    # A re-planned curve starts at the LR reached and still ends at the floor.
    schedule.plan = Plan(horizon=80, start_step=30, start_lr=schedule.lr(30))
    restored = Schedule(1e-3, section, horizon=50)
    restored.load_state_dict(schedule.state_dict())
    assert restored.plan == schedule.plan
    assert restored.lr(30) == pytest.approx(lr_at(30, **kw))
    assert restored.lr(79) > 1e-4 and restored.lr(80) == pytest.approx(1e-4) and restored.lr(50) > lr_at(50, **kw)


@pytest.mark.parametrize("name", ["cosine", "linear"])
@pytest.mark.parametrize("max_steps, warmup", [(1, 0), (2, 0), (10, 3), (10, 9)])
def test_no_step_runs_at_lr_0(name, max_steps, warmup):
    """min_lr_ratio 0 is the floor of the decay, reached after the run: every step trains."""
    assert all(lr_at(s, peak_lr=1.0, max_steps=max_steps, name=name, warmup_steps=warmup) > 0
               for s in range(max_steps))


def test_a_warmup_as_long_as_the_run_is_named_with_the_lr_it_reaches():
    from lisaft.config.schema import SchedulerSection
    from lisaft.optim.lr_schedule import Schedule

    note = Schedule(1e-3, SchedulerSection(warmup_steps=100), horizon=5).warmup_note()
    assert note and "scheduler.warmup_steps 100" in note and "training.max_steps 5" in note
    assert "last step trains at 5% of optimizer.lr" in note, note
    assert "at 83% of" in Schedule(1e-3, SchedulerSection(warmup_steps=6), horizon=5).warmup_note()
    assert Schedule(1e-3, SchedulerSection(warmup_steps=5), horizon=5).warmup_note() is None
