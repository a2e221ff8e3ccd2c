"""The data digest: an edit, a reorder or a moved token changes it; a resume over another digest
is refused unless asked for, and an older checkpoint without one still loads."""

import pytest

from lisaft.data.digest import DataChanged, examples_digest
from lisaft.data.order import DataOrder


def _examples(n: int, length: int = 8) -> list[dict]:
    return [{"input_ids": [(i * 7 + j) % 97 for j in range(length)],
             "labels": [-100] * 2 + [(i * 7 + j) % 97 for j in range(2, length)]} for i in range(n)]


def test_an_edit_a_reorder_or_a_moved_token_changes_the_digest():
    ex = _examples(6)
    base = examples_digest(ex)
    assert examples_digest(_examples(6)) == base
    edited = [dict(e) for e in ex]
    edited[3] = {**ex[3], "labels": [-100] * 8}  # same tokens, loss moved: another training signal
    moved = [dict(e) for e in ex]
    moved[0] = {"input_ids": ex[0]["input_ids"] + ex[1]["input_ids"][:1],
                "labels": ex[0]["labels"] + ex[1]["labels"][:1]}
    moved[1] = {"input_ids": ex[1]["input_ids"][1:], "labels": ex[1]["labels"][1:]}
    for other in (edited, list(reversed(ex)), moved, ex[:-1]):
        assert examples_digest(other) != base


def test_the_order_refuses_another_digest_in_one_line_unless_asked():
    saved = DataOrder(6, 2, seed=0, digest="aaaa").state_dict()
    assert saved["digest"] == "aaaa"
    with pytest.raises(DataChanged) as e:
        DataOrder(6, 2, seed=0, digest="bbbb").load_state_dict(saved)
    assert "\n" not in str(e.value) and "--set training.accept_data_change=true" in str(e.value)
    with pytest.raises(DataChanged, match="6 training examples then, 7 now"):
        DataOrder(7, 2, seed=0, digest="aaaa").load_state_dict(saved)
    accepting = DataOrder(6, 2, seed=0, digest="bbbb", accept_change=True)
    with pytest.warns(UserWarning, match="continuing over the new data as asked"):
        accepting.load_state_dict({**saved, "position": 4})
    assert accepting.position == 4
    older = {k: v for k, v in saved.items() if k != "digest"}  # written before the digest existed
    DataOrder(6, 2, seed=0, digest="bbbb").load_state_dict(older)
