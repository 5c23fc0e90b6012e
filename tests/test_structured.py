"""Structured output: grammar-constrained decoding per row, on every lane, and its edges.

Random weights prefer no JSON at all, so every answer that parses and validates here does so
because the grammar forced it.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from abstractruntime_mlx.errors import (
    InvalidRequest,
    InvalidResponseSchema,
    ResponseSchemaTooLarge,
    SpeculationUnavailable,
    StructuredOutputInvalid,
)
from abstractruntime_mlx.structured import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    ResponseFormat,
    answer_error,
    schema_hash,
)

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "count", "ok", "color"],
    "additionalProperties": False,
}

NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 1, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "tags", "owner"],
    "additionalProperties": False,
}

# A tree: nodes hold children of their own type.
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["v", "kids"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}

FREE_TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def nested_objects(levels: int) -> dict[str, object]:
    """An object schema ``levels`` objects deep (each level adds two JSON levels: the schema and its ``properties``)."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_arrays(depth: int) -> dict[str, object]:
    """A schema whose objects nest exactly ``depth`` JSON levels (arrays of arrays of strings)."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


HUGE_ANY_OF = {"anyOf": [{"const": f"value-{i}"} for i in range(20_000)]}
DEEP = nested_objects(450)


class Pick(BaseModel):
    color: Literal["red", "green"]
    count: int


def assert_valid(result, schema):
    value = json.loads(result.content)
    jsonschema.validate(value, schema)
    assert result.parsed == value
    structured = result.metadata["structured"]
    assert structured["mode"] == "constrained" and structured["complete"] is True
    assert structured["schema_hash"] == schema_hash(schema)
    return value


@pytest.fixture()
def batched(make_llm, dense_model):
    return make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=8, mlx_batch_wait_ms=200, speculation=False)


@pytest.mark.parametrize("schema", [RECORD, NESTED, TREE], ids=["record", "nested-pattern", "recursive"])
def test_random_weights_give_schema_valid_json(batched, schema):
    result = batched.generate(
        "Describe it.", thinking=False, temperature=0, max_output_tokens=96, response_schema=schema
    )
    assert_valid(result, schema)
    assert result.finish_reason == "stop"
    assert result.metadata["execution"]["mode"] == "continuous"
    assert result.metadata["execution"]["path"] != "single"  # the single lane applies no logits processors


def test_pydantic_model_and_json_object(batched):
    result = batched.generate("Pick one.", thinking=False, temperature=0, max_output_tokens=48, response_model=Pick)
    assert isinstance(result.parsed, Pick)
    assert result.to_dict()["parsed"] == result.parsed.model_dump()
    any_object = batched.generate(
        "Anything.", thinking=False, temperature=0, max_output_tokens=48, response_format={"type": "json_object"}
    )
    assert isinstance(any_object.parsed, dict) and any_object.metadata["structured"]["name"] == "json_object"


def test_sampled_constrained_rows_are_valid_and_seeded(batched):
    calls = [dict(temperature=1.0, seed=s) for s in (1, 2, 3)]
    results = [
        batched.generate("Describe it.", thinking=False, max_output_tokens=64, response_schema=RECORD, **c)
        for c in calls
    ]
    for r in results:
        assert_valid(r, RECORD)
    again = batched.generate("Describe it.", thinking=False, max_output_tokens=64, response_schema=RECORD, **calls[0])
    assert again.token_ids == results[0].token_ids


@pytest.mark.slow
def test_constrained_and_free_rows_share_a_batch_free_rows_unchanged(batched):
    prompts = [f"Question number {i}." for i in range(6)]
    alone = [batched.generate(p, thinking=False, temperature=0, max_output_tokens=24) for p in prompts]
    start = threading.Barrier(len(prompts))

    def one(i):
        start.wait()
        if i % 2:
            return batched.generate(
                prompts[i], thinking=False, temperature=0, max_output_tokens=48, response_schema=RECORD
            )
        return batched.generate(prompts[i], thinking=False, temperature=0, max_output_tokens=24)

    with ThreadPoolExecutor(len(prompts)) as pool:
        mixed = list(pool.map(one, range(len(prompts))))
    for i, r in enumerate(mixed):
        assert r.metadata["execution"]["mode"] == "continuous"
        if i % 2:
            assert_valid(r, RECORD)
        else:
            assert "structured" not in r.metadata and r.parsed is None
            assert r.token_ids == alone[i].token_ids  # the grammar of a batch-mate never touches this row
    assert max(r.metadata["execution"]["peak_batch_size"] for r in mixed) >= 4


def test_grammars_are_cached_by_schema_hash(batched):
    first = batched.generate("a", thinking=False, temperature=0, max_output_tokens=48, response_schema=NESTED)
    second = batched.generate("b", thinking=False, temperature=0, max_output_tokens=48, response_schema=dict(NESTED))
    assert second.metadata["structured"]["grammar_cached"] is True
    assert first.metadata["structured"]["schema_hash"] == second.metadata["structured"]["schema_hash"]
    assert first.metadata["structured"]["compile_s"] >= 0


def test_the_budget_closes_an_answer_the_cap_would_cut(batched):
    # An unbounded string: random weights almost never close it; the last tokens of the cap do.
    result = batched.generate("Write.", thinking=False, temperature=0, max_output_tokens=40, response_schema=FREE_TEXT)
    assert_valid(result, FREE_TEXT)
    assert result.metadata["structured"]["closed_at_budget"] is True
    assert result.usage["completion_tokens"] <= 40


def test_a_cap_too_small_for_the_schema_is_a_typed_error(batched):
    with pytest.raises(StructuredOutputInvalid) as info:
        batched.generate("x", thinking=False, temperature=0, max_output_tokens=3, response_schema=NESTED)
    assert info.value.http_status == 422
    assert info.value.details["finish_reason"] == "length" and "max_output_tokens" in info.value.message


def test_thinking_block_first_then_the_grammar(batched):
    # The tiny template leaves "<think>\n" open when thinking is on: the grammar waits for "</think>".
    result = batched.generate(
        "Think, then answer.", thinking=True, temperature=0, max_output_tokens=96, response_schema=RECORD
    )
    assert_valid(result, RECORD)
    assert result.reasoning is not None  # "</think>" came (forced at half the cap at the latest)


def test_serialized_lane_and_exclusive_lane(make_llm, dense_model):
    serial = make_llm(dense_model, mlx_batching=False, speculation=False)
    r = serial.generate("x", thinking=False, temperature=0, max_output_tokens=64, response_schema=RECORD)
    assert_valid(r, RECORD)
    assert r.metadata["execution"]["reason"] == "serialized_lane"
    serial.unload_model()
    exclusive = make_llm(dense_model, mlx_batching=True, speculation=False, mlx_sampled_exclusive=True)
    r = exclusive.generate("x", thinking=False, temperature=0.8, seed=5, max_output_tokens=64, response_schema=RECORD)
    assert_valid(r, RECORD)
    assert r.metadata["execution"]["mode"] == "exclusive"


def test_mtp_requests_run_target_only_under_a_grammar(make_llm, hybrid_model):
    llm = make_llm(hybrid_model, mlx_batching=True, speculation={"mode": "native_mtp", "num_draft_tokens": 2})
    r = llm.generate(
        "x",
        thinking=False,
        temperature=0,
        max_output_tokens=64,
        response_schema=RECORD,
        speculation={"mode": "native_mtp"},
    )
    assert_valid(r, RECORD)
    assert r.metadata["speculation"]["used"] is False and r.metadata["speculation"]["reason"] == "structured_output"
    assert r.metadata["execution"]["mode"] == "continuous"
    with pytest.raises(SpeculationUnavailable) as info:
        llm.generate(
            "x",
            max_output_tokens=8,
            response_schema=RECORD,
            speculation={"mode": "native_mtp", "require_acceleration": True},
        )
    assert info.value.reason == "structured_output"


@pytest.mark.parametrize(
    ("kwargs", "error", "path"),
    [
        (
            {"response_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            InvalidResponseSchema,
            "/properties/a/type",
        ),
        ({"response_schema": []}, InvalidResponseSchema, ""),
        ({"response_schema": {"type": "object"}, "response_model": Pick}, InvalidRequest, None),
        ({"response_model": dict}, InvalidRequest, None),
        ({"response_format": {"type": "xml"}}, InvalidRequest, None),
        ({"response_format": {"type": "json_schema"}}, InvalidResponseSchema, "/json_schema"),
        ({"response_schema": HUGE_ANY_OF}, ResponseSchemaTooLarge, ""),
        ({"response_schema": DEEP}, ResponseSchemaTooLarge, "/properties/a" * 16),
    ],
)
def test_bad_structured_inputs_are_typed_400s(batched, kwargs, error, path):
    with pytest.raises(error) as info:
        batched.generate("x", max_output_tokens=4, **kwargs)
    assert info.value.http_status == 400
    if path is not None:
        assert info.value.details["path"] == path


def test_a_schema_the_grammar_engine_cannot_compile_fails_before_admission(batched):
    # Valid JSON Schema that llguidance refuses (an unresolvable reference).
    with pytest.raises(InvalidResponseSchema) as info:
        batched.generate(
            "x",
            max_output_tokens=4,
            response_schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
        )
    assert info.value.code == "invalid_response_schema"
    # nothing was lost: the engine still serves
    assert batched.generate("x", thinking=False, temperature=0, max_output_tokens=4).usage["completion_tokens"] == 4


def test_answer_check_names_the_problem():
    fmt = ResponseFormat.from_call(response_schema=RECORD)
    assert fmt is not None
    assert answer_error('{"name": "a", "count": 5, "ok": true, "color": "red"}', fmt) is None
    assert "not JSON" in str(answer_error("hello", fmt))
    assert "$.count" in str(answer_error('{"name": "a", "count": 500, "ok": true, "color": "red"}', fmt))
    assert answer_error('```json\n{"name": "a", "count": 5, "ok": true, "color": "red"}\n```', fmt) is None


def test_node_payload_carries_the_schema_and_refuses_a_non_object():
    from abstractruntime_mlx.nodes.llm_node import generation_request
    from abstractruntime_mlx.runtime_plugin.adapter.payload import request_from_payload

    payload = {"prompt": "p", "params": {}, "response_schema": RECORD, "response_schema_name": "Record"}
    node_request = request_from_payload(payload, {})
    typed = generation_request(node_request)
    assert typed.response_format is not None and typed.response_format.name == "Record"
    assert typed.to_dict()["response_format"]["json_schema"]["schema"] == RECORD
    assert generation_request(request_from_payload({"prompt": "p", "response_schema": {}}, {})).response_format is None
    with pytest.raises(InvalidRequest) as info:
        request_from_payload({"prompt": "p", "response_schema": "a string"}, {})
    assert info.value.details["field"] == "response_schema"


@pytest.mark.slow
def test_the_answer_cannot_end_inside_the_think_block(batched):
    # The end-of-turn token (<|im_end|> = 2 in the tiny tokenizer) pushed up hard: unconstrained,
    # the request would end at once, inside its think block, with no answer.
    bias = {2: 40.0}
    free = batched.generate("Think.", thinking=True, temperature=0, max_output_tokens=48, logit_bias=bias)
    assert free.usage["completion_tokens"] <= 1 and free.reasoning is None
    for seed in (1, 2):
        result = batched.generate(
            "Think.",
            thinking=True,
            temperature=0.9,
            seed=seed,
            max_output_tokens=96,
            logit_bias=bias,
            response_schema=RECORD,
        )
        assert_valid(result, RECORD)
        assert result.reasoning is not None and result.metadata["structured"]["closed_at_budget"] is True


# ----------------------------------------------------------------------------- limits


@pytest.mark.parametrize(
    ("schema", "limit", "maximum", "path"),
    [
        (HUGE_ANY_OF, "max_schema_nodes", MAX_SCHEMA_NODES, ""),
        ({"enum": list(range(MAX_SCHEMA_NODES - 1))}, "max_schema_nodes", MAX_SCHEMA_NODES, ""),
        (DEEP, "max_schema_depth", MAX_SCHEMA_DEPTH, "/properties/a" * 16),
        (nested_arrays(MAX_SCHEMA_DEPTH + 1), "max_schema_depth", MAX_SCHEMA_DEPTH, "/items" * MAX_SCHEMA_DEPTH),
        (
            {"properties": {"a/b~c": nested_arrays(MAX_SCHEMA_DEPTH)}},
            "max_schema_depth",
            MAX_SCHEMA_DEPTH,
            "/properties/a~1b~0c" + "/items" * (MAX_SCHEMA_DEPTH - 2),
        ),
        ({"const": "x" * MAX_SCHEMA_BYTES}, "max_schema_bytes", MAX_SCHEMA_BYTES, ""),
    ],
    ids=["anyOf-20k", "one-value-over", "objects-450-deep", "arrays-one-level-over", "escaped-pointer", "bytes"],
)
def test_a_schema_over_a_limit_is_refused_naming_the_limit(schema, limit, maximum, path):
    with pytest.raises(ResponseSchemaTooLarge) as info:
        ResponseFormat.build(schema)
    error = info.value
    assert isinstance(error, InvalidResponseSchema) and error.http_status == 400
    assert error.code == "schema_too_large"
    assert error.details == {"limit": limit, "max": maximum, "path": path}
    assert f"{limit}={maximum}" in error.message


def test_a_schema_at_each_limit_is_accepted():
    at_nodes = ResponseFormat.build({"enum": list(range(MAX_SCHEMA_NODES - 2))})  # the object, the array, its values
    assert len(at_nodes.schema["enum"]) == MAX_SCHEMA_NODES - 2  # type: ignore[arg-type]
    ResponseFormat.build(nested_arrays(MAX_SCHEMA_DEPTH))
    ResponseFormat.build(nested_objects(MAX_SCHEMA_DEPTH // 2 - 1))
    padding = MAX_SCHEMA_BYTES - len(json.dumps({"const": ""}, separators=(",", ":")))
    ResponseFormat.build({"const": "x" * padding})


def test_flow_nodes_and_openai_bodies_get_the_same_limits():
    from abstractruntime_mlx.runtime_plugin.adapter.payload import request_from_payload

    for make in (
        lambda schema: request_from_payload({"prompt": "p", "response_schema": schema}, {}),
        lambda schema: ResponseFormat.from_openai({"type": "json_schema", "json_schema": {"schema": schema}}),
        lambda schema: ResponseFormat.from_call(response_schema=schema),
    ):
        for schema, limit in ((DEEP, "max_schema_depth"), (HUGE_ANY_OF, "max_schema_nodes")):
            with pytest.raises(ResponseSchemaTooLarge) as info:
                make(schema)
            assert info.value.details["limit"] == limit
