"""Training-time test (TTT): the draft unrolled over its own outputs, as at inference.

EAGLE-3 trains the draft the way the engine runs it. Index t of a training sequence holds the
pair (taps_t, tok_{t+1}) at rope position t, exactly what the draft extend writes into the
draft KV at position t (engine/speculative.py). Step 0 is that extend; its output at t
predicts tok_{t+2}. Step j >= 1 at index t is the draft step run at position t + j: it takes
tok_{t+1+j} (what step j-1 should have proposed) and step j-1's output at t as `hidden`, and
predicts tok_{t+2+j}. Its query attends to

    step-0 keys at indices <= t   (the committed prefix, causal)
    step-i keys at index t only, 1 <= i <= j   (its own chain: positions t+1 .. t+j)

which is the draft KV at inference after an extend ending at t and j chain steps. A test
checks that unrolled logits equal the engine's cached chain to float precision.

Loss (per step j, weight 0.8^j): cross-entropy against the target's own next-token
distribution at position t+1+j, restricted to the draft vocabulary and renormalised, on
positions whose label tok_{t+2+j} is an assistant token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specscope.draft.eagle3 import Eagle3Draft

ATTENTION = ("dense", "sdpa")
# Kernels for the "sdpa" mode. Not cuDNN attention, PyTorch's first choice for a masked SDPA
# on Hopper: it builds a graph per shape on the host, and the trainer's padded length changes
# with every batch. Round 5 on the H200 ran 0.55 s per step with it (GPU 6 % busy, the host
# inside SDPA forward and backward) against 0.15 s dense, though a fixed-shape benchmark ran
# it faster than dense; benchmarks/ttt_step.py now varies the length per step to see this.
# So pinned, round 6 trained with sdpa at 0.145 s per step per GPU (docs/training.md).
SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def check_attention(name: str) -> str:
    """`name` if it is a TTT attention mode (StepKeys), else a ValueError naming them."""
    if name not in ATTENTION:
        raise ValueError(f"TTT attention must be one of {', '.join(ATTENTION)}, got {name!r}")
    return name


class StepKeys:
    """The K/V of every unrolled step so far, per attention module (draft layer).

    attention: "dense" (the reference) materialises step 0's [T, T] scores per head in fp32
    and adds each later step's diagonal key; "sdpa" hands all steps' keys to one
    scaled_dot_product_attention call under a [T, (j+1)T] mask (causal block, then one
    diagonal block per later step), so no score matrix is stored for the backward pass, at
    the price of attention over (j+1)T keys of which most are masked. Same result."""

    def __init__(self, attention: str = "dense") -> None:
        self.attention = check_attention(attention)
        self.kv: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def attend(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, Hkv, T, D] of this step -> attention output [B, T, H*D]."""
        steps = self.kv.setdefault(module, [])
        steps.append((k, v))
        if self.attention == "sdpa":
            return self._attend_sdpa(steps, q, scale)
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        qg = q.view(B, Hkv, H // Hkv, T, D)  # GQA folded: head h uses kv head h // G
        k0, v0 = steps[0]
        s0 = torch.matmul(qg, k0[:, :, None].transpose(-1, -2)).float() * scale  # [B,Hkv,G,T,T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        # Each later step contributes one key per query: its own index (the diagonal).
        diag = [(qg * ki[:, :, None]).sum(-1, keepdim=True).float() * scale
                for ki, _ in steps[1:]]  # each [B, Hkv, G, T, 1]
        p = torch.cat([s0, *diag], dim=-1).softmax(-1).to(q.dtype)  # [B, Hkv, G, T, T + j]
        out = torch.matmul(p[..., :T], v0[:, :, None])  # [B, Hkv, G, T, D]
        for i, (_, vi) in enumerate(steps[1:]):
            out = out + p[..., T + i:T + i + 1] * vi[:, :, None]
        return out.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)

    def _attend_sdpa(self, steps: list[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
                     scale: float) -> torch.Tensor:
        B, H, T, D = q.shape
        k = torch.cat([ki for ki, _ in steps], dim=2)  # [B, Hkv, n*T, D]
        v = torch.cat([vi for _, vi in steps], dim=2)
        G = H // k.shape[1]
        if G > 1:  # GQA: head h uses kv head h // G
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        # [T, n*T]: step 0's keys causally, each later step's at the query's own index
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=q.device)
        mask = torch.cat([causal] + [eye] * (len(steps) - 1), dim=1)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B,H,T,D]
        return out.transpose(1, 2).reshape(B, T, H * D)


def shift_left(x: torch.Tensor, s: int, fill: int | float | bool = 0) -> torch.Tensor:
    """x[:, t + s] at index t along dim 1, `fill` past the end. [B, T, ...] -> same shape."""
    if s == 0:
        return x
    pad = x.new_full((x.shape[0], min(s, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat((x[:, s:], pad), dim=1)


def unroll(draft: Eagle3Draft, taps: torch.Tensor, input_ids: torch.Tensor,
           steps: int, attention: str = "dense") -> list[torch.Tensor]:
    """Draft logits of every unrolled step.

    taps [B, T, n * Ht] (the target's, at every index); input_ids [B, T] (the sequence).
    Returns `steps` tensors [B, T, Vd] fp32: entry j at index t predicts tok_{t+2+j}.
    The rope table must cover positions T + steps (Eagle3Draft.init_rope). attention: see
    StepKeys ("dense" is the reference).
    """
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    keys = StepKeys(attention)
    hidden = draft.project(taps)  # [B, T, H]
    out = []
    for j in range(steps):
        ids_j = shift_left(input_ids, j + 1)  # tok_{t+1+j} at index t
        hidden, normed = draft(ids_j, hidden, positions + j, ttt=keys)
        out.append(draft.compute_logits(normed))
    return out


@dataclass
class TTTBatch:
    """What one TTT loss needs from the target, all [B, T, ...] on the draft's device."""

    input_ids: torch.Tensor  # [B, T] int64
    label_mask: torch.Tensor  # [B, T] bool: token t is an assistant token (a label)
    taps: torch.Tensor  # [B, T, n * Ht]
    target_logp: torch.Tensor  # [B, T, Vd] fp32: log-softmax of the target over the draft vocab
    target_top: torch.Tensor  # [B, T] int64: the target's argmax over its full vocabulary


@dataclass
class StepMetrics:
    """Per unrolled step j: label count, top-1 agreement and on-policy chain hits."""

    count: torch.Tensor  # [steps] labels (float)
    correct: torch.Tensor  # [steps] draft top-1 == target top-1
    chain: torch.Tensor  # [steps] positions where steps 0..j all hit on-policy
    reached: torch.Tensor  # [steps] positions where steps 0..j-1 all hit (j=0: all labels)
    accepted: torch.Tensor | None = None  # [steps, B, T] bool: steps 0..j all hit at index t
    ce0: torch.Tensor | None = None  # [B, T] step-0 cross-entropy at every index (detached)
    valid0: torch.Tensor | None = None  # [B, T] bool: index t has a step-0 label

    @property
    def first_ce(self) -> torch.Tensor | None:
        """[n labels] step-0 cross-entropy per label. Selected on demand: a boolean index
        waits for the device, which a training step must not do."""
        if self.ce0 is None or self.valid0 is None:
            return None
        return self.ce0[self.valid0].float()


def ttt_loss(draft: Eagle3Draft, batch: TTTBatch, steps: int, decay: float = 0.8,
             attention: str = "dense") -> tuple[torch.Tensor, list[torch.Tensor], StepMetrics]:
    """(weighted loss, per-step losses, metrics) of one unrolled batch.

    A hit at step j for index t: the draft's top-1 equals the sequence's tok_{t+2+j} AND that
    token is the target's own greedy choice, so a greedy chain at inference would have fed
    exactly the tokens the unrolled steps were fed. chain / reached per step is then the
    engine's acceptance-by-position (StepStats definition).
    """
    logits = unroll(draft, batch.taps, batch.input_ids, steps, attention)
    total = torch.zeros((), device=batch.taps.device)
    losses = []
    count, correct, chain, reached = [], [], [], []
    alive = None
    ce0 = valid0 = None
    accepted = []
    for j, lg in enumerate(logits):
        valid = shift_left(batch.label_mask, j + 2, False)  # label tok_{t+2+j} exists, is ours
        p = shift_left(batch.target_logp, j + 1, 0.0).exp()  # target at position t+1+j
        logq = F.log_softmax(lg, dim=-1)
        ce = -(p * logq).sum(-1)  # [B, T]
        n = valid.sum()
        loss = (ce * valid).sum() / n.clamp_min(1)
        losses.append(loss.detach())
        total = total + (decay ** j) * loss
        with torch.no_grad():
            if j == 0:
                ce0, valid0 = ce.detach(), valid
            top = draft.to_target(lg.argmax(-1))  # [B, T] target ids
            tgt = shift_left(batch.target_top, j + 1, -1)
            label = shift_left(batch.input_ids, j + 2, -1)
            hit = valid & (top == label) & (label == tgt)
            reach = valid if alive is None else valid & alive
            alive = hit if alive is None else alive & hit
            accepted.append(alive)
            count.append(n.float())
            correct.append((valid & (top == tgt)).sum().float())
            chain.append(alive.sum().float())
            reached.append(reach.sum().float())
    metrics = StepMetrics(count=torch.stack(count), correct=torch.stack(correct),
                          chain=torch.stack(chain), reached=torch.stack(reached),
                          accepted=torch.stack(accepted), ce0=ce0, valid0=valid0)
    return total, losses, metrics


def acceptance(chain: torch.Tensor, reached: torch.Tensor) -> list[float]:
    """Acceptance by position (given every earlier position accepted) from summed metrics."""
    return [float(c / r) if r > 0 else 0.0 for c, r in zip(chain.tolist(), reached.tolist(),
                                                             strict=True)]


def predicted_accept_length(rates: list[float], num_steps: int) -> float:
    """tau of a greedy chain of num_steps: 1 + sum_k prod_{i<=k} a_i (the engine's
    accept_length: accepted draft tokens plus the bonus token)."""
    tau, run = 1.0, 1.0
    for a in rates[:num_steps]:
        run *= a
        tau += run
    return tau


def answer_spans(label_mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, each assistant answer as (start, end): start = the index of the token before
    the answer (where the first cycle's extend ends), end = the index after its last token."""
    out = []
    for row in label_mask.bool().cpu().tolist():
        spans, t = [], 0
        while t < len(row):
            if row[t]:
                e = t
                while e < len(row) and row[e]:
                    e += 1
                if t > 0:
                    spans.append((t - 1, e))
                t = e
            else:
                t += 1
        out.append(spans)
    return out


def walk_cycles(accepted: list[list[int]], spans: list[list[tuple[int, int]]]) -> list[int]:
    """Accepted draft tokens of every cycle of the engine's walk over each answer.

    accepted[b][t]: draft tokens a cycle whose extend ends at index t would accept. Cycles do
    not start at every index: the first starts at the answer's start, and a cycle at t is
    followed by one at t + a(t) + 1 (after its bonus token). Rejections cluster at hard
    positions, so the walk's mean is below the mean over all indices."""
    out = []
    for row, row_spans in zip(accepted, spans, strict=True):
        for t, end in row_spans:
            while t + 2 < end:  # the answer still has a token after this cycle's root
                acc = min(row[t], max(0, end - t - 2))
                out.append(acc)
                t += acc + 1
    return out


def walk_totals(accepted: torch.Tensor, starts: list[int], ends: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """walk_cycles for many acceptance patterns at once, one span per answer: accepted
    [N, B, T] (a(t) of N configurations); returns (accepted draft tokens [N], cycles [N])
    summed over the B answers. The walks advance in lock step, one cycle per iteration, so
    thousands of configurations cost as many tensor operations as one answer's cycles."""
    N, B, T = accepted.shape
    pos = torch.tensor(starts, dtype=torch.long).expand(N, B).clone()  # [N, B]
    end = torch.tensor(ends, dtype=torch.long).expand(N, B)
    tokens = torch.zeros(N, dtype=torch.long)
    cycles = torch.zeros(N, dtype=torch.long)
    while True:
        live = pos + 2 < end  # the answer still has a token after this cycle's root
        if not bool(live.any()):
            return tokens, cycles
        acc = accepted.gather(-1, pos.clamp(max=T - 1)[..., None])[..., 0].long()
        acc = torch.minimum(acc, (end - pos - 2).clamp(min=0)) * live
        tokens += acc.sum(-1)
        cycles += live.sum(-1)
        pos = torch.where(live, pos + acc + 1, pos)


def walk_accept_counts(m: StepMetrics, label_mask: torch.Tensor, num_steps: int
                       ) -> tuple[int, int]:
    """(accepted draft tokens, cycles) of a greedy chain of num_steps replayed on the batch:
    the engine's accept length is 1 + tokens / cycles."""
    if m.accepted is None:
        raise ValueError("walk_accept_counts needs StepMetrics.accepted (from ttt_loss)")
    a = m.accepted[:num_steps].long().sum(0).tolist()  # [B, T] leading hits
    c = walk_cycles(a, answer_spans(label_mask))
    return sum(c), len(c)
