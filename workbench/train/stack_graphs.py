"""The decoder stack replayed as CUDA graphs (train.cuda_graphs): one forward and one backward replay per step.

A LoRA step of the 48-layer Qwen3-30B-A3B on an H200 is host-bound: the GPU waits for Python and
the launches of a few thousand small kernels per step (benchmarks/NOTES.md, "LoRA"). Here the
whole stack of decoder layers is captured once as one callable (torch.cuda.make_graphed_callables:
one static input and output, one memory pool, no per-layer copies) and each later training forward
replays it; autograd runs the captured backward.

The first training forward runs eagerly and checks that every layer gets layer 0's inputs (families
may give layers their own masks); the second captures. Then layer 0 runs the graph of the stack and
layers 1..L-1, called next by the model's own loop with the graph's output, hand it on (a layer
called with other inputs than layer 0's stops the run: the replay computed it with layer 0's). A
forward the capture cannot stand for runs eagerly, layer by layer: gradients off or eval mode
(validation, generation), a cache, other inputs, other shapes (a boolean mask, packed documents or
padding, and the position ids are inputs of the graph: a step without a mask where the capture had one
runs eagerly).
The router logits (the aux loss) and the expert load counters come out of the replay as the eager
forward gives them. Needs one CUDA rank, no activation checkpointing, kernels without host syncs
(grouped_mm experts, not TE's or the per-expert loop).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from workbench.config_checks import ConfigError
from workbench.models.engine_state import engine_state
from workbench.moe.routed_load import load_counters

log = logging.getLogger("workbench")

# Shape suffixes: B batch, S sequence, D hidden.

# Layer keywords whose tensors are inputs of the graph, copied in at each replay: the mask of packed documents or
# padding, and the position ids (an attention implementation may read the documents from them).
_TENSOR_INPUTS = ("attention_mask", "position_ids")
# Layer keywords a replay ignores: not read by the layers on the training path (the cache's positions, the loss's
# token count).
_IGNORED = ("cache_position", "num_items_in_batch")
_OFF = ("cache", "past_key_values", "use_cache", "output_router_logits", "output_attentions")


class _Stack(nn.Module):
    """The decoder layers as one function of tensors: (hidden, cos, sin, *named) -> (hidden, *router logits)."""

    def __init__(self, layers: list[nn.Module], graphs: StackGraphs, names: tuple[str, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)  # holds the model's own modules (their names stay the model's)
        self.graphs = graphs
        self.names = names  # the layer keywords of the tensors after (hidden, cos, sin)

    def forward(self, hidden_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *named) -> tuple:
        """The layers' eager forward; the router logits their hooks recorded come out as outputs."""
        sink = self.graphs.sink
        logits: list[torch.Tensor] = []
        outer = (sink.logits, sink.topk_ids) if sink is not None else None
        if sink is not None:
            # the captured run's ids are not the replay's: none are recorded (the aux loss sorts its own)
            sink.logits, sink.topk_ids = logits, None
        try:
            for layer in self.layers:
                kwargs = {"position_embeddings": (cos, sin), **dict(zip(self.names, named, strict=True))}
                hidden_BSD = self.graphs.eager(layer, hidden_BSD, (), kwargs)
        finally:
            if sink is not None:
                sink.logits, sink.topk_ids = outer
        return (hidden_BSD, *logits)


class StackGraphs:
    """The captured stack of one model and the bookkeeping of a replayed forward."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList) -> None:
        self.layers = list(layers)
        self.eager_classes = {id(m): type(m) for m in self.layers}
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        self.sink = engine_state(model).router_sink
        self.model_ref = model
        self.graphed: nn.Module | None = None
        self.signature: tuple | None = None
        self.expect: int | None = None  # the next layer to hand the replay's output on
        self.output: torch.Tensor | None = None
        self.checked = None  # layer 0's (position embeddings, *tensor inputs) while an eager forward checks the layers
        self.replayed_with = None  # those of the forward being replayed
        self.ready = False  # an eager training forward found every layer replayable: the next one captures
        self.refused: str | None = None  # why no capture will be made (a layer with other inputs)
        self.replays = 0
        # Bytes of the capture's memory pool that hold no live tensor: the replays' activations. The allocator
        # counts them as free, so memory figures add them (memory_gib's `hidden` argument)
        self.pool_hidden_bytes = 0
        self.eager_forwards: dict[str, int] = {}  # reason -> training forwards that ran eagerly

    def eager(self, layer: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """The layer's own (Transformers') forward."""
        return self.eager_classes[id(layer)].forward(layer, hidden, *args, **kwargs)

    def _why_eager(
        self, layer: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict, first: bool = True
    ) -> str | None:
        if args:
            return "positional layer arguments"
        for key in _TENSOR_INPUTS:
            if kwargs.get(key) is not None and not isinstance(kwargs[key], torch.Tensor):
                return f"{key} that is not a tensor ({type(kwargs[key]).__name__})"
        for key in _OFF:
            if kwargs.get(key):
                return f"{key} set"
        pe = kwargs.get("position_embeddings")
        if not (isinstance(pe, tuple) and len(pe) == 2 and all(isinstance(t, torch.Tensor) for t in pe)):
            return "no (cos, sin) position embeddings"
        for key, value in kwargs.items():
            if key not in (*_IGNORED, *_OFF, *_TENSOR_INPUTS, "position_embeddings") and value is not None:
                return f"layer keyword {key!r}"
        if not hidden.is_cuda:
            return "hidden states not on a CUDA device"
        # only layer 0's input is the graph's: a later layer's is the replay's output (under LoRA it needs a
        # gradient where layer 0's input, the frozen embedding's, does not)
        if first and self.signature is not None and self.signature != _signature(hidden, *pe, _named(kwargs)):
            shapes = {k: tuple(v.shape) for k, v in _named(kwargs).items()}
            return f"other inputs than the captured ones (hidden {tuple(hidden.shape)}, {shapes})"
        return None

    def layer_forward(self, layer: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """What decoder layer `layer` returns: the stack's replay (layer 0), its output handed on, or eager."""
        i = self.index[id(layer)]
        training = torch.is_grad_enabled() and layer.training
        if i == 0:
            self.expect, self.output, self.checked = None, None, None
            if training:
                why = self._why_eager(layer, hidden, args, kwargs)
                if why is None and self.ready:
                    return self._replay(hidden, kwargs)
                if why is None and self.refused is None:
                    self.checked = _inputs(kwargs)  # this eager forward checks every layer
                else:
                    why = why or self.refused
                    if self.eager_forwards.get(why, 0) == 0:
                        log.warning("train.cuda_graphs: a training forward runs eagerly: %s", why)
                    self.eager_forwards[why] = self.eager_forwards.get(why, 0) + 1
        elif self.expect is not None:
            # the replay computed this layer with layer 0's keywords: its own must be those
            why = self._why_eager(layer, hidden, args, kwargs, first=False)
            if i != self.expect or hidden is not self.output or why is not None or not self._same_inputs(kwargs):
                raise RuntimeError(
                    f"train.cuda_graphs: decoder layer {i} was called with other inputs than layer 0 "
                    f"({why or 'another input or position embeddings'}) after the replay of the stack computed it "
                    "with layer 0's: this model's layers cannot be replayed as one stack; set train.cuda_graphs false"
                )
            self.expect = i + 1 if i + 1 < len(self.layers) else None
            return hidden
        elif self.checked is not None and training:
            # The capture waits for one eager training forward in which every layer could be replayed with
            # layer 0's inputs (a family may give layers their own masks: sliding windows, layer types).
            if self._why_eager(layer, hidden, args, kwargs, first=False) is not None or not self._same_inputs(kwargs):
                self.checked = None
                self.refused = f"decoder layer {i} takes other inputs than layer 0"
                log.warning("train.cuda_graphs: no capture: %s; every step runs eagerly", self.refused)
            elif i == len(self.layers) - 1:
                self.ready = self.refused is None
        return self.eager(layer, hidden, args, kwargs)

    def _same_inputs(self, kwargs: dict) -> bool:
        # Transformers' loops hand every layer the same position-embedding tuple, mask and position ids (a
        # family with per-layer masks, sliding windows, hands some layers another one)
        reference = self.checked if self.expect is None else self.replayed_with
        return all(a is b for a, b in zip(_inputs(kwargs), reference, strict=True))

    def _replay(self, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        cos, sin = kwargs["position_embeddings"]
        named = _named(kwargs)
        self.replayed_with = _inputs(kwargs)
        inputs = (hidden, cos, sin, *named.values())
        if self.graphed is None:
            self._capture(inputs, tuple(named))
        outputs = self.graphed(*inputs)
        if self.sink is not None and self.sink.logits is not None:
            self.sink.logits.extend(outputs[1:])
        self.replays += 1
        self.output = outputs[0]
        self.expect = 1 if len(self.layers) > 1 else None
        return outputs[0]

    def _capture(self, inputs: tuple[torch.Tensor, ...], names: tuple[str, ...]) -> None:
        counters = load_counters(self.model_ref)
        before = [c.clone() for c in counters]  # the warm-up forwards count tokens that were never trained on
        # the hidden states need a gradient exactly where the real ones do (LoRA: not at layer 0)
        sample = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
        try:
            self.graphed, self.pool_hidden_bytes = graph_stack(_Stack(self.layers, self, names), sample)
        except Exception as err:
            raise RuntimeError(
                f"train.cuda_graphs: capturing the decoder stack failed ({type(err).__name__}: {err}); an op in "
                "the layers waits for the host or changes shape from step to step: set train.cuda_graphs to false"
            ) from err
        with torch.no_grad():
            for counter, saved in zip(counters, before, strict=True):
                counter.copy_(saved)
        self.signature = _signature(*inputs[:3], dict(zip(names, inputs[3:], strict=True)))
        log.info(
            "train.cuda_graphs: captured %d decoder layers, input %s, also %s",
            len(self.layers),
            tuple(inputs[0].shape),
            {name: tuple(t.shape) for name, t in zip(names, inputs[3:], strict=True)},
        )


def graph_stack(stack: nn.Module, sample: tuple[torch.Tensor, ...]) -> tuple[nn.Module, int]:
    """`stack` made into its replayed CUDA graphs (forward and backward), and its pool's replay memory in bytes."""
    pool = torch.cuda.graph_pool_handle()
    # two warm-up passes: lazy initialization (cuBLAS workspaces, Triton compiles) stays out of the capture;
    # one callable, so its sample_args are its arguments themselves
    graphed = torch.cuda.make_graphed_callables(stack, sample, num_warmup_iters=2, allow_unused_input=True, pool=pool)
    torch.cuda.empty_cache()  # the warm-up passes' cached blocks: the pool holds what the replays use
    return graphed, pool_hidden_bytes(pool, sample[0].device)


def pool_hidden_bytes(pool, device: torch.device) -> int:
    """Bytes of graph memory pool `pool`'s segments that no live tensor holds (what its replays write into)."""
    segments = torch.cuda.memory_snapshot()
    if not segments or "segment_pool_id" not in segments[0]:
        # no pool ids in this torch's snapshot: everything reserved and unallocated (an upper bound)
        return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return sum(
        seg["total_size"] - seg["allocated_size"] for seg in segments if tuple(seg["segment_pool_id"]) == tuple(pool)
    )


def _inputs(kwargs: dict) -> tuple:
    return (kwargs.get("position_embeddings"), *(kwargs.get(k) for k in _TENSOR_INPUTS))


def _named(kwargs: dict) -> dict[str, torch.Tensor]:
    return {k: kwargs[k] for k in _TENSOR_INPUTS if kwargs.get(k) is not None}


def _signature(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, named: dict[str, torch.Tensor]) -> tuple:
    def of(t: torch.Tensor) -> tuple:
        return tuple(t.shape), t.dtype, t.device, t.requires_grad

    return (of(hidden), of(cos), of(sin), *((k, of(named[k]) if k in named else None) for k in _TENSOR_INPUTS))


class GraphedLayer:
    """Mixin put in front of a decoder layer's class: its forward goes through the model's StackGraphs."""

    stack_graphs: StackGraphs  # the model's, set by install_stack_graphs

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The replayed stack's output, or the layer's own forward (StackGraphs.layer_forward)."""
        return self.stack_graphs.layer_forward(self, hidden_states, args, kwargs)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (Transformers' `model.layers`)."""
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"train.cuda_graphs: {type(model).__name__} has no decoder layers at base_model.layers to capture"
        )
    return layers


def install_stack_graphs(model: nn.Module) -> StackGraphs:
    """Route `model`'s decoder layers through one StackGraphs (captured at the first training forward)."""
    layers = decoder_layers(model)
    graphs = StackGraphs(model, layers)
    for layer in layers:
        cls = type(layer)
        if not issubclass(cls, GraphedLayer):
            # a class swap, not a wrapper: parameter names and state dict keys stay Transformers'
            layer.__class__ = type(f"Graphed{cls.__name__}", (GraphedLayer, cls), {"__module__": __name__})
        layer.stack_graphs = graphs
    engine_state(model).stack_graphs = graphs
    return graphs


def check_stack_graphs(train, backend, world: int, accum: int, device: torch.device) -> None:
    """Refuse train.cuda_graphs where a capture cannot run or cannot be right (before any model is built).

    Every reason at once, so one edit of the config fixes them all.
    """
    if not train.cuda_graphs:
        return
    reasons = []
    if device.type != "cuda":
        reasons.append(f"it replays CUDA graphs, and this run's device is {device.type}")
    if world > 1:
        reasons.append(
            f"it runs on one rank for now (FSDP2's hooks and collectives are not captured): this run has {world}"
        )
    if accum > 1:
        # the replayed backward writes the parameters' gradients into the capture's buffers, which autograd hands
        # to .grad as they are: a second micro-batch would overwrite the first one's before adding to it
        reasons.append(
            f"it runs without gradient accumulation for now: this run has {accum} micro-batches per step (make "
            "train.local_batch_size the per-rank batch)"
        )
    if backend.experts == "te" or backend.expert_recompute:
        reasons.append(
            "it captures the grouped_mm experts: backend.experts='te' (host-side row counts) and "
            "backend.expert_recompute are not capturable; set backend.experts='grouped_mm', expert_recompute false"
        )
    if reasons:
        raise ConfigError("train.cuda_graphs cannot run here: " + "; ".join(reasons))
