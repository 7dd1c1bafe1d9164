"""The router's own OpenAPI 3.1 description, served at ``GET /openapi.json``.

It describes what kvroute itself promises, not the engines' full API: the proxied
endpoints with the few fields the router reads (``model``, ``stream``, ``stream_options``,
``max_tokens``...; everything else passes through to the engine, so the schemas allow
additional properties), the answers it can give (the engine's, or its own OpenAI-style
errors: 400, 401, 404, 408, 413, 429, 502, 503, 504), and ``/v1/models``, ``/health``,
``/metrics`` and, when enabled, the admin API. Fuzzers (schemathesis) and client
generators read it; the test suite checks the running router against it.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvroute.router import __version__
from kvroute.router.engines import ENDPOINTS, ENGINE_SETTINGS, ENGINES, Endpoint
from kvroute.router.engines.openai import RESPONSES, STORED_RESPONSE_ROUTES

JSON = "application/json"
SSE = "text/event-stream"

_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": ["string", "integer", "null"]},
                "param": {"type": ["string", "null"]},
            },
        }
    },
}

# The router's own errors per proxied request (the engine may answer others; see below).
_PROXY_ERRORS = {
    "400": "Malformed JSON, a body that is not an object, or a missing/invalid `model`.",
    "401": "Missing or wrong API key (when the router checks client keys).",
    "404": "No backend serves the requested model.",
    "408": "The request body did not arrive in time.",
    "413": "The request body is larger than the limit.",
    "429": "Over the client's rate limit, or the router's concurrency limit and wait queue are full.",
    "502": "The engine could not be reached or broke its answer.",
    "503": "No healthy backend.",
    "504": "The engine did not answer in time.",
}


def _error(description: str, *, retry_after: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description, "content": {JSON: {"schema": _ERROR_SCHEMA}}}
    if retry_after:
        response["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds to wait."}}
    return response


def _proxied_operation(endpoint: Endpoint, secured: bool) -> dict[str, Any]:
    body = dict(endpoint.schema or {})
    schema: dict[str, Any] = {"type": "object", "additionalProperties": True, **body}
    properties = dict(schema.get("properties", {}))
    properties["model"] = {"type": "string", "minLength": 1, "examples": ["sim"]}
    schema["properties"] = properties
    if endpoint.requires_model and "model" not in schema.get("required", []):
        schema["required"] = ["model", *schema.get("required", [])]
    operation: dict[str, Any] = {
        "operationId": endpoint.name,
        "summary": f"Proxied to a backend chosen by the routing policy ({endpoint.path}).",
        "description": "Served by " + ", ".join(_engines_serving(endpoint)) + " backends.",
        "requestBody": {"required": True, "content": {JSON: {"schema": schema}}},
        "responses": _relayed_answers(streams="stream" in properties),
    }
    if secured:
        operation["security"] = [{"apiKey": []}]
    return operation


def _stored_response_operation(operation_id: str, method: str, secured: bool) -> dict[str, Any]:
    """A stored response's own call: relayed to the replica that stored it."""
    parameters: list[dict[str, Any]] = [
        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    if operation_id == "responses_retrieve":
        parameters += [
            {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
            {"name": "starting_after", "in": "query", "required": False, "schema": {"type": "integer"}},
        ]
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": "Relayed to the backend that stored the response; where the router does not "
        "know which, to each in turn until one does not answer 404.",
        "description": "Served by " + ", ".join(_engines_serving(RESPONSES)) + " backends.",
        "parameters": parameters,
        "responses": _relayed_answers(streams=operation_id == "responses_retrieve"),
    }
    if method == "POST":
        operation["requestBody"] = {"required": False, "content": {JSON: {"schema": {}}}}
    if secured:
        operation["security"] = [{"apiKey": []}]
    return operation


def _relayed_answers(*, streams: bool) -> dict[str, Any]:
    """The answers of a relayed call: the engine's, or the router's own errors."""
    answer_content: dict[str, Any] = {JSON: {"schema": {}}}
    if streams:
        answer_content[SSE] = {"schema": {"type": "string"}}
    responses: dict[str, Any] = {
        "200": {
            "description": "The engine's answer, relayed (SSE when streaming). Headers name the backend.",
            "headers": {
                "x-kvroute-backend": {"schema": {"type": "string"}, "description": "The backend's URL."},
                "x-kvroute-policy": {"schema": {"type": "string"}},
                "x-kvroute-reason": {"schema": {"type": "string"}},
                "x-request-id": {
                    "schema": {"type": "string"},
                    "description": "The client's own (visible ASCII, at most 128 characters) or a fresh one.",
                },
            },
            "content": answer_content,
        },
        "default": {
            "description": "Any other status is the engine's own answer, relayed as it wrote it.",
            "content": {JSON: {"schema": {}}},
        },
    }
    for status, description in _PROXY_ERRORS.items():
        responses[status] = _error(description, retry_after=status == "429")
    return responses


def _engines_serving(endpoint: Endpoint) -> list[str]:
    return [name for name, engine in ENGINES.items() if engine.serves(endpoint.path)]


def _admin_paths() -> dict[str, Any]:
    secured: list[dict[str, list[str]]] = [{"adminToken": []}]
    target: dict[str, Any] = {
        "type": "object",
        "required": ["url"],
        "properties": {"url": {"type": "string", "examples": ["http://10.0.0.5:8000"]}},
    }
    errors = {
        "400": _error("Invalid body or URL."),
        "401": _error("Missing or wrong admin token."),
        "404": _error("No such backend."),
    }
    backend_state = {"type": "object", "required": ["url", "healthy", "draining", "in_flight"]}
    return {
        "/admin/backends": {
            "get": {
                "operationId": "admin_list_backends",
                "security": secured,
                "responses": {
                    "200": {
                        "description": "Every backend with its state.",
                        "content": {JSON: {"schema": {"type": "object", "required": ["backends"]}}},
                    },
                    "401": errors["401"],
                },
            },
            "post": {
                "operationId": "admin_add_backend",
                "security": secured,
                "requestBody": {
                    "required": True,
                    "content": {
                        JSON: {
                            "schema": {
                                **target,
                                "properties": {
                                    **target["properties"],
                                    "api_key": {"type": "string"},
                                    "capacity_tokens": {"type": "integer", "minimum": 1},
                                    "kv_events_endpoint": {"type": "string"},
                                    "engine": {"enum": list(ENGINE_SETTINGS)},
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "201": {"description": "Added (probed once).", "content": {JSON: {"schema": backend_state}}},
                    "400": errors["400"],
                    "401": errors["401"],
                    "403": _error("The URL resolves outside the allowed networks."),
                    "409": _error("Already in the pool."),
                },
            },
            "delete": {
                "operationId": "admin_remove_backend",
                "security": secured,
                "parameters": [{"name": "url", "in": "query", "required": True, "schema": {"type": "string"}}],
                "responses": {
                    "200": {"description": "Removed.", "content": {JSON: {"schema": backend_state}}},
                    **errors,
                },
            },
        },
        "/admin/backends/drain": {
            "post": {
                "operationId": "admin_drain_backend",
                "security": secured,
                "requestBody": {"required": True, "content": {JSON: {"schema": target}}},
                "responses": {
                    "202": {
                        "description": "Draining: no new requests; removed once its in-flight requests finish.",
                        "content": {JSON: {"schema": backend_state}},
                    },
                    **errors,
                },
            }
        },
        "/admin/decisions": {
            "get": {
                "operationId": "admin_list_decisions",
                "summary": "The last routing decisions, oldest first, each with every candidate's cost terms.",
                "security": secured,
                "parameters": [
                    {
                        "name": "last",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "pattern": "^[0-9]+$"},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "Recent decisions (kvroute.router.routing.decisions).",
                        "content": {JSON: {"schema": {"type": "object", "required": ["decisions"]}}},
                    },
                    "400": errors["400"],
                    "401": errors["401"],
                },
            }
        },
        "/admin/peers": {
            "get": {
                "operationId": "admin_show_peers",
                "summary": "The exchange with other routers: each peer's state, CURVE, DNS discovery, counters.",
                "security": secured,
                "responses": {
                    "200": {
                        "description": "exchange and discovery, each null when not configured.",
                        "content": {JSON: {"schema": {"type": "object", "required": ["exchange", "discovery"]}}},
                    },
                    "401": errors["401"],
                },
            }
        },
    }


def openapi_spec(*, admin: bool, api_keys: bool) -> dict[str, Any]:
    """The OpenAPI document of a router with this configuration."""
    paths: dict[str, Any] = {endpoint.path: {"post": _proxied_operation(endpoint, api_keys)} for endpoint in ENDPOINTS}
    for method, path, operation_id in STORED_RESPONSE_ROUTES:
        paths.setdefault(path, {})[method.lower()] = _stored_response_operation(operation_id, method, api_keys)
    models: dict[str, Any] = {
        "operationId": "list_models",
        "summary": "The union of the healthy backends' models.",
        "responses": {
            "200": {
                "description": "OpenAI model list.",
                "content": {
                    JSON: {
                        "schema": {
                            "type": "object",
                            "required": ["object", "data"],
                            "properties": {"object": {"const": "list"}, "data": {"type": "array"}},
                        }
                    }
                },
            },
            "401": _error(_PROXY_ERRORS["401"]),
            "429": _error(_PROXY_ERRORS["429"], retry_after=True),
        },
    }
    if api_keys:
        models["security"] = [{"apiKey": []}]
    paths["/v1/models"] = {"get": models}
    paths["/health"] = {
        "get": {
            "operationId": "health",
            "summary": "200 when at least one backend is healthy.",
            "responses": {
                "200": {"description": "Serving.", "content": {JSON: {"schema": {"type": "object"}}}},
                "503": _error("No healthy backend."),
            },
        }
    }
    paths["/livez"] = {
        "get": {
            "operationId": "livez",
            "summary": "200 while the router process serves, whatever its backends' health.",
            "responses": {"200": {"description": "Alive.", "content": {JSON: {"schema": {"type": "object"}}}}},
        }
    }
    paths["/metrics"] = {
        "get": {
            "operationId": "metrics",
            "summary": "Prometheus text exposition.",
            "responses": {
                "200": {"description": "Metrics.", "content": {"text/plain": {"schema": {"type": "string"}}}}
            },
        }
    }
    paths["/openapi.json"] = {
        "get": {
            "operationId": "openapi",
            "responses": {"200": {"description": "This document.", "content": {JSON: {"schema": {"type": "object"}}}}},
        }
    }
    if admin:
        paths.update(_admin_paths())
    schemes: dict[str, Any] = {}
    if api_keys:
        schemes["apiKey"] = {"type": "http", "scheme": "bearer", "description": "One of the router's --api-keys."}
    if admin:
        schemes["adminToken"] = {"type": "http", "scheme": "bearer", "description": "The --admin-token."}
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "kvroute",
            "version": __version__,
            "description": "Cache-aware load-balancing reverse proxy for vLLM and SGLang fleets.",
        },
        "paths": paths,
    }
    if schemes:
        spec["components"] = {"securitySchemes": schemes}
    return spec


def openapi_document(*, admin: bool, api_keys: bool) -> bytes:
    """:func:`openapi_spec` as JSON bytes (built once per application)."""
    return orjson.dumps(openapi_spec(admin=admin, api_keys=api_keys))
