"""Admin routes: hot reconfiguration of speculative decoding on a running server.

GET /admin/spec returns the configuration; POST /admin/spec changes num_steps / topk /
num_draft_tokens or turns speculation off ({"enabled": false}) and back on ({"enabled": true}:
the last configuration). Changes run on the engine thread between requests (a running request
keeps its configuration); the target and draft weights are never reloaded.

GET /admin/guardrail returns the goodput guardrail's state (server/guardrail.py): the
window's speculative tok/s, the plain-decoding prediction and its source, the verdict, and
whether the guardrail switched speculation off.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request

from specscope.config import SpecConfig
from specscope.engine.llm import LLM
from specscope.server.guardrail import Guardrail
from specscope.server.schemas import APIError
from specscope.server.worker import EngineWorker


def add_admin_routes(app: FastAPI, llm: LLM, worker: EngineWorker,
                     guardrail: Guardrail | None = None,
                     draft_spec: SpecConfig | None = None) -> None:
    """GET/POST /admin/spec and GET /admin/guardrail on `app`. The draft the server was
    started with (llm.spec, else draft_spec) stays known while speculation is off, so it can
    be switched back on."""
    start = llm.spec or draft_spec
    known = {"draft": start.draft if start else None,
             "draft_layer_ids": start.draft_layer_ids if start else None,
             "last": start}  # the configuration "enabled": true switches back to

    def spec_state() -> dict:
        s = llm.spec
        return {"object": "spec_config", "enabled": s is not None,
                "draft": s.draft if s else known["draft"],
                "num_steps": s.num_steps if s else None, "topk": s.topk if s else None,
                "num_draft_tokens": s.num_draft_tokens if s else None}

    @app.get("/admin/spec")
    async def get_spec():
        return spec_state()

    @app.get("/admin/guardrail")
    async def get_guardrail():
        if guardrail is None:
            return {"object": "guardrail", "mode": "off"}
        return guardrail.state()

    @app.post("/admin/spec")
    async def set_spec(request: Request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "expected a JSON object")
        allowed = {"enabled", "num_steps", "topk", "num_draft_tokens"}
        extra = sorted(set(body) - allowed)
        if extra:
            raise APIError(400, f"unsupported fields {extra}; allowed: {sorted(allowed)}",
                           param=extra[0])
        if body.get("enabled", True) is False:
            new = None
        else:
            if known["draft"] is None:
                raise APIError(400, "this server has no draft: start it with --draft to "
                                    "switch speculation on", param="enabled")
            cur = llm.spec or known["last"]
            fields = {"num_steps": cur.num_steps if cur else 5, "topk": cur.topk if cur else 1,
                      "num_draft_tokens": None}
            if cur and "num_steps" not in body and "topk" not in body:
                fields["num_draft_tokens"] = cur.num_draft_tokens
            for k in ("num_steps", "topk", "num_draft_tokens"):
                if k in body:
                    fields[k] = body[k]
            try:
                new = SpecConfig(draft=known["draft"],
                                 draft_layer_ids=known["draft_layer_ids"], **fields)
            except (TypeError, ValueError) as e:
                raise APIError(400, f"invalid speculative configuration: {e}") from None
        # Applied on the engine thread between requests: a running request keeps its config.
        await worker.call(lambda: llm.set_spec(new))
        if new is not None:
            known["last"] = new
        return spec_state()
