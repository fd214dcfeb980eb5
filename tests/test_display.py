"""Sizes as the epoch lines and `ckpt list` print them."""

from __future__ import annotations

import pytest

from jobrun.runner.display import human_size


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KB"), (5 * 2**20, "5.0 MB"),
    (3 * 2**30, "3.0 GB"), (5 * 2**40, "5.0 TB"), (3 * 2**50, "3072.0 TB"),
])
def test_human_size(n, text):
    assert human_size(n) == text
