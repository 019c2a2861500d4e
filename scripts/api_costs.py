#!/usr/bin/env python3
"""What logprobs cost through the whole api, and how fast a prompt is scored (`echo` with `max_tokens` 0), against a
running server (`foresight serve`; `--url`).

1. Logprobs: the chat set's first `--prompts` prompts, greedy, `--max-tokens` each, one at a time, without logprobs
   and with `logprobs` true and `top_logprobs` 0, 5 and 20, whole and streamed, the settings interleaved round by
   round so drift hits each alike. Reported: completion tokens per second of each setting and its ratio to the one
   without. The engine's share is `foresight bench --request-fields '{"logprobs": 5}'`; the rest is the api's.
2. Scoring: completions with the chat set's prompts joined into one text of about `--score-tokens` tokens, `echo` true,
   `logprobs` 1, `max_tokens` 0 (what lm-eval's loglikelihood requests send), against the same prompt answered
   with `max_tokens` 1 and no logprobs (its prefill and one token): prompt tokens per second of each.

Prints one JSON object (and writes it with --out).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from openai import OpenAI

from foresight.bench.prompts import chat_prompts

SETTINGS = {"none": {}, "top0": {"logprobs": True, "top_logprobs": 0}, "top5": {"logprobs": True, "top_logprobs": 5},
            "top20": {"logprobs": True, "top_logprobs": 20}}


def timed_chat(client: OpenAI, model: str, messages: list[dict], max_tokens: int, stream: bool,
               fields: dict) -> tuple[float, int]:
    """(seconds, completion tokens) of one greedy chat request."""
    t0 = time.perf_counter()
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                               **fields)
        return time.perf_counter() - t0, reply.usage.completion_tokens
    tokens = 0
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}, **fields):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return time.perf_counter() - t0, tokens


def logprobs_costs(client: OpenAI, model: str, prompts: list[dict], max_tokens: int, rounds: int) -> dict:
    out = {}
    for stream in (False, True):
        spent = {name: [0.0, 0] for name in SETTINGS}
        for _ in range(rounds):
            for p in prompts:
                for name, fields in SETTINGS.items():
                    s, n = timed_chat(client, model, p["messages"], max_tokens, stream, fields)
                    spent[name][0] += s
                    spent[name][1] += n
        rates = {name: n / s for name, (s, n) in spent.items()}
        out["stream" if stream else "whole"] = {
            name: {"tokens_per_s": round(r, 2), "vs_none": round(r / rates["none"], 3)} for name, r in rates.items()}
    return out


def scoring_speed(client: OpenAI, model: str, prompts: list[dict], score_tokens: int, repeats: int) -> dict:
    text, words = "", 0
    for p in prompts:
        if words * 1.3 >= score_tokens:
            break
        text += p["messages"][-1]["content"] + "\n\n"
        words = len(text.split())
    runs = {"echo_max_tokens_0": [], "prefill_max_tokens_1": []}
    n_prompt = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        reply = client.completions.create(model=model, prompt=text, max_tokens=0, echo=True, logprobs=1)
        runs["echo_max_tokens_0"].append(time.perf_counter() - t0)
        n_prompt = reply.usage.prompt_tokens
        assert len(reply.choices[0].logprobs.tokens) == n_prompt
        t0 = time.perf_counter()
        client.completions.create(model=model, prompt=text, max_tokens=1, temperature=0)
        runs["prefill_max_tokens_1"].append(time.perf_counter() - t0)
    return {"prompt_tokens": n_prompt, **{name: {"median_s": round(statistics.median(s), 4),
                                                 "prompt_tokens_per_s": round(n_prompt / statistics.median(s), 1)}
                                          for name, s in runs.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts per setting")
    p.add_argument("--score-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="scoring requests of each kind")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    client = OpenAI(base_url=f"{args.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    prompts = chat_prompts()[: args.prompts]
    timed_chat(client, model, prompts[0]["messages"], 8, False, {})  # warm-up
    result = {"settings": {"prompts": args.prompts, "max_tokens": args.max_tokens, "rounds": args.rounds},
              "logprobs": logprobs_costs(client, model, prompts, args.max_tokens, args.rounds),
              "scoring": scoring_speed(client, model, chat_prompts(), args.score_tokens, args.repeats)}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
