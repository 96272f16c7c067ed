"""MoE health per layer: dead experts, the most and least loaded expert's share, load CV, router entropy.

The load figures come from the expert load the step already records (`[layers][experts]` token counts of this
rank's tokens, read on the host with the step's other statistics), so they cost a few host operations on lists.
The router entropy comes from the router logits the aux-loss hooks already record in each forward
(models/router_aux): `router_entropy_sums` reduces them on the device to one number a layer, which rides the
step's one statistics copy (train/step_stats), so it adds no host sync.

Router entropy is normalised: the mean over tokens of H(softmax(logits)) / ln(E), in [0, 1] (1 = every token
spreads its probability evenly over the E experts, 0 = every token puts it all on one expert). It exists only
for families whose router logits are recorded (those with Transformers' standard aux loss: Qwen3-MoE, Mixtral,
OLMoE, GPT-OSS, ...); the record has no router entropy otherwise (DeepSeek-V3's sigmoid router, for one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Shape suffixes: T tokens, E experts.

# The per-layer lists a step record carries (each [layers]); workbench.ui and the trackers read these names.
HEALTH_KEYS = ("moe_dead_share", "moe_max_share", "moe_min_share", "moe_load_cv", "router_entropy")


def load_health(load: Sequence[Sequence[int]]) -> dict[str, list[float]]:
    """Per layer of `load` (token counts [layers][experts]): the share of experts with no tokens, the largest and
    smallest expert's share of the layer's tokens, std/mean of the counts (0 = balanced). A layer with no tokens
    at all counts every expert dead and has shares and CV 0."""
    out: dict[str, list[float]] = {"moe_dead_share": [], "moe_max_share": [], "moe_min_share": [], "moe_load_cv": []}
    for row in load:
        experts, total = len(row), sum(row)
        if experts == 0:
            continue
        mean = total / experts
        std = math.sqrt(sum((c - mean) ** 2 for c in row) / experts)
        out["moe_dead_share"].append(sum(1 for c in row if c == 0) / experts)
        out["moe_max_share"].append(max(row) / total if total else 0.0)
        out["moe_min_share"].append(min(row) / total if total else 0.0)
        out["moe_load_cv"].append(std / mean if mean > 0 else 0.0)
    return out


def router_entropy_sums(router_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """`[layers]` float64 on the logits' device: per layer, the mean over its tokens of the normalised entropy of
    softmax(logits) (H / ln E). No host read; the caller sums micro-batches and divides by their count."""
    rows = []
    with torch.no_grad():
        for logits in router_logits:
            logits_TE = logits.detach().reshape(-1, logits.shape[-1]).float()
            # entr(p) = -p ln p, 0 at p = 0 (a -inf logit): no 0 * -inf
            entropy_T = torch.special.entr(torch.softmax(logits_TE, dim=-1)).sum(dim=-1)
            # one expert: the entropy is 0, and ln 2 keeps the division defined
            rows.append(entropy_T.mean() / math.log(max(logits_TE.shape[-1], 2)))
    return torch.stack(rows).to(torch.float64)
