"""Real English text for `hf-zero3 compare` on GPUs: the Python 3.11 documentation, as Debian ships it.

Why this corpus: no network beyond package registries on the machines here, and the synthetic tiny corpus does
not count as real text (issue 17). Debian's `python3.11-doc` ships the reStructuredText sources of the whole
Python documentation (`html/_sources/**/*.rst.txt`): ~500 documents of English prose (tutorial, library
reference, HOWTOs, FAQs), ~9 MB of text. Markup lines (directives, underlines, code blocks) are dropped; each
document becomes one JSON line `{"text": ...}`, paragraphs joined by newlines.

Held out: every 20th document (sorted by path) goes to `validation.jsonl`, the rest to `train.jsonl`.
Tokenizer: a byte-level BPE (vocab 32,000) trained on `train.jsonl` only, the way assets/tiny/build_assets.py
trains the tiny one (nothing can be downloaded). Deterministic: the same .deb gives byte-identical outputs.

    apt-get download python3.11-doc          # Debian bookworm: python3.11-doc_3.11.2-6+deb12u9_all.deb
    python scripts/prepare_python_docs_corpus.py python3.11-doc_3.11.2-6+deb12u9_all.deb /work/main/.gpuwork/corpus
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 32_000
HELD_OUT_EVERY = 20
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+.:_])\1{2,}\s*$")
_ROLE = re.compile(r":[a-z:]+:`(?:[^`<]*<)?([^`>]+)>?`")


def paragraphs(rst: str) -> list[str]:
    """Prose paragraphs of one reST document: no directives, comments, tables, code or heading underlines."""
    kept = []
    for block in re.split(r"\n\s*\n", rst):
        lines = [line for line in block.splitlines() if not _UNDERLINE.match(line)]
        if not lines or lines[0].startswith((" ", "\t", "..", "+", "|", ">>>")):
            continue  # indented (code, directive bodies), directives/comments, tables, doctests
        text = " ".join(line.strip() for line in lines)
        text = _ROLE.sub(r"\1", text).replace("``", "").replace("**", "").replace("::", ":")
        if len(text.split()) >= 5:
            kept.append(text)
    return kept


def build_tokenizer(train_path: Path, vocab_size: int):
    """Byte-level BPE like the tiny recipe's (deterministic: no subword prefix/suffix)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(train_path)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


def main(deb: str, out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    version = subprocess.run(["dpkg-deb", "-W", "--showformat=${Package} ${Version}", deb], check=True,
                             capture_output=True, text=True).stdout.split()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", deb, tmp], check=True)
        sources = sorted(Path(tmp).glob("usr/share/doc/python3.*/html/_sources/**/*.rst.txt"))
        if not sources:
            sys.exit(f"error: {deb} holds no html/_sources/**/*.rst.txt: pass the python3.X-doc .deb")
        docs = [text for p in sources if (text := "\n".join(paragraphs(p.read_text(errors="replace"))))]
    splits = {"train": [], "validation": []}
    for index, text in enumerate(docs):
        splits["validation" if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train"].append(text)
    for name, texts in splits.items():
        with (out_dir / f"{name}.jsonl").open("w") as f:
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n")
    with tempfile.TemporaryDirectory() as tmp:  # the tokenizer learns from the plain text, not the JSON around it
        (Path(tmp) / "train.txt").write_text("\n".join(splits["train"]) + "\n")
        tokenizer = build_tokenizer(Path(tmp) / "train.txt", VOCAB_SIZE)
    tokenizer.save_pretrained(out_dir / "tokenizer")
    manifest = {"package": version[0], "version": version[1],
                "deb_sha256": hashlib.sha256(Path(deb).read_bytes()).hexdigest(),
                "sources": "usr/share/doc/python3.*/html/_sources/**/*.rst.txt",
                "documents": {k: len(v) for k, v in splits.items()},
                "bytes": {k: sum(len(t) for t in v) for k, v in splits.items()},
                "tokens": {k: sum(len(ids) for ids in tokenizer(v)["input_ids"]) for k, v in splits.items()},
                "vocab_size": len(tokenizer), "held_out": f"every {HELD_OUT_EVERY}th document by sorted path",
                "command": f"python scripts/prepare_python_docs_corpus.py {Path(deb).name} {out}"}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
