"""The train command's one-line JSON summary, found in a job's merged output."""

from __future__ import annotations

import json


def json_record(output: str, mark: str = '{"model"') -> dict:
    """The JSON summary in a job's merged output (other ranks' text may share its line); ``mark``: how it begins."""
    for line in output.splitlines():
        start = line.find(mark)
        if start >= 0:
            return json.JSONDecoder().raw_decode(line[start:])[0]
    raise AssertionError(f"no JSON summary in:\n{output}")
