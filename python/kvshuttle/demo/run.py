"""``kvshuttle demo``: multi-turn conversations whose prefill reads the previous turns' KV back from decode.

Two local processes, each with its own paged DRAM cache and NIXL agent (see :mod:`kvshuttle.demo_workers`):
"decode" retains every finished request's blocks in a retention ledger (TTL, memory budget, claims) and
hands out a handle in ``kv_transfer_params``; "prefill" has no prefix cache, so each turn its policy checks
the handle's digest chain against the new prompt, claims the verified blocks on decode, READs them over NIXL,
computes only the rest, and checks every byte of its cache against the KV the prompt must have.

The script walks the cases that matter: plain continuation (reuse), an edited history (only the verified
prefix is reused; an unverified reuse, vLLM's behaviour, would have served wrong KV), a short conversation
(below the 64-token threshold: recompute), a handle about to expire (recompute), and an eviction under the
retention budget (the claim is refused: recompute).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .workers import DemoShape, WorkerProcess

VOCAB = 32_000


@dataclass
class Conversation:
    name: str
    tokens: list[int] = field(default_factory=list)  # the whole history decode has seen (prompt + answer)
    params: dict[str, Any] | None = None  # decode's last kv_transfer_params
    turns: int = 0


class Scenario:
    def __init__(self, shape: DemoShape, path: str, threshold_tokens: int) -> None:
        self.shape, self.path, self.threshold = shape, path, threshold_tokens
        self.rng = np.random.default_rng(shape.seed)
        self.decode = WorkerProcess(shape, "decode")
        self.prefill = WorkerProcess(shape, "prefill")
        self.conversations: dict[str, Conversation] = {}
        self.rows: list[dict[str, Any]] = []

    def words(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, VOCAB, size=n)]

    def turn(self, name: str, user_tokens: int, answer_tokens: int, note: str, *, ttl_s: float | None = None,
             edit_at: int | None = None) -> None:
        conv = self.conversations.setdefault(name, Conversation(name))
        history = list(conv.tokens)
        if edit_at is not None:  # the user edited an earlier message
            history[edit_at] = (history[edit_at] + 1) % VOCAB
        prompt = history + self.words(user_tokens)
        row = self.prefill.call("turn", tokens=prompt, kv_transfer_params=conv.params, path=self.path,
                                threshold_tokens=self.threshold)
        if conv.params is not None:
            # What a reuse without content verification would take: the remote tokens the prompt covers.
            unverified = min(conv.params["remote_num_tokens"], len(prompt) - 1)
            first_diff = next((i for i, (a, b) in enumerate(zip(conv.tokens, prompt, strict=False)) if a != b),
                              unverified)
            row["unverified_wrong_tokens"] = max(0, unverified - first_diff)
        full = prompt + self.words(answer_tokens)
        # Decode holds KV for prompt + answer except the last sampled token.
        conv.turns += 1
        done = self.decode.call("finish_turn", conversation=name, request_id=f"{name}-{conv.turns}",
                                tokens=full, held=len(full) - 1, ttl_s=ttl_s)
        conv.tokens, conv.params = full, done["kv_transfer_params"]
        row.update(conversation=name, turn=conv.turns, note=note, prompt_tokens=len(prompt),
                   verified=row["verified"] and done["verified"], decode_retained_blocks=done["retained_blocks"])
        self.rows.append(row)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


def run_demo(shape: DemoShape | None = None, path: str = "auto", threshold_tokens: int = 64,
             pause_s: float = 1.5) -> dict[str, Any]:
    """Run the scripted conversations; one dict per turn."""
    shape = shape or DemoShape()
    started = time.perf_counter()
    s = Scenario(shape, path, threshold_tokens)
    try:
        s.turn("A", 600, 200, "first turn: nothing to reuse")
        s.turn("A", 120, 200, "continuation: read back prompt + answer")
        s.turn("A", 120, 200, "edited history: verified prefix only", edit_at=300)
        s.turn("B", 20, 30, "short first turn")
        s.turn("B", 10, 30, "below the 64-token threshold")
        s.turn("C", 300, 100, "first turn, 6 s retention", ttl_s=6.0)
        time.sleep(pause_s)  # a pause: C's handle now expires within the 5 s safety margin
        s.turn("C", 50, 100, "after a pause: about to expire")
        s.turn("D", 1500, 200, "long turn: retention budget evicts A")
        s.turn("D", 60, 50, "continuation")
        s.turn("A", 50, 50, "A again: its blocks were evicted")
    finally:
        s.close()
    return {"demo": "multi-turn reverse reads", "shape": asdict(shape), "path": path,
            "threshold_tokens": threshold_tokens, "kv_bytes_per_token": shape.kv_bytes_per_token, "turns": s.rows,
            "all_verified": all(r["verified"] for r in s.rows), "seconds": round(time.perf_counter() - started, 2)}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'turn':<5}{'prompt':>7}{'decision':>10} {'reason':<20}{'reused':>7}{'computed':>9}{'MiB':>7}"
             f"{'descs':>6}{'path':>7}{'ms':>7}  ok  note"]
    for r in result["turns"]:
        wrong = r.get("unverified_wrong_tokens", 0)
        note = r["note"] + (f" (unverified reuse: {wrong} wrong tokens)" if wrong else "")
        lines.append(
            f"{r['conversation'] + str(r['turn']):<5}{r['prompt_tokens']:>7}{r['decision']:>10} {r['reason'][:19]:<20}"
            f"{r['fetched_tokens']:>7}{r['computed_tokens']:>9}{r['bytes'] / 2**20:>7.1f}{r['descriptors']:>6}"
            f"{r['path']:>7}{r['transfer_ms']:>7.1f}  {'yes' if r['verified'] else 'NO '} {note}")
    lines.append(f"every byte of every prefill cache verified: {'yes' if result['all_verified'] else 'NO'}; "
                 f"{result['seconds']} s in all")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", choices=["auto", "direct", "packed"], default="auto")
    parser.add_argument("--layers", type=int, default=DemoShape.layers)
    parser.add_argument("--threshold", type=int, default=64, help="fetch iff reusable tokens >= this")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def main(args: argparse.Namespace) -> int:
    result = run_demo(DemoShape(layers=args.layers), args.path, args.threshold)
    print(json.dumps(result) if args.json else format_table(result))
    return 0 if result["all_verified"] else 1
