"""The router's entropy per MoE layer, reduced on the device from the router logits a forward already records.

The aux-loss hooks (models/router_aux) record each router's logits in every forward; `router_entropy_sums` reduces
them to one number a layer on the device, which rides the step's one statistics copy (train/step_stats), so it adds
no host sync. It is normalised: the mean over tokens of H(softmax(logits)) / ln(E), in [0, 1] (1 = every token
spreads its probability evenly over the E experts, 0 = every token puts it all on one expert). It exists only for
families whose router logits are recorded (those with Transformers' standard aux loss: Qwen3-MoE, Mixtral, OLMoE,
GPT-OSS, ...); a record has no router_entropy otherwise (DeepSeek-V3's sigmoid router, for one). The other MoE
health figures come from the expert load (workbench.runs.moe_health).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Shape suffixes: T tokens, E experts.


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
