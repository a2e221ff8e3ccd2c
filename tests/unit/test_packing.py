"""Packing: best-fit rows of whole examples, and documents that never see each other."""

import numpy as np
import pytest
import torch

from lisaft.data.collate import IGNORE_INDEX, collate
from lisaft.data.packing import best_fit_rows, pack_examples
from lisaft.errors import LisaftError


def _lognormal_lengths(n, max_seq_len, seed=0):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(200), 0.9, n).astype(int), 8, max_seq_len).tolist()


def _examples(lengths, seed=0, vocab=128):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(3, vocab, n).tolist()
        labels = list(ids)
        labels[: n // 3] = [IGNORE_INDEX] * (n // 3)  # a prompt with no loss
        out.append({"input_ids": ids, "labels": labels})
    return out


# --- the rows ------------------------------------------------------------------------------------


def test_rows_hold_every_example_once_whole_and_fill_over_95_percent():
    lengths = _lognormal_lengths(3000, 2048)
    rows = best_fit_rows(lengths, 2048, seed=0)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert max(sum(lengths[i] for i in r) for r in rows) <= 2048
    assert sum(lengths) / (len(rows) * 2048) >= 0.95


def test_rows_are_a_pure_function_of_seed_lengths_and_max_seq_len():
    lengths = _lognormal_lengths(500, 1024)
    assert best_fit_rows(lengths, 1024, seed=3) == best_fit_rows(list(lengths), 1024, seed=3)
    assert best_fit_rows(lengths, 1024, seed=3) != best_fit_rows(lengths, 1024, seed=4)
    assert best_fit_rows(lengths, 1024, seed=3) != best_fit_rows(lengths, 1100, seed=3)


def test_each_example_goes_to_the_open_row_it_fits_best():
    # Distinct lengths, so the placements happen longest first with no ties to order.
    lengths = np.random.default_rng(1).choice(np.arange(1, 512), 300, replace=False).tolist()
    rows = best_fit_rows(lengths, 512, seed=0)
    # Replay the placements: at each one, no other row had less room that was still enough.
    where = {i: r for r, members in enumerate(rows) for i in members}
    placed = sorted(where, key=lambda i: -lengths[i])
    room: dict[int, int] = {}
    for i in placed:
        r = where[i]
        fits = [left for left in room.values() if left >= lengths[i]]
        if r in room:
            assert room[r] == min(fits)
        else:
            assert not fits  # a new row only when no open row could take it
            room[r] = 512
        room[r] -= lengths[i]


def test_a_full_length_example_gets_a_row_of_its_own_and_longer_ones_are_refused():
    rows = best_fit_rows([16, 3, 13], 16, seed=0)
    assert sorted(map(sorted, rows)) == [[0], [1, 2]]
    with pytest.raises(ValueError):
        best_fit_rows([17], 16, seed=0)


def test_the_summary_line_and_the_digest():
    examples = _examples([10, 20, 30, 40, 5])
    packing = pack_examples(examples, 64, seed=0)
    assert packing.summary() == f"packing: 5 examples in {len(packing.rows)} rows, " \
                                f"{105 / (len(packing.rows) * 64):.1%} of positions real"
    assert pack_examples(examples, 64, seed=0).digest == packing.digest
    changed = [dict(ex) for ex in examples]
    changed[2] = {"input_ids": [7] + examples[2]["input_ids"][1:], "labels": examples[2]["labels"]}
    other = pack_examples(changed, 64, seed=0)
    assert other.digest != packing.digest
    other.load_state_dict(other.state_dict())
    with pytest.raises(LisaftError, match="packed into") as e:
        other.load_state_dict(packing.state_dict())
    assert "\n" not in str(e.value)


# --- the tensors -------------------------------------------------------------------------------


def test_collate_restarts_positions_and_masks_each_documents_first_label():
    packing = pack_examples(_examples([5, 3, 4]), 12, seed=0)
    assert len(packing.rows) == 1 and packing.rows[0]["doc_lens"] == [5, 4, 3]
    short = {"input_ids": [1, 2], "labels": [1, 2], "doc_lens": [2]}
    batch = collate([packing.rows[0], short], pad_id=0)
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2],
                                              [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    labels = batch["labels"][0].tolist()
    assert labels[0] == labels[5] == labels[9] == IGNORE_INDEX
    assert labels[4] == packing.rows[0]["labels"][4] and labels[8] == packing.rows[0]["labels"][8]
    assert batch["labels"][1, 2:].eq(IGNORE_INDEX).all()


def test_rows_of_one_whole_document_each_get_plain_causal_attention():
    """No position ids: transformers then neither searches them for packed documents (a read of
    the device per forward) nor builds a mask, and sdpa runs is_causal; the logits are those of
    the explicit positions, bit for bit."""
    from _tiny import tiny

    rows = [{**ex, "doc_lens": [8]} for ex in _examples([8, 8], vocab=128)]
    batch = collate(rows, pad_id=0)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["labels"][:, 0].eq(IGNORE_INDEX).all()
    assert batch["labels"][:, 1:].tolist() == [r["labels"][1:] for r in rows]
    model = tiny(0, 1)
    model.config._attn_implementation = "sdpa"
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        plain = model(input_ids=batch["input_ids"], use_cache=False).logits
        positioned = model(input_ids=batch["input_ids"], position_ids=torch.arange(8).repeat(2, 1),
                           use_cache=False).logits
    assert calls == [(None, True)] * 2
    assert torch.equal(plain, positioned)


def test_flattened_batches_carry_the_varlen_kernels_lengths():
    examples = _examples([5, 3, 4])
    batch = collate(examples, pad_id=0, flatten=True)
    assert batch["input_ids"].shape == (1, 12)
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 5, 8, 12]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 5 and isinstance(batch["max_length_q"], int)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]
    assert batch["labels"][0, [0, 5, 8]].eq(IGNORE_INDEX).all()
    assert "attention_mask" not in batch
    # Packed rows flatten into their documents.
    packed = pack_examples(examples, 8, seed=0)
    flat = collate(packed.rows, pad_id=0, flatten=True)
    assert flat["cu_seq_lens_q"].diff().tolist() == [n for r in packed.rows for n in r["doc_lens"]]


def test_data_order_over_packed_rows_names_rows_and_gives_ranks_whole_rows():
    from lisaft.data.order import DataOrder

    with pytest.raises(LisaftError, match="smaller than one batch: 3 packed rows"):
        DataOrder(3, 4, seed=0, unit="packed rows")
    single = DataOrder(10, 4, seed=0)
    ranks = [DataOrder(10, 2, seed=0, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        assert single.next_indices() == ranks[0].next_indices() + ranks[1].next_indices()
