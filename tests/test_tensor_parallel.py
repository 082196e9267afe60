"""Tensor parallelism on the CPU with gloo (docs/tensor-parallel.md): 2 ranks give 1 rank's
logits and token-for-token output (plain, speculative with the draft replicated or sharded),
each rank reads only its slices of the checkpoint, a dead or hung rank ends the server with
a message, and the profile splits each phase into collectives and compute."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specscope.config import ModelConfig, SamplingParams, SpecConfig
from specscope.engine.scheduler import Pool, Scheduler
from specscope.engine.sequence import Sequence
from specscope.engine.step_broadcast import MirrorScheduler, PlanSender
from specscope.kvcache.block_pool import BlockPool
from specscope.models.loader import allocate, load_weights, random_model, weight_files
from specscope.parallel.group import TPGroup
from specscope.parallel.launch import _free_port
from specscope.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from specscope.parallel.shard import Shard, shard_reads

pytestmark = pytest.mark.usefixtures("single_thread")

SRC = str(pathlib.Path(__file__).resolve().parents[1] / "src")

# Shapes the layer-level check shards over 2 ranks: GQA with a KV head per rank, one KV
# head replicated on both, tied embeddings, a vocabulary that does not split evenly, biases;
# MoE (tensor-parallel within the experts, with and without a gated shared expert) and
# DeepSeek-V3's MLA (heads split, the latent replicated; with and without q_lora_rank).
BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
MOE = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
MLA = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
       "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
       "num_hidden_layers": 3, "num_key_value_heads": 4, "n_routed_experts": 8,
       "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
       "v_head_dim": 12, "qk_nope_head_dim": 10, "n_group": 4, "topk_group": 2,
       "num_experts_per_tok": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5}
VARIANTS = {
    "gqa": {},
    "kv_replicated": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "odd_vocab_bias": {"vocab_size": 1001, "architectures": ["Qwen2ForCausalLM"]},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "head_dim": 16, "norm_topk_prob": True, **MOE},
    "qwen2_moe_shared": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                         "shared_expert_intermediate_size": 64, **MOE},
    "deepseek_v3": MLA,
    "deepseek_v3_no_q_lora": {**MLA, "q_lora_rank": None},
}


def _config(name: str) -> ModelConfig:
    from specscope.models.registry import config_from_hf

    return config_from_hf({**BASE, **VARIANTS[name]}, name=name)


def _full_model(name: str):
    """The variant's whole model, the same on every rank; routers' logits spread out, so
    that the rounding of a sharded forward never flips which experts a token picks."""
    m = random_model(_config(name), torch.float32, "cpu", seed=7)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if pname.endswith("mlp.gate.weight"):
                p.mul_(200.0)
    return m


def _save_hf(model, path: pathlib.Path) -> None:
    """The model's weights under HF names (fused rows split back out)."""
    from safetensors.torch import save_file

    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, (p, row, shape) in model.checkpoint_layout().items():
        w = params[p].detach()
        if isinstance(row, tuple):  # an expert's rows: (expert, first row)
            w, row = w[row[:-1]], row[-1]
        out[name] = w[row:row + shape[0]].contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"))


def _held_elements(model) -> int:
    """Checkpoint elements a shard holds: its parameters, less the vocabulary padding."""
    total = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, (VocabParallelEmbedding, ParallelLMHead)) and \
                m.weight is not getattr(model, "_counted", None):
            a, b, _ = m.shards["weight"].pieces[0]
            total -= (m.weight.shape[0] - (b - a)) * m.weight.shape[1]
            model._counted = m.weight  # a tied head shares the embedding's padding
    return total


def _layer_rank(rank: int, world: int, port: int, root: str) -> None:
    """One rank of the layer-level check: load each variant's shard from its checkpoint,
    compare logits with the whole model, count what was read."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    report = {}
    for name in VARIANTS:
        cfg = _config(name)
        full = _full_model(name)
        local = allocate(cfg, torch.float32, "cpu", TPGroup(rank, world))
        stats = load_weights(local, weight_files(pathlib.Path(root) / name))
        ids = torch.randint(0, cfg.vocab_size, (1, 11), generator=torch.Generator()
                            .manual_seed(3))
        pos = torch.arange(11)[None]
        with torch.inference_mode():
            want = full.compute_logits(full(ids, pos)[0])
            got = local.compute_logits(local(ids, pos)[0])
        report[name] = {"err": float((want - got).abs().max()), "shape": list(got.shape),
                        "read": stats.total, "held": _held_elements(local),
                        "reads": stats.elements,
                        # over the paged cache (MLA: the absorbed form), in lockstep: every
                        # rank's engine schedules the same steps
                        "engine": [_engine_tokens(full), _engine_tokens(local)]}
    # The control channel: a message in one broadcast, one past its buffer in two.
    from specscope.parallel.channel import Channel

    channel = Channel(rank, world, dist.new_group(backend="gloo"), capacity=1024)
    for msg in ({"small": 1}, list(range(5000))):
        got = channel.send(msg) if rank == 0 else channel.recv()
        report.setdefault("channel", []).append(rank == 0 or got == msg)
    report["broadcasts"] = channel.broadcasts
    pathlib.Path(root, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _engine_tokens(model) -> list[list[int]]:
    from specscope.engine.engine import BatchConfig, Engine

    engine = Engine(model, BatchConfig(num_blocks=32, block_size=4, max_num_batched_tokens=32,
                                       max_num_seqs=2, max_model_len=48))
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=6, ignore_eos=True))
            for i, p in enumerate(([5, 6, 7, 8, 9, 10, 11], [40, 3]))]
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        engine.step()
    return [s.output_ids for s in seqs]


def test_two_ranks_match_one_and_read_only_their_slices(tmp_path):
    for name in VARIANTS:
        _save_hf(_full_model(name), tmp_path / name)
    mp.spawn(_layer_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["channel"] == [True, True] for r in reports)
    assert reports[0]["broadcasts"] == 3  # 1 + 2
    for name in VARIANTS:
        cfg = _config(name)
        h, D = cfg.hidden_size, cfg.head_dim
        for rep in (r[name] for r in reports):
            scale = 1e-4 if cfg.moe else 1e-5  # routed sums of larger logits
            assert rep["err"] < scale, (name, rep["err"])
            assert rep["shape"] == [1, 11, cfg.vocab_size]
            assert rep["engine"][1] == rep["engine"][0], name  # greedy, paged, token for token
            assert rep["read"] == rep["held"], (name, rep["read"], rep["held"])  # no more
            reads = rep["reads"]
            if cfg.mla is None:
                a = "model.layers.0.self_attn."
                assert reads[a + "q_proj.weight"] == cfg.num_heads // 2 * D * h  # its heads
                assert reads[a + "k_proj.weight"] == max(cfg.num_kv_heads // 2, 1) * D * h
            if cfg.moe is not None:  # every expert's half of the width
                e = next(k for k in reads if ".experts.3.down_proj" in k)
                assert reads[e] == h * cfg.moe.expert_intermediate_size // 2


@pytest.mark.parametrize("own_embed", [False, True])
def test_sharded_draft_reads_only_its_slices(tmp_path, own_embed):
    """--draft-tp-size N: each rank's draft, loaded from the checkpoint with tp, equals the
    whole draft's slices, and reads exactly what it holds (its heads, its MLP columns, its
    block of the draft vocabulary; an odd vocabulary so the blocks are uneven)."""
    from specscope.draft.eagle3 import random_draft, shard_draft
    from specscope.draft.formats import save_draft
    from specscope.draft.loader import load_draft

    cfg = _config("odd_vocab_bias")
    extra = {"hidden_size": 48} if own_embed else {}  # a width of its own: own embedding
    full = random_draft(cfg, torch.float32, "cpu", draft_vocab_size=501, seed=4, **extra)
    d = save_draft(full, full.config, tmp_path / "draft", "sglang")
    whole = load_draft(d, cfg)
    held_total = 0
    for rank in range(2):
        tp = TPGroup(rank, 2)
        got = load_draft(d, cfg, tp=tp)
        want = shard_draft(whole.model, tp)
        assert got.model.config.own_embed_tokens == own_embed
        for (n, a), (_, b) in zip(got.model.named_parameters(), want.named_parameters(),
                                  strict=True):
            assert torch.equal(a, b), n
        assert torch.equal(got.model.d2t, whole.model.d2t)
        assert sum(got.reads.values()) == _held_elements(got.model)
        held_total += sum(got.reads.values())
        assert got.reads["midlayer.self_attn.q_proj.weight"] == \
            whole.reads["midlayer.self_attn.q_proj.weight"] // 2
    replicated = sum(p.numel() for n, p in whole.model.named_parameters()
                     if "norm" in n or n == "fc.weight")
    assert held_total == sum(whole.reads.values()) + replicated


def test_shard_reads_place_fused_rows_and_columns():
    # qkv rows of a rank: q rows [2, 4) at 0, k rows [5, 6) at 2 (of a fused [q 4 | k 2 | v 2])
    shard = Shard(0, ((2, 4, 0), (5, 6, 2), (7, 8, 3)))
    assert shard_reads(0, (4, 3), shard) == [((slice(2, 4), slice(None)),
                                              (slice(0, 2),))]
    assert shard_reads(4, (2, 3), shard) == [((slice(1, 2), slice(None)), (slice(2, 3),))]
    col = Shard(1, ((3, 6, 0),))  # a row-parallel weight's input columns
    assert shard_reads(0, (8, 6), col) == [((slice(None), slice(3, 6)),
                                            (slice(0, 8), slice(0, 3)))]
    experts = Shard(0, ((2, 4, 0),))  # expert-parallel: experts 2 and 3 here
    assert shard_reads((1, 0), (5, 4), experts) == []
    assert shard_reads((3, 5), (5, 4), experts) == [((slice(None), slice(None)),
                                                     (1, slice(5, 10)))]


class _Wire:
    """A channel that keeps what rank 0 sent."""

    def __init__(self) -> None:
        self.sent = []

    def send(self, obj) -> None:
        self.sent.append(obj)


def test_plans_carry_table_growth_preemption_and_generators():
    def scheduler(cls=Scheduler, **kw):
        return cls([Pool(BlockPool(16, 4, True))], max_num_batched_tokens=64, max_num_seqs=4,
                   max_model_len=32, **kw)

    sch = scheduler()
    mirror = scheduler(MirrorScheduler, rank=1, device=torch.device("cpu"))
    wire = _Wire()
    sender = PlanSender(wire)
    gen = torch.Generator().manual_seed(5)
    seq = Sequence("a", list(range(9)), SamplingParams(temperature=1.0), gen)
    sch.add(seq)

    def step(check: bool = True) -> None:
        plan = sch.schedule()
        sender.send(plan, None, sch)
        mirror.incoming = wire.sent[-1]
        mine = mirror.schedule()
        for it, m in zip(plan.scheduled, mine.scheduled, strict=True):
            assert m.seq.block_tables == it.seq.block_tables
            assert (m.seq.num_computed, m.num_tokens) == (it.seq.num_computed, it.num_tokens)
            for s, n in ((it.seq, it.num_tokens), (m.seq, m.num_tokens)):
                s.output_ids.append(1)  # the step's token, then its positions computed
                (sch if s is it.seq else mirror).computed(s, n)

    step()
    copy = mirror.seqs["a"]
    assert torch.equal(copy.generator.get_state(), gen.get_state())
    assert wire.sent[-1].items[0].new is not None  # first seen: whole
    for _ in range(6):
        step()
    item = wire.sent[-1].items[0]
    assert item.new is None and item.tables[0][0] >= 3  # known: only its table's tail
    sch.running.remove(seq)
    sch._preempt(seq)  # its blocks go back; it is prefilled again (a prefix-cache hit)
    step()
    assert copy.num_computed == seq.num_computed and copy.block_tables == seq.block_tables
    sch.finish(seq, "stop")
    sch.add(Sequence("b", [1, 2], SamplingParams()))
    step()
    assert wire.sent[-1].dropped == ["a"] and "a" not in mirror.seqs
    mirror.seqs["b"].output_ids.append(7)  # a rank that went its own way is caught
    sender.send(sch.schedule(), None, sch)
    mirror.incoming = wire.sent[-1]
    with pytest.raises(RuntimeError, match="diverged"):
        mirror.schedule()


# -- the whole engine over 2 ranks ---------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """The tiny model on one rank and on two (rank 1 a child process)."""
    from specscope import LLM

    kw = dict(dtype="fp32", device="cpu", kv_cache_memory=8 << 20, max_num_seqs=4,
              max_model_len=128, spec=None)
    one = LLM(str(tiny_model_dir), **kw)
    two = LLM(str(tiny_model_dir), tensor_parallel_size=2, dist_timeout=60, **kw)
    yield one, two
    two.close()


PROMPTS = [[5, 17, 300, 4000, 12], [9, 9, 9], [1000, 2000, 3000, 4000, 5000, 6000, 7]]


def _tokens(llm, n: int = 10) -> list[list[int]]:
    """Greedy tokens of each prompt alone, then of all of them in one batch."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    alone = [_ids(llm, [ids], params)[0] for ids in PROMPTS]
    return alone + _ids(llm, PROMPTS, params)


def _ids(llm, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    rids = [llm.add_request(p, params) for p in prompts]
    done = {}
    while len(done) < len(rids):
        for d in llm.step():
            if d.finished:
                done[d.request_id] = d.output.token_ids
    return [done[r] for r in rids]


def test_logits_and_loading_over_two_ranks(pair):
    one, two = pair
    ids = PROMPTS[2]
    # fp32, summed in another order (each rank's partial sums, then the all-reduce)
    torch.testing.assert_close(two.prompt_logits(ids), one.prompt_logits(ids), rtol=1e-5,
                               atol=1e-4)
    stats = two.gather_from_ranks("load_stats")
    full = one.load_stats
    assert all(s.total < full.total for s in stats)  # each reads about half
    q = "model.layers.0.self_attn.q_proj.weight"
    assert [s.elements[q] for s in stats] == [full.elements[q] // 2] * 2
    norm = "model.norm.weight"
    assert [s.elements[norm] for s in stats] == [full.elements[norm]] * 2  # replicated


def test_greedy_plain_and_speculative_output_equal_one_rank(pair):
    one, two = pair
    plain = _tokens(one)
    assert _tokens(two) == plain
    for draft_tp in (1, 2):  # a random draft, really verified: lossless
        two.set_spec(SpecConfig(draft="random", num_steps=3,
                                draft_tensor_parallel_size=draft_tp))
        assert _tokens(two) == plain, draft_tp
    # Simulated acceptance accepts drafts now and then: chains and a tree, committed
    # paths included, agree with one rank's token for token.
    for steps, topk, ndt in ((3, 1, None), (3, 2, 6)):
        cfg = dict(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt,
                   simulate_acceptance=2.5)
        one.set_spec(SpecConfig(**cfg))
        want = _tokens(one)
        for draft_tp in (1, 2):
            two.set_spec(SpecConfig(**cfg, draft_tensor_parallel_size=draft_tp))
            assert _tokens(two) == want, (steps, topk, draft_tp)
    one.set_spec(None)
    two.set_spec(None)


def test_a_draft_checkpoint_over_two_ranks_is_lossless(pair, tmp_path):
    """A draft from a checkpoint, replicated (each rank reads it whole) and sharded (each
    reads its slices): greedy output equals one rank's with the same draft."""
    from specscope.draft.eagle3 import random_draft
    from specscope.draft.formats import save_draft

    one, two = pair
    full = random_draft(one.model_config, torch.float32, "cpu", draft_vocab_size=300, seed=9,
                        std=0.2)
    path = str(save_draft(full, full.config, tmp_path / "draft", "sglang"))
    cfg = dict(draft=path, num_steps=3, topk=2, num_draft_tokens=6)
    one.set_spec(SpecConfig(**cfg))
    want = _tokens(one)
    assert want == (one.set_spec(None) or _tokens(one))  # lossless on one rank too
    for draft_tp in (1, 2):
        two.set_spec(SpecConfig(**cfg, draft_tensor_parallel_size=draft_tp))
        assert _tokens(two) == want, draft_tp
    two.set_spec(None)
    # Sampled, seeded: every rank draws from the same generator over the same logits.
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    assert _ids(two, PROMPTS, params) == _ids(one, PROMPTS, params)


def test_profile_splits_phases_into_collectives_and_compute(pair):
    from specscope.profiler import format_summary
    from specscope.profiler.trace import chrome_trace

    _, two = pair
    two.set_spec(SpecConfig(draft="random", num_steps=2, simulate_acceptance=2.0))
    two.enable_profiling(True, interval=None)
    _ids(two, PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    (s,) = two.profile_summary()
    assert s["tensor_parallel"]["size"] == 2
    assert s["tensor_parallel"]["draft_placement"] == "replicated"
    assert "tp=2 draft_tp=1" in s["config"]
    verify = s["phases"]["verify"]
    assert verify["comm_ms"] > 0
    for name, p in s["phases"].items():
        assert abs(p.get("comm_ms", 0.0) + p.get("compute_ms", p["mean_ms"]) - p["mean_ms"]) \
            < 1e-9, name
    # A replicated draft runs no collective in its steps.
    assert all(p.get("comm_ms", 0.0) == 0.0 for n, p in s["phases"].items()
               if n.startswith("draft_step"))
    assert s["collectives"]["count_per_cycle"] > 0
    assert s["ranks"]["size"] == 2 and s["ranks"]["phases"]["verify"]["skew"] >= 1.0
    text = format_summary(s)
    assert "verify" in text and "collectives" in text and "per-rank skew" in text
    slices = [e for e in chrome_trace(two.timer.all_records())["traceEvents"]
              if e.get("cat") == "collective"]
    assert slices and {e["name"] for e in slices} <= {"all_reduce", "all_gather"}
    two.enable_profiling(False)
    two.set_spec(None)


# -- a dead or hung rank ends the server ----------------------------------------------------


def _serve(model_dir: pathlib.Path, *extra: str) -> tuple[subprocess.Popen, int, int]:
    """`specscope serve --tp-size 2` on the tiny model: the process, its port, rank 1's pid."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", "from specscope.cli import main; raise SystemExit(main())",
           "serve", str(model_dir), "--device", "cpu", "--dtype", "fp32", "--tp-size", "2",
           "--port", "0", "--kv-cache-memory", "8MiB", "--max-model-len", "128", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env)
    port = pid = None
    seen = []
    deadline = time.monotonic() + 120
    while (port is None or pid is None) and time.monotonic() < deadline:
        line = p.stdout.readline()
        seen.append(line)
        if not line:
            break
        if "started rank 1 of 2 (pid " in line:
            pid = int(line.split("(pid ")[1].split(")")[0])
        if "Uvicorn running on http://" in line:
            port = int(line.rsplit(":", 1)[1].split()[0])
    assert port and pid, "the server did not start:\n" + "".join(seen[-20:])
    return p, port, pid


def _wait_exit(p: subprocess.Popen, limit: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        out, _ = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"the server did not exit within {limit} s") from None
    return p.returncode, out, time.monotonic() - t0


def test_killed_rank_ends_the_server_with_a_message(tiny_model_dir):
    p, _, pid = _serve(tiny_model_dir)
    os.kill(pid, signal.SIGKILL)
    code, out, took = _wait_exit(p, 30)
    assert code != 0 and took < 30
    assert "tensor-parallel rank 1" in out and "SIGKILL" in out


def test_hung_rank_times_out_the_server(tiny_model_dir):
    import httpx

    p, port, pid = _serve(tiny_model_dir, "--dist-timeout", "3")
    os.kill(pid, signal.SIGSTOP)  # alive, but never answers a collective again
    try:
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"prompt": "Hello", "max_tokens": 4})
        code, out, took = _wait_exit(p, 30)
    finally:
        if p.poll() is None:
            p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert code != 0
    assert "tensor-parallel" in out and "failed" in out


# -- the cost model keeps compute and collectives apart ------------------------------------


def test_cost_model_prices_a_draft_placement_it_did_not_measure():
    from specscope.draft.eagle3 import random_draft
    from specscope.tune.cost import Calibration, draft_columns, fit_cost_model
    from specscope.tune.placement import draft_forward_collectives, with_draft_placement

    draft_cfg = random_draft(_config("gqa"), torch.float32, "cpu").config
    # A sharded draft (draft TP 2) measured: compute 0.3 + 0.2 per step, each forward's
    # collectives at 0.05 ms apiece plus 0.5 ms per MB; the target's 0.6 ms per cycle.
    alpha, beta = 0.05, 0.5
    n1, b1 = draft_forward_collectives(draft_cfg, 2, 1, 4)
    n4, b4 = draft_forward_collectives(draft_cfg, 2, 4, 4)
    cals = []
    for s, k, n in ((1, 1, 2), (4, 1, 5), (8, 1, 9), (2, 4, 8), (3, 8, 16), (5, 2, 10)):
        cols = draft_columns(s, k, n)
        compute = 0.3 * cols[0] + 0.2 * cols[1] + 0.1 * cols[2] + 0.05 * cols[3]
        count, nbytes = n4 + (s - 1) * n1 + 10, b4 + (s - 1) * b1 + 1e5
        dcomm = n4 * alpha + b4 / 1e6 * beta + (s - 1) * (n1 * alpha + b1 / 1e6 * beta)
        comm = count * alpha + nbytes / 1e6 * beta
        cals.append(Calibration(s, k, n, compute + dcomm, 1.0 + 0.01 * n + comm - dcomm, 0.1,
                                draft_comm_ms=dcomm, verify_comm_ms=comm - dcomm,
                                comm_count=count, comm_bytes=nbytes, comm_ms=comm))
    fit = fit_cost_model(cals, plain_ms=2.0, tp=2, draft_tp=2)
    assert fit.comm_alpha_ms == pytest.approx(alpha, rel=1e-6)
    assert fit.comm_beta_ms_per_mb == pytest.approx(beta, rel=1e-6)
    assert fit.a_draft == pytest.approx(0.3, abs=1e-6)  # compute only
    assert fit.draft_ms(4, 1, 5) == pytest.approx(cals[1].draft_ms, rel=1e-6)
    # Replicated: twice the compute per rank, no collective at all.
    rep = with_draft_placement(fit, 1, draft_cfg, 4)
    assert rep.a_draft_comm == rep.b_step_comm == 0.0
    assert rep.draft_ms(4, 1, 5) == pytest.approx(2 * (0.3 + 0.2 * 3), rel=1e-6)
    # ... and back: the collectives priced from alpha and beta alone.
    back = with_draft_placement(rep, 2, draft_cfg, 4, extend_rows=4.0)
    assert back.draft_ms(4, 1, 5) == pytest.approx(cals[1].draft_ms, rel=1e-6)
