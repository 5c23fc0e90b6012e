"""One resolution everywhere: for every combination of the call, run, provider and policy levels,
the node, the provider's ``generate``, ``get_execution_capabilities`` and the server report the
same effective speculation and thinking and the same deciding level (tiny hybrid MTP model)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from abstractruntime_mlx.capabilities import get_execution_capabilities
from abstractruntime_mlx.nodes import LLMNode, NodeRequest, ProviderRegistry
from abstractruntime_mlx.server import create_app

OFF: Any = False
MTP2 = {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": False}
MTP3 = {"mode": "native_mtp", "num_draft_tokens": 3, "require_acceleration": False}
MTP4 = {"mode": "native_mtp", "num_draft_tokens": 4, "require_acceleration": False}

# Core policy file contents: the text route's options (None: a file with no policy at all).
POLICIES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "off": {"speculation": False},
    "depth3+low": {
        "speculation": {"mode": "native_mtp", "num_draft_tokens": 3, "require_acceleration": False},
        "thinking": "low",
    },
}
# Provider (constructor) levels.
PROVIDERS: dict[str, dict[str, Any]] = {
    "none": {},
    "off": {"speculation": False},
    "mtp-no-depth": {"speculation": {"mode": "native_mtp", "require_acceleration": False}, "thinking": False},
    "depth4": {"speculation": {"num_draft_tokens": 4}},
}
# What a call that says nothing resolves to: (speculation, source, thinking, source), written out by hand.
EXPECTED_BARE: dict[tuple[str, str], tuple[Any, str, Any, str]] = {
    ("none", "none"): (MTP2, "verified_default", None, "model_default"),
    ("none", "off"): (OFF, "provider", None, "model_default"),
    ("none", "mtp-no-depth"): (MTP2, "provider", False, "provider"),
    ("none", "depth4"): (MTP4, "provider", None, "model_default"),
    ("off", "none"): (OFF, "policy", None, "model_default"),
    ("off", "off"): (OFF, "provider", None, "model_default"),
    ("off", "mtp-no-depth"): (MTP2, "provider", False, "provider"),
    ("off", "depth4"): (MTP4, "provider", None, "model_default"),
    ("depth3+low", "none"): (MTP3, "policy", "low", "policy"),
    ("depth3+low", "off"): (OFF, "provider", "low", "policy"),
    # the provider's partial object inherits the policy's depth: depth 3 is reported and run
    ("depth3+low", "mtp-no-depth"): (MTP3, "provider", False, "provider"),
    ("depth3+low", "depth4"): (MTP4, "provider", "low", "policy"),
}
# Call and run levels laid over every (policy, provider) pair.
CALLS: dict[str, dict[str, Any]] = {
    "bare": {},
    "call-depth1": {"speculation": {"num_draft_tokens": 1}},
    "call-off+high": {"speculation": False, "thinking": "high"},
}
RUNS: dict[str, dict[str, Any]] = {
    "bare": {},
    "run-depth5+off": {"speculation": {"num_draft_tokens": 5}, "thinking": False},
}


def write_policy(path: Path, options: dict[str, Any] | None) -> None:
    routes = {} if options is None else {"input.text": {"options": options}}
    path.write_text(json.dumps({"capability_defaults": {"version": 1, "routes": routes}}))


def resolved(spec: Any, spec_source: str, thinking: Any, thinking_source: str) -> dict[str, Any]:
    return {
        "speculation": spec,
        "speculation_source": spec_source,
        "thinking": thinking,
        "thinking_source": thinking_source,
    }


def ran(metadata: dict[str, Any]) -> dict[str, Any]:
    """The controls a generation reports, checked against the speculation it ran."""
    controls = metadata["controls"]
    speculation = metadata["speculation"]
    assert speculation["source"] == controls["speculation_source"]
    assert speculation["requested"] is bool(controls["speculation"])
    if controls["speculation"]:
        assert speculation["num_draft_tokens"] == controls["speculation"]["num_draft_tokens"]
    return controls


@pytest.mark.parametrize("provider_name", list(PROVIDERS))
def test_every_level_combination_reports_what_runs(hybrid_model, policy_file, provider_name):
    # One resident provider at a time: each constructor level is its own load-time choice.
    registry = ProviderRegistry()
    try:
        llm = registry.local(hybrid_model, PROVIDERS[provider_name]).provider
        for policy_name, options in POLICIES.items():
            write_policy(policy_file, options)
            check_all_four(hybrid_model, registry, llm, policy_name, provider_name)
    finally:
        registry.close()


def check_all_four(
    hybrid_model: str, registry: ProviderRegistry, llm: Any, policy_name: str, provider_name: str
) -> None:
    bare = resolved(*EXPECTED_BARE[(policy_name, provider_name)])
    where = f"policy={policy_name} provider={provider_name}"

    # capabilities, in process and over HTTP
    caps = get_execution_capabilities(hybrid_model, instance=llm)
    assert (caps["speculation"]["effective_default"], caps["speculation"]["effective_source"]) == (
        bare["speculation"],
        bare["speculation_source"],
    ), where
    assert caps["thinking"] == {"effective_default": bare["thinking"], "effective_source": bare["thinking_source"]}, (
        where
    )
    with TestClient(create_app(llm)) as http:
        served_caps = http.get("/v1/models/execution-capabilities", params={"model_name": hybrid_model}).json()
        assert served_caps["speculation"] == caps["speculation"] and served_caps["thinking"] == caps["thinking"], where

        node = LLMNode(registry=registry, default_model=hybrid_model, provider_options=PROVIDERS[provider_name])
        for (call_name, call), (run_name, run) in itertools.product(CALLS.items(), RUNS.items()):
            case = f"{where} call={call_name} run={run_name}"
            request = NodeRequest(
                prompt="hi",
                speculation=call.get("speculation"),
                thinking=call.get("thinking"),
                run_speculation=run.get("speculation"),
                run_thinking=run.get("thinking"),
                sampling={"temperature": 0},
                max_output_tokens=1,
            )
            prepared = node.prepare(request)
            expected = prepared.controls.to_metadata()
            said = {
                name: "call" if name in call else "run" if name in run else None for name in ("speculation", "thinking")
            }
            for name in ("speculation", "thinking"):
                assert expected[f"{name}_source"] == (said[name] or bare[f"{name}_source"]), case
            if not call and not run:
                assert expected == bare, case
            executed = node.execute(prepared).to_runtime_result()["metadata"]
            assert ran(executed) == expected, case
            if run:
                continue  # the provider's generate() and the HTTP body have no run level
            generated = llm.generate("hi", temperature=0, max_output_tokens=1, **call)
            assert ran(generated.metadata) == expected, case
            reply = http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 1, **call},
            )
            assert reply.status_code == 200, reply.text
            assert ran(reply.json()["abstractcore"]) == expected, case
