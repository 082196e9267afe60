"""Admin routes: hot reconfiguration of speculative decoding on a running server.

GET /admin/spec returns the configuration; POST /admin/spec changes num_steps / topk /
num_draft_tokens or turns speculation off ({"enabled": false}) and back on ({"enabled": true}:
the last configuration). Changes run on the engine thread between requests (a running request
keeps its configuration); the target and draft weights are never reloaded.

The routes are off unless the server was started with --enable-admin (which needs an API
key: they change what every client gets); off, /admin/* answers 404 saying so. The body is
validated with the CLI flags' types and ranges (schemas.SpecUpdate, config.py).

GET /admin/guardrail returns the goodput guardrail's state (server/guardrail.py): the
window's speculative tok/s, the plain-decoding prediction and its source, the verdict, and
whether the guardrail switched speculation off.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from specscope.config import SpecConfig, chain_confidence_stop
from specscope.engine.llm import LLM
from specscope.engine.machine import resolve_confidence_stop
from specscope.server.guardrail import Guardrail
from specscope.server.schemas import APIError, SpecUpdate, parse_json
from specscope.server.worker import EngineWorker


def add_admin_routes(app: FastAPI, llm: LLM, worker: EngineWorker,
                     guardrail: Guardrail | None = None,
                     draft_spec: SpecConfig | None = None, *, enabled: bool = False) -> None:
    """GET/POST /admin/spec and GET /admin/guardrail on `app` (when `enabled`). The draft the
    server was started with (llm.spec, else draft_spec) stays known while speculation is off,
    so it can be switched back on."""
    if not enabled:
        @app.api_route("/admin/{rest:path}", methods=["GET", "POST", "HEAD"])
        async def admin_off(rest: str):
            raise APIError(404, "admin routes are off: start the server with --enable-admin "
                           "(and --api-key) to use them", type="not_found_error",
                           code="admin_disabled")
        return
    start = llm.spec or draft_spec
    known = {"draft": start.draft if start else None,
             "draft_layer_ids": start.draft_layer_ids if start else None,
             "last": start}  # the configuration "enabled": true switches back to

    def spec_state() -> dict:
        s = llm.spec
        return {"object": "spec_config", "enabled": s is not None,
                "draft": s.draft if s else known["draft"],
                "num_steps": s.num_steps if s else None, "topk": s.topk if s else None,
                "num_draft_tokens": s.num_draft_tokens if s else None,
                # the confidence stop this configuration runs with (0: fixed chains)
                "confidence_stop": resolve_confidence_stop(
                    s, llm.device, llm.tp.size if llm.tp is not None else 1) if s else None,
                # speculation by batch size, when a policy is in force (--spec-policy,
                # --auto-tune by batch size, or the guardrail's switch-off of a bucket)
                "policy": llm.spec_policy.flag() if s and llm.spec_policy else None}

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
        upd: SpecUpdate = parse_json(await request.body(), SpecUpdate)
        if upd.enabled is False:
            new = None
        else:
            if known["draft"] is None:
                raise APIError(400, "this server has no draft: start it with --draft to "
                                    "switch speculation on", param="enabled")
            cur = llm.spec or known["last"]
            fields = {"num_steps": cur.num_steps if cur else 5, "topk": cur.topk if cur else 1,
                      "num_draft_tokens": None}
            stop = cur.confidence_stop if cur else None
            if cur and upd.num_steps is None and upd.topk is None:
                fields["num_draft_tokens"] = cur.num_draft_tokens
            for k in ("num_steps", "topk", "num_draft_tokens"):
                if getattr(upd, k) is not None:
                    fields[k] = getattr(upd, k)
            try:
                new = SpecConfig(draft=known["draft"],
                                 draft_layer_ids=known["draft_layer_ids"],
                                 confidence_stop=chain_confidence_stop(fields["topk"], stop),
                                 **fields)
            except (TypeError, ValueError) as e:
                raise APIError(400, f"invalid speculative configuration: {e}") from None
        # Applied on the engine thread between requests: a running request keeps its config.
        await worker.call(lambda: llm.set_spec(new))
        if new is not None:
            known["last"] = new
        return spec_state()
