"""``lanes.LANES`` and the lane table in ``docs/architecture.md`` say the same, and every lane's
backend is a class whose ``kind`` is that lane: the docs, the table and the code cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

from abstractruntime_mlx.engine.backends import backend, serial, single, text_loop
from abstractruntime_mlx.engine.backends.rows import LaneName
from abstractruntime_mlx.engine.core.lanes import LANES, LaneContext, choose_lane
from abstractruntime_mlx.engine.core.request import EngineRequest, ExecutionMode, Sampling

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
HEADER = "| lane | admits | backend | adopts from | `execution.path` |"


def doc_rows() -> list[list[str]]:
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER) + 2  # past the header and its rule
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def code(cell: str) -> str:
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match is not None, cell
    return match.group(1)


def test_the_docs_table_is_the_lane_table():
    rows = doc_rows()
    assert [code(r[0]) for r in rows] == [str(name) for name in LANES]  # the same lanes, in precedence order
    for (name, admits, backend_cls, adopts, path), spec in zip(rows, LANES.values()):
        assert admits == spec.admits.__doc__, name
        assert code(backend_cls) == spec.backend, name
        assert adopts == (f"`{spec.adopts_from}`" if spec.adopts_from else "-"), name
        adopted = f" (adopted: `{spec.adopted_path}`)" if spec.adopted_path else ""
        assert path == f"`{spec.path}`{adopted}", name


def test_each_lane_names_the_backend_that_reports_it():
    classes = {
        cls.__name__: cls
        for module in (backend, serial, single, text_loop)
        for cls in vars(module).values()
        if isinstance(cls, type)
    }
    for spec in LANES.values():
        assert classes[spec.backend].kind == spec.name, spec.name
    # the wire values ``execution.path`` keeps
    assert {str(s.path) for s in LANES.values()} | {"single_then_batch"} == {
        "single",
        "single_then_batch",
        "batch",
        "text_batch",
        "serial",
    }


def req(**kw: object) -> EngineRequest:
    return EngineRequest(request_id="r", prompt_ids=[1, 2, 3], max_tokens=4, **kw)  # type: ignore[arg-type]


def test_a_new_group_runs_on_the_first_lane_that_admits_it():
    native = LaneContext(frozenset({LaneName.BATCH, LaneName.SINGLE, LaneName.TEXT}))
    continuous = ExecutionMode.CONTINUOUS
    assert choose_lane(continuous, [req()], native) == LaneName.SINGLE
    assert choose_lane(continuous, [req(), req()], native) == LaneName.TEXT
    assert choose_lane(continuous, [req(sampling=Sampling(repetition_penalty=1.2))], native) == LaneName.TEXT
    keyed = [req(prompt_cache_key="k"), req(prompt_cache_key="k")]
    assert choose_lane(continuous, keyed, native) == LaneName.BATCH
    # Keyed rows run on the text lane where it restores their prefixes (a model whose prefixes are
    # shared as blocks, from RAM or the SSD tier); elsewhere (hybrid models) on the batch lane.
    restoring = LaneContext(native.open, prefix_cache=True, lanes_restore=True)
    assert choose_lane(continuous, keyed, restoring) == LaneName.TEXT
    assert choose_lane(continuous, keyed, LaneContext(native.open, prefix_cache=True)) == LaneName.BATCH
    assert choose_lane(ExecutionMode.COHORT, [req()], native) == LaneName.BATCH
    assert choose_lane(ExecutionMode.EXCLUSIVE, [req()], native) == LaneName.BATCH
    assert choose_lane(continuous, [req()], LaneContext(frozenset({LaneName.BATCH}))) == LaneName.BATCH
    for alone in (LaneName.SERIAL, LaneName.IN_PROCESS):
        assert choose_lane(ExecutionMode.EXCLUSIVE, [req()], LaneContext(frozenset({alone}))) == alone
