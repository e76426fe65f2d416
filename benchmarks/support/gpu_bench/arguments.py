"""The arguments every row's program takes (device, repeats, the scale note) and list parsing."""

from __future__ import annotations

import argparse


def int_list(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` as ``(1, 4, 16)``."""
    return tuple(int(part) for part in text.split(",") if part)


def row_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the arguments every row takes; the program adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per figure")
    parser.add_argument("--note", default="", help="how the sizes differ from the GPU's (said in the row)")
    return parser


def noted(note: str, figures: str) -> str:
    """``figures`` with the scale note in front when there is one."""
    return f"[{note}] {figures}" if note else figures
