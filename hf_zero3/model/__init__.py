"""Model preparation: what a run puts on or into the model it trains (adapter, leaf modules, checkpointed layers,
FP8, regional compile, activation offload, tiles, ZeRO-3's linear), applied in one order by `prepare.py`."""
