"""`python head_outputs.py [REPEATS]`: CPU time (one thread) of the LM head's forward and backward alone at the tiny
chat run's shape (2,048 positions, hidden 128, vocab 1,024, a fifth of the positions trained), interleaved: the
full logits with cross-entropy, and TRL's chunked kernel with and without its per-step extras (entropy, top-1 for
the token accuracy), over every position and over the trained ones only."""

import statistics as st
import sys
import time

import torch
from trl.kernels import ChunkedLogProbFunction

torch.set_num_threads(1)
torch.manual_seed(0)
N, H, V = 2048, 128, 1024
hidden, weight = torch.randn(N, H), torch.randn(V, H) * 0.05
labels = torch.randint(0, V, (N,))
labels[torch.rand(N) > 0.2] = -100
mask = labels != -100


def full_logits():
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy((h @ w.T).float(), labels, reduction="sum") / mask.sum()
    loss.backward()


def chunked(outputs, trained_only):
    def step():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        rows, targets = (h[mask], labels[mask]) if trained_only else (h, labels.clamp(min=0))
        log_probs = ChunkedLogProbFunction.apply(rows, w, None, targets, 1.0, 32768, None, 1.0, outputs)[0]
        log_probs = log_probs if trained_only else log_probs.masked_fill(~mask, 0)
        (-log_probs.sum() / mask.sum()).backward()
    return step


EXTRAS = ("log_probs", "entropy", "is_top1")
cases = {"full logits + cross-entropy (78a2bc5)": full_logits,
         "TRL, every position, with extras (TRL on CPU)": chunked(EXTRAS, False),
         "TRL, every position, log_probs only": chunked(("log_probs",), False),
         "TRL, trained positions, with extras (this change)": chunked(EXTRAS, True),
         "TRL, trained positions, log_probs only": chunked(("log_probs",), True)}
times = {name: [] for name in cases}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 30):
    for name, step in cases.items():
        start = time.process_time()
        step()
        times[name].append(time.process_time() - start)
for name, t in times.items():
    print(f"{name:50s} {st.median(t) * 1e3:5.1f} ms")
