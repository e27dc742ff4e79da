"""Model shapes for the planner: read from a recipe, a config folder or a hub id (the recipes' published models
known offline).

The planner needs exact parameter counts without building the model, so they are computed here from
the shape (a test checks them against `sum(p.numel())` of a real `LlamaForCausalLM` on the meta device).
The formulas are the Llama family's: RMSNorm, GQA attention, SwiGLU MLP, optional biases, untied or
tied `lm_head`; a mixture of experts replaces the MLP of its MoE layers by a router and `experts` SwiGLU experts
of width `expert_ffn` (plus always-on shared experts), of which `experts_per_token` run per token: total parameters
count every expert, FLOPs (and MFU) only the active ones. `flops_per_token` is imported by the throughput callback; keep its name.

A recipe's name (`--model 70b`) means the model its YAML names: the recipe registry (`hf_zero3.recipes`) is the
one list of names, and nothing here overrides what a recipe says.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_zero3 import recipes
from hf_zero3.plan.experts import expert_count


class ModelError(ValueError):
    """A model that cannot be resolved; the message names the fix."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that decide its memory; parameter counts derive from them."""

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0
    """0 means hidden // heads (the Llama default)."""
    tied_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_positions: int = 4096
    qk_norm: bool = False
    """An RMSNorm of head_dim on queries and on keys in every layer (Qwen3)."""
    experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    expert_ffn: int = 0
    """Intermediate width of one routed expert (Qwen3-MoE's moe_intermediate_size; Mixtral's intermediate_size)."""
    shared_expert_ffn: int = 0
    """Intermediate width of the always-on shared expert(s) of an MoE layer, all together (0: none)."""
    dense_layers: int = 0
    """Layers of an MoE model with a dense MLP of width `ffn` instead of experts (DeepSeek's first layers)."""

    def __post_init__(self):
        for field in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "max_positions"):
            if getattr(self, field) < 1:
                raise ModelError(f"model {self.name}: {field} must be >= 1 (got {getattr(self, field)})")
        if self.heads % self.kv_heads:
            raise ModelError(f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads}): give kv_heads (--kv-heads) a divisor of {self.heads}")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.experts and not (0 < self.experts_per_token <= self.experts and self.expert_ffn > 0
                                 and 0 <= self.dense_layers < self.layers):
            raise ModelError(f"model {self.name}: {self.experts} experts need 1 <= experts_per_token <= experts "
                             f"(got {self.experts_per_token}), expert_ffn >= 1 (got {self.expert_ffn}) and fewer "
                             f"dense_layers than layers (got {self.dense_layers})")

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """0 when tied: the output projection reuses the embedding matrix."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def attention_params(self) -> int:
        """q, k, v, o projections of one layer (GQA: k and v are kv_dim wide)."""
        weights = 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim
        biases = self.q_dim + 2 * self.kv_dim + self.hidden if self.attention_bias else 0
        return weights + biases

    @property
    def mlp_params(self) -> int:
        """gate, up, down projections of one dense layer (SwiGLU)."""
        return 3 * self.hidden * self.ffn + ((2 * self.ffn + self.hidden) if self.mlp_bias else 0)

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return self.layers - self.dense_layers if self.experts else 0

    def expert_block_params(self, experts: int | None = None) -> int:
        """One MoE layer's MLP with `experts` routed experts (default: all): router, experts, shared experts."""
        experts = self.experts if experts is None else experts
        return self.hidden * self.experts + experts * 3 * self.hidden * self.expert_ffn + \
            3 * self.hidden * self.shared_expert_ffn

    @property
    def layer_params(self) -> int:
        """One dense decoder layer: attention, MLP and its two RMSNorms."""
        return self.attention_params + self.mlp_params + self._norms

    @property
    def _norms(self) -> int:
        """A layer's RMSNorm weights: before attention and MLP, and Qwen3's on queries and keys."""
        return 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def _total(self, experts: int | None) -> int:
        dense = self.layers - self.moe_layers
        return (self.embedding_params + self.layers * (self.attention_params + self._norms) +
                dense * self.mlp_params + self.moe_layers * self.expert_block_params(experts) + self.hidden +
                self.lm_head_params)

    @property
    def params(self) -> int:
        """Every parameter (every expert): embedding, layers, final norm, untied lm_head. What memory scales with."""
        return self._total(None)

    @property
    def active_params(self) -> int:
        """The parameters one token runs through: `params` with `experts_per_token` experts per MoE layer."""
        return self._total(self.experts_per_token) if self.experts else self.params

    @property
    def active_ffn(self) -> int:
        """The MLP width one token's activations span: `ffn`, or its experts' and the shared experts' together."""
        return self.experts_per_token * self.expert_ffn + self.shared_expert_ffn if self.experts else self.ffn

    @property
    def largest_module_params(self) -> int:
        """The biggest module ZeRO-3 gathers at once: embedding, lm_head, an MLP linear or q_proj, or a mixture of
        experts' whole block (a leaf module: router, every expert and the shared ones in one gather)."""
        mlp_linear = self.hidden * self.ffn + (self.ffn if self.mlp_bias else 0)
        q_proj = self.hidden * self.q_dim + (self.q_dim if self.attention_bias else 0)
        block = self.expert_block_params() if self.experts else 0
        return max(self.embedding_params, mlp_linear, q_proj, block)

    def parameter_order(self) -> list[int]:
        """Elements of each parameter tensor in `model.parameters()` order (transformers' Llama family; a mixture of
        experts' router first (Mixtral, Qwen2-MoE; Qwen3-MoE's comes after its experts), then its fused gate_up (E, 2f, h)
        and down (E, h, f) tensors, then shared experts).
        DeepSpeed cuts its optimizer sub-groups walking this order, so where a large tensor falls decides them."""
        h, E = self.hidden, self.experts
        attention = [h * self.q_dim, *([self.q_dim] if self.attention_bias else []),
                     h * self.kv_dim, *([self.kv_dim] if self.attention_bias else []),
                     h * self.kv_dim, *([self.kv_dim] if self.attention_bias else []),
                     h * self.q_dim, *([h] if self.attention_bias else []),
                     *([self.head_dim, self.head_dim] if self.qk_norm else [])]
        linear = [h * self.ffn, *([self.ffn] if self.mlp_bias else [])]
        dense = [*linear, *linear, h * self.ffn, *([h] if self.mlp_bias else [])]
        moe = [E * h, E * 2 * self.expert_ffn * h, E * self.expert_ffn * h,
               *([h * self.shared_expert_ffn] * 3 if self.shared_expert_ffn else [])]
        order = [self.embedding_params]
        for layer in range(self.layers):
            order += attention + (dense if layer < self.layers - self.moe_layers else moe) + [h, h]
        return order + [h] + ([self.lm_head_params] if self.lm_head_params else [])

    def tensor_sizes(self) -> list[tuple[int, int]]:
        """(elements, how many) of each kind of parameter tensor: what ZeRO-3's persistence threshold is compared
        with, tensor by tensor."""
        return list(collections.Counter(self.parameter_order()).items())

    def persistent_params(self, threshold: int) -> int:
        """Elements in the tensors of at most `threshold` elements, which ZeRO-3 keeps whole on every GPU
        (`stage3_param_persistence_threshold`; "auto" = 10 x hidden leaves the norms)."""
        return sum(n * count for n, count in self.tensor_sizes() if n <= threshold)


def matmul_params(shape: ModelShape) -> int:
    """N of `flops_per_token`: every active parameter except the input embedding table (a lookup, no FLOPs).

    The output projection is counted even when tied, because the logits matmul is real work. This is
    torchtitan's choice (`get_num_flop_per_token` with embeddings excluded). A mixture of experts counts the
    experts a token is routed to (`active_params`), not all of them: MFU then measures work done.
    """
    return shape.active_params - shape.embedding_params + (shape.embedding_params if shape.tied_embeddings else 0)


def flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """Training FLOPs per token: 6·N + 12·L·H·S (PaLM, appendix B), N = `matmul_params(shape)`.

    6·N is forward + backward of the matmuls; 12·L·H·S the attention scores and values, with H the
    query width (heads x head_dim, = hidden for Llama) and no discount for the causal mask (PaLM's
    convention, so MFU figures compare across codebases).
    """
    return 6 * matmul_params(shape) + 12 * shape.layers * shape.q_dim * seq_len


def _llama2(name: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int) -> ModelShape:
    return ModelShape(name, layers, hidden, ffn, heads, kv_heads, vocab=32000, max_positions=4096)


PUBLISHED: dict[str, ModelShape] = {
    "meta-llama/Llama-2-7b-hf": _llama2("meta-llama/Llama-2-7b-hf", 32, 4096, 11008, 32, 32),
    "meta-llama/Llama-2-13b-hf": _llama2("meta-llama/Llama-2-13b-hf", 40, 5120, 13824, 40, 40),
    "meta-llama/Llama-2-70b-hf": _llama2("meta-llama/Llama-2-70b-hf", 80, 8192, 28672, 64, 8),
    "meta-llama/Meta-Llama-3-8B": ModelShape("meta-llama/Meta-Llama-3-8B", 32, 4096, 14336, 32, 8, vocab=128256,
                                             max_positions=8192),
}
"""The shapes of the models the recipes name, from their published config.json: the planner answers for them
without the network (gated repos) or the HF cache; a config in the cache is read instead."""


def shape_from_config(config: Any, name: str = "") -> ModelShape:
    """A shape from a transformers config object (or anything with the same attribute names)."""
    get = (lambda key, default=None: config.get(key, default)) if isinstance(config, dict) else (
        lambda key, default=None: getattr(config, key, default))
    missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                           "vocab_size") if get(k) is None]
    if missing:
        raise ModelError(f"model {name}: config has no {', '.join(missing)}; the planner models Llama-style "
                         "decoders (Llama, Mistral, Qwen2, ...): pass --model with such a config or a recipe")
    heads = get("num_attention_heads")
    experts = expert_count(config)
    moe = {}
    if experts:
        sparse_step = get("decoder_sparse_step") or 1
        layers = get("num_hidden_layers")
        first_dense = get("first_k_dense_replace") or 0
        dense = {i for i in range(layers) if i < first_dense or i in (get("mlp_only_layers") or [])
                 or (i + 1) % sparse_step}
        shared = (get("shared_expert_intermediate_size") or 0) or \
            (get("n_shared_experts") or 0) * (get("moe_intermediate_size") or 0)
        moe = dict(experts=experts, experts_per_token=get("num_experts_per_tok") or get("moe_topk") or 1,
                   expert_ffn=get("moe_intermediate_size") or get("intermediate_size"), shared_expert_ffn=shared,
                   dense_layers=len(dense))
    return ModelShape(
        name=name or str(get("_name_or_path", "") or get("model_type", "model")),
        layers=get("num_hidden_layers"),
        hidden=get("hidden_size"),
        ffn=get("intermediate_size"),
        heads=heads,
        kv_heads=get("num_key_value_heads") or heads,
        vocab=get("vocab_size"),
        head_dim=get("head_dim") or 0,
        tied_embeddings=bool(get("tie_word_embeddings", False)),
        attention_bias=bool(get("attention_bias", False)),
        mlp_bias=bool(get("mlp_bias", False)),
        max_positions=get("max_position_embeddings") or 4096,
        qk_norm=str(get("model_type", "")).startswith("qwen3"),
        **moe,
    )


def load_config_shape(source: str, name: str = "", overrides: str | None = None) -> ModelShape:
    """Read a config folder or hub id with `AutoConfig` (local cache first, so it works offline)."""
    from transformers import AutoConfig  # transformers' config classes: only when a config is read

    try:
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=True)
        except OSError:
            if os.path.isdir(source):
                raise
            if source in PUBLISHED and not overrides:
                return dataclasses.replace(PUBLISHED[source], name=name or source)
            config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ModelError(f"could not read a model config from {source!r} ({str(e).splitlines()[0]}). Pass a "
                         f"recipe ({', '.join(recipes.names()) or 'none'}), a local folder with config.json, or a hub "
                         "id that is in the HF cache or reachable (set HF_HUB_OFFLINE=1 to skip the network)") from e
    if overrides:
        config.update_from_string(overrides)
    return shape_from_config(config, name or source)


def load_shape(model: str) -> ModelShape:
    """`--model`: a recipe name (recipes/<name>/), a config folder (or its config.json), a hub id."""
    recipe = recipes.find(model) if "/" not in model else None
    if recipe is not None:
        if not recipe.model:
            raise ModelError(f"{recipe.yaml} names no model (model_name_or_path or config_name): add one")
        return load_config_shape(recipe.model, name=model, overrides=recipe.config_overrides)
    path = Path(model).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir():
        return load_config_shape(str(path), name=model)
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelError(f"unknown model {model!r}: use a recipe ({', '.join(recipes.names()) or 'none'}), a folder "
                         "with config.json, or a hub id like org/name")
    return load_config_shape(model)


def with_changes(shape: ModelShape, **changes: Any) -> ModelShape:
    """A copy of `shape` with some sizes changed (e.g. from --layers/--hidden on the command line)."""
    if {"hidden", "heads"} & changes.keys() and "head_dim" not in changes:
        changes["head_dim"] = 0  # re-derive hidden // heads
    return dataclasses.replace(shape, **changes)
