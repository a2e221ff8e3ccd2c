"""data.format chat: `messages` rendered with the tokenizer's chat template; loss on assistant
turns only.

Roles are system, user and assistant; `data.roles` maps other names onto them (ShareGPT's
human/gpt), and any other role is an error naming the row. A turn's span is found by rendering
the conversation up to the turn with the generation prompt, and up to and including the turn:
the text between the two renders is the turn's content plus whatever the template closes it
with (e.g. an end-of-turn token). The full conversation is tokenized once and a token carries
loss when it starts inside such a span, so token boundaries are never guessed from partial
renders. EOS is appended only when the template closes the last assistant turn with no special
token at all.
"""

from __future__ import annotations

from lisaft.config.schema import CHAT_ROLES
from lisaft.console import first_line
from lisaft.data.formats.base import IGNORE_INDEX, DataFormat, Example, Prompt, Tokens, encode, missing_field
from lisaft.data.read import Rows
from lisaft.errors import LisaftError

# Role names of common chat datasets (ShareGPT, OpenAssistant, Gemini-style exports) and the role
# each means; a name not here gets no guess, since a wrong one would move the loss onto the user.
_KNOWN_ROLES = {
    "human": "user", "prompter": "user", "question": "user", "customer": "user",
    "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant", "chatgpt": "assistant",
    "answer": "assistant", "response": "assistant", "assistant": "assistant", "user": "user",
    "system": "system", "sys": "system", "system_prompt": "system",
}


def _role_hint(name: str) -> str:
    target = _KNOWN_ROLES.get(name.strip().lower())
    if target is not None:
        return f"e.g. {{{name}: {target}}}"
    return f"to the role it plays: {{{name}: user}}, {{{name}: assistant}} or {{{name}: system}}"


def chat_messages(rows: Rows, i: int, roles: dict[str, str], field: str = "messages") -> list[dict]:
    """A row's turns (field `field`) with data.roles applied, or an error naming the row
    (training and `lisaft generate` alike)."""
    messages = rows.rows[i].get(field)
    if messages is None:
        raise missing_field(rows, i, field)
    if not isinstance(messages, list) or not messages:
        raise LisaftError(f"{rows.where(i)}: field {field!r} must be a non-empty list of {{role, content}}")
    clean = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise LisaftError(
                f"{rows.where(i)}: {field}[{j}] must be an object with string 'role' and 'content'"
            )
        role = roles.get(m["role"], m["role"])
        if role not in CHAT_ROLES:
            raise LisaftError(
                f"{rows.where(i)}: {field}[{j}] has role {m['role']!r}, not one of {', '.join(CHAT_ROLES)}; "
                f"map it with data.roles, {_role_hint(m['role'])}")
        clean.append({"role": role, "content": m["content"]})
    return clean


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _assistant_spans(tokenizer, messages: list[dict], where: str, first_turn: int) -> tuple[str, list]:
    """The rendered conversation and the character spans of its assistant turns from `first_turn` on."""
    try:
        full = _render(tokenizer, messages, False)
        spans = []
        for j, m in enumerate(messages):
            if m["role"] != "assistant" or j < first_turn:
                continue
            before = _render(tokenizer, messages[:j], True) if j else ""
            through = _render(tokenizer, messages[: j + 1], False)
            if not (through.startswith(before) and full.startswith(through)):
                raise LisaftError(
                    f"{where}: the chat template renders earlier turns differently once later "
                    "turns follow, so assistant turns cannot be located; use a template that renders "
                    "conversations incrementally"
                )
            spans.append((len(before), len(through)))
    except LisaftError:
        raise
    except Exception as e:  # jinja errors from the template itself (e.g. role order rules)
        raise LisaftError(f"{where}: the chat template rejected this conversation: {first_line(e)}") from None
    return full, spans


def conversation_example(tokenizer, messages: list[dict], rows: Rows, i: int, tokens: Tokens, special: set[int],
                         first_turn: int = 0) -> Example:
    """The conversation's tokens, loss on its assistant turns from `first_turn` on (preference
    pairs score only the answer that follows the prompt's turns)."""
    full, spans = _assistant_spans(tokenizer, messages, rows.where(i), first_turn)
    # The rendered text carries the template's own BOS, so nothing is added while tokenizing.
    if tokenizer.is_fast:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, starts = enc["input_ids"], [s for s, _ in enc["offset_mapping"]]
        labels = [
            t if any(a <= s < b for a, b in spans) else IGNORE_INDEX for t, s in zip(ids, starts)
        ]
    else:
        # No offsets: measure each span in tokens by encoding the text up to its ends.
        ids = encode(tokenizer, full)
        labels = [IGNORE_INDEX] * len(ids)
        for a, b in spans:
            lo = len(encode(tokenizer, full[:a]))
            hi = len(encode(tokenizer, full[:b]))
            labels[lo:hi] = ids[lo:hi]
    if spans and spans[-1][1] == len(full) and not _turn_has_special(ids, labels, special):
        # The conversation ends on an assistant turn the template leaves open: without an EOS to
        # learn, the model would never stop generating.
        eos = tokens.need_eos(rows.key)
        ids = list(ids) + [eos]
        labels = labels + [eos]
    return {"input_ids": list(ids), "labels": labels}


def _turn_has_special(ids: list[int], labels: list[int], special: set[int]) -> bool:
    """Whether the last labelled run of tokens (the final assistant turn) holds a special token,
    i.e. the template already closes the turn with something the model can learn to emit."""
    j = len(labels) - 1
    while j >= 0 and labels[j] == IGNORE_INDEX:
        j -= 1
    while j >= 0 and labels[j] != IGNORE_INDEX:
        if ids[j] in special:
            return True
        j -= 1
    return False


def split_conversations(rows, tokenizer, fmt: str, is_conversation) -> tuple[list[int], list[int]]:
    """The row indices of a format that takes both shapes: (standard, conversational). Conversations
    need the tokenizer's chat template, refused naming the first such row when it has none."""
    talk = [i for i, row in enumerate(rows.rows) if is_conversation(row)]
    if talk:
        need_chat_template(tokenizer, rows.key, f"{fmt} with conversations ({rows.where(talk[0])})")
    spoken = set(talk)
    return [i for i in range(len(rows.rows)) if i not in spoken], talk


def need_chat_template(tokenizer, key: str, fmt: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise LisaftError(f"{key}: data.format is {fmt} but the tokenizer has no chat template; point "
                          "model.tokenizer at one that has (an instruct model's folder: its tokenizer_config.json "
                          "holds chat_template), or write the rows for data.format: instruction")


def chat_prompt_ids(tokenizer, messages: list[dict], where: str) -> list[int]:
    """The conversation so far with the generation prompt, as `lisaft generate` prompts with it."""
    if not getattr(tokenizer, "chat_template", None):
        raise LisaftError(f"{where}: chat prompts need a chat template and the tokenizer has none; "
                          "pass --format instruction or text")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja errors from the template itself (e.g. role order rules)
        raise LisaftError(f"{where}: the chat template rejected this conversation: {first_line(e)}") from None
    # The rendered text carries the template's own BOS, as in training.
    return encode(tokenizer, text)


class Chat(DataFormat):
    name = "chat"
    required = ("messages",)
    fields = "`messages`, a list of {role, content} (loss on assistant turns only)"
    input_note = "--input is ignored for chat prompts (it fills an instruction's input); put the whole " \
                 "user message in --prompt"

    def examples(self, rows: Rows, tokenizer, template: str | None, roles: dict[str, str]) -> list[Example]:
        need_chat_template(tokenizer, rows.key, self.name)
        tokens, special = Tokens(tokenizer), set(tokenizer.all_special_ids)
        return [conversation_example(tokenizer, chat_messages(rows, i, roles), rows, i, tokens, special)
                for i in range(len(rows.rows))]

    def prompt(self, tokenizer, rows: Rows, i: int, template: str | None, roles: dict[str, str]) -> Prompt:
        messages = chat_messages(rows, i, roles)
        reference = messages.pop()["content"] if messages[-1]["role"] == "assistant" else None
        if not messages:
            raise LisaftError(f"{rows.where(i)}: the conversation is a single assistant turn; nothing "
                              "comes before it to prompt with")
        return Prompt(chat_prompt_ids(tokenizer, messages, rows.where(i)), reference, messages[-1]["content"])

    def command_line_row(self, prompt: str, input_text: str | None) -> dict:
        return {"messages": [{"role": "user", "content": prompt}]}
