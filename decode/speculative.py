"""The speculative decoder: a drafter q proposes up to gamma tokens, the target p verifies them.

Works over two `transformers` causal LMs sharing a vocabulary (up to padding), or a drafter
with its own tokenizer through a mapping. `generate` is the one round loop; each kind of drafter
is a strategy behind `drafters.base.Drafter`. A round plans k (`decoder.draft_length`, reading
q and earlier rounds only, so it stays lossless), drafts up to k tokens, verifies them in one
target forward (`verify.Verifier`), and rolls both caches back to the longest accepted prefix
in the batch; rows that accepted less keep masked holes, so nothing is recomputed.

`baseline` decodes with the target alone through the same caches, so a speedup compares like
with like. Nothing here reads a clock: tokens and counters are a function of the models,
prompts, config and seed.
"""

from __future__ import annotations

from functools import partial

import torch

from specdistill.data.runtime import ConfigError
from specdistill.decode.acceptance import (
    greedy_tokens,
    probs_from_logits,
    sample_from,
    uniforms,
)
from specdistill.decode.cache import (
    ModelRunner,
    bucket_capacity,
    check_rollback,
    prefill_prompt,
    step_mask,
)
from specdistill.decode.config import (
    DecoderConfig,
    check_decoder_config,
    check_pair_for_decoding,
    model_device_dtype,
)
from specdistill.decode.draft_length import make_policy, verify_widths
from specdistill.decode.draft_vocab import draft_vocab_of, subset_head
from specdistill.decode.drafters import DRAFTERS, Drafter, MappedVocab, mapped_drafter
from specdistill.decode.drafters.context import context_cut, drafter_positions
from specdistill.decode.drafters.mapped import check_mapped_decoding, check_mapped_pair
from specdistill.decode.drafters.parallel import trained_depth
from specdistill.decode.lookup import PromptLookup
from specdistill.decode.outputs import DecodeOutput, RoundRecord
from specdistill.decode.verify import RoundState, Verifier

# re-exported: callers import the decoder's types from here
__all__ = [
    "DecodeOutput",
    "DecoderConfig",
    "RoundRecord",
    "SpeculativeDecoder",
    "check_decoder_config",
    "check_pair_for_decoding",
    "model_device_dtype",
]


class SpeculativeDecoder:
    """Draft with q (drafter), verify with p (target); lossless unless `lenience` < 1."""

    def __init__(
        self,
        target,
        drafter,
        cfg: DecoderConfig,
        *,
        tokenizer_len: int | None = None,
        mapped: MappedVocab | None = None,
    ) -> None:
        """mapped: the drafter's own vocabulary mapping (decode.drafters.mapped); None: shared."""
        check_decoder_config(cfg)
        if mapped is None:
            self.vocab = check_pair_for_decoding(target, drafter, tokenizer_len)
        else:
            check_mapped_decoding(cfg)
            self.vocab = check_mapped_pair(target, drafter, mapped)
        self.mapped = mapped
        check_rollback(target, "pair.target")
        check_rollback(drafter, "pair.drafter")
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.device, self.dtype = model_device_dtype(target)
        cuda = self.device.type == "cuda"
        compile_on = cfg.compile is True or (cfg.compile == "auto" and cuda)
        # `static` is the target's cache (and an eager drafter's); compiled drafter steps always
        # run over a static cache of their own, whatever the target's.
        self.static = cfg.cache == "static" or (cfg.cache == "auto" and (cuda or compile_on))
        self.compile_target = compile_on and self.static
        self.compile = self.compile_target or cfg.compile == "drafter"  # some steps compiled
        # auto: 8 on CUDA, where the host queues steps ahead; on CPU steps past an EOS only cost
        self.sync_every = cfg.host_sync_every or (8 if cuda else 1)
        self.max_draft = cfg.most_drafts
        if cfg.draft_length == "heuristic" and cfg.drafting == "parallel":
            # no mask past the depth the drafter was trained for: it never learnt to draft there
            self.max_draft = min(self.max_draft, trained_depth(drafter) or self.max_draft)
        fixed = cfg.draft_length == "fixed" and not cfg.lookup
        # one verify shape for a fixed gamma; a few padded widths when lengths vary
        self.verify_widths = [self.max_draft + 1] if fixed else verify_widths(self.max_draft)
        self.policy = make_policy(cfg.draft_length, cfg.gamma, self.max_draft, cfg.p_min)
        kinds = DRAFTERS[cfg.drafting] if mapped is None else partial(mapped_drafter, mapped)
        self.drafting: Drafter = kinds(
            drafter,
            vocab=self.vocab,
            sampling=cfg.sampling,
            device=self.device,
            max_draft=self.max_draft,
            compiled=self.compile,
            make_runner=lambda slots: self._runner(self.drafter, slots),
            mask_token_id=cfg.mask_token_id,
        )
        self.verifier = Verifier(
            cfg, self.vocab, self.device, self.verify_widths, self.compile_target and not fixed
        )
        self.parallel = self.drafting.parallel
        self.mask_token_id = getattr(self.drafting, "mask_token_id", None)
        ids = draft_vocab_of(drafter) if cfg.draft_vocab == "auto" else None
        if ids is not None and self.drafting.reserved_ids:  # never draft the mask token
            ids = [t for t in ids if t not in self.drafting.reserved_ids]
        self.draft_head = subset_head(drafter, ids) if ids and drafter is not target else None
        self.drafter_limit = drafter_positions(drafter)  # decoder.drafter_context=auto's bound

    def drafter_cut(self, plen: int) -> int:
        """Leading slots of a `plen`-slot prompt the drafter skips (`decoder.drafter_context`,
        decode/drafters/context.py): the decode reaches plen + max_new_tokens + a round's drafts."""
        horizon = plen + self.cfg.max_new_tokens + self.max_draft + 1
        return context_cut(plen, horizon, self.cfg.drafter_context, self.drafter_limit)

    def _prepare(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        ids = input_ids.to(self.device)
        if attention_mask is None:
            attention_mask = torch.ones_like(ids)
        mask = attention_mask.to(self.device).bool()
        if ids.shape[0] == 1:  # strip left padding: batch 1 runs dense (no mask, no positions)
            ids = ids[:, mask[0]]
            mask = mask[:, mask[0]]
        if ids.shape[1] == 0:
            raise ConfigError("an empty prompt cannot be decoded: every prompt needs >= 1 token")
        if not bool(mask[:, -1].all()):
            raise ConfigError("prompts must be left-padded (tokenizer.padding_side = 'left')")
        return ids, mask

    def _capacity(self, slots: int) -> int:
        return bucket_capacity(slots) if self.compile else slots

    def _runner(self, model, slots: int) -> ModelRunner:
        """Compiled steps get a static cache of bucketed capacity (few shapes); eager steps keep
        `slots`, so an eager target's steps never attend over a bucket's empty tail."""
        compiled = self.compile_target or (self.compile and model is self.drafter)
        cap = bucket_capacity(slots) if compiled else slots
        return ModelRunner(
            model,
            static=self.static or compiled,
            capacity=cap,
            compile_steps=compiled,
            head=self.draft_head if model is self.drafter else None,
        )

    def spec_slots(self, batch: int, plen: int) -> int:
        """Slots a speculative decode may use: rows that reject early leave holes, so a batched
        layout can outgrow the tokens emitted."""
        w, new = self.verify_widths[-1], self.cfg.max_new_tokens
        return plen + w * (1 if batch == 1 else new) + new + 2

    def spec_capacity(self, batch: int, plen: int) -> int:
        """`spec_slots` as the shared mask's width (bucketed when any step is compiled)."""
        return self._capacity(self.spec_slots(batch, plen))

    @torch.inference_mode()
    def warm_up(self, input_ids: torch.Tensor) -> None:
        """Run every decode-step shape once for this batch-1 prompt's capacity (compiled steps
        compile here, untimed): target 1-token and verify steps, the drafter's steps."""
        ids, _ = self._prepare(input_ids, None)
        plen = ids.shape[1]
        dft_ids = self.drafting.drafter_ids(ids)
        for model, x, cap, steps in (  # (tokens fed, logits kept) exactly as the loop calls them
            (self.target, ids, plen + self.cfg.max_new_tokens + 1, ((1, 1),)),
            (self.target, ids, self.spec_slots(1, plen), tuple((w, w) for w in self.verify_widths)),
            (self.drafter, dft_ids, self.spec_slots(1, plen), self.drafting.warm_shapes()),
        ):
            runner = self._runner(model, cap)
            prefill_prompt([runner], x, torch.ones_like(x, dtype=torch.bool), True)
            for width, keep in steps:
                for _ in range(2):
                    runner.forward(x[:, -1:].repeat(1, width), keep=keep)
                    runner.rollback(runner.length - width)

    # ---------------------------------------------------------------- target alone
    @torch.inference_mode()
    def baseline(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeOutput:
        """Autoregressive decoding with the target p alone, same caches and stopping rules."""
        cfg, s = self.cfg, self.cfg.sampling
        ids, mask0 = self._prepare(input_ids, attention_mask)
        b, plen = ids.shape
        dense = b == 1
        slots = plen + cfg.max_new_tokens + 1
        cap = self._capacity(slots)
        runner = self._runner(self.target, slots)
        mask = torch.zeros(b, cap, dtype=torch.bool, device=self.device)
        mask[:, :plen] = mask0
        t, pos = prefill_prompt([runner], ids, mask0, dense)
        out = DecodeOutput(tokens=[[] for _ in range(b)])
        done = [False] * b
        pending: list[torch.Tensor] = []  # tokens still on the device
        while not all(done):
            length = runner.length
            if not dense:  # batch 1 runs without a mask: no per-step write to keep it current
                mask[:, length] = True
            attn = None if dense else step_mask(runner, mask, length + 1)
            logits = runner.forward(t[:, None], attn, None if dense else pos[:, None], keep=1)[
                :, -1
            ]
            if s.greedy:
                t = greedy_tokens(logits)
            else:
                probs = probs_from_logits(logits, s)
                t = sample_from(probs, uniforms((b,), generator, self.device))
            pos = pos + 1
            out.target_forwards += 1
            pending.append(t)
            # Batched host moves let the host queue steps meanwhile; a row past its EOS wastes
            # at most sync_every - 1 steps (its output is cut at the EOS all the same).
            if len(pending) >= self.sync_every or out.target_forwards >= cfg.max_new_tokens:
                for r, toks in enumerate(torch.stack(pending, 1).tolist()):
                    if not done[r]:
                        done[r] = self.verifier.emit(out.tokens[r], toks)
                pending = []
        return out

    # ---------------------------------------------------------------- speculative
    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeOutput:
        """Speculative decoding of left-padded `input_ids` (B, P); see the module docstring."""
        st = self._start(input_ids, attention_mask, generator)
        while not all(st.done):
            self._round(st)
        return st.out

    def _start(self, input_ids, attention_mask, generator) -> RoundState:
        """Prefill both models and set up the shared slot mask and the counters of one decode."""
        kmax = self.max_draft
        ids, mask0 = self._prepare(input_ids, attention_mask)
        b, plen = ids.shape
        dense = b == 1
        slots = self.spec_slots(b, plen)
        tgt = self._runner(self.target, slots)
        mask = torch.zeros(b, self._capacity(slots), dtype=torch.bool, device=self.device)
        mask[:, :plen] = mask0
        self.drafting.start(ids, mask0, mask, dense, slots, self.drafter_cut(plen))
        t, pos = prefill_prompt([tgt], ids, mask0, dense)
        out = DecodeOutput.counting(b, kmax)
        steps = torch.arange(self.verify_widths[-1], device=self.device)
        self.policy.start(b)
        lookup = PromptLookup(ids[0, mask0[0]].tolist()) if self.cfg.lookup and dense else None
        return RoundState(
            tgt, mask, dense, self.policy, out, [False] * b, t, pos, steps, generator, lookup
        )

    def _round(self, st: RoundState) -> None:
        """One round (see the module docstring)."""
        length, b = st.tgt.length, len(st.done)
        active = [not d for d in st.done]
        budget = self._draft_width(st.out.tokens, st.done)
        if st.lookup is not None:
            st.lookup.catch_up(st.out.tokens[0])  # the prompt and row 0's output so far
            found = st.lookup.propose(budget)
            if found:
                self._lookup_round(st, found, active)
                return
        policy = st.policy
        k = policy.plan(budget)
        if not st.dense:
            st.mask[:, length : length + k + 1] = True
        keep = partial(policy.keep_drafting, active=active) if policy.reads_q else None
        prop = self.drafting.propose(st.t, st.pos, k, st.generator, keep)
        st.out.drafter_forwards += prop.forwards
        draft_t, q, kd = prop.tokens, prop.q, prop.tokens.shape[1]
        lengths = policy.lengths(prop.conf, kd, b)
        kv = max(lengths)
        if kv < kd:
            draft_t, q = draft_t[:, :kv], None if q is None else q[:, :kv]
        if not st.dense and kv < k:  # slots planned for drafts that are not verified
            st.mask[:, length + kv + 1 : length + k + 1] = False
        row_cut = any(n < kv for n in lengths)
        verdict = self.verifier.verify(st, draft_t, q, lengths if row_cut else None)
        st.out.target_forwards += 1
        rows = self.verifier.settle(st, active, verdict, lengths)
        n, width = verdict.accepted, verdict.width
        accepted = [row.accepted for row in rows]
        policy.observe(lengths, accepted, active)
        maxn = max(accepted)
        if not st.dense:
            st.mask[:, length + 1 : length + width] &= st.steps[None, : width - 1] < n[:, None]
        st.tgt.rollback(length + 1 + maxn)
        self.drafting.accept(draft_t, maxn, length + 1 + maxn, st.pos)
        st.pos = st.pos + 1 + n
        st.t = verdict.next_token

    def _lookup_round(self, st: RoundState, found: list[int], active: list[bool]) -> None:
        """A round whose drafts come from the context (decode.lookup, batch 1): verified as any
        drafts, q one-hot (deterministic proposals); no drafter forward, so the drafter lags
        by the tokens the round emits and reads them at its next forward (`Drafter.skip`)."""
        length, k = st.tgt.length, len(found)
        draft_t = torch.tensor([found], dtype=st.t.dtype, device=self.device)
        q = None
        if not self.cfg.sampling.greedy:
            q = torch.nn.functional.one_hot(draft_t, self.vocab).to(self.dtype)
        verdict = self.verifier.verify(st, draft_t, q, None)
        st.out.target_forwards += 1
        rows = self.verifier.settle(st, active, verdict, [k], lookup=True)
        got = rows[0].accepted
        st.out.lookup_rounds += 1
        st.out.lookup_drafted += k
        st.out.lookup_accepted += got
        st.tgt.rollback(length + 1 + got)
        self.drafting.skip(st.t, st.pos)
        for j in range(got):
            self.drafting.skip(draft_t[:, j], st.pos + 1 + j)
        st.pos = st.pos + 1 + verdict.accepted
        st.t = verdict.next_token

    def _draft_width(self, tokens: list[list[int]], done: list[bool]) -> int:
        """Drafts this round may hold: the most a round verifies, or fewer when no unfinished
        row has the budget left to use them (a round emits at most drafts + 1 tokens). A
        compiled target with a fixed gamma keeps gamma: one verify shape."""
        g = self.max_draft
        if self.compile_target and len(self.verify_widths) == 1:
            return g
        left = max(self.cfg.max_new_tokens - len(row) for row, d in zip(tokens, done) if not d)
        return max(1, min(g, left - 1))
