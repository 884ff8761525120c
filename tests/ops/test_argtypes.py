"""The argparse types of every kvtier command line: what each accepts, and a bad value is an ArgumentTypeError
whose message argparse turns into one usage line (exit code 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.ops import argtypes


@pytest.mark.parametrize(("parse", "text", "value"), [
    (argtypes.positive_int, "1", 1), (argtypes.positive_int, "+7", 7), (argtypes.non_negative_int, "0", 0),
    (argtypes.positive_size, "64KiB", 65536), (argtypes.positive_size, "4096B", 4096),
    (argtypes.positive_float, "0.5", 0.5), (argtypes.non_negative_float, "0", 0.0),
    (argtypes.positive_ints, "512, 1024", (512, 1024)), (argtypes.positive_sizes, "32MiB,2MiB", (32 << 20, 2 << 20)),
    (argtypes.names_from(["cpu", "disk"]), "disk,cpu", ("disk", "cpu")), (argtypes.key_value, "A=b=c", "A=b=c"),
])
def test_each_type_accepts(parse: Callable[[str], Any], text: str, value: Any) -> None:
    assert parse(text) == value


@pytest.mark.parametrize(("parse", "text", "message"), [
    (argtypes.positive_int, "0", "expected an integer >= 1, got '0'"),
    (argtypes.positive_int, "1.5", "expected an integer >= 1"), (argtypes.non_negative_int, "-1", "expected"),
    (argtypes.non_negative_int, "", "expected"), (argtypes.positive_size, "0", "expected a size above 0"),
    (argtypes.positive_size, "-1MiB", "expected"), (argtypes.positive_size, "lots", "expected"),
    (argtypes.positive_float, "0", "expected a positive number"), (argtypes.positive_float, "nan", "expected"),
    (argtypes.non_negative_float, "-0.1", "expected a number >= 0"),
    (argtypes.positive_ints, " , ", "expected a comma list"), (argtypes.positive_ints, "4,0", "expected an integer"),
    (argtypes.names_from(["cpu", "disk"]), "cpu,tape", "unknown tape (choose from cpu, disk)"),
    (argtypes.key_value, "=x", "expected KEY=VALUE, got '=x'"), (argtypes.key_value, "x", "expected KEY=VALUE"),
])
def test_each_type_refuses_with_its_reason(parse: Callable[[str], Any], text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse(text)


def test_a_size_without_a_unit_is_refused_with_a_guess() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'256' has no unit \(did you mean 256MiB or 256GiB\? "
                                                         r"256B is bytes\)$"):
        argtypes.positive_size("256")


def test_paths_must_exist(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert argtypes.existing_path(str(tmp_path / "f")) == str(tmp_path / "f")
    assert argtypes.existing_dir(str(tmp_path)) == str(tmp_path)
    with pytest.raises(argparse.ArgumentTypeError, match="is not a directory"):
        argtypes.existing_dir(str(tmp_path / "f"))
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        argtypes.existing_path(str(tmp_path / "absent"))
