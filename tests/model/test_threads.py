"""`one_thread`: torch runs the block on one thread and gets its thread count back, also when
blocks nest, raise, or overlap in several threads."""

from __future__ import annotations

import threading

import pytest
import torch

from kvq.model.threads import one_thread


@pytest.fixture
def two_threads() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_thread_inside_and_restored_after(two_threads: object) -> None:
    with one_thread():
        assert torch.get_num_threads() == 1
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1, "the inner block does not end the outer one"
    assert torch.get_num_threads() == 2


def test_restored_after_an_exception(two_threads: object) -> None:
    with pytest.raises(RuntimeError), one_thread():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


def test_overlapping_blocks_in_two_threads_each_restore_their_own(two_threads: object) -> None:
    """A enters, B enters, A leaves, B leaves: each thread gets back the count it had."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def b() -> None:
        a_in.wait(5)
        seen["before"] = torch.get_num_threads()
        with one_thread():
            seen["inside"] = torch.get_num_threads()
            b_in.set()
            a_out.wait(5)
        seen["after"] = torch.get_num_threads()

    t = threading.Thread(target=b)
    t.start()
    with one_thread():
        a_in.set()
        assert b_in.wait(5)
    a_out.set()
    t.join(5)
    assert torch.get_num_threads() == 2
    assert seen["inside"] == 1 and seen["after"] == seen["before"]
