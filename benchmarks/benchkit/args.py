"""Argument checks shared by the benchmark scripts: bad values are one ``usage`` line naming the flag (exit 2),
found before anything is measured."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable

from cppo.fileio import check_writable


def count(minimum: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    return parse


def check_output_file(ap: argparse.ArgumentParser, flag: str, path: pathlib.Path) -> None:
    """``ap.error`` unless ``path`` can be written as a file: not a folder, its folder creatable and writable."""
    if path.is_dir():
        ap.error(f"{flag} {str(path)!r} is a folder: name the file to write")
    try:
        check_writable(str(path.parent), create=False)
    except ValueError as e:
        ap.error(f"{flag} {str(path)!r}: " + str(e).replace("output_dir", "its folder", 1))
