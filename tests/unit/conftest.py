"""Shared by the LISA and optimizer unit tests."""

import warnings

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models run faster on one thread than on cores shared with other processes.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _quiet_paging():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*runs unpaged.*")
        yield
