# Sourced by every benchmarks/gpu_*.sh, from the repository root: the GPU box's set-up and the helpers they share.
#   - .whl/install.sh, when the checkout carries one (wheels for a GPU box without network; skipped with CHECK_ONLY=1)
#   - TORCH_CUDA_ARCH_LIST: DeepSpeed's JIT op builder cannot parse the "9.0a" some CUDA images set, so 9.0
#   - libaio for DeepSpeed's async_io op (NVMe offload) from .whl/libaio (Debian's libaio1 + libaio-dev unpacked with
#     dpkg-deb -x) when the box lacks it: copied to /tmp/hfz-libaio, compiler, linker and loader pointed at it
#   - scratch_dir DIR: an empty DIR of the script's own
#   - llama3_8b_config: outputs/llama3-8b, the Llama-3-8B shape as a config folder (random weights, no download),
#     written once, so every 8B benchmark measures the same model
if [ -z "${CHECK_ONLY:-}" ] && [ -f .whl/install.sh ]; then source .whl/install.sh || return 1; fi
if [ -n "${TORCH_CUDA_ARCH_LIST:-}" ]; then export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST//9.0a/9.0}"; fi

if [ -d .whl/libaio ]; then
  HFZ_AIO=/tmp/hfz-libaio
  mkdir -p "$HFZ_AIO/lib" "$HFZ_AIO/include"
  cp .whl/libaio/usr/include/libaio.h "$HFZ_AIO/include/" 2>/dev/null
  hfz_so=$(ls .whl/libaio/usr/lib/x86_64-linux-gnu/libaio.so.1.* 2>/dev/null | head -1)
  if [ -n "$hfz_so" ]; then
    cp -L "$hfz_so" "$HFZ_AIO/lib/" && ln -sf "$(basename "$hfz_so")" "$HFZ_AIO/lib/libaio.so.1" \
      && ln -sf "$(basename "$hfz_so")" "$HFZ_AIO/lib/libaio.so"
  fi
  export CFLAGS="-I$HFZ_AIO/include ${CFLAGS:-}" LDFLAGS="-L$HFZ_AIO/lib ${LDFLAGS:-}"
  export CPATH="$HFZ_AIO/include${CPATH:+:$CPATH}" LIBRARY_PATH="$HFZ_AIO/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$HFZ_AIO/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# An empty DIR of the script's own. DIR is emptied only when an hf-zero3 tool made it (the owner file DIR.owner beside
# it, the convention of hf_zero3/checkpoint/export.py) or when it is empty; someone's folder of that name stops the
# script, untouched.
scratch_dir() {
  local dir=${1%/}
  if [ -e "$dir" ] || [ -L "$dir" ]; then
    if [ -d "$dir" ] && [ ! -L "$dir" ] && [ -z "$(ls -A "$dir")" ]; then
      rmdir "$dir"
    elif [ -f "$dir.owner" ]; then
      rm -rf "$dir"
    else
      echo "error: $dir exists and was not made by an hf-zero3 script (no $(basename "$dir").owner beside it):" \
           "move it away or point the script at another folder; nothing was deleted" >&2
      return 2
    fi
  fi
  mkdir -p "$dir" && echo "hf-zero3 scratch folder: safe to delete together with the folder of the same name" > "$dir.owner"
}

llama3_8b_config() {
  [ -f outputs/llama3-8b/config.json ] || python3 - <<'PY'
from transformers import LlamaConfig
LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=3).save_pretrained("outputs/llama3-8b")
PY
}
