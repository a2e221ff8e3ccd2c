"""Write the quickstart's tokenizer, model config and data into recipes/quickstart/.

    python scripts/make_quickstart_assets.py [--out recipes/quickstart]

The output is a pure function of this script (fixed seed, no downloads), so the shipped files
can be regenerated and diffed. What it makes:

- tokenizer/: character-level over printable ASCII and newline, plus single tokens for the
  instruction template's headers, the task names and the chat roles, so prompts stay short.
  BOS is prepended on encode; a small chat template ends every assistant turn with EOS.
- config.json: a small Llama (random init; the quickstart trains it from scratch).
- train.jsonl / eval.jsonl: string transforms of short letter strings in the instruction
  format. Eval inputs never occur in train, so eval accuracy measures the rule, not recall.

The same row maker serves other task families: `task_rows(FAMILIES["B"], ...)` makes the new
tasks of the learning benchmark (benchmarks/learning_bench.py), which fine-tunes a model that
learned family A (the quickstart's tasks) on them. Family B's task names are not single tokens
in the tokenizer: they are spelled character by character, which adding tokens here would
change (and with it the shipped tokenizer).
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

from lisaft.data.formats.instruction import INPUT_HEADER, INSTRUCTION_HEADER, RESPONSE_HEADER

SEED = 1234
N_TRAIN = 4000
N_EVAL = 200
LETTERS = "abcdefghij"  # ten letters: enough variety, few enough for a tiny model to master
MIN_LEN, MAX_LEN = 3, 6

TASKS = {
    "Reverse": lambda s: s[::-1],
    "Uppercase": str.upper,
    "Sort": lambda s: "".join(sorted(s)),
}
# New tasks over the same letters: per-letter maps and moves unlike any of family A's.
NEW_TASKS = {
    "Shift": lambda s: "".join(chr(ord(c) + 1) for c in s),  # a -> b, ..., j -> k
    "Rotate": lambda s: s[1:] + s[:1],
    "Double": lambda s: "".join(c + c for c in s),
}
FAMILIES = {"A": TASKS, "B": NEW_TASKS}

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
ROLES = ["<|system|>\n", "<|user|>\n", "<|assistant|>\n"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]  # printable ASCII, \t, \n
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Every character is its own word; Fuse joins them back without inserting spaces.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    core.add_special_tokens([AddedToken(t, normalized=False) for t in SPECIALS])
    words = [INSTRUCTION_HEADER, INPUT_HEADER, RESPONSE_HEADER, *TASKS, *ROLES]
    core.add_tokens([AddedToken(w, normalized=False, single_word=False) for w in words])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        model_max_length=256,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def llama_config(vocab_size: int) -> dict:
    # Written by hand rather than via LlamaConfig.to_json_file so the file holds only what
    # matters and reads the same under transformers 4.x and 5.x.
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def save_tokenizer(tok, folder: Path) -> None:
    tok.save_pretrained(str(folder))
    # transformers 5 names its own backend class and keeps the template in a side file; the
    # generic class name and an inline template load under 4.x as well.
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def task_rows(tasks: dict, rng: random.Random, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """Train and eval rows cycling through `tasks`, in the instruction format."""
    # Distinct inputs first, then split: no eval input (under any task) appears in train.
    seen, inputs = set(), []
    while len(inputs) < n_train + n_eval:
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
        if s not in seen:
            seen.add(s)
            inputs.append(s)
    names = list(tasks)
    rows = []
    for k, s in enumerate(inputs):
        name = names[k % len(names)]
        rows.append({"instruction": name, "input": s, "output": tasks[name](s)})
    return rows[:n_train], rows[n_train:]


def make_rows(rng: random.Random) -> tuple[list[dict], list[dict]]:
    return task_rows(TASKS, rng, N_TRAIN, N_EVAL)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "recipes" / "quickstart")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    save_tokenizer(tok, out / "tokenizer")
    (out / "config.json").write_text(json.dumps(llama_config(len(tok)), indent=2) + "\n")

    train, evals = make_rows(random.Random(SEED))
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", evals)
    print(f"wrote {out}: vocab {len(tok)}, {len(train)} train rows, {len(evals)} eval rows")


if __name__ == "__main__":
    main()
