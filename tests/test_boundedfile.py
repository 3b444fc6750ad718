"""The bounded reader of every file the agent parses: size, UTF-8, nesting depth, parse errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.core.boundedfile import (
    KIB,
    MIB,
    BoundedFileError,
    describe_size,
    json_depth_exceeds,
    load_yaml,
    parse_json,
    parse_yaml,
    read_bytes,
    read_text,
)


def test_reads_up_to_the_limit_and_no_further(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert read_bytes(path, max_bytes=10) == b"x" * 10
    with pytest.raises(BoundedFileError) as caught:
        read_bytes(path, max_bytes=9, what="YAML taint policy")
    assert caught.value.reason == "too_large"
    assert str(caught.value) == (
        f"file {path}: larger than 9 bytes; expected a YAML taint policy of at most 9 bytes"
    )


def test_unreadable_file_names_the_cause(tmp_path: Path) -> None:
    with pytest.raises(BoundedFileError) as caught:
        read_bytes(tmp_path / "missing", max_bytes=10, what="kubeconfig")
    assert caught.value.reason == "unreadable"
    assert caught.value.detail == "a readable kubeconfig; it is unreadable (No such file or directory)"
    with pytest.raises(BoundedFileError, match="Is a directory"):
        read_bytes(tmp_path, max_bytes=10)


def test_binary_garbage_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "garbage"
    path.write_bytes(b"ok\n\xb8\x00\xff")
    with pytest.raises(BoundedFileError) as caught:
        read_text(path, max_bytes=KIB, what="kubeconfig")
    assert caught.value.reason == "not_utf8"
    assert str(caught.value) == (
        f"file {path}: not UTF-8 text (byte 3 is 0xb8); expected a kubeconfig in UTF-8"
    )


def test_sizes_are_described_for_people() -> None:
    assert [describe_size(n) for n in (512, 64 * KIB, 3 * MIB // 2, 64 * MIB)] == [
        "512 bytes",
        "64 KiB",
        "1.5 MiB",
        "64 MiB",
    ]


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("", 0),
        ("1", 0),
        ("[]", 1),
        ("{[]}", 2),
        ("[{}]", 2),
        ("[[],[[]],{}]", 3),
        ('{"a": "[[[[", "b": "x\\"[[["}', 1),
        ("[[[[}]]]", 4),  # invalid: the open prefix counts
        ('[["a]]]]', 2),  # an unterminated string
    ],
)
def test_json_depth(text: str, depth: int) -> None:
    assert [json_depth_exceeds(text, limit) for limit in range(6)] == [depth > limit for limit in range(6)]


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert not json_depth_exceeds('{"a": "[[[[[[\\"[[[[", "b": [[1]]}', 3)
    assert json_depth_exceeds('{"a": [[{"b": 1}]]}', 3)
    assert parse_json('{"a": "[[[[[[\\"[[[[", "b": [[1]]}', "x", max_depth=3) == {
        "a": '[[[[[["[[[[',
        "b": [[1]],
    }


def test_deeply_nested_json_is_refused_before_the_parser_recurses() -> None:
    text = "[" * 200_000 + "]" * 200_000  # json.loads alone raises RecursionError on this
    with pytest.raises(BoundedFileError) as caught:
        parse_json(text, "deep.json", what="checkpoint")
    assert caught.value.reason == "too_deep"
    assert str(caught.value) == (
        "file deep.json: nested more than 64 levels deep; expected a checkpoint nested at most 64 levels"
    )


def test_invalid_json_says_where() -> None:
    with pytest.raises(BoundedFileError, match=r"not valid JSON \(Expecting .* line 1 column 6") as caught:
        parse_json('{"a":', "f.json")
    assert caught.value.reason == "invalid"


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100 + "]" * 100,  # flow style
        "".join("  " * i + "a:\n" for i in range(100)) + "  " * 100 + "b: 1\n",  # block style
        "[" * 100_000 + "]" * 100_000,  # yaml.safe_load raises RecursionError on this
    ],
    ids=["flow", "block", "very-deep"],
)
def test_deeply_nested_yaml_is_refused(text: str) -> None:
    with pytest.raises(BoundedFileError) as caught:
        parse_yaml(text, "deep.yaml")
    assert str(caught.value).startswith("file deep.yaml: ")
    assert caught.value.reason in ("too_deep", "invalid")  # libyaml stops at its own limit first


def test_yaml_at_the_depth_limit_loads() -> None:
    assert parse_yaml("[" * 64 + "]" * 64, "ok.yaml") is not None
    with pytest.raises(BoundedFileError, match="nested more than 64 levels"):
        parse_yaml("[" * 65 + "]" * 65, "ok.yaml")


def test_invalid_yaml_names_the_line() -> None:
    with pytest.raises(BoundedFileError) as caught:
        parse_yaml("a: 1\nb: [c\nd: e\n", "bad.yaml", what="YAML taint policy")
    assert caught.value.reason == "invalid"
    assert "not valid YAML at line 3" in str(caught.value)
    assert str(caught.value).endswith("expected a YAML taint policy")


def test_yaml_is_loaded_safely() -> None:
    with pytest.raises(BoundedFileError, match="not valid YAML"):
        parse_yaml("!!python/object:os.system {}", "evil.yaml")
    assert parse_yaml("a: 1", "x") == {"a": 1}


def test_load_yaml_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("a: [1]\n")
    assert load_yaml(tmp_path / "a.yaml", max_bytes=KIB) == {"a": [1]}
    with pytest.raises(BoundedFileError, match="larger than 4 bytes"):
        load_yaml(tmp_path / "a.yaml", max_bytes=4)
