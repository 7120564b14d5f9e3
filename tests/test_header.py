"""The fast ustar header packer writes exactly what the standard library writes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from feedpipe.format._tar import _slow_header, member_header

names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
                min_size=1, max_size=120)


@given(name=names, size=st.one_of(st.integers(0, 10**7), st.integers(8**11 - 2, 8**11 + 2)))
def test_fast_header_matches_tarfile(name: str, size: int) -> None:
    assert member_header(name, size) == _slow_header(name, size)
