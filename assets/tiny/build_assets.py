"""Build the tiny recipe's shipped assets: a synthetic corpus, a BPE tokenizer and a tiny Llama config.

Everything is generated here (nothing downloaded) so tests and the tiny recipe run offline, and every
output is deterministic: re-running this script must reproduce the committed files byte for byte.

    python assets/tiny/build_assets.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, MixtralConfig, PreTrainedTokenizerFast, Qwen3MoeConfig

HERE = Path(__file__).resolve().parent
CORPUS_DIR = HERE / "corpus"
CHAT_DIR = HERE / "chat"
MODEL_DIR = HERE / "model"
TRAIN_BYTES = 1_500_000
VALIDATION_BYTES = 100_000
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen \
sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
NAMES = """anna ben clara david emma felix grace henry iris jack kate leo mia noah olive paul rosa sam tom
lucy max nora oscar ruby simon tara victor wendy adam bella carlos daisy ethan fiona george hannah isaac
julia kevin laura martin nina peter quinn rachel steven ursula walter yvonne zoe""".split()
ADJECTIVES = """big small quick slow lazy happy sleepy brave quiet loud old young clever hungry tired gentle
curious friendly tiny huge funny shy proud busy calm angry silly wise""".split()
COLORS = "red blue green yellow brown black white grey orange purple".split()
ANIMALS = {  # animal -> (legs, sound, home): fixed facts the model can learn
    "dog": (4, "woof", "kennel"), "cat": (4, "meow", "house"), "cow": (4, "moo", "barn"),
    "fox": (4, "yip", "den"), "bird": (2, "tweet", "nest"), "duck": (2, "quack", "pond"),
    "owl": (2, "hoot", "tree"), "spider": (8, "nothing", "web"), "fish": (0, "nothing", "river"),
    "horse": (4, "neigh", "stable"), "sheep": (4, "baa", "field"), "frog": (4, "croak", "pond"),
}
MOVES = "jumps over|runs past|looks at|sleeps next to|walks around|plays with|hides behind".split("|")
THINGS = {"apple": "red", "banana": "yellow", "leaf": "green", "sky": "blue", "snow": "white",
          "coal": "black", "carrot": "orange", "grape": "purple", "cloud": "grey", "bark": "brown"}
WEEK = "monday tuesday wednesday thursday friday saturday sunday".split()
PLACES = ["the park", "the market", "school", "the beach", "the library", "the farm", "the river",
          "the museum", "the garden", "the station", "the bakery", "the hospital", "the cinema",
          "the mountains", "the forest", "the harbor", "the zoo"]
JOBS = {  # job -> workplace: fixed facts
    "teacher": "school", "doctor": "hospital", "baker": "bakery", "farmer": "farm", "pilot": "airport",
    "chef": "kitchen", "nurse": "hospital", "librarian": "library", "sailor": "harbor", "painter": "studio",
    "gardener": "garden", "driver": "garage", "singer": "theater", "judge": "court", "banker": "bank",
}
OBJECTS = """umbrella kite bicycle lamp basket ladder hammer blanket bottle candle wallet guitar violin
drum puzzle camera window pillow jacket sweater helmet compass map ticket letter envelope notebook
teapot kettle spoon mirror clock statue painting feather shell pebble rocket robot wagon sandwich
cookie pie cake muffin pancake orange lemon cherry peach pear melon potato tomato onion""".split()
VERBS = "finds|buys|sees|carries|paints|cleans|drops|wants|borrows|repairs|hides|sells".split("|")


def num(n: int) -> str:
    """English words for 0..99."""
    if n < 20:
        return ONES[n]
    tens, ones = divmod(n, 10)
    return TENS[tens] if ones == 0 else f"{TENS[tens]} {ONES[ones]}"


def plural(word: str, n: int) -> str:
    return word if n == 1 else ("sheep" if word == "sheep" else "fish" if word == "fish" else word + "s")


def scene(r: random.Random) -> str:
    a, b = r.sample(sorted(ANIMALS), 2)
    adj, color, move, adj2 = r.choice(ADJECTIVES), r.choice(COLORS), r.choice(MOVES), r.choice(ADJECTIVES)
    return f"the {adj} {color} {a} {move} the {adj2} {b}."


def animal_fact(r: random.Random) -> str:
    a = r.choice(sorted(ANIMALS))
    legs, sound, home = ANIMALS[a]
    return r.choice([
        f"{article(a)} has {num(legs)} legs.",
        f"the {a} says {sound}." if sound != "nothing" else f"the {a} says nothing.",
        f"the {a} lives in the {home}.",
        f"{article(a)} has {num(legs)} legs and lives in the {home}.",
    ])


def color_fact(r: random.Random) -> str:
    thing = r.choice(sorted(THINGS))
    return f"the {thing} is {THINGS[thing]}."


def arithmetic(r: random.Random) -> str:
    op = r.choice(["plus", "minus", "times"])
    if op == "plus":
        a, b = r.randint(0, 20), r.randint(0, 20)
        c = a + b
    elif op == "minus":
        a = r.randint(0, 20)
        b = r.randint(0, a)
        c = a - b
    else:
        a, b = r.randint(0, 9), r.randint(0, 9)
        c = a * b
    return f"{num(a)} {op} {num(b)} is {num(c)}."


def counting(r: random.Random) -> str:
    start = r.randint(0, 80)
    end = min(99, start + r.randint(3, 12))
    step = r.choice([1, 1, 1, 2])
    seq = ", ".join(num(i) for i in range(start, end + 1, step))
    by = "" if step == 1 else " by twos"
    return f"{r.choice(NAMES)} counts{by} from {num(start)}: {seq}."


def days(r: random.Random) -> str:
    i = r.randrange(7)
    return r.choice([
        f"after {WEEK[i]} comes {WEEK[(i + 1) % 7]}.",
        f"before {WEEK[i]} comes {WEEK[i - 1]}.",
        f"on {WEEK[i]} {r.choice(NAMES)} goes to {r.choice(PLACES)}.",
    ])


def story(r: random.Random) -> str:
    """A small exchange whose final counts follow from the first two sentences."""
    x, y = r.sample(NAMES, 2)
    thing = r.choice(["apple", "banana", "carrot", "grape", "book", "ball", "coin", "pencil"])
    have = r.randint(2, 15)
    give = r.randint(1, have)
    return (f"{x} has {num(have)} {plural(thing, have)}. {x} gives {num(give)} to {y}. "
            f"now {x} has {num(have - give)} {plural(thing, have - give)} and {y} has {num(give)} "
            f"{plural(thing, give)}.")


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def errand(r: random.Random) -> str:
    adj, obj = r.choice(ADJECTIVES + COLORS), r.choice(OBJECTS)
    return f"{r.choice(NAMES)} {r.choice(VERBS)} {article(adj)} {obj} at {r.choice(PLACES)}."


def job(r: random.Random) -> str:
    j = r.choice(sorted(JOBS))
    return r.choice([
        f"{r.choice(NAMES)} is {article(j)} and works at the {JOBS[j]}.",
        f"the {j} works at the {JOBS[j]}.",
        f"every {WEEK[r.randrange(5)]} the {j} goes to the {JOBS[j]}.",
    ])


SENTENCES = [(scene, 3), (animal_fact, 3), (color_fact, 2), (arithmetic, 3), (counting, 1), (days, 2),
             (story, 1), (errand, 3), (job, 2)]


def paragraph(r: random.Random) -> str:
    makers, weights = zip(*SENTENCES)
    return " ".join(f(r) for f in r.choices(makers, weights, k=r.randint(3, 8)))


def write_corpus(path: Path, seed: int, n_bytes: int) -> None:
    r = random.Random(seed)
    lines, size = [], 0
    while size < n_bytes:
        line = paragraph(r)
        lines.append(line)
        size += len(line) + 1
    path.write_text("\n".join(lines) + "\n", encoding="ascii", newline="\n")


def build_tokenizer(train_path: Path) -> PreTrainedTokenizerFast:
    """Byte-level BPE. Training is deterministic as long as no continuing_subword_prefix /
    end_of_word_suffix is set (those get hash-order ids: huggingface/tokenizers#1794)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(train_path)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


CHAT_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<assistant>\\n' }}{% generation %}{{ message.content ~ eos_token }}{% endgeneration %}
    {%- elif message.role in ['system', 'user', 'tool'] %}
        {{- '<' ~ message.role ~ '>\\n' ~ message.content ~ '\\n' }}
    {%- else %}
        {{- raise_exception('roles are system, user, assistant and tool, not ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<assistant>\\n' }}
{%- endif %}"""
"""Plain-text role markers (the tokenizer has no chat tokens); the assistant's text and its EOS inside
{% generation %} so `return_assistant_tokens_mask` marks what is trained."""

SYSTEM = "you answer short questions about animals, colors, days, jobs and numbers."


def qa(r: random.Random) -> tuple[str, str]:
    """One question about the corpus's fixed facts, and its answer."""
    kind = r.choice(["legs", "sound", "home", "color", "sum", "day", "job", "story"])
    a = r.choice(sorted(ANIMALS))
    legs, sound, home = ANIMALS[a]
    if kind == "legs":
        return f"how many legs does {article(a)} have?", f"{article(a)} has {num(legs)} legs."
    if kind == "sound":
        return f"what does the {a} say?", f"the {a} says {sound}."
    if kind == "home":
        return f"where does the {a} live?", f"the {a} lives in the {home}."
    if kind == "color":
        thing = r.choice(sorted(THINGS))
        return f"what color is the {thing}?", f"the {thing} is {THINGS[thing]}."
    if kind == "sum":
        fact = arithmetic(r)
        question = fact.split(" is ")[0]
        return f"what is {question}?", fact
    if kind == "day":
        i = r.randrange(7)
        return f"what comes after {WEEK[i]}?", f"after {WEEK[i]} comes {WEEK[(i + 1) % 7]}."
    if kind == "job":
        j = r.choice(sorted(JOBS))
        return f"where does the {j} work?", f"the {j} works at the {JOBS[j]}."
    x, y = r.sample(NAMES, 2)
    thing = r.choice(["apple", "banana", "carrot", "grape", "book", "ball", "coin", "pencil"])
    have = r.randint(2, 15)
    give = r.randint(1, have)
    return (f"{x} has {num(have)} {plural(thing, have)} and gives {num(give)} to {y}. how many does {x} have now?",
            f"{x} has {num(have - give)} {plural(thing, have - give)} now.")


def conversation(r: random.Random) -> list[dict]:
    """A system turn sometimes, one to three questions, and now and then a calculator (tool) turn."""
    messages = [{"role": "system", "content": SYSTEM}] if r.random() < 0.3 else []
    for _ in range(r.randint(1, 3)):
        if r.random() < 0.1:
            fact = arithmetic(r)
            question, answer = fact.split(" is ")
            messages += [{"role": "user", "content": f"what is {question}?"},
                         {"role": "assistant", "content": "i will ask the calculator."},
                         {"role": "tool", "content": answer.rstrip(".")},
                         {"role": "assistant", "content": fact}]
        else:
            question, answer = qa(r)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def write_chat(path: Path, seed: int, n: int) -> None:
    r = random.Random(seed)
    path.write_text("".join(json.dumps({"messages": conversation(r)}) + "\n" for _ in range(n)), encoding="ascii")


def write_instructions(path: Path, seed: int, n: int) -> None:
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        question, answer = qa(r)
        rows.append(json.dumps({"prompt": f"question: {question}\nanswer:", "completion": f" {answer}"}) + "\n")
    path.write_text("".join(rows), encoding="ascii")


def main() -> None:
    CORPUS_DIR.mkdir(parents=True, exist_ok=True)
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    train_path = CORPUS_DIR / "train.txt"
    write_corpus(train_path, seed=1234, n_bytes=TRAIN_BYTES)
    write_corpus(CORPUS_DIR / "validation.txt", seed=5678, n_bytes=VALIDATION_BYTES)

    CHAT_DIR.mkdir(parents=True, exist_ok=True)
    write_chat(CHAT_DIR / "train.jsonl", seed=4321, n=3000)
    write_chat(CHAT_DIR / "validation.jsonl", seed=8765, n=150)
    write_instructions(CHAT_DIR / "instructions.jsonl", seed=2468, n=2000)
    write_instructions(CHAT_DIR / "instructions_validation.jsonl", seed=1357, n=150)

    tokenizer = build_tokenizer(train_path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(MODEL_DIR)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.save_pretrained(MODEL_DIR)
    print(f"wrote {CORPUS_DIR} and {MODEL_DIR} (vocab {len(tokenizer)})")
    write_moe_configs(tokenizer)


def write_moe_configs(tokenizer) -> None:
    """Two tiny mixtures of experts (2 layers, 4 experts, top-2) that use the tiny tokenizer: Mixtral's shape and
    Qwen3-MoE's (per-expert width apart from the dense one), for the MoE tests and docs/experts.md."""
    common = dict(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    MixtralConfig(intermediate_size=176, num_local_experts=4, num_experts_per_tok=2, **common).save_pretrained(
        MODEL_DIR.parent / "mixtral")
    Qwen3MoeConfig(intermediate_size=352, moe_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                   norm_topk_prob=True, **common).save_pretrained(MODEL_DIR.parent / "qwen3-moe")


if __name__ == "__main__":
    main()
