"""lab.paths: where things live, and paths made portable for tables that travel between machines."""

import math

from lab import paths


def test_repo_relative_inside_outside_and_missing(tmp_path):
    inside = paths.REPO_ROOT / "artifacts" / "t.json"
    assert paths.repo_relative(inside) == "artifacts/t.json"
    assert paths.repo_relative(str(inside)) == "artifacts/t.json"
    outside = tmp_path / "t.json"
    if not outside.resolve().is_relative_to(paths.REPO_ROOT):
        assert paths.repo_relative(str(outside)) == str(outside)
    assert paths.repo_relative(None) is None and paths.repo_relative(math.nan) is None
