"""The expert blocks of a mixture-of-experts model: which module classes ZeRO-3 must treat as leaves.

With top-k routing each rank runs a different subset of experts in a step. ZeRO-3 gathers a module's parameters in
that module's forward hook, so per-expert modules make the ranks issue different gathers and hang (or trace a
different order each step and crawl). A leaf module is gathered whole when it is entered: every rank gathers the same
tensors whatever the router picked. transformers 5 fuses most families' experts into 3-D tensors, one module per
block; the block (router + experts + shared experts) is still the natural leaf: one gather and one gradient reduce
per layer instead of one per child.

Found from the model's own structure and config, not a list of class names that goes stale: the experts are a
`ModuleList` of exactly `n` children, or a module holding parameters of 3 or more dimensions whose first is `n`
(`n` the config's routed-expert count); the leaf is the smallest module holding those experts and the router (a
parameter with a dimension of size `n` outside the experts).
"""

from __future__ import annotations

from typing import Any

EXPERT_COUNT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
"""The config keys transformers' MoE families name their routed-expert count with (the first present and > 1)."""


def expert_count(config: Any) -> int:
    """Routed experts per MoE layer from a transformers config (or a dict of one); 0 for a dense model."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    for key in EXPERT_COUNT_KEYS:
        value = get(key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return 0


def _shape(param) -> tuple[int, ...]:
    """A parameter's full shape, also once ZeRO-3 has partitioned it (its data is then empty; `ds_shape` is kept)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def _holds_experts(module, n: int) -> bool:
    import torch

    if isinstance(module, torch.nn.ModuleList):
        return len(module) == n
    return any(len(shape) >= 3 and shape[0] == n for shape in map(_shape, module.parameters(recurse=False)))


def expert_containers(model, n: int | None = None) -> list[str]:
    """Names of the modules that hold a layer's experts (outermost only), in model order."""
    n = expert_count(model.config) if n is None else n
    if not n:
        return []
    found: list[str] = []
    for name, module in model.named_modules():
        if _holds_experts(module, n) and not any(name.startswith(f"{outer}.") for outer in found):
            found.append(name)
    return found


def _has_router(module, experts, n: int) -> bool:
    inside = {id(p) for p in experts.parameters()}
    return any(n in _shape(p) for p in module.parameters() if id(p) not in inside)


def leaf_modules(model) -> dict[str, str]:
    """{module name: class name} of each expert block ZeRO-3 should gather whole; empty for a dense model.

    The block is the smallest module around an expert container that also holds the router; a container whose
    router sits in the decoder layer itself (or nowhere) is the leaf on its own.
    """
    n = expert_count(model.config)
    modules = dict(model.named_modules())
    leaves: dict[str, str] = {}
    for name in expert_containers(model, n):
        experts, leaf = modules[name], name
        parent = name.rpartition(".")[0]
        if parent in modules and _has_router(modules[parent], experts, n) and not _is_decoder_layer(modules[parent]):
            leaf = parent
        leaves[leaf] = type(modules[leaf]).__name__
    return leaves


def _is_decoder_layer(module) -> bool:
    """A decoder layer holds attention too: far more than the expert block, so never the leaf."""
    return any("attn" in child or "attention" in child for child, _ in module.named_children())


def leaf_classes(model) -> list[str]:
    """The class names of `leaf_modules(model)`, once each, in model order: DeepSpeed's `leaf_module.classes`."""
    return list(dict.fromkeys(leaf_modules(model).values()))
