"""The speculative decoder: a drafter q proposes gamma tokens, the target p verifies them at once.

Works over any two `transformers` causal LMs sharing a vocabulary (a drafter padded differently
is padded/trimmed to the target's size). `generate` is the one round loop, whatever the kind of
drafter: each kind (autoregressive, parallel = PARD mask tokens; `decoder.drafting`) is a
strategy behind the small interface of `specdistill.decode.drafters.base.Drafter` (propose k
drafts with their q and confidences, skip a plain target step, accept / roll back, cost).

Both KV caches share one slot layout (see `specdistill.decode.cache`): a round has the drafter
propose k drafts and the target verify them in one (k+1)-token step, then rolls both caches
back to the longest accepted prefix in the batch; rows that accepted less keep masked "holes",
so rows may accept different lengths and nothing is recomputed. A round drafts fewer than gamma
tokens only when no unfinished row could emit more before `max_new_tokens` (eager target steps;
a compiled target keeps one verify shape). `baseline` decodes with the target alone through the
same machinery, so a speedup compares like with like.

`decoder.draft_length` other than `fixed` picks each round's length with a policy of
`specdistill.decode.draft_length` (it reads q and earlier rounds only, so the rule stays
lossless); a round of 0 drafts is a plain target step, whose token the drafter reads in its
next round. A compiled target pads verifies to a few widths (`verify_widths`), a compiled
drafter feeds a long catch-up in power-of-two chunks. `step_timer` is the public way to time
the decoder's own steps (target step, verify of k drafts, draft step).
"""

from __future__ import annotations

import dataclasses
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
    PREFILL_DTYPES,
    DecoderConfig,
    check_decoder_config,
    check_pair_for_decoding,
    model_device_dtype,
)
from specdistill.decode.cpu_matmul import (
    LINEAR,
    MAX_ROWS,
    PACKED,
    WEIGHT_MAJOR,
    Layout,
    has_two_column_weight,
    packed_available,
)
from specdistill.decode.draft_length import DraftCosts, make_policy, measure_costs, verify_widths
from specdistill.decode.draft_length.costs_memo import CostsMemo
from specdistill.decode.draft_length.policies import DraftLengthPolicy
from specdistill.decode.draft_vocab import draft_vocab_of, subset_head
from specdistill.decode.drafters import DRAFTERS, Drafter, MappedVocab, mapped_drafter
from specdistill.decode.drafters.context import context_cut, drafter_positions
from specdistill.decode.drafters.mapped import check_mapped_decoding, check_mapped_pair
from specdistill.decode.drafters.parallel import trained_depth
from specdistill.decode.lookup import PromptLookup
from specdistill.decode.matmul_choice import choose_layouts
from specdistill.decode.outputs import DecodeOutput, RoundRecord
from specdistill.decode.prefill_memo import PrefillMemo, prefill_timed
from specdistill.decode.step_timer import StepTimer
from specdistill.decode.verify import RoundState, Verifier

AUTOCAST = ("cpu", "cuda")  # devices whose autocast runs a bf16 prefill (decoder.prefill_dtype)

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
        prefill_memo: PrefillMemo | None = None,
        costs_memo: CostsMemo | None = None,
    ) -> None:
        """mapped: the drafter's own vocabulary mapping (decode.drafters.mapped); None: shared.
        prefill_memo: prefill each prompt once per model and restore its cache on later decodes
        of it (decode.prefill_memo; validate shares one over its decoders for long prompts).
        costs_memo: measured draft costs shared with other decoders over the same models
        (decode/draft_length/costs_memo.py; validate shares one over its decoders)."""
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
        if PREFILL_DTYPES[cfg.prefill_dtype] is not None and self.device.type not in AUTOCAST:
            raise ConfigError(
                f"decoder.prefill_dtype={cfg.prefill_dtype}: a bf16 prefill runs under autocast, "
                f"which this decoder supports on {' and '.join(AUTOCAST)}, not {self.device.type}; "
                "set decoder.prefill_dtype=model"
            )
        cuda = self.device.type == "cuda"
        compile_on = cfg.compile is True or (cfg.compile == "auto" and cuda)
        # `static` is the target's cache (and an eager drafter's); compiled drafter steps always
        # run over a static cache of their own, whatever the target's.
        self.static = cfg.cache == "static" or (cfg.cache == "auto" and (cuda or compile_on))
        self.compile_target = compile_on and self.static
        self.compile = self.compile_target or cfg.compile == "drafter"  # some steps compiled
        # auto: 8 on CUDA, where the host can queue steps ahead; 1 on CPU, where it cannot and
        # steps past an EOS would only cost time
        self.sync_every = cfg.host_sync_every or (8 if cuda else 1)
        self._layouts: dict[str, Layout] | None = None  # per role, on first use (`layout`)
        # most drafts a round may verify: gamma, or max_draft for the adaptive policies
        self.max_draft = cfg.gamma if cfg.draft_length == "fixed" else cfg.max_draft
        fixed = cfg.draft_length == "fixed"
        if not fixed and cfg.drafting == "parallel":  # (a mapped drafter is refused above)
            # an adaptive round proposes no mask past the depth the drafter was trained for:
            # those masks draft what it never learnt (a fixed gamma is the user's to choose)
            self.max_draft = min(self.max_draft, trained_depth(drafter) or self.max_draft)
        self.verify_widths = [self.max_draft + 1] if fixed else verify_widths(self.max_draft)
        self._costs = cfg.draft_costs
        self._measured: dict[int, DraftCosts] = {}  # by batch size
        self._policy: DraftLengthPolicy | None = None
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
        self.prefill_memo = prefill_memo
        self.drafting.prefill_memo = prefill_memo
        self.costs_memo = costs_memo
        self.drafter_limit = drafter_positions(drafter)  # decoder.drafter_context=auto's bound

    def drafter_cut(self, plen: int) -> int:
        """Leading slots of a `plen`-slot prompt the drafter skips (`decoder.drafter_context`,
        decode/drafters/context.py): the decode reaches plen + max_new_tokens + a round's drafts."""
        horizon = plen + self.cfg.max_new_tokens + self.max_draft + 1
        return context_cut(plen, horizon, self.cfg.drafter_context, self.drafter_limit)

    def get_policy(self, input_ids: torch.Tensor | None = None):
        """The draft-length policy (decode.draft_length); its calibration lives as long as the
        decoder. The adaptive ones plan with the pair's step costs: unless configured, measured
        here on the first row of `input_ids` (untimed callers pass a warm-up prompt)."""
        if self._policy is None:
            cfg = self.cfg
            adaptive = cfg.draft_length != "fixed"
            costs = self.draft_costs(input_ids) if adaptive else DraftCosts()
            self._policy = make_policy(
                cfg.draft_length,
                cfg.gamma,
                self.max_draft,
                costs,
                scope=cfg.draft_scope,
                floor=cfg.draft_floor,
                probe_every=cfg.probe_every,
            )
        return self._policy

    def draft_costs(self, input_ids: torch.Tensor | None = None, batch: int = 1) -> DraftCosts:
        """The step costs the adaptive policies plan with at this batch size: configured, or
        measured once per batch size on the first row of `input_ids` repeated (batched steps
        cost differently: a 4-row 5-token verify is 20 rows, past the few-row CPU linears)."""
        if self._costs is not None:
            costs = dataclasses.replace(self._costs, parallel=self.parallel)
            return costs.linear() if self.cfg.verify_costs == "linear" else costs
        if batch not in self._measured:
            if input_ids is None:
                raise ValueError("measuring the draft costs needs a prompt")
            ids, _ = self._prepare(input_ids[:1], None)
            self._measured[batch] = measure_costs(self, ids.repeat(batch, 1), memo=self.costs_memo)
        return self._measured[batch]

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

    def _runner(self, model, slots: int, layout: Layout | None = None) -> ModelRunner:
        """Compiled steps get a static cache of bucketed capacity (few shapes); eager steps keep
        `slots`, so an eager target's steps never attend over a bucket's empty tail. layout:
        the CPU linear layout (default: the model's, `layout`)."""
        compiled = self.compile_target or (self.compile and model is self.drafter)
        cap = bucket_capacity(slots) if compiled else slots
        return ModelRunner(
            model,
            static=self.static or compiled,
            capacity=cap,
            compile_steps=compiled,
            layout=self.layout(model) if layout is None else layout,
            head=self.draft_head if model is self.drafter else None,
            lean=self.cfg.lean_steps,
            prefill_cast=PREFILL_DTYPES[self.cfg.prefill_dtype],
        )

    def layout(self, model) -> Layout:
        """How `model`'s few-row linears run on CPU (decode.cpu_matmul): `linear` or off CPU:
        F.linear; `weight_major`: weight @ x.T; `packed`: oneDNN over prepacked weights (F.linear
        where this torch has no oneDNN); `auto`: whichever this machine runs faster in the
        decoder's own steps (decode.matmul_choice). Compiled steps keep weight-major whatever
        the setting: timing them would compile every timed shape, and the prepacked path was
        never tried under compile."""
        setting = self.cfg.cpu_matmul
        if self.device.type != "cpu" or setting == "linear":
            return LINEAR
        if setting == "weight_major" or self.compile:
            return WEIGHT_MAJOR
        if setting == "packed":
            return PACKED if packed_available(self.dtype) else LINEAR
        if self._layouts is None:
            self._layouts = self._choose_layouts()
        return self._layouts["target" if model is self.target else "drafter"]

    def _choose_layouts(self) -> dict[str, Layout]:
        """Time the layouts for the target (its verify widths) and the drafter (its catch-up
        and multi-token draft widths), and each one's 1-token step (the 2-column product over
        every weight, or over a tall, narrow one where the model has it)."""
        models = {"target": self.target, "drafter": self.drafter}
        k = self.max_draft
        top = min(k + 1, MAX_ROWS)
        widths = {  # the target's verify widths, sampled (where a kernel switch sits matters:
            # 4 rows for MKL's on an AVX-512 Xeon), few of them (each costs 3 timed layouts)
            "target": tuple(sorted({top} | {w for w in (2, 4) if w <= top})),
            "drafter": tuple(
                sorted({2} | {w for w in self.drafting.draft_widths(k) if 2 <= w <= MAX_ROWS})
            ),
        }
        sub = None if self.draft_head is None else len(self.draft_head[1].ids)
        one_row = {  # a tall, narrow weight; a draft vocabulary's head is never one
            "target": has_two_column_weight(self.target),
            "drafter": sub is None and has_two_column_weight(self.drafter),
        }
        return choose_layouts(
            models,
            {role: partial(self._runner, model) for role, model in models.items()},
            widths,
            one_row,
            self.device,
            key={"drafter": sub},
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
        compile here, untimed): target 1-token and (gamma+1)-token, drafter 1- and 2-token."""
        ids, _ = self._prepare(input_ids, None)
        plen = ids.shape[1]
        adaptive = self.cfg.draft_length != "fixed"
        dft_ids = self.drafting.drafter_ids(ids)
        for model, x, cap, steps in (  # (tokens fed, logits kept) exactly as the loop calls them
            (self.target, ids, plen + self.cfg.max_new_tokens + 1, ((1, 1),)),
            (self.target, ids, self.spec_slots(1, plen), tuple((w, w) for w in self.verify_widths)),
            (self.drafter, dft_ids, self.spec_slots(1, plen), self.drafting.warm_shapes(adaptive)),
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
        pre = prefill_timed(runner, ids, mask0, dense, self.prefill_memo)
        t, pos = pre.t, pre.pos
        out = DecodeOutput(
            tokens=[[] for _ in range(b)], prefill_target_s=pre.seconds, prefill_saved_s=pre.saved
        )
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
            # Moving tokens to the host stalls the host until the device is done; batching the
            # moves lets it queue the next steps meanwhile. A row past its EOS wastes at most
            # sync_every - 1 steps; its output is cut at the EOS all the same.
            if len(pending) >= self.sync_every or out.target_forwards >= cfg.max_new_tokens:
                for r, toks in enumerate(torch.stack(pending, 1).tolist()):
                    if not done[r]:
                        done[r] = self.verifier.emit(out.tokens[r], toks)
                pending = []
        return out

    def step_timer(self, input_ids: torch.Tensor, slots: int | None = None) -> StepTimer:
        """The public way to time this decoder's own steps (a target step, a verify of k drafts,
        a round's draft forwards) at the length of `input_ids` (B, P): B > 1 times the masked,
        batched path. `slots`: the caches' size (default: prompt + widest verify + 2; pass a
        decode's `spec_slots` so compiled steps reuse its graphs)."""
        ids = input_ids.to(self.device)
        slots = slots or ids.shape[1] + max(self.verify_widths[-1], self.max_draft + 1) + 2
        cut = self.drafter_cut(ids.shape[1])  # the drafter's steps over the context it reads
        return StepTimer(
            ids,
            slots,
            {
                "target": lambda n: self._runner(self.target, n),
                "drafter": lambda n: self.drafting.make_runner(n - cut),
            },
            self.drafting.draft_widths,
            lambda x: self.drafting.drafter_ids(x[:, cut:]),
            self.prefill_memo,
        )

    # ---------------------------------------------------------------- speculative
    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeOutput:
        """Speculative decoding of left-padded `input_ids` (B, P); see the module docstring.
        The one round loop: every kind of drafter runs through `self.drafting`."""
        st = self._start(input_ids, attention_mask, generator)
        while not all(st.done):
            self._round(st)
        st.out.prefill_drafter_s = self.drafting.prefill_seconds  # lazy: at its first round
        st.out.prefill_saved_s += self.drafting.prefill_saved
        return st.out

    def _start(self, input_ids, attention_mask, generator) -> RoundState:
        """Prefill the target (and the drafter, unless the floor may spare it) and set up the
        shared slot mask, the policy and the counters of one decode."""
        cfg, kmax = self.cfg, self.max_draft
        adaptive = cfg.draft_length != "fixed"
        ids, mask0 = self._prepare(input_ids, attention_mask)
        policy = self.get_policy(ids[:, mask0[0]][:1] if adaptive else None)
        if adaptive:
            policy.set_costs(self.draft_costs(ids[:, mask0[0]][:1], ids.shape[0]))
        b, plen = ids.shape
        dense = b == 1
        slots = self.spec_slots(b, plen)
        tgt = self._runner(self.target, slots)
        mask = torch.zeros(b, self._capacity(slots), dtype=torch.bool, device=self.device)
        mask[:, :plen] = mask0
        # With the floor, the drafter reads the prompt only when a round first drafts: a decode
        # that never drafts costs what target-only decoding does (no drafter prefill).
        lazy = adaptive and cfg.draft_floor
        cut = self.drafter_cut(plen)
        self.drafting.start(ids, mask0, mask, dense, slots, lazy, cut)
        pre = prefill_timed(tgt, ids, mask0, dense, self.prefill_memo)
        t, pos = pre.t, pre.pos
        out = DecodeOutput(
            tokens=[[] for _ in range(b)],
            prefill_target_s=pre.seconds,
            prefill_saved_s=pre.saved,
            accepted_at=[0] * kmax,
            trials_at=[0] * kmax,
            lookup_accepted_at=[0] * kmax,
            lookup_trials_at=[0] * kmax,
            draft_lengths=[0] * (kmax + 1),
        )
        steps = torch.arange(self.verify_widths[-1], device=self.device)
        policy.start(b)
        # the drafter's prefill a first drafting round would pay (the prompt but its last token)
        policy.pending = policy.costs.prefill_cost(plen - 1 - cut) if lazy else 0.0
        lookup = PromptLookup(ids[0, mask0[0]].tolist()) if cfg.lookup and dense else None
        shadow = adaptive and cfg.draft_floor  # the floor learns from the steps it skipped
        return RoundState(
            tgt,
            mask,
            dense,
            policy,
            adaptive,
            out,
            [False] * b,
            t,
            pos,
            steps,
            generator,
            [] if shadow else None,
            lookup,
        )

    def _round(self, st: RoundState) -> None:
        """One round: plan k (policy), a plain target step when k = 0, else the drafter's k
        proposals (q, confidences), the verify of the drafts each row keeps, then both caches
        rolled back to the longest accepted prefix (shorter rows keep masked holes)."""
        length, b = st.tgt.length, len(st.done)
        active = [not d for d in st.done]
        budget = self._draft_width(st.out.tokens, st.done)
        if st.lookup is not None:
            st.lookup.catch_up(st.out.tokens[0])  # the prompt and row 0's output so far
            found = st.lookup.propose(budget, st.policy.costs)
            if found:
                self._lookup_round(st, found, active)
                return
        if st.adaptive:
            st.policy.left = self._left(st.out.tokens, st.done)
        k = st.policy.plan(budget, active).k if st.adaptive else budget
        if not st.dense:
            st.mask[:, length : length + k + 1] = True
        if k == 0:  # the floor: a plain target step, as lean as `baseline`'s
            self.drafting.skip(st.t, st.pos)
            st.t = self.verifier.target_step(st, active)
            st.pos = st.pos + 1
            st.policy.observe_step(active)
            return
        reads_q = st.policy.reads_q
        keep = st.policy.keep_drafting if reads_q else None
        shadow = len(st.plain_p) if st.plain_p else 0
        prop = self.drafting.propose(st.t, st.pos, k, st.generator, keep, shadow)
        st.policy.pending = 0.0  # the drafter has read the prompt now
        if shadow:
            self._observe_shadow(st, prop.shadow, active)
        st.out.drafter_forwards += prop.forwards
        draft_t, q, kd = prop.tokens, prop.q, prop.tokens.shape[1]
        if not st.adaptive:
            lengths = [kd] * b
        elif self.drafting.parallel and reads_q:  # all proposals known: verify the best prefix
            lengths = st.policy.verify_lengths(prop.conf, active)
        else:
            lengths = st.policy.lengths(kd)
        kv = max(lengths)
        if kv < kd:
            draft_t, q = draft_t[:, :kv], None if q is None else q[:, :kv]
        if not st.dense and kv < k:  # slots planned for drafts that are not verified
            st.mask[:, length + kv + 1 : length + k + 1] = False
        row_cut = any(n < kv for n in lengths)
        n, nxt, alpha_pos, t_logits, width = self.verifier.verify(
            st, draft_t, q, lengths if row_cut else None
        )
        st.out.target_forwards += 1
        rows = self.verifier.settle(
            st.out, st.done, active, (draft_t, n, nxt, alpha_pos), t_logits, lengths, row_cut
        )
        n_list = [row.accepted for row in rows]
        if st.adaptive:
            # sampled: each tested draft's acceptance probability, not its coin's outcome, and
            # each position's expected acceptance (exact where lenience is 1, `verify`)
            probs = alphas = None
            if not self.cfg.sampling.greedy:
                probs = [row.probs for row in rows]
                if self.cfg.lenience == 1.0:
                    alphas = [row.alphas for row in rows]
            st.policy.observe(lengths, n_list, active, prop.conf, probs, alphas)
        maxn = max(n_list)
        if not st.dense:
            st.mask[:, length + 1 : length + width] &= st.steps[None, : width - 1] < n[:, None]
        st.tgt.rollback(length + 1 + maxn)
        self.drafting.accept(draft_t, maxn, length + 1 + maxn, st.pos)
        st.pos = st.pos + 1 + n
        st.t = nxt

    def _lookup_round(self, st: RoundState, found: list[int], active: list[bool]) -> None:
        """A round whose drafts come from the context (decode.lookup, batch 1): verified as any
        drafts, q one-hot (deterministic proposals); no drafter forward, so the drafter lags
        by the tokens the round emits and reads them at its next forward (`Drafter.skip`)."""
        length, k = st.tgt.length, len(found)
        draft_t = torch.tensor([found], dtype=st.t.dtype, device=self.device)
        q = None
        if not self.cfg.sampling.greedy:
            q = torch.nn.functional.one_hot(draft_t, self.vocab).to(self.dtype)
        n, nxt, alpha_pos, t_logits, _ = self.verifier.verify(st, draft_t, q, None)
        st.out.target_forwards += 1
        rows = self.verifier.settle(
            st.out, st.done, active, (draft_t, n, nxt, alpha_pos), t_logits, [k], lookup=True
        )
        got = rows[0].accepted
        st.lookup.observe(k, got)
        if st.adaptive:
            st.policy.observe_lookup(k, got, active)
        st.out.lookup_rounds += 1
        st.out.lookup_drafted += k
        st.out.lookup_accepted += got
        st.tgt.rollback(length + 1 + got)
        self.drafting.skip(st.t, st.pos)
        for j in range(got):
            self.drafting.skip(draft_t[:, j], st.pos + 1 + j)
        if st.plain_p:  # the drafter's lag is no longer only the floor's tokens
            st.plain_p = []
        st.pos = st.pos + 1 + n
        st.t = nxt

    def _observe_shadow(self, st: RoundState, seen: torch.Tensor | None, active: list[bool]):
        """Tell the policy what drafts would have done at the plain steps' tokens: per row,
        min(1, q/p) of each (greedy: 1 where q's argmax was the target's token), an unbiased
        estimate of each skipped round's first-draft acceptance (`Drafter._shadow`)."""
        plain, st.plain_p = st.plain_p, []
        if seen is None or not seen.shape[1]:
            return
        greedy = self.cfg.sampling.greedy
        # greedy: p of each plain step's token is 1, so the verdicts are q's own hits
        est = seen if greedy else torch.clamp(seen / torch.cat(plain[-seen.shape[1] :], 1), max=1.0)
        st.policy.observe_shadow(
            est.tolist(), active, pairs=greedy and not self.drafting.parallel, block=not greedy
        )

    def _draft_width(self, tokens: list[list[int]], done: list[bool]) -> int:
        """Drafts this round: gamma, or fewer when no unfinished row has the budget left to use
        them (a round emits at most drafts + 1 tokens), so a decode's last round drafts and
        verifies no token past `max_new_tokens`. A compiled target keeps gamma: one verify shape
        (drafter steps are 1 or 2 tokens either way)."""
        g = self.max_draft
        if self.compile_target and self.cfg.draft_length == "fixed":
            return g
        return max(1, min(g, self._left(tokens, done) - 1))

    def _left(self, tokens: list[list[int]], done: list[bool]) -> int:
        """The most tokens an unfinished row may still emit."""
        return max(self.cfg.max_new_tokens - len(row) for row, d in zip(tokens, done) if not d)
