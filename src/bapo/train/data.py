"""Prompt data: rows {"prompt", "answer", ...} from JSONL/Parquet (through `datasets`) or a list,
tokenized once, served in a seeded, resumable order (epoch-wise shuffle)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from bapo.train.config import ConfigError, DataSection


def load_examples(cfg: DataSection, needs_answer: bool = False) -> list[dict]:
    """The rows of data.path, checked by check_rows (needs_answer: every row carries a reference
    answer). JSONL is read line by line so that a bad line is reported with its 1-based number;
    .json (a list of rows) and .parquet go through `datasets`. Errors are ConfigError, one line,
    with the fix."""
    path = Path(cfg.path)
    where = f"data.path={cfg.path}"
    if path.suffix.lower() == ".jsonl":
        rows, numbers = [], []
        with path.open("rb") as f:
            for number, raw in enumerate(f, 1):
                try:  # a leading byte-order mark (some Windows editors write one) is fine
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as err:
                    raise ConfigError(
                        f"{where} line {number}: not UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1}); "
                        "save the file as UTF-8"
                    ) from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(
                        f"{where} line {number}: not valid JSON ({err.msg} at column {err.colno}); "
                        'each line must be one object like {"prompt": ..., "answer": ...}'
                    ) from None
                rows.append(row)
                numbers.append(number)
    else:
        import datasets

        try:
            kind = "parquet" if path.suffix.lower() == ".parquet" else "json"
            rows = [dict(row) for row in datasets.load_dataset(kind, data_files=str(path), split="train")]
        except Exception as err:  # noqa: BLE001  (datasets wraps parse errors in several types)
            raise ConfigError(
                f"{where}: cannot be read as {path.suffix} ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); a .json file must hold a list of "
                "objects (or use .jsonl, one object per line)"
            ) from None
        numbers = list(range(1, len(rows) + 1))
    if not rows:
        raise ConfigError(
            f"{where}: the file holds no rows; add one object per line, e.g. "
            '{"prompt": "What is 2+3?", "answer": "5"}'
        )
    check_rows(rows, cfg, needs_answer, where, numbers, "line" if path.suffix.lower() == ".jsonl" else "row")
    return rows


def check_rows(
    rows: list, cfg: DataSection, needs_answer: bool, where: str, numbers: list[int] | None = None, unit: str = "row"
) -> None:
    """Every row an object whose prompt is a non-empty string and, when the verifier compares with
    a reference (needs_answer), whose answer is a string or a number. One ConfigError line naming
    the row and the fix; nothing is loaded before this passes."""
    for index, row in enumerate(rows):
        at = f"{where} {unit} {numbers[index] if numbers else index + 1}"
        if not isinstance(row, dict):
            raise ConfigError(f"{at}: a row must be a JSON object, got {type(row).__name__}")
        if cfg.prompt_key not in row:
            raise ConfigError(
                f"{at}: no key {cfg.prompt_key!r} (data.prompt_key); the row has {sorted(row)}: add it, or "
                "set data.prompt_key to the key that holds the prompt"
            )
        prompt = row[cfg.prompt_key]
        if not isinstance(prompt, str) or not prompt.strip():
            got = f"{type(prompt).__name__} {prompt!r}"[:80]
            raise ConfigError(f"{at}: {cfg.prompt_key!r} must be a non-empty string (the prompt text), got {got}")
        if not needs_answer:
            continue
        if cfg.answer_key not in row:
            raise ConfigError(
                f"{at}: no key {cfg.answer_key!r} (data.answer_key), which reward.verifier compares with; the row "
                f"has {sorted(row)}: add it, or set data.answer_key"
            )
        answer = row[cfg.answer_key]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            got = f"{type(answer).__name__} {answer!r}"[:80]
            raise ConfigError(
                f"{at}: {cfg.answer_key!r} must be a string or a number (the reference answer), got {got}"
            )


def format_prompt(text: str, tokenizer, chat_template: bool, system_prompt: str | None) -> str:
    """The prompt text the model sees: one user turn (+ system turn) through the tokenizer's chat
    template, or system_prompt + text. Training and `bapo eval --config` share this."""
    if chat_template:
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": text}
        ]
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return (system_prompt or "") + text


def tokenize_prompts(examples: list[dict], tokenizer, cfg: DataSection) -> tuple[list[dict], list[list[int]], int]:
    """-> (kept examples, their prompt token ids, number dropped for being too long)."""
    texts = [format_prompt(ex[cfg.prompt_key], tokenizer, cfg.chat_template, cfg.system_prompt) for ex in examples]
    ids = tokenizer(texts, add_special_tokens=not cfg.chat_template)["input_ids"]
    kept = [(ex, p) for ex, p in zip(examples, ids) if 0 < len(p) <= cfg.max_prompt_tokens]
    if not kept:
        longest = max(len(p) for p in ids)
        raise ConfigError(
            f"data.max_prompt_tokens={cfg.max_prompt_tokens}: no prompt fits (the longest has "
            f"{longest} tokens); raise data.max_prompt_tokens"
        )
    return [k[0] for k in kept], [k[1] for k in kept], len(examples) - len(kept)


@dataclass
class PromptSampler:
    """Endless prompt indices; reshuffled every epoch. Its state is two ints and an RNG state."""

    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    order: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.order:
            self._new_order()

    def _new_order(self):
        self.order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(self.order)

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._new_order()
            out.append(self.order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._new_order()


def special_token_warnings(tokenizer, generation_config) -> list[str]:
    """Mismatches between the tokenizer's eos/pad and the model's generation_config, each with
    what happens and the fix. (SmolLM2 converted from GGUF has eos_token=<|im_start|> while
    generation stops on id 2, <|im_end|>.)"""
    eos = getattr(generation_config, "eos_token_id", None)
    gen_eos = [eos] if isinstance(eos, int) else list(eos or [])
    messages = []
    if gen_eos and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in gen_eos:
        names = [tokenizer.convert_ids_to_tokens(i) for i in gen_eos]
        messages.append(
            f"tokenizer eos_token={tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) differs from "
            f"generation_config.eos_token_id={eos} ({', '.join(map(str, names))}): generation stops on both, "
            "but padding and templates may use the wrong token; fix the model folder's "
            "tokenizer_config.json (eos_token) or generation_config.json"
        )
    pad = getattr(generation_config, "pad_token_id", None)
    if pad is not None and tokenizer.pad_token_id is not None and tokenizer.pad_token_id != pad:
        messages.append(
            f"tokenizer pad_token_id={tokenizer.pad_token_id} differs from generation_config."
            f"pad_token_id={pad}; padding is masked out either way, but check the model folder"
        )
    return messages


def digit_token_ids(tokenizer) -> list[int]:
    """Ids of the tokens whose text holds a decimal digit ("7", "Ġ12", ...; special tokens
    excluded): the answer tokens of an arithmetic task, for the entropy split by token kind
    (bapo.core.token_kind_sums). One pass over the vocabulary."""
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.get_vocab()
    return sorted(
        token_id
        for token, token_id in vocab.items()
        if token_id not in special and any(char.isdigit() and char.isascii() for char in token)
    )


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """One JSON object per line (the parent folder is made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSONL file (blank lines skipped)."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
