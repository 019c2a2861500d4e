"""Log-probabilities of what a request commits (OpenAI's `logprobs` / `top_logprobs`) and of its prompt
(completions' `echo` with `logprobs`), from the very forward that verified or prefilled those positions.

Which distribution (`--logprobs-mode`, as vLLM's `logprobs_mode`):
    raw        (default) the target's own next-token distribution, log_softmax of its logits: what OpenAI
               reports and what scoring harnesses (lm-eval's loglikelihood) need;
    processed  the distribution the token was decided on: the request's logit rules (logit_rules.py), then
               temperature, top-k and top-p (sampling.py); at temperature 0 the rules alone (greedy takes their
               argmax). Tokens those remove have logprob -inf.
Prompt tokens are always scored raw: no rule and no sampling decided them.

Lossless under speculation: the committed token at a position is scored on the row of the verify forward that
decided it, which is the same distribution a plain step would have computed there (up to float rounding, as
the tokens themselves), so a request's logprobs are the same in `ar` and in every speculative mode. A draft
the verification rejected is never scored; nucleus verification reports the target's values of what it accepted.

Precision: a bf16 target's logits are the model's own bf16 head's, with every entry near each row's maximum
recomputed in fp32 (logit_head.py). Those carry nearly all of the probability mass, so the normaliser is fp32 to
within the far entries' rounding; the entries a response reports (each committed token, and its row's top k) are
made fp32 too. Recomputing the whole row in fp32 instead measured 7 ms a row on one core (the fp32 head is 113 MB
read per row), which would halve the tokens/s of a request that asks for logprobs.
"""
from __future__ import annotations

import torch

from ..protocol.messages import SamplingParams, TokenLogprobs
from ..spec.sampling import process_logits



def reported_logits(result, rows: int, tokens: list[int], top: int, head) -> torch.Tensor:
    """[rows, vocab] float32: a forward's first `rows` rows of logits, with the entries of `tokens` [rows] (one per
    row) and of each row's `top` most likely in fp32 where the runner's logits are refined only near the maximum."""
    logits = result.logits[:rows].float()
    if head is None or result.head_input is None:
        return logits  # every entry is already in the runner's full precision
    columns = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]  # [rows, 1]
    if top:
        columns = torch.cat([columns, logits.topk(top, dim=-1).indices], dim=-1)  # [rows, 1 + top]
    return head.exact_columns(logits, columns, result.head_input[:rows])


def score(logits: torch.Tensor, tokens: list[int], top: int) -> TokenLogprobs:
    """Logprobs of `tokens` [n] under logits [n, vocab] (one row per token), with each row's `top` most likely."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0]  # [n]
    top_values, top_ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    return TokenLogprobs(values=chosen.tolist(), top_ids=top_ids.tolist(), top_values=top_values.tolist())


def committed_logprobs(result, decided: torch.Tensor, committed: list[int], sampling: SamplingParams, head,
                       mode: str) -> TokenLogprobs:
    """Logprobs of a round's `committed` tokens: the accepted drafts and the verdict's token, decided on rows 0..k
    of its forward `result` (`decided`: those logits as the verification took them, the request's rules applied)."""
    n = len(committed)
    if mode == "processed":
        logits = decided[:n] if sampling.temperature == 0 else \
            process_logits(decided[:n], sampling.temperature, sampling.top_k, sampling.top_p)
    else:
        logits = reported_logits(result, n, committed, sampling.logprobs, head)
    return score(logits, committed, sampling.logprobs)


def prompt_chunk_logprobs(result, prompt_ids: list[int], start: int, fed: int, top: int, head) -> TokenLogprobs:
    """Raw logprobs of the prompt tokens a prefill chunk's rows predict: the chunk fed positions start..start+fed-1
    with logits kept for every one (`result`); row j scores prompt token start + j + 1, while it is in the prompt."""
    rows = min(fed, len(prompt_ids) - start - 1)
    if rows <= 0:
        return TokenLogprobs([], [], [])
    tokens = prompt_ids[start + 1:start + 1 + rows]
    return score(reported_logits(result, rows, tokens, top, head), tokens, top)
