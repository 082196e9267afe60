"""CUDA checks (marked gpu; run with `pytest -m gpu` on a machine with a GPU)."""

from __future__ import annotations

import pytest
import torch

from specscope.config import ModelConfig, SamplingParams
from specscope.models.loader import random_model
from specscope.sampling import make_generator, sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 8,
    "num_key_value_heads": 2, "max_position_embeddings": 1024, "rope_theta": 10000.0,
}


def _llm(model, spec=None, graphs=True, compile=False, **kw):
    from specscope import LLM

    return LLM.from_model(model, spec=spec, cuda_graphs=graphs, compile=compile,
                          kv_cache_memory=64 << 20, **kw)


def _greedy(model, prompt, n, **kw):
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    return _llm(model, **kw).generate(" ".join(map(str, prompt)), params)[0].token_ids


def _greedy_cuda_equals_cpu(build, n: int = 32) -> None:
    """The same weights (fp32, no TF32) on the CPU and on CUDA: the same greedy tokens."""
    cpu, gpu = build(torch.float32, "cpu"), build(torch.float32, "cuda")
    gpu.load_state_dict(cpu.state_dict())
    torch.backends.cuda.matmul.allow_tf32 = False
    prompt = list(range(3, 40))
    assert _greedy(cpu, prompt, n) == _greedy(gpu, prompt, n)


def test_cuda_greedy_equals_cpu_fp32():
    cfg = ModelConfig.from_hf(TINY)
    _greedy_cuda_equals_cpu(lambda dtype, dev: random_model(cfg, dtype, dev, seed=1), 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_eager(dtype):
    """Batched decode steps replayed per batch-size bucket match eager steps exactly."""
    cfg = ModelConfig.from_hf(TINY)
    model = random_model(cfg, dtype, "cuda", seed=2)
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [" ".join(str(i) for i in range(5, 5 + n)) for n in (25, 3, 60, 11, 7)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    graphs = _llm(model)
    eager = _llm(model, graphs=False)
    for batch in (prompts, prompts[:1], prompts[1:4]):
        got = [o.token_ids for o in graphs.generate(batch, params)]
        assert got == [o.token_ids for o in eager.generate(batch, params)]
    assert len(graphs.engine.graphs.graphs) >= 3  # buckets 1, 4 and 8 were captured


def test_compiled_cuda_graphs_equal_eager_fp32():
    cfg = ModelConfig.from_hf(TINY)
    model = random_model(cfg, torch.float32, "cuda", seed=4)
    torch.backends.cuda.matmul.allow_tf32 = False
    prompt = list(range(9, 30))
    eager = _greedy(model, prompt, 40, graphs=False)
    assert _greedy(model, prompt, 40, compile=True) == eager


def _reads_in_one_step(llm) -> int:
    """One llm.step() with any host sync an error, except in the engine's read: how many
    reads it made."""
    from specscope.engine.engine import Engine

    reads = []
    real = Engine._read

    def read(self, *args):
        torch.cuda.set_sync_debug_mode("default")
        reads.append(1)
        return real(self, *args)

    Engine._read = read
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        Engine._read = real
    return len(reads)


def test_cuda_decode_step_has_no_host_sync_but_its_read():
    """A plain decode step (forward + sampling) synchronises with the host only in its one
    read of the sampled tokens."""

    cfg = ModelConfig.from_hf(TINY)
    model = random_model(cfg, torch.bfloat16, "cuda")
    llm = _llm(model, graphs=False)
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=0)
    llm.add_request(list(range(10)), params)
    llm.step()  # the prefill
    assert _reads_in_one_step(llm) == 1


def test_cuda_seeded_sampling_repeats():
    cfg = ModelConfig.from_hf(TINY)
    model = random_model(cfg, torch.bfloat16, "cuda")
    logits = model.compute_logits(model(torch.tensor([[1, 2, 3]], device="cuda"),
                                        torch.tensor([[0, 1, 2]], device="cuda"))[0][:, -1])
    params = SamplingParams(temperature=1.0, top_p=0.95)
    a = [sample(logits, params, make_generator(7, "cuda")).item() for _ in range(5)]
    b = [sample(logits, params, make_generator(7, "cuda")).item() for _ in range(5)]
    assert a == b


def _spec_llm(model, spec=None, graphs=True):
    return _llm(model, spec, graphs)


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(4, 1, None), (3, 2, 6)])
def test_spec_cycle_graphs_match_eager_and_plain(steps, topk, ndt):
    """Speculative cycles replayed as CUDA graphs: greedy output equals plain decoding, and
    in simulated mode (many accepted paths) graphs equal eager token for token."""
    from specscope import SamplingParams
    from specscope.config import SpecConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig.from_hf(TINY)
    model = random_model(cfg, torch.float32, "cuda", seed=5)
    params = SamplingParams(max_tokens=70, ignore_eos=True)
    prompt = " ".join(str(i) for i in range(20, 45))
    plain = _spec_llm(model).generate(prompt, params)[0].token_ids
    spec = SpecConfig(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt)
    assert _spec_llm(model, spec).generate(prompt, params)[0].token_ids == plain
    sim = SpecConfig(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt,
                     simulate_acceptance=2.5)
    g = _spec_llm(model, sim).generate(prompt, params)[0]
    e = _spec_llm(model, sim, graphs=False).generate(prompt, params)[0]
    assert g.token_ids == e.token_ids
    assert g.spec["accepted_per_cycle"] == e.spec["accepted_per_cycle"]
    assert g.spec["accept_length"] > 1.5


def test_plain_greedy_cycle_graph_equals_eager():
    """Plain greedy steps replayed as graphs match eager decoding across repeated requests
    and lengths."""
    from specscope import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig.from_hf(TINY)
    model = random_model(cfg, torch.float32, "cuda", seed=6)
    graphs, eager = _spec_llm(model), _spec_llm(model, graphs=False)
    for n_prompt, n_new in ((25, 50), (12, 30), (60, 120)):
        prompt = " ".join(str(i) for i in range(30, 30 + n_prompt))
        p = SamplingParams(max_tokens=n_new, ignore_eos=True)
        assert graphs.generate(prompt, p)[0].token_ids == eager.generate(prompt, p)[0].token_ids


def test_batched_regeneration_graphs_equal_eager():
    """train/regenerate.py's BatchGenerator on the engine: CUDA-graph decode steps (one
    graph per batch-size bucket, reused across batches) give the eager path's tokens."""
    from specscope.train.regenerate import BatchGenerator

    cfg = ModelConfig.from_hf(TINY)
    model = random_model(cfg, torch.float32, "cuda", seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 2)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eager = BatchGenerator(model, 8, 96, graphs=False)
    graphs = BatchGenerator(model, 8, 96, graphs=True)
    for batch in (prompts, prompts[1:3]):
        assert graphs.generate(batch, 24, params, set(), None) == \
            eager.generate(batch, 24, params, set(), None)
    assert graphs.engine.graphs is not None and len(graphs.engine.graphs.graphs) > 1


def test_ttt_sdpa_equals_dense_on_cuda_at_changing_lengths():
    """--ttt-attention sdpa on CUDA (its pinned kernels) gives the dense reference's logits
    and gradients, fp32, at a new length each call, as the trainer's padded batches come."""
    from specscope.draft.eagle3 import random_draft
    from specscope.train.ttt import unroll

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig.from_hf(TINY)
    target = random_model(cfg, torch.float32, "cuda", seed=1)
    target.set_taps((0, 1, 2))
    for T in (17, 40, 63):
        ids = torch.randint(0, cfg.vocab_size, (2, T), device="cuda")
        _, taps = target(ids, torch.arange(T, device="cuda")[None].expand(2, T),
                         return_taps=True)
        got = {}
        for mode in ("dense", "sdpa"):
            draft = random_draft(cfg, torch.float32, "cuda", draft_vocab_size=50, seed=2,
                                 std=0.2, layer_ids=(0, 1, 2))
            draft.attach_target(target)
            draft.init_rope(T + 8)
            draft.requires_grad_(True)
            out = unroll(draft, taps, ids, 4, attention=mode)
            sum(o.sum() for o in out).backward()
            got[mode] = (out, [p.grad for p in draft.parameters() if p.grad is not None])
        for a, b in zip(got["dense"][0], got["sdpa"][0], strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        # Gradients by their norm: the fused backward sums many fp32 terms in another order,
        # which moves a few near-zero elements by more than any elementwise rtol.
        for a, b in zip(got["dense"][1], got["sdpa"][1], strict=True):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-6


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_data_parallel_training_on_two_gpus(tiny_model_dir, tmp_path):
    """torchrun-style, NCCL, one process per GPU: the run finishes (the replicas are checked
    bit-equal at every checkpoint and at the end) and rank 0 exports."""
    import json
    import os
    import socket
    import subprocess
    import sys

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write about topic {i}."}) + "\n"
                               for i in range(64)))
    cfg = dict(target=str(tiny_model_dir), data=[str(prompts)], out=str(tmp_path / "run"),
               draft_vocab_size=400, ttt_length=3, max_steps=8, lr=3e-3, batch_tokens=512,
               max_len=96, eval_every=4, save_every=4, log_every=2,
               regen_max_new_tokens=24, regen_batch_size=8, device="cuda", progress=False)
    script = ("import json, sys\n"
              "from specscope.train.trainer import TrainConfig, train_draft\n"
              "train_draft(TrainConfig(**json.loads(sys.argv[1])))\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(cfg)],
        env=dict(os.environ, WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    prov = json.loads((tmp_path / "run" / "draft" / "config.json").read_text())[
        "specscope_provenance"]
    assert prov["processes"] == 2 and prov["steps"] == 8


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(5, 1, None), (3, 3, 8)])
def test_batched_spec_graphs_equal_eager(steps, topk, ndt):
    """Concurrent speculating requests replayed as the two captured segments per bucket:
    greedy output equals eager (fp32), simulated acceptance too (the same draws), and
    the captured path ran."""
    from specscope.config import SpecConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig.from_hf(TINY)
    model = random_model(cfg, torch.float32, "cuda", seed=7)
    prompts = [" ".join(str(i) for i in range(5, 5 + n)) for n in (25, 3, 60, 11, 7)]
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for sim in (None, 2.5):
        spec = SpecConfig(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt,
                          simulate_acceptance=sim)
        g, e = _spec_llm(model, spec), _spec_llm(model, spec, graphs=False)
        got = g.generate(prompts, params)
        want = e.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.spec["accepted_per_cycle"] for o in got] == \
            [o.spec["accepted_per_cycle"] for o in want]
        assert g.engine.spec_graphs.entries


def test_cuda_spec_graph_step_has_no_host_sync_but_its_read():
    """A captured speculative step (the inputs' upload, two replays, the verdicts' read)
    synchronises with the host only in its one read."""
    from specscope.config import SpecConfig
    from specscope.engine.engine import Engine

    cfg = ModelConfig.from_hf(TINY)
    model = random_model(cfg, torch.bfloat16, "cuda")
    spec = SpecConfig(draft="random", num_steps=4, simulate_acceptance=3.0)
    llm = _llm(model, spec)
    llm.add_request(list(range(10)), SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(4):  # the prefill, an eager first step, then captures
        llm.step()
    calls, reads = [], []
    real_read, real_graph = Engine._read, Engine._graph_spec

    def read(self, *args):
        torch.cuda.set_sync_debug_mode("default")
        reads.append(1)
        return real_read(self, *args)

    def graph(self, items):
        calls.append(1)
        return real_graph(self, items)

    Engine._read, Engine._graph_spec = read, graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        Engine._read, Engine._graph_spec = real_read, real_graph
    assert reads == [1] and calls == [1]


QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 16, "num_experts": 32, "num_experts_per_tok": 4,
    "moe_intermediate_size": 64, "norm_topk_prob": True, "max_position_embeddings": 1024,
}


def _random_moe(raw, dtype, device, seed):
    from specscope.models.registry import config_from_hf

    m = random_model(config_from_hf(raw), dtype, device, seed=seed)
    with torch.no_grad():  # a spread-out router: tokens pick different experts
        for block in m.moe_blocks():
            block.gate.weight.normal_(0, 1.0)
    return m


def _moe_model(dtype, device, seed=3):
    return _random_moe(QWEN3_MOE, dtype, device, seed)


def test_cuda_moe_grouped_kernel_equals_cpu_fp32():
    """The Triton grouped expert GEMM (CUDA) against the CPU's per-expert loop."""
    _greedy_cuda_equals_cpu(_moe_model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_moe_graphs_equal_eager(dtype):
    model = _moe_model(dtype, "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [" ".join(str(i) for i in range(5, 5 + n)) for n in (25, 3, 60, 11, 7)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    graphs, eager = _llm(model), _llm(model, graphs=False)
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == [o.token_ids for o in eager.generate(prompts, params)]


def test_cuda_moe_decode_step_has_no_host_sync_but_its_read():
    """A MoE decode step (router, dispatch, grouped GEMM, expert counts) synchronises with
    the host only in its one read, which carries the expert counts."""

    llm = _llm(_moe_model(torch.bfloat16, "cuda"), graphs=False)
    llm.add_request(list(range(10)), SamplingParams(max_tokens=8, ignore_eos=True))
    llm.step()  # the prefill
    assert _reads_in_one_step(llm) == 1
    assert llm.engine.last_stats.experts_active == 4  # one token: exactly top_k a layer


DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 8, "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 16,
    "v_head_dim": 32, "qk_nope_head_dim": 32, "n_routed_experts": 32, "n_shared_experts": 1,
    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    "max_position_embeddings": 1024, "routed_scaling_factor": 2.5,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def _mla_model(dtype, device, seed=5):
    return _random_moe(DEEPSEEK, dtype, device, seed)


def test_cuda_mla_greedy_equals_cpu_fp32():
    """MLA's latent cache and absorbed decode on CUDA against the CPU (grouped routing,
    the correction bias and the Triton expert GEMM on the way)."""
    _greedy_cuda_equals_cpu(_mla_model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mla_graphs_equal_eager_plain_and_speculative(dtype):
    from specscope.config import SpecConfig

    model = _mla_model(dtype, "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [" ".join(str(i) for i in range(5, 5 + n)) for n in (25, 3, 60, 11)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for spec in (None, SpecConfig(draft="random", num_steps=3, topk=2, num_draft_tokens=6)):
        graphs, eager = _llm(model, spec=spec), _llm(model, spec=spec, graphs=False)
        got = [o.token_ids for o in graphs.generate(prompts, params)]
        assert got == [o.token_ids for o in eager.generate(prompts, params)]


def test_cuda_mla_decode_step_has_no_host_sync_but_its_read():
    llm = _llm(_mla_model(torch.bfloat16, "cuda"), graphs=False)
    llm.add_request(list(range(10)), SamplingParams(max_tokens=8, ignore_eos=True))
    llm.step()  # the prefill
    assert _reads_in_one_step(llm) == 1


def test_folded_layer_products_match_the_unfolded_layers_in_bf16(monkeypatch):
    """A bf16 decode of a few sequences through the products that fold SwiGLU and the
    residual adds (models/llama.py attend_folded, mlp_folded) gives the separate kernels'
    logits: the folds round as those kernels do, so bit for bit."""
    from specscope.kvcache.paged import BatchMeta, PagedKV
    from specscope.models import llama

    cfg = ModelConfig.from_hf({**TINY, "hidden_size": 256, "intermediate_size": 512})
    model = random_model(cfg, torch.bfloat16, "cuda", seed=5)
    bs, S, P = 16, 4, 40
    tables = torch.arange(S * 4, device="cuda").view(S, 4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (S, P + 1), generator=g).cuda()

    def logits() -> torch.Tensor:
        kv = PagedKV(cfg.num_layers, S * 4 + 1, bs, cfg.num_kv_heads, cfg.head_dim,
                     torch.bfloat16, "cuda")
        seq = torch.arange(S, device="cuda").repeat_interleave(P)
        pos = torch.arange(P, device="cuda").repeat(S)
        model(ids[:, :P].reshape(1, -1), pos[None], kv,
              batch=BatchMeta.causal(tables, seq, pos, bs))  # the prefill: not folded
        last = torch.full((S,), P, device="cuda")
        hidden, _ = model(ids[:, P][None], last[None], kv,
                          batch=BatchMeta.causal(tables, torch.arange(S, device="cuda"),
                                                 last, bs))
        return model.compute_logits(hidden[0])

    folded = logits()
    monkeypatch.setattr(llama, "few_row_layer_kernel", lambda *a: None)
    plain = logits()
    assert torch.equal(folded, plain)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="dependent launches need Hopper or later")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_dependent_launches_change_no_token(monkeypatch, family):
    """bf16 plain and speculative decoding of concurrent requests in CUDA graphs, the
    Triton kernels launched dependently (models/dependent_launch.py) and not: the same
    tokens, greedy and seeded sampling alike, and the same simulated acceptance, on a dense
    model and on a MoE one (router, routing and the pair kernels). A kernel that read its
    predecessor's output before waiting would differ here."""
    from specscope.config import SpecConfig
    from specscope.models import dependent_launch

    if family == "llama":
        cfg = ModelConfig.from_hf({**TINY, "hidden_size": 256, "intermediate_size": 512})
        model = random_model(cfg, torch.bfloat16, "cuda", seed=11)
    else:
        model = _moe_model(torch.bfloat16, "cuda")
    prompts = [" ".join(str(i) for i in range(5, 5 + n)) for n in (25, 3, 60, 11, 7)]
    greedy = SamplingParams(max_tokens=48, ignore_eos=True)
    sampled = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.8, seed=3)

    def run(pdl: str) -> list:
        monkeypatch.setenv(dependent_launch.ENV, pdl)
        assert dependent_launch.enabled(torch.empty(1, device="cuda")) == (pdl == "1")
        out = []
        for spec in (None, SpecConfig(draft="random", num_steps=5, simulate_acceptance=2.5)):
            llm = _spec_llm(model, spec)
            for params in (greedy, sampled):
                got = llm.generate(prompts, params)
                out.append([o.token_ids for o in got])
                if spec is not None:
                    out.append([o.spec["accepted_per_cycle"] for o in got])
        return out

    assert run("1") == run("0")
