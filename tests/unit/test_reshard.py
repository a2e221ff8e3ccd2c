"""Optimizer moments of a training.fsdp checkpoint cut for another number of ranks (lisaft/checkpoint/reshard.py)."""

import pytest
import torch

from lisaft.checkpoint.reshard import ReshardNotes, _code, reshard_unit_state, row_range
from lisaft.errors import LisaftError

GROUPS = [{"params": [0]}]


def test_row_ranges_are_the_slices_fsdp_cuts():
    for n in (1, 3, 7, 32, 110):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.arange(n).chunk(world)
            for rank in range(world):
                lo, hi = row_range(n, world, rank)
                expected = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(lo, hi)) == expected, (n, world, rank)


def _quantize(values, signed):
    import bitsandbytes.functional as F

    q, qs = F.quantize_blockwise(values, code=_code(signed), blocksize=256)
    return q, qs.absmax.float()


def _dequantize(q, absmax, signed):
    import bitsandbytes.functional as F

    return F.dequantize_blockwise(q, absmax=absmax, code=_code(signed), blocksize=256)


def _slices(m, v, shape, world, eight_bit):
    """Per-rank state_dicts as lisaft's unit optimizers save them: flat moments of each slice."""
    out = []
    for rank in range(world):
        lo, hi = row_range(shape[0], world, rank)
        ms, vs = m[lo:hi].reshape(-1), v[lo:hi].reshape(-1)
        st = {"step": 7}
        if eight_bit and ms.numel() >= 4096:
            st["exp_avg"], st["absmax1"] = _quantize(ms, True)
            st["exp_avg_sq"], st["absmax2"] = _quantize(vs, False)
        else:
            st["exp_avg"], st["exp_avg_sq"] = ms.clone(), vs.clone()
        out.append({"state": {0: st}, "param_groups": GROUPS})
    return out


def _moments(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 1e-3, torch.rand(shape, generator=g) * 1e-6


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (3, 2), (1, 4), (4, 3)])
def test_float32_moments_move_exactly(old_world, new_world):
    shape = (11, 5)
    m, v = _moments(shape)
    olds = _slices(m, v, shape, old_world, eight_bit=False)
    notes = ReshardNotes()
    for rank in range(new_world):
        lo, hi = row_range(shape[0], new_world, rank)
        sd = reshard_unit_state(olds, [torch.Size(shape)], new_world, rank, False, notes)
        st = sd["state"][0]
        assert st["step"] == 7 and sd["param_groups"] == GROUPS
        assert st["exp_avg"].equal(m[lo:hi].reshape(-1)) and st["exp_avg_sq"].equal(v[lo:hi].reshape(-1))
    assert notes.requantized == 0


def test_8bit_moments_in_whole_row_blocks_move_exactly():
    # Rows of 256 elements: every block lies in one row, so slices join and split at block edges
    # and the bytes and absmax of one rank over all rows are the two ranks' side by side.
    shape = (32, 256)
    m, v = _moments(shape)
    olds = _slices(m, v, shape, 2, eight_bit=True)
    whole = _slices(m, v, shape, 1, eight_bit=True)[0]["state"][0]
    notes = ReshardNotes()
    st = reshard_unit_state(olds, [torch.Size(shape)], 1, 0, True, notes)["state"][0]
    for key in ("exp_avg", "exp_avg_sq", "absmax1", "absmax2"):
        assert st[key].equal(whole[key]), key
    assert notes.requantized == 0


@pytest.mark.parametrize("shape,old_world,new_world", [((33, 200), 2, 1), ((64, 64), 2, 1), ((64, 96), 1, 2)])
def test_moments_that_cannot_move_as_bytes_are_requantized_once(shape, old_world, new_world):
    # (33, 200): blocks straddle rows; (64, 64): float32 halves become one 8-bit tensor;
    # (64, 96): an 8-bit tensor becomes float32 halves.
    m, v = _moments(shape, seed=1)
    olds = _slices(m, v, shape, old_world, eight_bit=True)
    notes = ReshardNotes()
    for rank in range(new_world):
        lo, hi = row_range(shape[0], new_world, rank)
        st = reshard_unit_state(olds, [torch.Size(shape)], new_world, rank, True, notes)["state"][0]
        got = []
        for signed, key, absmax in ((True, "exp_avg", "absmax1"), (False, "exp_avg_sq", "absmax2")):
            t = st[key]
            got.append(_dequantize(t, st[absmax], signed) if t.dtype == torch.uint8 else t)
        for values, want in zip(got, (m, v)):
            want = want[lo:hi].reshape(-1)
            # Within two 8-bit quantizations of each block's largest value.
            assert (values - want).abs().max() <= 0.05 * want.abs().max()
    assert notes.requantized == new_world


def test_a_rank_missing_the_moments_others_hold_is_refused():
    shape = (8, 4)
    m, v = _moments(shape)
    olds = _slices(m, v, shape, 2, eight_bit=False)
    olds[1]["state"] = {}
    with pytest.raises(LisaftError, match="rank-1/layer-00003.pt lacks the moments of parameter 0"):
        reshard_unit_state(olds, [torch.Size(shape)], 1, 0, False, ReshardNotes(), "layer-00003")


def test_a_unit_no_rank_saved_has_no_state():
    assert reshard_unit_state([None, None], [torch.Size((4, 4))], 1, 0, False, ReshardNotes()) is None
