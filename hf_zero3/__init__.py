"""hf_zero3: DeepSpeed ZeRO-3 recipes, config generator and Trainer callbacks for Hugging Face causal LMs."""

__version__ = "0.1.0"
