# Sourced by the 8B GPU scripts: the Llama-3-8B shape as a config folder (random weights, no download) in
# outputs/llama3-8b, written once. One place, so every 8B benchmark measures the same model.
[ -f outputs/llama3-8b/config.json ] || python3 - <<'PY'
from transformers import LlamaConfig
LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=3).save_pretrained("outputs/llama3-8b")
PY
