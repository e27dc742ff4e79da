# Sourced by the GPU scripts whose runs offload to NVMe: DeepSpeed's async_io op JIT-builds against libaio
# (op_builder/async_io.py links a test program with -laio), which the GPU box lacks. .whl/libaio/ holds Debian
# bookworm's libaio1 + libaio-dev unpacked (dpkg-deb -x); this copies the library and header to /tmp/hfz-libaio and
# points the compiler, linker and loader at them. Without .whl/libaio it does nothing (the NVMe runs then say why).
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
