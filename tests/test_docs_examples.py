"""The Python examples of the README and the provider docs run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from abstractruntime_mlx.nodes import default_registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "docs/provider.md",
    "docs/progress.md",
    "docs/check.md",
    "docs/prompt-cache.md",
    "docs/inspector.md",
    "docs/flows.md",
    "docs/structured-output.md",
    "docs/traces.md",
    "docs/server.md",
]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_examples_run(doc, policy_file, tmp_path, monkeypatch):
    blocks = [b for b in python_blocks(ROOT / doc) if "tiny_model(" in b]
    assert blocks, f"{doc} has no runnable example"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # examples name repo paths, as run from the root
    try:
        for block in blocks:
            code = block.replace("/tmp/arm-", str(tmp_path / "arm-"))
            # dont_inherit: the example runs as a script would, without this module's future imports
            exec(compile(code, f"{doc}:example", "exec", dont_inherit=True), {"__name__": "__doc_example__"})
    finally:
        # Flow examples leave their model resident in the process-wide registry, as a user's
        # process would; later tests count resident models.
        default_registry().close()
