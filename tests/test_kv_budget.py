"""KV pool sizing: a byte budget or a GPU memory fraction -> blocks, with clear errors."""

from __future__ import annotations

import pytest
import torch

from specscope.kvcache.budget import (
    DEFAULT_CPU_KV_BYTES,
    GiB,
    KVLayout,
    kv_budget,
    parse_bytes,
)

LLAMA_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
DRAFT_8B = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
CPU = torch.device("cpu")


def test_bytes_per_token_of_the_8b_shape():
    assert LLAMA_8B.bytes_per_token == 131072  # 128 KiB: the "131 KB per token"


def test_a_byte_budget_of_the_target_alone():
    b = kv_budget([LLAMA_8B], 16, CPU, kv_cache_memory=10 * GiB)
    assert b.num_blocks == 5120  # 10 GiB / (16 tokens x 128 KiB)


def test_a_byte_budget_buys_whole_blocks_of_both_pools():
    b = kv_budget([LLAMA_8B, DRAFT_8B], 16, CPU, kv_cache_memory=10 * GiB)
    per_block = 16 * (131072 + 4096)
    assert b.num_blocks == 10 * GiB // per_block
    assert b.bytes == b.num_blocks * per_block <= 10 * GiB
    assert b.num_tokens == 16 * b.num_blocks
    line = b.describe(8192)
    assert f"{b.num_tokens} tokens" in line and "sequences of the full context" in line


def test_the_cpu_default_and_the_utilization_flag_off_cuda():
    b = kv_budget([LLAMA_8B], 16, CPU)
    assert b.bytes <= DEFAULT_CPU_KV_BYTES and "--kv-cache-memory" in b.source


@pytest.mark.parametrize("kw,match", [
    ({"gpu_memory_utilization": 0.0}, "gpu-memory-utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu-memory-utilization"),
    ({"kv_cache_memory": -1}, "kv-cache-memory"),
    ({"kv_cache_memory": 1000}, "holds no block"),
])
def test_bad_budgets_say_what_to_change(kw, match):
    with pytest.raises(ValueError, match=match):
        kv_budget([LLAMA_8B], 16, CPU, **kw)


@pytest.mark.parametrize("text,value", [("4GiB", 4 * GiB), ("512 MiB", 512 << 20),
                                        ("2G", 2_000_000_000), ("1e9", 10 ** 9),
                                        ("123", 123), ("1.5gb", 1_500_000_000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "4 XB", "-1G", "0"])
def test_parse_bytes_rejects_nonsense(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_a_speculating_engine_reserves_its_verify_logits():
    """A verify computes every tree node's logits: on Qwen3-30B-A3B's 152k vocabulary a
    2,048-node verify needs 3.1 GB (bf16 output, its fp32 copy, the probabilities), more
    than the sampled rows' bound, and the reserve covers it."""
    from types import SimpleNamespace

    from specscope.kvcache.budget import activation_bytes

    model = SimpleNamespace(hidden_size=2048, intermediate_size=6144, vocab_size=151936)
    engine = SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=256)
    plain = activation_bytes(model, engine, torch.bfloat16)
    spec = activation_bytes(model, engine, torch.bfloat16, verify_rows=2048)
    assert spec - plain == 10 * 151936 * 2048 - 12 * 151936 * 256
    assert spec > 3.5e9
