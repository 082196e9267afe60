"""MoE routing in one Triton launch (CUDA): the fast path of `route` (models/moe.py).

`route` is ~20 small torch kernels (softmax or sigmoid, the bias add, the group top-2 and
its sort, the mask, the expert sort, the gather, the renormalisation); at decode sizes
their launches, not their work, are the router's cost. Here one launch does it all in
registers, a block of BLOCK_T tokens per program, with exactly `route`'s semantics (route
stays its reference, tests/test_moe_route_triton.py checks one against the other):

1. a token's E logits are a [G_PAD, PER_PAD] tile (groups x experts in a group, each
   padded to a power of two; padding is never eligible), held flat as one row of
   G_PAD * PER_PAD positions, group-major, so positions ascend with expert ids. Without
   grouped selection (n_group == 1, or topk_group == n_group, which keeps every group)
   the tile is [1, next_pow2(E)];
2. scores = softmax or sigmoid in fp32; choice = scores + bias (for the choice only);
3. grouped: the row viewed as [G_PAD, PER_PAD]; a group's score is the sum of its two best
   choices (its one best when it has one expert); the topk_group best groups are kept by
   iterative max, ties to the lower group id; the other groups' choices become -inf;
4. top_k experts by iterative max, ties to the lower expert id, best first. Each max is
   one argmax (leftmost on ties) over an int32 key that orders like the fp32 choice and
   has one value below -inf for "not pickable" (padding, already picked). So the experts
   of dropped groups (choice -inf) stay selectable after every eligible one, in id order,
   as `route`'s stable sort orders them (reachable only when topk_group * per < top_k);
5. weights = the picked experts' scores (never the bias-shifted choice), recomputed from
   their logits by the same ops, renormalised w / (sum + 1e-20) when norm_topk_prob,
   times routed_scaling_factor.

The same block of work also counts the distinct experts the real tokens picked (the
profile's expert metric) when one program holds every token; past that, `_count_kernel`
counts from the ids in one more launch.

`router_fused` (decode and verify: up to 16 tokens) puts the router's logits in the same
launch: its programs each compute a 16-expert tile's partial logits over a chunk of the
hidden width, and the last program to finish (an acquire-release ticket) adds the
partials in order and routes every token. Larger batches take F.linear's fp32 logits and
`route_fused`.

Static shapes, a grid from the shape alone, no host reads: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specscope.config import MoEConfig
from specscope.models import dependent_launch
from specscope.models.dependent_launch import release, wait
from specscope.models.moe_experts import LiveSlots

# Below every fp32 value's _order_key (-inf's is -2**31 + 2**23 - 1): not pickable.
_UNAVAIL = -(2**31)
# Scores held per program at most (BLOCK_T tokens x a token's padded tile): bounds the
# registers a program needs. A choice, not a measurement: no GPU has timed this kernel yet.
_MAX_TILE = 4096


# Helpers are called once per program, never inside a loop: under Triton's CPU interpreter
# every device-function call (tl.max and tl.sum included) re-patches triton.language, which
# costs milliseconds; so each step below is one reduction where it can be.


@triton.jit
def _order_key(v):
    """fp32 [...] -> int32 [...] in the same order, equal values equal (-0.0 is first made
    +0.0, defensively: a choice is never -0.0), so that INT32_MIN ranks below every value,
    -inf included: `_UNAVAIL`, the mark of what may not be picked (padding, rows past N,
    what was picked already)."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negatives: larger magnitude lower


@triton.jit
def _group_keep(choice, G: tl.constexpr, TOPK_GROUP: tl.constexpr, G_PAD: tl.constexpr,
                PER_PAD: tl.constexpr, TOP2: tl.constexpr, UNAVAIL: tl.constexpr):
    """choice [BT, G_PAD, PER_PAD] (-inf on padding) -> keep [BT, G_PAD, 1]: each token's
    TOPK_GROUP best groups by the sum of their two best choices, ties to the lower group."""
    best, first = tl.max(choice, axis=2, return_indices=True,
                         return_indices_tie_break_left=True)  # [BT, G_PAD] each
    score = best
    if TOP2:
        # Drop only the first position holding the best: a tied second best still counts,
        # as torch.topk(2).values does.
        j = tl.arange(0, PER_PAD)[None, None, :]
        score = best + tl.max(tl.where(j == first[:, :, None], float("-inf"), choice), axis=2)
    gid = tl.arange(0, G_PAD)[None, :]  # [1, G_PAD]
    key = tl.where(gid < G, _order_key(score), UNAVAIL)  # [BT, G_PAD]
    for _ in tl.static_range(TOPK_GROUP):
        _, sel = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
        key = tl.where(gid == sel[:, None], UNAVAIL, key)  # taken
    return ((key == UNAVAIL) & (gid < G))[:, :, None]  # the taken real groups


@triton.jit
def _logits(ptrs, mask, other, stride_s, SPLIT: tl.constexpr, CACHE: tl.constexpr):
    """fp32 logits at ptrs: the sum of SPLIT partial sums stride_s apart, in order."""
    x = tl.load(ptrs, mask=mask, other=other, cache_modifier=CACHE).to(tl.float32)
    for i in tl.static_range(1, SPLIT):
        x += tl.load(ptrs + i * stride_s, mask=mask, other=0.0, cache_modifier=CACHE)
    return x


@triton.jit
def _route_block(tok0, logits_ptr, bias_ptr, ids_ptr, w_ptr, slots_ptr, active_ptr, N,
                 stride_l, scale, first, end, G: tl.constexpr, PER: tl.constexpr,
                 K: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
                 G_PAD: tl.constexpr, PER_PAD: tl.constexpr, K_PAD: tl.constexpr,
                 SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                 TOP2: tl.constexpr, NORM: tl.constexpr, UNAVAIL: tl.constexpr,
                 COUNT: tl.constexpr, HAS_SLOTS: tl.constexpr, CACHE: tl.constexpr,
                 SPLIT: tl.constexpr, stride_s):
    """Tokens [tok0, tok0 + BLOCK_T): logits [N, E] (E = G * PER) -> ids [N, K] int64,
    weights [N, K] fp32. A token's experts are one row of T = G_PAD * PER_PAD positions,
    group-major (pos = g * PER_PAD + j), so positions ascend with expert ids. COUNT (this
    block holds every token): also active = the distinct experts the real tokens picked
    (HAS_SLOTS: a token is real where its KV slot is outside [first, end)). CACHE: the
    logits' load cache modifier; SPLIT: the logits are SPLIT partial sums stride_s apart,
    added in order."""
    T: tl.constexpr = G_PAD * PER_PAD
    tok = tok0 + tl.arange(0, BLOCK_T)  # [BT]
    live = (tok < N)[:, None]  # [BT, 1]
    real = live
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + tok, mask=tok < N, other=first)[:, None]
        real = live & ((slot < first) | (slot >= end))
    row = logits_ptr + tok.to(tl.int64)[:, None] * stride_l  # [BT, 1]
    pos = tl.arange(0, T)[None, :]  # [1, T]
    valid = (pos // PER_PAD < G) & (pos % PER_PAD < PER)  # [1, T]: a real expert
    e = (pos // PER_PAD) * PER + pos % PER_PAD  # its id, where valid
    x = _logits(row + e, live & valid, float("-inf"), stride_s, SPLIT, CACHE)  # [BT, T]
    x = tl.where(live, x, 0.0)  # rows past N: finite (never stored), so no NaN softmax
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        mx = tl.max(x, axis=1)[:, None]  # [BT, 1]
        ex = tl.exp(x - mx)  # padding: exp(-inf) = 0
        den = tl.sum(ex, axis=1)[:, None]
        scores = ex / den
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPED:
        keep = _group_keep(tl.reshape(choice, [BLOCK_T, G_PAD, PER_PAD]), G, TOPK_GROUP,
                           G_PAD, PER_PAD, TOP2, UNAVAIL)  # [BT, G_PAD, 1]
        keep = tl.reshape(tl.broadcast_to(keep, [BLOCK_T, G_PAD, PER_PAD]), [BLOCK_T, T])
        choice = tl.where(keep, choice, float("-inf"))
    # Dropped groups' experts are -inf, still above UNAVAIL: selectable after every
    # eligible expert, in id order, as route()'s stable sort has them.
    key = tl.where(live & valid, _order_key(choice), UNAVAIL)  # [BT, T]
    kk = tl.arange(0, K_PAD)[None, :]  # [1, K_PAD]
    picked = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)  # positions, best first
    hit = tl.zeros([T], dtype=tl.int32)  # COUNT: positions some real token picked
    for t in tl.static_range(K):
        # The best available, the lowest position (= expert id) among equals.
        _, p = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
        picked = tl.where(kk == t, p[:, None], picked)
        taken = pos == p[:, None]  # [BT, T]
        key = tl.where(taken, UNAVAIL, key)
        if COUNT:
            hit = tl.maximum(hit, tl.max((taken & real).to(tl.int32), axis=0))
    if COUNT:
        tl.store(active_ptr, tl.sum(hit).to(tl.int64))
    ids = (picked // PER_PAD) * PER + picked % PER_PAD  # [BT, K_PAD]
    store = live & (kk < K)
    # The weights are the picked experts' scores: recomputed from their logits by the same
    # ops (the same values), a gather instead of K more reductions over the row.
    xs = _logits(row + ids, store, 0.0, stride_s, SPLIT, CACHE)  # [BT, K_PAD]
    w = tl.sigmoid(xs) if SIGMOID else tl.exp(xs - mx) / den
    w = tl.where(store, w, 0.0)
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)  # sigmoid sums may be ~0, as route()
    w = w * scale
    out = tok.to(tl.int64)[:, None] * K + kk
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=store)
    tl.store(w_ptr + out, w, mask=store)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, slots_ptr, active_ptr, N,
                  stride_l, scale, first, end,
                  G: tl.constexpr, PER: tl.constexpr, K: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr, G_PAD: tl.constexpr,
                  PER_PAD: tl.constexpr, K_PAD: tl.constexpr, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, TOP2: tl.constexpr,
                  NORM: tl.constexpr, UNAVAIL: tl.constexpr, COUNT: tl.constexpr,
                  HAS_SLOTS: tl.constexpr, PDL: tl.constexpr):
    """`_route_block` for tokens [pid * BLOCK_T, +BLOCK_T) of logits an earlier kernel
    wrote."""
    wait(PDL)  # the router's logits come from the kernel before
    release(PDL)
    _route_block(tl.program_id(0) * BLOCK_T, logits_ptr, bias_ptr, ids_ptr, w_ptr, slots_ptr,
                 active_ptr, N, stride_l, scale, first, end,
                 G, PER, K, TOPK_GROUP, BLOCK_T, G_PAD, PER_PAD, K_PAD, SIGMOID,
                 HAS_BIAS, GROUPED, TOP2, NORM, UNAVAIL, COUNT, HAS_SLOTS, "", 1, 0)


@triton.jit
def _router_kernel(x_ptr, rw_ptr, part_ptr, ticket_ptr, bias_ptr, ids_ptr, w_ptr,
                   slots_ptr, active_ptr, N, H, stride_x, scale, first, end, CHUNK,
                   SPLIT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                   PRECISION: tl.constexpr,
                   G: tl.constexpr, PER: tl.constexpr, K: tl.constexpr,
                   TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr, G_PAD: tl.constexpr,
                   PER_PAD: tl.constexpr, K_PAD: tl.constexpr, SIGMOID: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, TOP2: tl.constexpr,
                   NORM: tl.constexpr, UNAVAIL: tl.constexpr, COUNT: tl.constexpr,
                   HAS_SLOTS: tl.constexpr, PDL: tl.constexpr):
    """The router and the routing in one launch, for at most 16 tokens (BLOCK_T <= 16).
    Program (i, s) computes the fp32 partial logits of experts [i * BLOCK_E, +BLOCK_E)
    over hidden columns [s * CHUNK, +CHUNK) for every token (x [N, H] times the router
    weight rw [E, H] on the tensor cores: the 16-bit products are exact in fp32, summed in
    fp32) into part [SPLIT, N, E]; the last program to finish (a ticket taken with an
    acquire-release atomic after the stores) adds the SPLIT parts in order, past L1, and
    routes all N tokens, then resets the ticket for the next launch."""
    E: tl.constexpr = G * PER
    pid = tl.program_id(0)
    s = pid % SPLIT
    ex = (pid // SPLIT) * BLOCK_E + tl.arange(0, BLOCK_E)
    m = tl.arange(0, 16)
    wait(PDL)  # x comes from the kernel before
    acc = tl.zeros([16, BLOCK_E], tl.float32)
    for h0 in range(s * CHUNK, (s + 1) * CHUNK, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        xt = tl.load(x_ptr + m[:, None] * stride_x + h[None, :],
                     mask=(m < N)[:, None] & (h < H)[None, :], other=0.0)
        wt = tl.load(rw_ptr + ex[:, None].to(tl.int64) * H + h[None, :],
                     mask=(ex < E)[:, None] & (h < H)[None, :], other=0.0)
        acc += tl.dot(xt, tl.trans(wt), input_precision=PRECISION)  # [16, BLOCK_E]
    release(PDL)
    tl.store(part_ptr + s * N * E + m[:, None] * E + ex[None, :], acc,
             mask=(m < N)[:, None] & (ex < E)[None, :])
    tl.debug_barrier()  # every thread's stores before the ticket's release
    done = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        _route_block(0, part_ptr, bias_ptr, ids_ptr, w_ptr, slots_ptr, active_ptr, N, E,
                     scale, first, end,
                     G, PER, K, TOPK_GROUP, BLOCK_T, G_PAD, PER_PAD, K_PAD, SIGMOID,
                     HAS_BIAS, GROUPED, TOP2, NORM, UNAVAIL, COUNT, HAS_SLOTS, ".cg",
                     SPLIT, N * E)
        tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def _count_kernel(ids_ptr, slots_ptr, active_ptr, NK, first, end, K: tl.constexpr,
                  E_PAD: tl.constexpr, BLOCK_P: tl.constexpr, HAS_SLOTS: tl.constexpr,
                  PDL: tl.constexpr):
    """active = the distinct experts among the ids [NK] of real tokens (pair p is token
    p // K's; HAS_SLOTS: real where its KV slot is outside [first, end)): one program,
    for routings of more tokens than one route program holds."""
    wait(PDL)
    release(PDL)
    e = tl.arange(0, E_PAD)[None, :]  # [1, E_PAD]
    hit = tl.zeros([E_PAD], dtype=tl.int32)
    for p0 in range(0, NK, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)  # [BP]
        ok = p < NK
        if HAS_SLOTS:
            slot = tl.load(slots_ptr + p // K, mask=ok, other=first)
            ok = ok & ((slot < first) | (slot >= end))
        ids = tl.load(ids_ptr + p, mask=ok, other=-1)[:, None]  # [BP, 1]
        hit = tl.maximum(hit, tl.max((ids == e).to(tl.int32), axis=0))
    tl.store(active_ptr, tl.sum(hit).to(tl.int64))


def _layout(E: int, moe: MoEConfig) -> dict:
    """The routing constexprs of E experts under `moe` (the tile of a token's experts)."""
    grouped = moe.n_group > 1 and moe.topk_group < moe.n_group
    G = moe.n_group if grouped else 1
    return dict(G=G, PER=E // G, K=moe.top_k, TOPK_GROUP=moe.topk_group if grouped else 1,
                G_PAD=triton.next_power_of_2(G), PER_PAD=triton.next_power_of_2(E // G),
                K_PAD=triton.next_power_of_2(moe.top_k), SIGMOID=moe.scoring == "sigmoid",
                GROUPED=grouped, TOP2=E // G >= 2, NORM=moe.norm_topk_prob, UNAVAIL=_UNAVAIL)


@torch.compiler.disable  # as experts_grouped: a launch with a host-side grid
def route_fused(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None = None,
                active: torch.Tensor | None = None, live: LiveSlots | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """route()'s contract in one launch: logits [N, E] (fp32) -> ids [N, k] int64, weights
    [N, k] fp32: the same ids, token for token, and the same weights to rounding.

    active (a 0-d int64, or None): also written with the distinct experts the real tokens
    picked (live: (slots [N], first, end), a token is real where its slot is outside the
    scratch range [first, end); None: every token), the count `expert_counts` gives. Within
    the routing launch when one program holds every token, else one more launch."""
    N, E = logits.shape
    k = moe.top_k
    ids = torch.empty(N, k, dtype=torch.long, device=logits.device)
    w = torch.empty(N, k, dtype=torch.float32, device=logits.device)
    if N == 0:
        if active is not None:
            active.zero_()
        return ids, w  # a grid of 0 programs is not a launch
    lay = _layout(E, moe)
    tile = lay["G_PAD"] * lay["PER_PAD"]
    BT = min(triton.next_power_of_2(N), max(1, _MAX_TILE // tile))
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    slots, first, end = live if live is not None else (logits, 0, 0)
    programs = triton.cdiv(N, BT)
    count_here = active is not None and programs == 1
    launch = dependent_launch.options(logits, N)
    _route_kernel[(programs,)](
        logits, logits if bias is None else bias, ids, w, slots,
        active if count_here else ids, N, logits.stride(0),
        float(moe.routed_scaling_factor), first, end, BLOCK_T=BT, HAS_BIAS=bias is not None,
        COUNT=count_here, HAS_SLOTS=live is not None, num_warps=_warps(BT * tile), **lay,
        **launch)
    if active is not None and not count_here:
        E_PAD = triton.next_power_of_2(E)
        _count_kernel[(1,)](ids, slots, active, N * k, first, end, K=k, E_PAD=E_PAD,
                            BLOCK_P=max(1, _MAX_TILE // E_PAD), HAS_SLOTS=live is not None,
                            num_warps=4, **launch)
    return ids, w


# Tokens the one-launch router takes (its logits tile is 16 rows: the tensor cores'
# smallest), and experts per program of it.
ROUTER_MAX_TOKENS = 16
ROUTER_BLOCK_E = 16
# Hidden columns per load step of a router program, and the programs a launch aims at.
ROUTER_BLOCK_H = 256
ROUTER_PROGRAMS = 64


def router_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether router_fused takes x [N, H] with the router weight [E, H]: 1 to 16 tokens,
    one dtype, a contiguous weight of x's width (a mismatch goes to F.linear, which names
    it)."""
    return (0 < x.shape[0] <= ROUTER_MAX_TOKENS and weight.dtype == x.dtype
            and weight.is_contiguous() and weight.shape[1] == x.shape[1])


@torch.compiler.disable
def router_fused(x: torch.Tensor, weight: torch.Tensor, moe: MoEConfig, ticket: torch.Tensor,
                 bias: torch.Tensor | None = None, active: torch.Tensor | None = None,
                 live: LiveSlots | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits and route_fused's routing (and count) in one launch, for the few
    tokens of decode and verify (router_fits): x [N, H], weight [E, H] -> ids [N, k] int64,
    weights [N, k] fp32. Each tile of 16 experts is cut into hidden chunks so the launch
    has about ROUTER_PROGRAMS programs; the routing program adds the chunks' partial
    logits in order (deterministic). ticket: a zeroed int32 [1] the launch counts its
    finished programs in (the last routes, then zeroes it): one per router, not shared
    between launches that may run at once."""
    N, H = x.shape
    E = weight.shape[0]
    k = moe.top_k
    e_tiles = triton.cdiv(E, ROUTER_BLOCK_E)
    block_h = min(ROUTER_BLOCK_H, max(16, triton.next_power_of_2(H)))
    # Hidden chunks a tile of experts is cut into, for about ROUTER_PROGRAMS programs of at
    # least one BLOCK_H step each: one 16-row tile's stream over all of H is a long chain
    # of dependent loads for a single program.
    split = max(1, min(H // block_h, ROUTER_PROGRAMS // e_tiles))
    chunk = triton.cdiv(triton.cdiv(H, split), block_h) * block_h
    split = triton.cdiv(H, chunk)
    part = torch.empty(split, N, E, dtype=torch.float32, device=x.device)
    ids = torch.empty(N, k, dtype=torch.long, device=x.device)
    w = torch.empty(N, k, dtype=torch.float32, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    lay = _layout(E, moe)
    BT = triton.next_power_of_2(N)
    slots, first, end = live if live is not None else (part, 0, 0)
    _router_kernel[(e_tiles * split,)](
        x, weight, part, ticket, part if bias is None else bias, ids, w, slots,
        active if active is not None else ids, N, H, x.stride(0),
        float(moe.routed_scaling_factor), first, end, chunk, SPLIT=split,
        BLOCK_E=ROUTER_BLOCK_E, BLOCK_H=block_h,
        PRECISION="ieee" if x.dtype == torch.float32 else None, BLOCK_T=BT,
        HAS_BIAS=bias is not None, COUNT=active is not None, HAS_SLOTS=live is not None,
        num_warps=_warps(BT * lay["G_PAD"] * lay["PER_PAD"]), **lay,
        **dependent_launch.options(x, N))
    return ids, w


def _warps(tile: int) -> int:
    """Warps for a program of `tile` scores (BLOCK_T x the padded row)."""
    return 1 if tile <= 512 else 4 if tile <= 2048 else 8
