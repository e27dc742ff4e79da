"""Activation offload on a real ZeRO-3 engine, one mode per process (run by gpu_activation_offload.sh).

One process (all ranks) builds the model once the way `hf-zero3 train` does (zero.Init through HfDeepSpeedConfig,
bf16, sdpa, Liger, non-reentrant gradient checkpointing), with `hf_zero3.model.activation_offload.enable` or without,
and then:
  1. measures each `--seqs` length for `--steps` optimizer steps (micro batch 1, random tokens): per step the time;
     what the decoder leaves allocated on the GPU when its forward ends (its saved activations: what offload
     moves), what is allocated when the whole forward ends (plus the lm_head and Liger's loss, kept on the GPU);
     the forward+backward peak above what is allocated before the forward (the activation-driven part: the step's
     fp32 gradients come after it); the overall peak, pinned host memory and the bytes the hooks moved;
  2. with `--search`, caps this process's GPU memory at the states it holds between steps + `--cap-above-rest-gib`
     (room for the step's fp32 gradients and ~20 GiB of activations, so the search ends within a short device call), and
     tries each length for one step until the first out-of-memory error, which ends the process (a rank that
     catches it cannot leave ZeRO-3's collectives cleanly; the launcher stops the others).
Each rank appends one JSON line per measurement to OUT/<mode>_rank<R>.jsonl as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

GiB = 1024**3


def _fill_auto(config: dict, hidden: int, world: int, bf16: bool) -> dict:
    """The values transformers' bridge would put in place of "auto" (micro batch 1, no accumulation)."""
    zero = config["zero_optimization"]
    for key, value in (("reduce_bucket_size", hidden * hidden), ("stage3_prefetch_bucket_size", int(0.9 * hidden ** 2)),
                       ("stage3_param_persistence_threshold", 10 * hidden)):
        if zero.get(key) == "auto":
            zero[key] = value
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world,
                  gradient_clipping=1.0, zero_allow_untested_optimizer=True)
    config.pop("fp16", None)
    config["bf16"] = {"enabled": bf16}
    return config


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="model config folder")
    parser.add_argument("--ds-config", default="recipes/8b/ds_config.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--seqs", default="4096,16384")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--search", default="", help="lengths to try, ascending, e.g. 24576,32768,49152")
    parser.add_argument("--cap-above-rest-gib", type=float, default=0.0,
                        help="search under a GPU cap of what is allocated between steps (the states) + this (0: none)")
    parser.add_argument("--search-budget-s", type=float, default=120.0)
    parser.add_argument("--no-liger", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from hf_zero3.model import activation_offload

    cuda = torch.cuda.is_available()  # CPU: a plumbing check of this script with a tiny model (gloo)
    deepspeed.init_distributed(dist_backend=None if cuda else "gloo")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    peak = torch.cuda.max_memory_allocated if cuda else (lambda: 0)
    mode = "offload" if args.offload else "checkpointing"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{mode}_rank{rank}.jsonl"

    def record(**fields):
        fields = {"mode": mode, "rank": rank, "world": world, "time": time.time(), **fields}
        with log.open("a") as f:
            f.write(json.dumps(fields) + "\n")
        if rank == 0:
            print("bench:", json.dumps(fields), flush=True)

    started = time.time()
    model_config = AutoConfig.from_pretrained(args.config)
    model_config.use_cache = False
    ds_config = _fill_auto(json.loads(Path(args.ds_config).read_text()), model_config.hidden_size, world, cuda)
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 -- zero.Init while the weights are made, as the Trainer does
    model = AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16 if cuda else torch.float32,
                                             attn_implementation="sdpa")
    if not args.no_liger and cuda:
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, None)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    offloader = activation_offload.enable(model) if args.offload else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    record(event="ready", seconds=round(time.time() - started, 1), liger=cuda and not args.no_liger,
           params=sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()))
    vocab = model_config.vocab_size
    held = {}
    decoder = activation_offload.decoder_of(model)

    def mark(name):  # memory allocated at the decoder's entry and exit (all streams done: offload copies included)
        def hook(*_):
            sync()
            held[name] = allocated()
        return hook

    decoder.register_forward_pre_hook(mark("in"))
    decoder.register_forward_hook(mark("out"))

    def one_step(seq: int) -> dict:
        ids = torch.randint(0, vocab, (1, seq), device=device)
        sync()
        before = allocated()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        sync()
        after_forward = allocated() - before
        engine.backward(loss)
        sync()
        fwd_bwd_peak = peak() - before
        engine.step()
        sync()
        seconds = time.perf_counter() - t0
        try:
            pinned = torch.cuda.host_memory_stats()["allocated_bytes.current"]
        except (KeyError, RuntimeError, AttributeError):
            pinned = -1
        return {"seconds": seconds, "fwd_bwd_above_rest_gib": fwd_bwd_peak / GiB,
                "decoder_held_gib": (held["out"] - held["in"]) / GiB, "held_after_forward_gib": after_forward / GiB, "rest_gib": before / GiB,
                "peak_allocated_gib": peak() / GiB,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB if cuda else 0.0, "pinned_host_gib": pinned / GiB,
                "offloaded_gib": offloader.stats.bytes / GiB if offloader else 0.0,
                "host_peak_gib": offloader.stats.peak_host_bytes / GiB if offloader else 0.0,
                "loss": float(loss)}

    def release_pinned():  # the host caching allocator keeps each length's blocks; the next length needs others
        if cuda and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()

    for seq in [int(s) for s in args.seqs.split(",") if s]:
        release_pinned()
        steps = [one_step(seq) for _ in range(args.steps)]
        timed = steps[2:] or steps  # the first steps allocate (pinned buffers, the allocator's cache)
        median = statistics.median(s["seconds"] for s in timed)
        record(event="measure", seq=seq, steps=len(steps), step_time_s=round(median, 4),
               tokens_per_s_per_gpu=round(seq / median, 1),
               fwd_bwd_above_rest_gib=round(max(s["fwd_bwd_above_rest_gib"] for s in steps), 3),
               decoder_held_gib=round(steps[-1]["decoder_held_gib"], 3),
               held_after_forward_gib=round(steps[-1]["held_after_forward_gib"], 3),
               rest_gib=round(steps[-1]["rest_gib"], 3),
               peak_allocated_gib=round(max(s["peak_allocated_gib"] for s in steps), 3),
               peak_reserved_gib=round(max(s["peak_reserved_gib"] for s in steps), 3),
               pinned_host_gib=round(steps[-1]["pinned_host_gib"], 3), offloaded_gib=round(steps[-1]["offloaded_gib"], 3),
               host_peak_gib=round(steps[-1]["host_peak_gib"], 3), losses=[round(s["loss"], 4) for s in steps])
    search = [int(s) for s in args.search.split(",") if s]
    if search:
        cap_gib = 0.0
        if args.cap_above_rest_gib and cuda:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.empty_cache()
            cap_gib = torch.cuda.memory_allocated() / GiB + args.cap_above_rest_gib
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GiB / total))
        begun, last = time.time(), None
        for seq in search:
            if last is not None:  # the next attempt's expected time, attention being quadratic
                guess = last[1] * (seq / last[0]) ** 1.5
                if time.time() - begun + guess > args.search_budget_s:
                    record(event="search_stopped", seq=seq, cap_gib=round(cap_gib, 2), reason=f"budget {args.search_budget_s} s")
                    break
            release_pinned()
            record(event="attempt", seq=seq, cap_gib=round(cap_gib, 2))
            try:
                result = one_step(seq)
            except torch.OutOfMemoryError as e:
                record(event="oom", seq=seq, cap_gib=round(cap_gib, 2), error=str(e).splitlines()[0][:300])
                sys.stdout.flush()
                os._exit(3)  # the other ranks may be inside a collective: the launcher stops them
            last = (seq, result["seconds"])
            record(event="fits", seq=seq, cap_gib=round(cap_gib, 2), **{k: round(v, 3) for k, v in result.items()})
    record(event="done", seconds=round(time.time() - started, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
