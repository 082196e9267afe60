"""`specscope serve`: its flags and start-up (the server itself is in server/).

Everything that can be checked is, before the (slow) model load: the flags, the access rules
and limits (config.ServerConfig), the draft checkpoint, and the port, which is bound first and
listened on once the model is up.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from specscope.cli_args import (
    add_model_args,
    add_parallel_args,
    add_spec_args,
    check_engine_args,
    engine_kwargs,
    int_in,
    non_negative_float,
    non_negative_int,
    policy_from_args,
    port,
    positive_float,
    positive_int,
    spec_from_args,
    tensor_parallel_size,
)
from specscope.cli_draft import (
    add_serve_draft_args,
    check_serve_draft_args,
    doctor_prompts,
    doctor_report,
    start_serve_draft,
)
from specscope.config import TOOL_CALL_PARSERS, ServerConfig

log = logging.getLogger("specscope.serve")


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, "
                                     "/v1/completions, /metrics, /profile)")
    s.add_argument("target", nargs="?", default=None,
                   help="the model (same as --model; default: the embedded SmolLM2)")
    add_model_args(s)
    add_parallel_args(s)
    add_spec_args(s)
    add_serve_draft_args(s)
    _add_serve_args(s)
    s.add_argument("--profile", action="store_true", default=None,
                   help="time every phase of every cycle; enables /profile and "
                        "/profile/trace (also SPECSCOPE_PROFILE=1)")
    s.add_argument("--profile-interval", type=positive_int, default=None,
                   help="log a phase summary every N cycles (default 100 when profiling)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """serve's access rules and limits, validated (before anything loads)."""
    keys = args.api_key
    if keys is None:  # the environment keeps the key out of `ps` and shell history
        env = os.environ.get("SPECSCOPE_API_KEY") or os.environ.get("VLLM_API_KEY", "")
        keys = [env] if env else []
    hosts = [h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip()]
    return ServerConfig(
        served_model_name=args.served_model_name, max_queue=args.max_queue,
        api_keys=tuple(keys), enable_admin=args.enable_admin, enable_docs=args.enable_docs,
        allowed_hosts=tuple(hosts), max_request_bytes=args.max_request_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        request_read_timeout=args.request_read_timeout,
        max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
        max_n=args.max_n, shutdown_timeout=args.shutdown_timeout,
        log_stats_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser)


def cmd_serve(args: argparse.Namespace) -> int:
    from specscope.engine.llm import LLM
    from specscope.engine.machine import freeze_heap
    from specscope.server import create_app
    from specscope.server.serve import bind_sockets, serve

    # Everything that can be checked is, before the (slow) model load: flags, the draft
    # checkpoint, and the port, which is bound now and listened on once the model is up.
    args.model = args.target or args.model
    config = _server_config(args)
    check_engine_args(args)
    spec = spec_from_args(args)
    policy_from_args(args, spec)  # a bad --spec-policy fails now, not after the model loads
    guardrail_mode = check_serve_draft_args(args, spec)
    tp = tensor_parallel_size(args)
    if tp > 1 and args.doctor:
        raise ValueError("--doctor probes the draft on one rank; run it with "
                         "--tensor-parallel-size 1 (specscope doctor), then serve")
    if tp > 1:
        from specscope.parallel.launch import exit_on_rank_failure

        exit_on_rank_failure()  # a dead or hung rank ends the server, status 1
    # Only rank 0 listens; under torchrun the others never return from LLM(...).
    rank0 = os.environ.get("RANK", "0") == "0"
    sockets = bind_sockets(args.host, args.port) if rank0 else []
    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device,
                  max_model_len=args.max_model_len, cache_dir=args.cache_dir,
                  quantization=args.quantization,
                  cuda_graphs=args.cuda_graphs, **engine_kwargs(args),
                  compile=args.compile, spec=None, profile=args.profile,
                  profile_interval=args.profile_interval, tensor_parallel_size=tp,
                  dist_timeout=args.dist_timeout)
        freeze_heap()  # the engine is built: no full collection stalls a cycle from here
        if args.doctor:  # before the engine loads the draft, which stops at its first error
            report = doctor_report(llm, spec.draft, doctor_prompts(None, 8),
                                   spec.draft_layer_ids, 64)
            print(report.format(), file=sys.stderr)
            if not report.healthy:
                print("specscope serve: the draft failed specscope doctor; not serving (fix "
                      "it, or drop --doctor)", file=sys.stderr)
                return 1
        guardrail = start_serve_draft(llm, spec, args, guardrail_mode)  # --auto-tune
        log.info("serving %s", llm.describe())
        app = create_app(llm, config, guardrail=guardrail, draft_spec=spec)
        code = serve(app, sockets=sockets, log_level=args.log_level,
                     shutdown_timeout=config.shutdown_timeout)
        if tp > 1:
            llm.close()  # the other ranks stop (atexit would too; now, not after cleanup)
        return code
    finally:
        for sock in sockets:  # uvicorn closed them if it ran; a failed start leaves them
            sock.close()


def _add_serve_args(s: argparse.ArgumentParser) -> None:
    """serve's own flags: where it listens, who may use it, and the per-request limits.
    Defaults are config.ServerConfig's."""
    d = ServerConfig
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (an IPv4 or IPv6 address, or a host name)")
    s.add_argument("--port", type=port, default=8000, help="TCP port (0: any free one)")
    s.add_argument("--served-model-name", nargs="+", default=d.served_model_name,
                   metavar="NAME",
                   help="the model id(s) clients may send; responses carry the first "
                        "(default: the model path or hub id)")
    s.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health "
                        "(repeatable; default: $SPECSCOPE_API_KEY, else vLLM's $VLLM_API_KEY, if "
                        "set, else no key)")
    s.add_argument("--enable-admin", action="store_true", default=d.enable_admin,
                   help="serve /admin/* (switch speculation, the guardrail); needs --api-key")
    s.add_argument("--enable-docs", action="store_true", default=d.enable_docs,
                   help="serve /docs and /openapi.json")
    s.add_argument("--allowed-hosts", default=None, metavar="HOST,...",
                   help="comma-separated names the Host header must be one of, against DNS "
                        "rebinding (default: any)")
    s.add_argument("--max-queue", type=non_negative_int, default=d.max_queue,
                   help="requests that may wait behind the running one; more get 503 "
                        "(default %(default)s)")
    s.add_argument("--max-request-bytes", type=int_in(1024), default=d.max_request_bytes,
                   help="largest request body; larger ones get 413 (default %(default)s, "
                        "4 MiB)")
    s.add_argument("--max-prompt-tokens", type=positive_int, default=d.max_prompt_tokens,
                   help="longest prompt in tokens; longer ones get 400 (default: the model's "
                        "context length minus one)")
    s.add_argument("--request-read-timeout", type=positive_float,
                   default=d.request_read_timeout,
                   help="seconds a client has to send its whole request body; then 408 "
                        "(default %(default)s)")
    s.add_argument("--max-stop-strings", type=non_negative_int, default=d.max_stop_strings,
                   help="most stop strings a request may give (default %(default)s)")
    s.add_argument("--max-stop-chars", type=positive_int, default=d.max_stop_chars,
                   help="longest stop string, in characters (default %(default)s)")
    s.add_argument("--max-n", type=positive_int, default=d.max_n,
                   help="largest `n` (choices per request) (default %(default)s)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   default=d.enable_auto_tool_choice,
                   help="tool_choice 'auto': parse the model's tool calls out of its answers "
                        "(needs --tool-call-parser; vLLM's flag)")
    s.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=d.tool_call_parser,
                   help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>, "
                        "Hermes and Qwen) or llama3_json (Llama 3.1's JSON)")
    s.add_argument("--seed", "--random-seed", dest="engine_seed", type=int, default=None,
                   help="seed of the requests that give none, so a server's sampled output "
                        "repeats across runs (default: unseeded)")
    s.add_argument("--log-stats-interval", type=positive_float, default=d.log_stats_interval,
                   help="seconds between the throughput log lines (prompt and generation "
                        "tok/s, queues, KV cache, speculation) (default %(default)s)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput log lines (vLLM's flag)")
    s.add_argument("--shutdown-timeout", type=non_negative_float, default=d.shutdown_timeout,
                   help="on SIGTERM/SIGINT, seconds that running and queued requests may "
                        "still take (new ones get 503 meanwhile); then the running one is "
                        "stopped at its next cycle and queued ones get 503 (default "
                        "%(default)s)")
