"""The data audit: what a split's examples will train on, counted from the examples `lisaft train`
builds (lisaft/data/examples.py hands each split here after data.max_seq_len cut it), and the
checks both `lisaft data` and `lisaft train` make before step 1.

Counted per kind of sequence (a format's examples; a preference pair's chosen and rejected):
lengths in tokens as tokenized (before the cut), how many were cut, how many have no loss token
left, the positions and loss tokens they train on, how many learn to stop (EOS, or another special
token such as a chat template's turn end, carries loss) and how many targets are the tokenizer's
unknown token. A label at position 0 is never a target (nothing precedes it), so it is never
counted as carrying loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lisaft.console import warn
from lisaft.data.formats.base import IGNORE_INDEX, DataFormat, DataWarning, Example, Fit, numbers
from lisaft.data.read import Rows
from lisaft.errors import LisaftError

# Above this share of loss tokens that are the unknown token, training warns: a tokenizer that
# covers the data maps next to none of its characters to it, and the model learns to write it.
UNK_WARN_SHARE = 0.001


def nearest_rank(sorted_values: list[int], q: int) -> int:
    """The q-th percentile by nearest rank: the smallest value at least q% of them do not exceed."""
    return sorted_values[max(0, -(-q * len(sorted_values) // 100) - 1)]


@dataclass
class Sequences:
    """One kind of sequence of a split (every example, or the chosen or rejected answers)."""

    count: int                     # sequences tokenized (one per row)
    p50: int                       # lengths in tokens before data.max_seq_len, by nearest rank
    p95: int
    max: int
    truncated: int                 # longer than data.max_seq_len, cut at the end
    no_loss: int                   # no loss token left after the cut: dropped, they train nothing
    tokens: int                    # positions of the sequences that train, after the cut
    loss_tokens: int               # their targets that carry loss
    stop_examples: int             # sequences that train in which EOS or a turn-end token carries loss
    stop_tokens: int               # loss tokens that are EOS or a turn-end token
    unk_tokens: int | None         # loss tokens that are the unknown token; None: the tokenizer has none
    unk_rows: list[int] = field(default_factory=list)  # indices of the rows that hold one

    def as_json(self) -> dict:
        trains = self.count - self.no_loss
        return {
            "count": self.count, "tokens_p50": self.p50, "tokens_p95": self.p95, "tokens_max": self.max,
            "truncated": self.truncated, "truncated_share": _share(self.truncated, self.count),
            "no_loss": self.no_loss, "trained_tokens": self.tokens, "loss_tokens": self.loss_tokens,
            "loss_share": _share(self.loss_tokens, self.tokens), "stop_examples": self.stop_examples,
            "stop_tokens": self.stop_tokens, "stop_share": _share(self.stop_examples, trains),
            "unk_tokens": self.unk_tokens,
            "unk_share": None if self.unk_tokens is None else _share(self.unk_tokens, self.loss_tokens),
        }


@dataclass
class SplitAudit:
    """A split's counts: `sequences` by kind ("examples", or "chosen" and "rejected")."""

    key: str
    source: str
    rows: int
    sequences: dict[str, Sequences]
    truncated: int                 # rows cut (a pair: either answer)
    dropped: list[int]             # indices of rows dropped for having no loss token left
    same_answers: list[int]        # pairs whose two answers are the same tokens once cut: no signal
    numbers: list[int]             # each row's line (or row) number in its file
    desirable: int | None = None   # unpaired feedback: rows labelled desirable (None: rows carry no label)

    def as_json(self) -> dict:
        return {"key": self.key, "source": self.source, "rows": self.rows, "truncated": self.truncated,
                "truncated_share": _share(self.truncated, self.rows), "dropped": len(self.dropped),
                "dropped_rows": [self.numbers[i] for i in self.dropped],
                "same_answers": len(self.same_answers), "desirable": self.desirable,
                "sequences": {k: s.as_json() for k, s in self.sequences.items()}}


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def stop_ids(tokenizer) -> set[int]:
    """Tokens whose loss teaches the model to stop: EOS and the other special tokens (a chat
    template's turn end), as lisaft/data/formats/chat.py decides whether a template closes a
    turn; not BOS, the unknown token, or a padding token other than EOS."""
    ids = set(tokenizer.all_special_ids)
    ids -= {tokenizer.bos_token_id, tokenizer.unk_token_id}
    if tokenizer.pad_token_id != tokenizer.eos_token_id:
        ids.discard(tokenizer.pad_token_id)
    ids.discard(None)
    return ids


def _sequences(raw: list[Example], cut: list[Example], dropped: set[int], stops: set[int],
               unk: int | None) -> Sequences:
    lengths = sorted(len(ex["input_ids"]) for ex in raw)
    truncated = sum(len(c["input_ids"]) < len(r["input_ids"]) for r, c in zip(raw, cut))
    tokens = loss = stopping = stop_count = unk_count = 0
    unk_rows = []
    for i, ex in enumerate(cut):
        if i in dropped:
            continue
        # Targets are labels[1:]; list.count keeps this at C speed on large sets.
        targets = ex["labels"][1:]
        tokens += len(ex["input_ids"])
        loss += len(targets) - targets.count(IGNORE_INDEX)
        stops_here = sum(targets.count(s) for s in stops)
        stop_count += stops_here
        stopping += stops_here > 0
        if unk is not None and (n := targets.count(unk)):
            unk_count += n
            unk_rows.append(i)
    return Sequences(len(raw), nearest_rank(lengths, 50), nearest_rank(lengths, 95), lengths[-1], truncated,
                     len(dropped), tokens, loss, stopping, stop_count, None if unk is None else unk_count, unk_rows)


def audit_split(fmt: DataFormat, rows: Rows, examples: list[Example], fit: Fit, tokenizer) -> SplitAudit:
    """The counts of one split, from its examples as tokenized and as data.max_seq_len left them."""
    stops, unk = stop_ids(tokenizer), tokenizer.unk_token_id
    dropped = set(fit.dropped)
    if fmt.sequences_per_example == 1:
        sequences = {"examples": _sequences(examples, fit.cut, dropped, stops, unk)}
        same: list[int] = []
    else:
        sequences = {k: _sequences([p[k] for p in examples], [p[k] for p in fit.cut], dropped, stops, unk)
                     for k in ("chosen", "rejected")}
        same = [i for i, p in enumerate(fit.cut) if p["chosen"]["input_ids"] == p["rejected"]["input_ids"]]
    labelled = [ex["desirable"] for ex in fit.kept if "desirable" in ex]
    return SplitAudit(rows.key, str(rows.source), len(examples), sequences, len(fit.truncated),
                      list(fit.dropped), same, list(rows.numbers), sum(labelled) if labelled else None)


def check_split(audit: SplitAudit, rows: Rows, tokenizer) -> None:
    """Refuse a split that would train on nothing, warn of one that trains on something wrong."""
    where = f"{audit.key}: {audit.source}"
    if audit.same_answers and len(audit.same_answers) == audit.rows:
        raise LisaftError(f"{where}: nothing to train on: every pair's chosen and rejected answers are the same "
                          "tokens once cut to data.max_seq_len; raise data.max_seq_len")
    if audit.same_answers:
        warn(f"{where}: {len(audit.same_answers)} of {audit.rows} pairs have the same chosen and rejected tokens "
             f"once cut to data.max_seq_len and teach nothing ({numbers(rows, audit.same_answers)})", DataWarning)
    seqs = list(audit.sequences.values())
    loss = sum(s.loss_tokens for s in seqs)
    if not loss:  # data.format prompts: what trains are the completions sampled from them
        return
    unk = sum(s.unk_tokens or 0 for s in seqs)
    if unk and unk == loss - sum(s.stop_tokens for s in seqs):
        raise LisaftError(f"{where}: nothing to train on: every loss token but EOS and turn ends is the "
                          f"tokenizer's unknown token {tokenizer.unk_token}; the tokenizer does not cover this data")
    if unk > UNK_WARN_SHARE * loss:
        at = sorted({i for s in seqs for i in s.unk_rows})
        warn(f"{where}: {unk:,} of {loss:,} loss tokens ({unk / loss:.1%}) are the tokenizer's unknown token "
             f"{tokenizer.unk_token}, so the model learns to write it ({numbers(rows, at)}); use a tokenizer "
             "that covers the data", DataWarning)
    if not any(s.stop_examples for s in seqs):
        warn(f"{where}: in no example does EOS or a turn-end token carry loss, so the model does not learn "
             "to stop (every one cut by data.max_seq_len, or a template that ends turns with text)", DataWarning)


def marked(example: Example, tokenizer, start: int = 0) -> list[tuple[str, bool]]:
    """The example's text from position `start` on, in runs of tokens that carry loss or not,
    decoded as the tokenizer reads them (special tokens shown)."""
    ids, labels = example["input_ids"], example["labels"]
    runs: list[tuple[list[int], bool]] = []
    for j in range(start, len(ids)):
        t, loss = ids[j], j > 0 and labels[j] != IGNORE_INDEX
        if runs and runs[-1][1] == loss:
            runs[-1][0].append(t)
        else:
            runs.append(([t], loss))
    return [(tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False), loss)
            for run, loss in runs]
