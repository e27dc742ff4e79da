"""A mixture of experts' ZeRO-3 leaf modules, written into the run's ds_config before DeepSpeed starts.

DeepSpeed reads `zero_optimization.leaf_module` when the engine is built (after the model is loaded, before its
hooks are put on), so the block classes found from the loaded model (`plan.experts`) go into the ds_config the HF
bridge holds; `run_config.json` then records them with the rest. A dense model's ds_config is left as it is.
"""

from __future__ import annotations

from collections import Counter

from hf_zero3.job.facts import ds_config_of
from hf_zero3.plan.experts import leaf_modules


def set_leaf_modules(model, requested: list[str] | None, training_args) -> str | None:
    """Put the leaf classes into the running ds_config (ZeRO-3 only); the line that says what was done, or None.

    `requested`: the run's `leaf_modules` (None: found from the model). Raises ValueError for a requested class the
    model does not have, naming the ones it does."""
    zero = (ds_config_of(training_args) or {}).get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        return None
    if "leaf_module" in zero:
        return f"ZeRO-3 leaf modules from the ds_config: {zero['leaf_module']}"
    found = leaf_modules(model)
    if requested is None:
        classes, why = list(dict.fromkeys(found.values())), "found from the model's experts"
    else:
        present = Counter(type(m).__name__ for m in model.modules())
        if unknown := [name for name in requested if name not in present]:
            suggestions = sorted(set(found.values())) or sorted(present)[:12]
            raise ValueError(f"leaf_modules: {', '.join(unknown)} is not a module class of this model; its "
                             f"{'expert blocks are' if found else 'classes include'} {', '.join(suggestions)}")
        classes, why = list(requested), "leaf_modules"
    if not classes:
        return None if requested is None else "ZeRO-3 leaf modules: none (leaf_modules: [])"
    zero["leaf_module"] = {"classes": classes}
    counts = Counter(type(m).__name__ for m in model.modules())
    listed = ", ".join(f"{name} x{counts[name]}" for name in classes)
    return f"ZeRO-3 leaf modules ({why}; each gathered whole when entered): {listed}"
