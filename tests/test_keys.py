"""Key encoding: reversible, injective, and safe under the WebDataset first-dot rule."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from webdataset.tariterators import base_plus_ext

from feedpipe.format._keys import (
    decode_key,
    encode_key,
    source_path,
    split_member,
    split_source,
    valid_extension,
)

# Any text that can be a file-name component (no "/", no NUL, no lone surrogates), with the
# characters that matter over-represented.
_odd = st.sampled_from(list(". %%2E\\\t\n\u00a0\u2028é猫🙂-_~#"))
_char = st.one_of(_odd, st.characters(exclude_categories=("Cs",), exclude_characters="/\0"))
component = st.text(_char, min_size=1, max_size=12)
stems = st.lists(component, min_size=1, max_size=4).map("/".join)
extensions = st.text(st.characters(codec="ascii", exclude_characters="/%. \t\n\r\x0b\x0c\\"),
                     min_size=1, max_size=6).filter(lambda e: e.isprintable())


@given(st.text(st.characters(exclude_categories=("Cs",))))
@example("a/cat.v2")
@example("100% done.%2E")
@example("a\\b")
@example("dir.v1/x y\u3000z")
def test_encode_decode_round_trip(text: str) -> None:
    assert decode_key(encode_key(text)) == text


@given(stems, stems)
def test_encoding_is_injective(a: str, b: str) -> None:
    if a != b:
        assert encode_key(a) != encode_key(b)


def test_backslash_does_not_fold_into_slash() -> None:
    # a\b.jpg and a/b.jpg are two different files on POSIX: they must not share a key
    assert encode_key("a\\b") != encode_key("a/b")
    assert source_path(encode_key("a\\b"), "jpg") == "a\\b.jpg"


@given(stems, extensions)
@example("a/cat.v2", "jpg")
@example("my dir/100% done", "json")
@example(".hidden.tar", "gz")
def test_encoded_keys_survive_the_first_dot_rule(stem: str, ext: str) -> None:
    key = encode_key(stem)
    name = f"{key}.{ext}"
    assert "." not in key.rsplit("/", 1)[-1]
    assert not any(c.isspace() for c in key)
    assert split_member(name) == (key, ext)
    # the webdataset library's own rule agrees
    assert base_plus_ext(name) == (key, ext)
    # and the source path comes back
    assert source_path(key, ext) == f"{stem}.{ext}"


@given(stems, extensions)
def test_split_source_then_encode_recovers_path(stem: str, ext: str) -> None:
    rel = f"{stem}.{ext}"
    s, e = split_source(rel)
    assert (s, e) == (stem, ext)
    assert source_path(encode_key(s), e) == rel


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cls/0001.jpg", ("cls/0001", "jpg")),
        ("a.b/c.d.e", ("a.b/c", "d.e")),
        ("noext", ("noext", "")),
        ("dir/noext", ("dir/noext", "")),
    ],
)
def test_split_member_follows_webdataset(name: str, expected: tuple[str, str]) -> None:
    assert split_member(name) == expected


@pytest.mark.parametrize(
    ("rel", "expected"),
    [
        ("a/cat.v2.jpg", ("a/cat.v2", "jpg")),
        ("cls/0001.json", ("cls/0001", "json")),
        ("README", ("README", "")),
        ("dir.d/README", ("dir.d/README", "")),
        ("dir/.hidden", ("dir/.hidden", "")),
    ],
)
def test_split_source_at_last_dot(rel: str, expected: tuple[str, str]) -> None:
    assert split_source(rel) == expected


@pytest.mark.parametrize("ext", ["", "a b", "a/b", "50%", "x\ty"])
def test_invalid_extensions(ext: str) -> None:
    assert not valid_extension(ext)


@pytest.mark.parametrize("ext", ["jpg", "json", "seg.png", "cls"])
def test_valid_extensions(ext: str) -> None:
    assert valid_extension(ext)
