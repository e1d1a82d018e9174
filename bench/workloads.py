"""The benchmark workloads shared by throughput.py and serving.py: prompts plus forced output lengths.

- `chat`: 64 chat conversations (one user turn each) with output lengths cycling 16/32/64/128, i.e.
  3,840 output tokens for 64 requests. The model's chat template is applied by whoever runs them.
- `random`: random token-id prompts of 100-1,000 tokens and outputs of 100-500 tokens from a fixed
  seed (the shape of vLLM's "random" dataset), 256 requests unless told otherwise.

Every request runs greedy with `ignore_eos`, so each peer computes exactly the same number of tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

CHAT_OUTPUT_LENGTHS = (16, 32, 64, 128)

_TOPICS = (
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "the immune system",
    "machine learning",
    "the water cycle",
    "plate tectonics",
    "the Roman Empire",
    "renewable energy",
    "the human heart",
    "volcanoes",
    "the stock market",
    "honey bees",
    "the printing press",
    "climate change",
    "the Moon landing",
)
_QUESTIONS = (
    "Explain {} in simple terms.",
    "What are the most important facts about {}?",
    "Write a short paragraph for a school report on {}.",
    "Why should a curious teenager learn about {}? Give reasons.",
)


@dataclass(frozen=True)
class BenchRequest:
    """One request: a chat conversation or raw prompt token ids, and its forced output length."""

    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) pairs; empty for token-id prompts
    prompt_token_ids: tuple[int, ...] = ()
    lora_name: str = ""  # the LoRA adapter it runs through ("" for the base model)

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def chat_workload(num_requests: int = 64) -> list[BenchRequest]:
    """Request i asks about topic i % 16 in question form i // 16 (cycling), for 16/32/64/128 tokens."""
    requests = []
    for i in range(num_requests):
        question = _QUESTIONS[(i // len(_TOPICS)) % len(_QUESTIONS)].format(_TOPICS[i % len(_TOPICS)])
        max_tokens = CHAT_OUTPUT_LENGTHS[i % len(CHAT_OUTPUT_LENGTHS)]
        requests.append(BenchRequest(max_tokens, messages=(("user", question),)))
    return requests


def random_workload(
    num_requests: int = 256,
    vocab_size: int = 49152,
    seed: int = 0,
    prompt_lens: tuple[int, int] = (100, 1000),
    output_lens: tuple[int, int] = (100, 500),
) -> list[BenchRequest]:
    """Uniform prompt and output lengths (inclusive ranges); token ids avoid the low special ids."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_lens)
        prompt = tuple(rng.randrange(100, vocab_size) for _ in range(prompt_len))
        requests.append(BenchRequest(rng.randint(*output_lens), prompt_token_ids=prompt))
    return requests


def through_adapters(requests: list[BenchRequest], names: list[str]) -> list[BenchRequest]:
    """Request i through adapter i % (len(names) + 1), the last of those slots the base model."""
    cycle = [*names, ""]
    return [replace(r, lora_name=cycle[i % len(cycle)]) for i, r in enumerate(requests)]


def build_workload(name: str, num_requests: int | None, seed: int = 0) -> list[BenchRequest]:
    if name == "chat":
        return chat_workload(64 if num_requests is None else num_requests)
    if name == "random":
        return random_workload(256 if num_requests is None else num_requests, seed=seed)
    raise ValueError(f"unknown workload {name!r} (chat or random)")


def encode_chat(tokenizer: object, messages: list[dict[str, str]]) -> list[int]:
    """The chat template applied exactly as pagedserve's engine applies it (generation prompt added)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)  # type: ignore[attr-defined]
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # recent transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def prompt_token_ids(tokenizer: object, requests: list[BenchRequest]) -> list[list[int]]:
    return [
        encode_chat(tokenizer, r.chat_messages()) if r.is_chat else list(r.prompt_token_ids) for r in requests
    ]
