"""Many short samples after one header from a batch whose rows never idle (`source: self`).

Each sampled query ends at its own end-of-turn token or runs to `max_query_tokens`. A fixed batch
(`generate`) decodes until its longest sample is done, and about a third of SmolLM2-Instruct's
samples run the whole budget, so most rows idle for most steps. Here a row whose sample is done
hands it over and restarts from the header at once: its slice of the KV cache takes the header's
keys and values (prefilled once; the rotary position is already inside each key, so the header's
keys hold wherever they sit), the attention mask hides the rest of its old sample, and each
row's position ids count its own tokens. Columns no row sees any more are trimmed every `TRIM`
of them, so the cache stays within header + budget + `TRIM` columns.

Each sample is exactly what decoding it alone gives (tested: every token's log-probability
against a full forward of the header and the sample). The draws come from one generator seeded
once, so the same settings give the same samples. Only plain growing caches (`DynamicLayer`:
full attention, no sliding window) can be rewritten like this; `supported` says whether a model's
can, and the caller keeps the fixed batch otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple

import torch

from specdistill.data.runtime import cache_argument
from specdistill.data.sampling import Sampling

TRIM = 32  # columns no row sees any more, dropped once this many have piled up
Draw = Callable[[torch.Tensor], torch.Tensor]  # logits (n, V) -> token ids (n,)


class Sample(NamedTuple):
    """One sample's token ids (its stop token last, or `max_tokens` ids without one) and each
    token's log-probability under the model (temperature 1, before any warping)."""

    ids: list[int]
    logprobs: list[float]


def sampling_draw(s: Sampling, generator: torch.Generator) -> Draw:
    """Draws with the one sampling spec: `transformers`' temperature, top-k and top-p warpers
    in `generate`'s order, then one multinomial draw per row from `generator`."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(s.temperature)])
    if s.top_k:
        warpers.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1.0:
        warpers.append(TopPLogitsWarper(s.top_p))

    def draw(logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(warpers(None, logits.float()), dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    return draw


def supported(model: Any) -> bool:
    """Whether the model's cache is plain growing layers (a row's slice can be rewritten)."""
    from transformers.cache_utils import DynamicLayer

    with torch.inference_mode():
        cache = model(torch.zeros(1, 1, dtype=torch.long, device=model.device)).past_key_values
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> list[float]:
    chosen = logits.float().gather(1, tokens[:, None])[:, 0]
    return (chosen - torch.logsumexp(logits.float(), dim=-1)).tolist()


@torch.inference_mode()
def stream_samples(
    model: Any,
    header_ids: list[int],
    max_tokens: int,
    stops: Collection[int],
    rows: int,
    draw: Draw,
) -> Iterator[Sample]:
    """Samples after `header_ids` for as long as the caller reads: `rows` decode side by side,
    each restarting when its sample ends. They come in the order they started, not finished:
    any prefix of the stream is then a fair draw, where the first to finish would favour short
    samples (the long ones still running when the caller stops would be left out)."""
    device = model.device
    header = torch.tensor([header_ids] * rows, device=device)
    h = header.shape[1]
    out = model(header, use_cache=True)
    cache = out.past_key_values
    kw = cache_argument(model)
    head_kv = [(layer.keys[:1].clone(), layer.values[:1].clone()) for layer in cache.layers]
    head_logits = out.logits[:1, -1]
    first = draw(head_logits.expand(rows, -1))
    ids = [[t] for t in first.tolist()]
    logps = [[lp] for lp in _logprobs(head_logits.expand(rows, -1), first)]
    mask = torch.ones(rows, h, dtype=torch.long, device=device)
    number = list(range(rows))  # each row's sample, numbered as it starts
    started, emitted = rows, 0
    finished_samples: dict[int, Sample] = {}

    def finished(r: int) -> bool:
        return ids[r][-1] in stops or len(ids[r]) >= max_tokens

    while True:
        done = [r for r in range(rows) if finished(r)]
        while done:  # a restart's first draw may end its sample at once (an empty query)
            for r in done:
                finished_samples[number[r]] = Sample(ids[r], logps[r])
                number[r], started = started, started + 1
            while emitted in finished_samples:
                yield finished_samples.pop(emitted)
                emitted += 1
            # restart those rows from the header: its KV at the end, the rest masked
            length = mask.shape[1]
            index = torch.tensor(done, device=device)
            for layer, (k, v) in zip(cache.layers, head_kv, strict=True):
                layer.keys[index, :, length - h :] = k
                layer.values[index, :, length - h :] = v
            mask[index] = 0
            mask[index, length - h :] = 1
            fresh = draw(head_logits.expand(len(done), -1))
            lps = _logprobs(head_logits.expand(len(done), -1), fresh)
            for r, t, lp in zip(done, fresh.tolist(), lps, strict=True):
                ids[r], logps[r] = [t], [lp]
            done = [r for r in done if finished(r)]
        step = torch.tensor([[t[-1]] for t in ids], device=device)
        positions = torch.tensor([[h + len(t) - 1] for t in ids], device=device)
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype, device=device)], dim=1)
        logits = model(
            step, attention_mask=mask, position_ids=positions, use_cache=True, **{kw: cache}
        ).logits[:, -1]
        nxt = draw(logits)
        for r, t, lp in zip(range(rows), nxt.tolist(), _logprobs(logits, nxt), strict=True):
            ids[r].append(t)
            logps[r].append(lp)
        unseen = int(mask.argmax(dim=1).min())  # the first column any row still sees
        if unseen >= TRIM:
            for layer in cache.layers:
                layer.keys = layer.keys[:, :, unseen:].contiguous()
                layer.values = layer.values[:, :, unseen:].contiguous()
            mask = mask[:, unseen:].contiguous()
