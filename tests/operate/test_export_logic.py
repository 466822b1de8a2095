"""The plan as a definitions document and as Terraform (pure: no broker).

The Terraform module is read back with an HCL parser and must hold exactly the
exchanges, queues and bindings of the plan, with the same arguments, so the
infrastructure creates what ``declare_delay_topology`` would have declared.
"""

from __future__ import annotations

import json
import re
from io import StringIO
from typing import Any

import hcl2
import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings
from hcl2.utils import SerializationOptions

from deferred.core.topology import Plan, build_plan
from deferred.operate.export import _identifiers, definitions, terraform

PLANS = {
    "classic-r16": build_plan(
        prefix="deferred",
        radix=16,
        resolution_ms=1,
        max_delay_ms=315_360_000_000,
        queue_type="classic",
        queues=("default", "billing"),
    ),
    "quorum-r2": build_plan(
        prefix="app:prod",
        radix=2,
        resolution_ms=10,
        max_delay_ms=60_000,
        queue_type="quorum",
        queues=("default",),
        delivery_limit=7,
    ),
}


def plan_exchanges(plan: Plan) -> set[tuple[str, str, str]]:
    return {(e.name, e.type, json.dumps(e.arguments, sort_keys=True)) for e in plan.all_exchanges}


def plan_queues(plan: Plan) -> set[tuple[str, str]]:
    return {(q.name, json.dumps(q.arguments, sort_keys=True)) for q in plan.all_queues}


def plan_bindings(plan: Plan) -> set[tuple[str, str, str, str]]:
    return {(b.source, b.destination, b.destination_type, b.routing_key) for b in plan.all_bindings}


# --------------------------------------------------------------------------- definitions


@pytest.mark.parametrize("name", PLANS)
def test_definitions_hold_exactly_the_plan(name):
    plan = PLANS[name]
    doc = json.loads(json.dumps(definitions(plan, vhost="jobs")))  # JSON-ready
    assert set(doc) == {"exchanges", "queues", "bindings"}
    every = [*doc["exchanges"], *doc["queues"], *doc["bindings"]]
    # rabbitmqctl import_definitions needs the vhost in every object.
    assert {item["vhost"] for item in every} == {"jobs"}
    assert all(x["durable"] and not x["auto_delete"] for x in doc["exchanges"] + doc["queues"])
    assert not any(e["internal"] for e in doc["exchanges"])
    assert {
        (e["name"], e["type"], json.dumps(e["arguments"], sort_keys=True)) for e in doc["exchanges"]
    } == plan_exchanges(plan)
    assert {
        (q["name"], json.dumps(q["arguments"], sort_keys=True)) for q in doc["queues"]
    } == plan_queues(plan)
    assert {
        (b["source"], b["destination"], b["destination_type"], b["routing_key"])
        for b in doc["bindings"]
    } == plan_bindings(plan)
    assert len(doc["bindings"]) == len(plan.all_bindings)  # no duplicates hidden by the set


def test_definitions_keep_integer_arguments_integers():
    plan = PLANS["quorum-r2"]
    queues = {q["name"]: q["arguments"] for q in definitions(plan)["queues"]}
    ttls = [args["x-message-ttl"] for args in queues.values() if "x-message-ttl" in args]
    assert ttls and all(type(ttl) is int for ttl in ttls)
    assert queues[plan.ready_queues["default"].name]["x-delivery-limit"] == 7


# --------------------------------------------------------------------------- terraform


def parse(text: str) -> dict[str, Any]:
    return hcl2.loads(text, serialization_options=SerializationOptions(strip_string_quotes=True))


def resources(parsed: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """``{resource name: body}`` of one resource type; a name given twice fails."""
    out: dict[str, dict[str, Any]] = {}
    for entry in parsed.get("resource", []):
        for rtype, named in entry.items():
            if rtype != kind:
                continue
            for name, body in named.items():
                assert name not in out, f"resource {kind}.{name} defined twice"
                out[name] = body
    return out


def jsonencoded(expression: str) -> dict[str, Any]:
    """The object inside ``${jsonencode({...})}``, as Python values."""
    match = re.fullmatch(r"\$\{jsonencode\((\{.*\})\)\}", expression, re.S)
    assert match, expression
    return dict(parse(f"value = {match.group(1)}")["value"])


def reference(expression: str, kind: str) -> str:
    """The resource name of ``${<kind>.<name>.name}``."""
    match = re.fullmatch(rf"\$\{{{kind}\.([A-Za-z0-9_-]+)\.name\}}", expression)
    assert match, expression
    return match.group(1)


@pytest.mark.parametrize("name", PLANS)
def test_terraform_names_exactly_the_resources_of_the_plan(name):
    plan = PLANS[name]
    parsed = parse(terraform(plan, vhost="/"))

    (provider,) = parsed["terraform"][0]["required_providers"]
    assert provider["rabbitmq"]["source"] == "cyrilgdn/rabbitmq"
    (variable,) = parsed["variable"]
    assert variable["vhost"]["default"] == "/"

    exchanges = resources(parsed, "rabbitmq_exchange")
    exchange_names = {ident: body["name"] for ident, body in exchanges.items()}
    seen_exchanges = set()
    for body in exchanges.values():
        assert body["vhost"] == "${var.vhost}"
        (settings,) = body["settings"]
        assert settings["durable"] is True and settings["auto_delete"] is False
        arguments = settings.get("arguments", {})
        seen_exchanges.add((body["name"], settings["type"], json.dumps(arguments, sort_keys=True)))
    assert seen_exchanges == plan_exchanges(plan)
    assert len(exchanges) == len(plan.all_exchanges)

    queues = resources(parsed, "rabbitmq_queue")
    queue_names = {ident: body["name"] for ident, body in queues.items()}
    seen_queues = set()
    for body in queues.values():
        assert body["vhost"] == "${var.vhost}"
        (settings,) = body["settings"]
        assert settings["durable"] is True and settings["auto_delete"] is False
        assert "arguments" not in settings  # that map would send x-message-ttl as a string
        arguments = jsonencoded(settings["arguments_json"]) if "arguments_json" in settings else {}
        seen_queues.add((body["name"], json.dumps(arguments, sort_keys=True)))
    assert seen_queues == plan_queues(plan)
    assert len(queues) == len(plan.all_queues)

    bindings = resources(parsed, "rabbitmq_binding")
    seen_bindings = set()
    for body in bindings.values():
        assert body["vhost"] == "${var.vhost}"
        source = exchange_names[reference(body["source"], "rabbitmq_exchange")]
        if body["destination_type"] == "exchange":
            destination = exchange_names[reference(body["destination"], "rabbitmq_exchange")]
        else:
            destination = queue_names[reference(body["destination"], "rabbitmq_queue")]
        seen_bindings.add((source, destination, body["destination_type"], body["routing_key"]))
    assert seen_bindings == plan_bindings(plan)
    assert len(bindings) == len(plan.all_bindings)


def test_terraform_queue_arguments_keep_their_types():
    plan = PLANS["quorum-r2"]
    queues = resources(parse(terraform(plan)), "rabbitmq_queue")
    by_name = {
        body["name"]: jsonencoded(body["settings"][0]["arguments_json"]) for body in queues.values()
    }
    delay = plan.delay_queues[0]
    assert by_name[delay.name]["x-message-ttl"] == delay.ttl_ms
    assert type(by_name[delay.name]["x-message-ttl"]) is int
    assert by_name[plan.ready_queues["default"].name]["x-delivery-limit"] == 7


def test_terraform_is_deterministic_and_takes_the_vhost():
    plan = PLANS["quorum-r2"]
    assert terraform(plan, vhost="jobs") == terraform(plan, vhost="jobs")
    parsed = parse(terraform(plan, vhost="jobs"))
    assert parsed["variable"][0]["vhost"]["default"] == "jobs"


def test_terraform_escapes_what_hcl_would_interpolate():
    plan = PLANS["quorum-r2"]
    parsed = parse(terraform(plan, vhost='a${b}%{c}"d\\'))
    # Quotes and backslashes are escaped; "${" and "%{" are kept literal ("$${", "%%{").
    assert parsed["variable"][0]["vhost"]["default"] == 'a$${b}%%{c}"d\\'


def test_resource_names_are_valid_and_unique():
    names = ["a.b", "a_b", "a-b", "1.x", "a.b"]
    idents = _identifiers(names)
    assert len(set(idents)) == len(idents)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", ident) for ident in idents)
    assert idents[:2] == ["a_b", "a_b_2"]


# --------------------------------------------------------------------------- the command


def run(*args: str) -> str:
    out = StringIO()
    call_command("declare_delay_topology", *args, stdout=out)
    return out.getvalue()


NOWHERE = "amqp://guest:guest@127.0.0.1:1/team%2Fjobs"  # nothing listens on port 1


def test_the_command_prints_both_formats_without_the_broker():
    with override_settings(DEFERRED={"BROKER_URL": NOWHERE, "PREFIX": "iac", "MAX_DELAY": 60}):
        doc = json.loads(run("--format", "definitions"))
        # The vhost of BROKER_URL by default, decoded as pika decodes it.
        assert {q["vhost"] for q in doc["queues"]} == {"team/jobs"}
        assert "iac.ready.p9.default" in {q["name"] for q in doc["queues"]}
        doc = json.loads(run("--format", "definitions", "--vhost", "other"))
        assert {q["vhost"] for q in doc["queues"]} == {"other"}
        parsed = parse(run("--format", "terraform"))
        assert parsed["variable"][0]["vhost"]["default"] == "team/jobs"
        queues = resources(parsed, "rabbitmq_queue")
        assert queues["iac_ready_p9_default"]["name"] == "iac.ready.p9.default"


def test_the_command_refuses_meaningless_combinations():
    with override_settings(DEFERRED={"BROKER_URL": NOWHERE}):
        with pytest.raises(CommandError, match="--vhost only applies"):
            run("--vhost", "x")
        with pytest.raises(CommandError, match="only prints"):
            run("--format", "terraform", "--check")
