"""The server's cost over HTTP, and its behaviour under many clients.

1. The same prompts in-process (`LLM.stream`) and streamed over HTTP to `specscope serve`'s
   app serving the same loaded engine (its event loop and engine worker threads as in
   `specscope serve`, the loop here in a background thread), one request at a time. The
   HTTP client is `specscope bench`'s, run in its own process as `specscope bench` would
   be (`--client-in-process`: in this process, sharing the GIL with the server, a harsher
   setting). The two paths alternate, in-process first for even (repeat + prompt) and
   HTTP first for odd, so drift on a shared machine (another job, CPU frequency) falls on
   both alike. Output tok/s = tokens / wall of each request; reported per pair, over all
   pairs (total tokens / total wall), and as the mean (with its standard error) and
   median of the per-pair ratios. Each pair also shows the CPU seconds other processes
   took meanwhile (from /proc), to tell interference from cost.
2. N concurrent streaming clients (default 64): all must complete, none lost or failed.

    python benchmarks/server.py --num-prompts 4 --max-tokens 64 --repeats 3 --clients 64
    python benchmarks/server.py --draft random --simulate-acceptance 3 ...   # speculative

A table, then a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def client_worker(url: str) -> None:
    """`--client-worker URL`: run `run_bench` for each JSON job read from stdin and write
    its result as one JSON line (the benchmark's out-of-process client)."""
    from specscope.bench.client import run_bench

    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        result = asyncio.run(run_bench(url, model=None, prompts=job["prompts"],
                                       concurrency=job["concurrency"],
                                       max_tokens=job["max_tokens"], temperature=0.0,
                                       progress=False))
        print(json.dumps(result), flush=True)


class Client:
    """`run_bench` in a child process (idle, blocked on stdin, while in-process runs
    time) or, with in_process, in this one."""

    def __init__(self, url: str, in_process: bool) -> None:
        self.url, self.proc = url, None
        if not in_process:
            self.proc = subprocess.Popen([sys.executable, __file__, "--client-worker", url],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
            assert self.proc.stdout.readline().strip() == "ready"

    def run(self, prompts: list, concurrency: int, max_tokens: int) -> dict:
        if self.proc is None:
            from specscope.bench.client import run_bench

            return asyncio.run(run_bench(self.url, model=None, prompts=prompts,
                                         concurrency=concurrency, max_tokens=max_tokens,
                                         temperature=0.0, progress=False))
        job = {"prompts": prompts, "concurrency": concurrency, "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of `pids`) so far, from /proc:
    their difference over a pair is what other processes took meanwhile (interference)."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        mine = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            mine += int(stat[11]) + int(stat[12])  # utime + stime
    except (OSError, IndexError, ValueError):  # not Linux: no interference figure
        return float("nan"), float("nan")
    return busy / tick, mine / tick


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--client-worker":
        client_worker(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="passes over the prompts")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--client-tokens", type=int, default=16)
    ap.add_argument("--client-in-process", action="store_true",
                    help="run the HTTP client in this process (shares the GIL)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--simulate-acceptance", type=float, default=None)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()

    from specscope import LLM, SamplingParams, SpecConfig
    from specscope.bench.datasets import load_prompts
    from specscope.server import create_app
    from specscope.server.background import BackgroundServer

    spec = None
    if args.draft:
        spec = SpecConfig(draft=args.draft, num_steps=args.num_steps,
                          simulate_acceptance=args.simulate_acceptance)
    llm = LLM(args.model, dtype=args.dtype, device="cpu", cache_dir=args.cache_dir, spec=spec)
    prompts = load_prompts(args.dataset, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens)  # greedy; stops as the server's do

    def same_acceptance() -> None:  # simulated accepts: the same draws in both paths
        llm.reset_simulation()

    def local(prompt) -> dict:
        same_acceptance()
        t0 = time.perf_counter()
        ttft = None
        for delta in llm.stream(prompt, params):
            if ttft is None and delta.text:
                ttft = time.perf_counter() - t0
            out = delta.output
        wall = time.perf_counter() - t0
        n = len(out.token_ids)
        return {"tokens": n, "wall_s": wall, "ttft_ms": (ttft or wall) * 1e3,
                "tpot_ms": (wall - (ttft or wall)) / max(n - 1, 1) * 1e3,
                "accept_length": out.spec["accept_length"] if out.spec else None}

    def http(prompt) -> dict:
        same_acceptance()
        r = client.run([prompt], 1, args.max_tokens)
        assert r["completed"] == 1, r["error_messages"]
        return {"tokens": r["total_completion_tokens"], "wall_s": r["wall_s"],
                "ttft_ms": r["ttft_ms"]["mean"], "tpot_ms": r["tpot_ms"]["mean"],
                "accept_length": r["accept_length"]}

    server = BackgroundServer(create_app(llm))
    client = Client(server.url, args.client_in_process)
    try:
        local(prompts[0])  # warm-up, both paths, full length
        http(prompts[0])
        pairs = []
        pids = [os.getpid()] + ([client.proc.pid] if client.proc else [])
        print(f"{'rep':>3} {'prompt':>6} {'first':>5} {'tokens':>6} {'local s':>8} "
              f"{'HTTP s':>8} {'local tok/s':>11} {'HTTP tok/s':>10} {'HTTP/local':>10} "
              f"{'other CPU s':>11}", flush=True)
        for rep in range(args.repeats):
            for i, p in enumerate(prompts):
                first = "local" if (rep + i) % 2 == 0 else "HTTP"
                busy0, mine0 = cpu_seconds(pids)
                if first == "local":
                    a = local(p)
                    b = http(p)
                else:
                    b = http(p)
                    a = local(p)
                busy1, mine1 = cpu_seconds(pids)
                other = (busy1 - busy0) - (mine1 - mine0)
                ratio = (b["tokens"] / b["wall_s"]) / (a["tokens"] / a["wall_s"])
                pairs.append({"repeat": rep, "prompt": i, "first": first, "local": a,
                              "http": b, "ratio": ratio, "other_cpu_s": other})
                same = "" if a["tokens"] == b["tokens"] else "  (token counts differ!)"
                print(f"{rep:>3} {i:>6} {first:>5} {a['tokens']:>6} {a['wall_s']:>8.3f} "
                      f"{b['wall_s']:>8.3f} {a['tokens'] / a['wall_s']:>11.2f} "
                      f"{b['tokens'] / b['wall_s']:>10.2f} {(ratio - 1) * 100:>+9.2f}% "
                      f"{other:>11.2f}{same}", flush=True)
        many_prompts = [prompts[i % len(prompts)] for i in range(args.clients)]
        many = client.run(many_prompts, args.clients, args.client_tokens)
    finally:
        client.close()
        server.stop()

    def total(path: str) -> tuple[int, float]:
        return (sum(p[path]["tokens"] for p in pairs), sum(p[path]["wall_s"] for p in pairs))

    (lt, lw), (ht, hw) = total("local"), total("http")
    overall = (ht / hw) / (lt / lw)
    m, se = mean_se([p["ratio"] for p in pairs])
    med = statistics.median(p["ratio"] for p in pairs)

    def avg(path: str, key: str) -> float:
        return sum(p[path][key] for p in pairs) / len(pairs)

    print()
    print(f"{'path':<30} {'tokens':>7} {'wall s':>8} {'tok/s':>8} {'TTFT ms':>8} "
          f"{'TPOT ms':>8}")
    for name, path, t, w in (("in-process LLM.stream", "local", lt, lw),
                             ("HTTP streaming (1 client)", "http", ht, hw)):
        print(f"{name:<30} {t:>7} {w:>8.2f} {t / w:>8.2f} {avg(path, 'ttft_ms'):>8.1f} "
              f"{avg(path, 'tpot_ms'):>8.2f}")
    client_where = "in this process" if args.client_in_process else "in its own process"
    print(f"HTTP / in-process tok/s over all {len(pairs)} pairs: {overall:.4f} "
          f"({(overall - 1) * 100:+.2f} %); per-pair ratios: mean {(m - 1) * 100:+.2f} % "
          f"± {se * 100:.2f} % (s.e.), median {(med - 1) * 100:+.2f} %, range "
          f"{(min(p['ratio'] for p in pairs) - 1) * 100:+.2f} .. "
          f"{(max(p['ratio'] for p in pairs) - 1) * 100:+.2f} %; client {client_where}; "
          f"other processes took {sum(p['other_cpu_s'] for p in pairs):.1f} CPU s "
          f"during the pairs")
    print(f"{args.clients} concurrent clients: completed {many['completed']}, errors "
          f"{many['errors']}, wall {many['wall_s']:.1f} s, TTFT p50/p99 "
          f"{many['ttft_ms']['p50']:.0f}/{many['ttft_ms']['p99']:.0f} ms")
    if spec is not None:
        al = [p["local"]["accept_length"] for p in pairs]
        ah = [p["http"]["accept_length"] for p in pairs]
        print(f"accept length (SIMULATED): in-process {sum(al) / len(al):.2f}, "
              f"HTTP {sum(ah) / len(ah):.2f}")
    print(json.dumps({"benchmark": "server", "model": args.model or "default",
                      "dtype": args.dtype, "spec": bool(spec),
                      "client_in_process": args.client_in_process, "pairs": pairs,
                      "local_tok_s": lt / lw, "http_tok_s": ht / hw, "http_over_local": overall,
                      "mean_pair_ratio": m, "mean_pair_ratio_se": se,
                      "median_pair_ratio": med, "concurrent": many}))


if __name__ == "__main__":
    main()
