"""The int8-activation kernel, built once for the tests of this folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvq.quant import qdot


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> qdot.Built:
    b = qdot.load("cc", tmp_path_factory.mktemp("qdot"))
    if b is None:
        pytest.skip("no C compiler here: the float32 kernels are what runs")
    return b


@pytest.fixture
def int8(built: qdot.Built) -> Iterator[None]:
    """KVQ_ACTIVATIONS=int8 for one test, with the session's build."""
    before = qdot.options()
    qdot.configure(qdot.KernelOptions("int8", "cc", str(built.path.parent)))
    yield
    qdot.configure(before)
