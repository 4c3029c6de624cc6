"""Seeded benchmark workloads: lists of jobs, each a conversation of one or more chat turns.

    mixed          one turn; prompt and output lengths uniform around their means (vLLM's
                   ``random`` dataset with a range ratio)
    shared-prefix  one turn; G groups share a long system prompt, each request adds its own question
    multi-turn     conversations: a long first message (the history), then short follow-ups that
                   resend the whole history (the prefix cache should make them cheap)
    cancel-storm   one turn, long outputs, each stream cancelled after a few tokens

Prompt text is cut from the project corpus by token windows, so a prompt of L tokens re-encodes to
about L tokens (a boundary token or two may merge); the benchmark reports the server's count.
Every job starts with a unique tag so that two jobs never share a prefix by accident.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

from backend.tokenizer_train import ASSETS, TOKENIZER_DIR

WORKLOADS = ("mixed", "shared-prefix", "multi-turn", "cancel-storm")


@dataclass
class Turn:
    user: str                       # this turn's user message
    max_tokens: int
    cancel_after: int | None = None  # cancel the stream after this many content chunks


@dataclass
class Job:
    """A conversation; each turn resends the system prompt and the whole history."""
    job_id: str
    turns: list[Turn]
    system: str | None = None
    prompt_len: int = 0             # planned tokens of the first turn's text (before the chat template)

    def messages(self, history: list[dict], turn: Turn) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + history + [{"role": "user", "content": turn.user}]


@dataclass
class WorkloadSpec:
    """Knobs of every workload (each uses the ones that apply); defaults suit bench-15m."""
    name: str = "mixed"
    num_jobs: int = 128
    seed: int = 0
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.5        # lengths uniform in [L*(1-r), L*(1+r)]
    output_dist: str = "uniform"    # mixed: "exponential" = outputs exp. with mean output_len, capped
    output_cap: int = 256           # mixed, exponential outputs: the cap
    num_groups: int = 4             # shared-prefix
    prefix_len: int = 512           # shared-prefix: shared system prompt
    turns: int = 4                  # multi-turn: turns per conversation
    history_len: int = 1024         # multi-turn: the first message
    followup_len: int = 32          # multi-turn: each later message
    cancel_after: tuple[int, int] = (1, 8)   # cancel-storm: uniform range of chunks before cancel
    extra: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"))


@functools.lru_cache(maxsize=1)
def _corpus_ids() -> list[int]:
    text = (ASSETS / "corpus.txt").read_text()
    return _tokenizer()(text)["input_ids"]


def text_of_tokens(rng: random.Random, length: int) -> str:
    """About ``length`` tokens of corpus text from a random offset (wrapping around)."""
    ids = _corpus_ids()
    if length <= 0:
        return ""
    start = rng.randrange(len(ids))
    window = (ids[start:] + ids * (1 + length // len(ids)))[:length]
    return _tokenizer().decode(window)


def _uniform(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def _tag(i: int) -> str:
    return f"[{i:05d}] "


def mixed(spec: WorkloadSpec) -> list[Job]:
    rng = random.Random(spec.seed)
    jobs = []
    for i in range(spec.num_jobs):
        n_in = _uniform(rng, spec.input_len, spec.range_ratio)
        if spec.output_dist == "exponential":
            n_out = min(spec.output_cap, max(1, round(rng.expovariate(1 / spec.output_len))))
        else:
            n_out = _uniform(rng, spec.output_len, spec.range_ratio)
        jobs.append(Job(f"mixed-{i}", [Turn(_tag(i) + text_of_tokens(rng, n_in), n_out)], prompt_len=n_in))
    return jobs


def shared_prefix(spec: WorkloadSpec) -> list[Job]:
    rng = random.Random(spec.seed)
    prefixes = [f"You are assistant {g}. " + text_of_tokens(rng, spec.prefix_len)
                for g in range(spec.num_groups)]
    jobs = []
    for i in range(spec.num_jobs):
        n_in = _uniform(rng, spec.input_len, spec.range_ratio)
        jobs.append(Job(f"prefix-{i}", [Turn(_tag(i) + text_of_tokens(rng, n_in), spec.output_len)],
                        system=prefixes[i % spec.num_groups], prompt_len=spec.prefix_len + n_in))
    return jobs


def multi_turn(spec: WorkloadSpec) -> list[Job]:
    rng = random.Random(spec.seed)
    jobs = []
    for i in range(spec.num_jobs):
        turns = [Turn(_tag(i) + text_of_tokens(rng, spec.history_len), spec.output_len)]
        turns += [Turn(text_of_tokens(rng, spec.followup_len), spec.output_len)
                  for _ in range(spec.turns - 1)]
        jobs.append(Job(f"conv-{i}", turns, prompt_len=spec.history_len))
    return jobs


def cancel_storm(spec: WorkloadSpec) -> list[Job]:
    rng = random.Random(spec.seed)
    lo, hi = spec.cancel_after
    jobs = []
    for i in range(spec.num_jobs):
        n_in = _uniform(rng, spec.input_len, spec.range_ratio)
        turn = Turn(_tag(i) + text_of_tokens(rng, n_in), spec.output_len, cancel_after=rng.randint(lo, hi))
        jobs.append(Job(f"cancel-{i}", [turn], prompt_len=n_in))
    return jobs


def make_workload(spec: WorkloadSpec) -> list[Job]:
    builders = {"mixed": mixed, "shared-prefix": shared_prefix, "multi-turn": multi_turn,
                "cancel-storm": cancel_storm}
    if spec.name not in builders:
        raise ValueError(f"unknown workload {spec.name!r}; choose from {', '.join(WORKLOADS)}")
    if spec.num_jobs < 1:
        raise ValueError(f"num_jobs must be positive, got {spec.num_jobs}")
    return builders[spec.name](spec)
