"""The speculative decoder: a drafter q proposes gamma tokens, the target p verifies them at once.

Works over any two `transformers` causal LMs sharing a vocabulary (a drafter padded differently
is padded/trimmed to the target's size). Both KV caches share one slot layout (see
`specdistill.decode.cache`): a round feeds the drafter gamma single-token steps and the target one
(gamma+1)-token verify step, then rolls both caches back to the longest accepted prefix in the
batch; rows that accepted less keep masked "holes", so rows may accept different lengths and
nothing is recomputed. When a row accepts all gamma drafts, the drafter's cache lacks the last
draft and catches it up in its next step. A round drafts fewer than gamma tokens only when no
unfinished row could emit more before `max_new_tokens` (eager target steps; a compiled target
keeps one verify shape). `baseline` decodes with the target alone through the same machinery, so
a speedup compares like with like.

`decoder.draft_length` other than `fixed` picks each round's length with a policy of
`specdistill.decode.draft_length` (it reads q and earlier rounds only, so the rule stays
lossless); a round of 0 drafts is a plain target step, after which the drafter lags and catches
up on those tokens in the first step of its next round. A compiled target pads verifies to a few
widths (`verify_widths`), a compiled drafter feeds a long catch-up in power-of-two chunks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from specdistill.data.pairs import check_vocab, match_vocab, vocab_size
from specdistill.data.runtime import ConfigError, padded_positions
from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import (
    accept_prefix,
    expected_alpha,
    greedy_agreement,
    probs_from_logits,
    sample_from,
    uniforms,
    verify_sampling,
)
from specdistill.decode.cache import ModelRunner, bucket_capacity, check_rollback
from specdistill.decode.draft_length import (
    MIN_OVERHEAD,
    POLICIES,
    SCOPES,
    DraftCosts,
    chunk_widths,
    make_policy,
    measure_costs,
    verify_widths,
)
from specdistill.decode.draft_vocab import draft_vocab_of, subset_head
from specdistill.decode.parallel import DRAFTING, generate_parallel, resolve_mask_token


@dataclass(frozen=True)
class DecoderConfig:
    """How to decode; `lenience` < 1 is DistillSpec's lossy rule (report it as lossy)."""

    gamma: int = 4
    max_new_tokens: int = 64
    sampling: Sampling = field(default_factory=Sampling)
    lenience: float = 1.0
    eos_token_id: tuple[int, ...] = ()
    cache: str = "auto"  # auto (static on CUDA, dynamic on CPU) | static | dynamic
    # auto: CUDA graphs on CUDA only; True: also inductor on CPU; "drafter": compile the drafter's
    # steps only (the target, and so the target-only baseline, stays eager)
    compile: str | bool = "auto"
    record_probs: bool = False  # keep the target's probabilities per verified position
    host_sync_every: int = 0  # target-only decoding: tokens reach the host every N steps; 0: auto
    # auto: on CPU, verify and catch-up steps (2-16 tokens) run linears as weight @ x.T, which
    # costs about one 1-token step (decode.cpu_matmul); linear: F.linear everywhere
    cpu_matmul: str = "auto"
    # Per-round draft length (decode.draft_length): fixed (gamma every round) | heuristic
    # (transformers' +2/-1 schedule from gamma) | confidence (expected gain of the drafter's
    # calibrated confidence); the adaptive ones draft at most `max_draft` per round, fall back to
    # plain target steps when drafting does not pay (`draft_floor`), and probe every `probe_every`
    # such steps. `draft_scope`: batch (one length for all rows) | row (each row its own).
    draft_length: str = "fixed"
    max_draft: int = 8
    draft_scope: str = "batch"
    draft_floor: bool = True
    probe_every: int = 8
    draft_costs: DraftCosts | None = None  # None: measured on the pair at first use
    # autoregressive: gamma drafter steps per round | parallel: one drafter forward over the
    # new tokens + gamma-1 mask tokens proposes all gamma (decode.parallel; a PARD drafter)
    drafting: str = "autoregressive"
    mask_token_id: int | None = None  # parallel: None reads the drafter's config.mask_token_id
    # auto: the drafter's head scores only its config's `draft_vocab_ids` when it has them (the
    # distill stage writes them for large vocabularies; decode.draft_vocab) | full: the whole head
    draft_vocab: str = "auto"

    @property
    def lossy(self) -> bool:
        return self.lenience != 1.0


@dataclass
class RoundRecord:
    """One draft/verify round, for online adaptation (p = target, q = drafter).

    `start[r]`: tokens row r had emitted before the round (the drafts continue from there);
    `draft` (B, gamma): proposed tokens; `accepted` (B,): how many were kept; `next_token` (B,):
    the target's correction or bonus token; `target_probs` (B, gamma+1, V) fp32 softmax of the
    target's raw (temperature-1) logits at each verified position, if `record_probs`.
    Rows that were already finished are flagged in `active`.
    """

    start: list[int]
    draft: torch.Tensor
    accepted: torch.Tensor
    next_token: torch.Tensor
    active: list[bool]
    target_probs: torch.Tensor | None = None
    lengths: list[int] | None = None  # drafts row r verified, when rows differ (draft_scope=row)


@dataclass
class DecodeOutput:
    """New tokens per row (EOS included when hit) and the counters the report is built from."""

    tokens: list[list[int]]
    target_forwards: int = 0  # decode-time forwards of the target (prefill excluded)
    drafter_forwards: int = 0
    rounds: list[RoundRecord] = field(default_factory=list)
    block_tokens: int = 0  # sum over active row-rounds of accepted + 1
    row_rounds: int = 0
    alpha_sum: float = 0.0  # sum over acceptance trials of sum_x min(p, q)
    trials: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # by draft position
    trials_at: list[int] = field(default_factory=list)
    # row-rounds by drafts verified (index 0: plain target steps of the draft-length floor)
    draft_lengths: list[int] = field(default_factory=list)

    @property
    def mean_draft_length(self) -> float:
        return sum(k * n for k, n in enumerate(self.draft_lengths)) / max(self.row_rounds, 1)

    @property
    def tau(self) -> float:
        return self.block_tokens / max(self.row_rounds, 1)

    @property
    def alpha(self) -> float:
        return self.alpha_sum / max(self.trials, 1)


def model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters())
    return param.device, param.dtype


def check_decoder_config(cfg: DecoderConfig) -> None:
    """Reject bad settings before any decoding, naming the config field."""
    s = cfg.sampling
    if not isinstance(cfg.gamma, int) or cfg.gamma < 1:
        raise ConfigError(f"decoder.gamma={cfg.gamma!r} must be an integer >= 1 (or auto)")
    if not isinstance(cfg.max_new_tokens, int) or cfg.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens!r} must be an integer >= 1")
    s.check("decoder.sampling")
    if not 0.0 < cfg.lenience <= 1.0:
        raise ConfigError(f"decoder.lenience={cfg.lenience} must lie in (0, 1] (1 = lossless)")
    if cfg.cache not in ("auto", "static", "dynamic"):
        raise ConfigError(f"decoder.cache={cfg.cache!r}: use auto, static or dynamic")
    if not isinstance(cfg.host_sync_every, int) or cfg.host_sync_every < 0:
        raise ConfigError(
            f"decoder.host_sync_every={cfg.host_sync_every!r} must be an integer >= 0 (0 = auto)"
        )
    if cfg.cpu_matmul not in ("auto", "linear"):
        raise ConfigError(f"decoder.cpu_matmul={cfg.cpu_matmul!r}: use auto or linear")
    if cfg.compile not in ("auto", True, False, "drafter"):
        raise ConfigError(f"decoder.compile={cfg.compile!r}: use auto, true, false or drafter")
    if cfg.draft_length not in POLICIES:
        raise ConfigError(f"decoder.draft_length={cfg.draft_length!r}: use {', '.join(POLICIES)}")
    if (
        isinstance(cfg.max_draft, bool)
        or not isinstance(cfg.max_draft, int)
        or not (1 <= cfg.max_draft <= 15)
    ):
        raise ConfigError(f"decoder.max_draft={cfg.max_draft!r} must be an integer in 1..15")
    if cfg.draft_scope not in SCOPES:
        raise ConfigError(f"decoder.draft_scope={cfg.draft_scope!r}: use {' or '.join(SCOPES)}")
    if not isinstance(cfg.draft_floor, bool):
        raise ConfigError(f"decoder.draft_floor={cfg.draft_floor!r} must be true or false")
    if (
        isinstance(cfg.probe_every, bool)
        or not isinstance(cfg.probe_every, int)
        or not (1 <= cfg.probe_every <= 64)
    ):
        raise ConfigError(f"decoder.probe_every={cfg.probe_every!r} must be an integer in 1..64")
    if cfg.draft_costs is not None:
        dc = cfg.draft_costs
        for name in ("c", "verify_per_token", "round_overhead", "draft_per_token"):
            v = getattr(dc, name)
            low = MIN_OVERHEAD if name == "round_overhead" else 0  # a verify may undercut a step
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v < 100:
                raise ConfigError(f"decoder.draft_{name}={v!r} must be a number >= {low} (or auto)")
    if cfg.drafting not in DRAFTING:
        raise ConfigError(f"decoder.drafting={cfg.drafting!r}: use {' or '.join(DRAFTING)}")
    if cfg.draft_vocab not in ("auto", "full"):
        raise ConfigError(
            f"decoder.draft_vocab={cfg.draft_vocab!r}: use auto (the drafter's config "
            "draft_vocab_ids when present) or full"
        )
    if cfg.compile is True and cfg.cache == "dynamic":
        raise ConfigError(
            "decoder.compile=true compiles fixed-shape steps over a static cache: "
            "set decoder.cache=static or auto"
        )


def check_pair_for_decoding(target, drafter, tokenizer_len: int | None = None) -> int:
    """Same device, same dtype, compatible vocabularies; returns the common vocab size."""
    t_dev, t_dtype = model_device_dtype(target)
    d_dev, d_dtype = model_device_dtype(drafter)
    if t_dev != d_dev:
        raise ConfigError(
            f"pair.drafter is on {d_dev} but pair.target is on {t_dev}: load both on one device"
        )
    if t_dtype != d_dtype:
        raise ConfigError(
            f"pair.drafter has dtype {d_dtype} but pair.target has {t_dtype}: load both with the "
            "same dtype (the `dtype` setting)"
        )
    tv, dv = vocab_size(target), vocab_size(drafter)
    if tokenizer_len is None:
        if tv != dv:
            raise ConfigError(
                f"target and drafter vocab sizes differ ({tv} vs {dv}): pass the tokenizer's "
                "length so padding can be told apart from a different tokenizer (pair.tokenizer)"
            )
        tokenizer_len = tv
    return check_vocab(tv, dv, tokenizer_len)


class SpeculativeDecoder:
    """Draft with q (drafter), verify with p (target); lossless unless `lenience` < 1."""

    def __init__(
        self, target, drafter, cfg: DecoderConfig, *, tokenizer_len: int | None = None
    ) -> None:
        check_decoder_config(cfg)
        self.vocab = check_pair_for_decoding(target, drafter, tokenizer_len)
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
        # auto: 8 on CUDA, where the host can queue steps ahead; 1 on CPU, where it cannot and
        # steps past an EOS would only cost time
        self.sync_every = cfg.host_sync_every or (8 if cuda else 1)
        self.weight_major = cfg.cpu_matmul == "auto" and self.device.type == "cpu"
        # most drafts a round may verify: gamma, or max_draft for the adaptive policies
        self.max_draft = cfg.gamma if cfg.draft_length == "fixed" else cfg.max_draft
        fixed = cfg.draft_length == "fixed"
        self.verify_widths = [self.max_draft + 1] if fixed else verify_widths(self.max_draft)
        self._costs = cfg.draft_costs
        self._measured: dict[int, DraftCosts] = {}  # by batch size
        self._policy = None
        self.parallel = cfg.drafting == "parallel"
        self.mask_token_id = (
            resolve_mask_token(drafter, cfg.mask_token_id, self.vocab) if self.parallel else None
        )
        ids = draft_vocab_of(drafter) if cfg.draft_vocab == "auto" else None
        if ids is not None and self.mask_token_id is not None and self.mask_token_id in ids:
            ids = [t for t in ids if t != self.mask_token_id]  # never draft the mask token
        self.draft_head = subset_head(drafter, ids) if ids and drafter is not target else None

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
            return dataclasses.replace(self._costs, parallel=self.parallel)
        if batch not in self._measured:
            if input_ids is None:
                raise ValueError("measuring the draft costs needs a prompt")
            ids, _ = self._prepare(input_ids[:1], None)
            self._measured[batch] = measure_costs(self, ids.repeat(batch, 1))
        return self._measured[batch]

    def _arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device)

    # ---------------------------------------------------------------- shared setup
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
            weight_major=self.weight_major,
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
        compile here, untimed): target 1-token and (gamma+1)-token, drafter 1- and 2-token."""
        ids, _ = self._prepare(input_ids, None)
        plen = ids.shape[1]
        fixed = self.cfg.draft_length == "fixed"
        # drafter catch-up widths: 2 after a fully accepted round, powers of two after the floor
        catch = (2,) if fixed else (2, 4, 8, 16)
        for model, cap, steps in (  # (tokens fed, logits kept) exactly as the loops call them
            (self.target, plen + self.cfg.max_new_tokens + 1, ((1, 1),)),
            (self.target, self.spec_slots(1, plen), tuple((w, w) for w in self.verify_widths)),
            (self.drafter, self.spec_slots(1, plen), self._drafter_shapes(catch)),
        ):
            runner = self._runner(model, cap)
            self._prefill([runner], ids, torch.ones_like(ids, dtype=torch.bool), True)
            for width, keep in steps:
                for _ in range(2):
                    runner.forward(ids[:, -1:].repeat(1, width), keep=keep)
                    runner.rollback(runner.length - width)

    def _drafter_shapes(self, catch: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """(tokens fed, logits kept) of the drafter's decode steps: 1-token drafts and catch-ups,
        or a parallel round's one forward over lag + t + gamma-1 masks (lag 0..gamma)."""
        g = self.max_draft
        if self.parallel:
            return tuple((g + lag, g) for lag in range(g + 1))
        return ((1, 1), *((w, 1) for w in catch))

    @staticmethod
    def _attn(runner: ModelRunner, mask: torch.Tensor, width: int) -> torch.Tensor:
        """The 2-D mask for a step: full width over a static cache (one shape for compiled
        steps; slots past the step are causally masked anyway), else the slots in use."""
        return mask[:, : runner.capacity] if runner.static else mask[:, :width]

    def _prefill(self, runners, ids, mask, dense):
        """Feed all prompt tokens but the last (it opens the first round): both caches alike."""
        if ids.shape[1] > 1:
            attn = None if dense else mask[:, :-1]
            pos = None if dense else padded_positions(mask)[:, :-1]
            for r in runners:
                r.forward(ids[:, :-1], attn, pos, keep=1, prefill=True)
        return ids[:, -1], mask.long().sum(1) - 1  # pending token, its position

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
        t, pos = self._prefill([runner], ids, mask0, dense)
        out = DecodeOutput(tokens=[[] for _ in range(b)])
        done = [False] * b
        pending: list[torch.Tensor] = []  # tokens still on the device
        while not all(done):
            length = runner.length
            if not dense:  # batch 1 runs without a mask: no per-step write to keep it current
                mask[:, length] = True
            attn = None if dense else self._attn(runner, mask, length + 1)
            logits = runner.forward(t[:, None], attn, None if dense else pos[:, None], keep=1)[
                :, -1
            ]
            if s.greedy:
                t = logits.argmax(-1)
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
                        done[r] = self._emit(out.tokens[r], toks)
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
        if self.parallel:
            return generate_parallel(self, input_ids, attention_mask, generator)
        cfg, s, kmax = self.cfg, self.cfg.sampling, self.max_draft
        adaptive = cfg.draft_length != "fixed"
        ids, mask0 = self._prepare(input_ids, attention_mask)
        policy = self.get_policy(ids[:, mask0[0]][:1] if adaptive else None)
        if adaptive:
            policy.set_costs(self.draft_costs(ids[:, mask0[0]][:1], ids.shape[0]))
        b, plen = ids.shape
        dense = b == 1
        slots = self.spec_slots(b, plen)
        cap = self._capacity(slots)
        tgt, dft = self._runner(self.target, slots), self._runner(self.drafter, slots)
        mask = torch.zeros(b, cap, dtype=torch.bool, device=self.device)
        mask[:, :plen] = mask0
        # With the floor, the drafter reads the prompt only when a round first drafts: a decode
        # that never drafts costs what target-only decoding does (no drafter prefill).
        drafter_ready = not (adaptive and cfg.draft_floor)
        t, pos = self._prefill([tgt, dft] if drafter_ready else [tgt], ids, mask0, dense)
        out = DecodeOutput(
            tokens=[[] for _ in range(b)],
            accepted_at=[0] * kmax,
            trials_at=[0] * kmax,
            draft_lengths=[0] * (kmax + 1),
        )
        done = [False] * b
        # Tokens in the target's cache the drafter has not seen yet, oldest first: the last draft
        # of a round some row accepted whole, and the tokens of plain target steps (floor).
        lag: list[torch.Tensor] = []
        steps = torch.arange(self.verify_widths[-1], device=self.device)
        policy.start(b)
        while not all(done):
            length = tgt.length
            active = [not d for d in done]
            budget = self._draft_width(out.tokens, done)
            k = policy.plan(budget, active).k if adaptive else budget
            if not dense:
                mask[:, length : length + k + 1] = True
            if k == 0:  # the floor: a plain target step, as lean as `baseline`'s
                lag.append(t)  # the target sees t now, the drafter in its next drafting round
                t = self._target_step(tgt, mask, t, pos, dense, out, active, done, generator)
                pos = pos + 1
                policy.observe_step(active)
                continue
            # Draft up to k tokens with q (the first step also catches the drafter up).
            draft, q_probs, confs = [], [], []
            if k:
                if not drafter_ready:
                    self._prefill([dft], ids, mask0, dense)
                    drafter_ready = True
                x = torch.stack([*lag, t], 1)
                lag = []
                xpos = None if dense else pos[:, None] - x.shape[1] + 1 + self._arange(x.shape[1])
                x, xpos = self._catch_up(dft, mask, x, xpos, dense)
            for i in range(k):
                attn = None if dense else self._attn(dft, mask, dft.length + x.shape[1])
                logits = match_vocab(dft.forward(x, attn, xpos, keep=1)[:, -1], self.vocab)
                if s.greedy:
                    d = logits.argmax(-1)
                    qd = torch.softmax(logits.float(), -1) if policy.reads_q else None
                else:
                    qd = probs_from_logits(logits, s)
                    d = sample_from(qd, uniforms((b,), generator, self.device))
                    q_probs.append(qd)
                draft.append(d)
                if policy.reads_q:  # the drafter's probability of its own draft (q only)
                    conf = qd.gather(-1, d[:, None])[:, 0].tolist()
                    confs.append(conf)
                    if i + 1 < k and not policy.keep_drafting(i + 1, conf):
                        break
                if i + 1 < k:
                    x = d[:, None]
                    xpos = None if dense else pos[:, None] + i + 1
            kd = len(draft)
            out.drafter_forwards += kd
            if not dense and kd < k:  # slots planned for drafts that were not drafted
                mask[:, length + kd + 1 : length + k + 1] = False
            lengths = policy.lengths(kd) if adaptive else [kd] * b
            row_cut = adaptive and any(n < kd for n in lengths)
            draft_t = (
                torch.stack(draft, 1)
                if draft
                else torch.zeros(b, 0, dtype=t.dtype, device=t.device)
            )
            q = torch.stack(q_probs, 1) if q_probs else None
            n, nxt, alpha_pos, t_logits, width = self._verify(
                tgt, mask, t, pos, draft_t, q, lengths if row_cut else None, dense, generator, steps
            )
            out.target_forwards += 1
            host = self._settle(
                out, done, active, (draft_t, n, nxt, alpha_pos), t_logits, lengths, row_cut
            )
            n_list = [row[kd] for row in host]
            if adaptive:
                policy.observe(lengths, n_list, active, [list(c) for c in zip(*confs)] or None)
            # Roll back to the longest accepted prefix; shorter rows keep masked holes.
            maxn = max(n_list)
            new_len = length + 1 + maxn
            if not dense:
                mask[:, length + 1 : length + width] &= steps[None, : width - 1] < n[:, None]
            tgt.rollback(new_len)
            if kd == 0:  # a plain target step: the drafter has not seen t
                lag.append(t)
            elif maxn == kd:  # the drafter never saw d_K: feed it first next round
                lag = [draft_t[:, -1]]
            else:
                dft.rollback(new_len)
            pos = pos + 1 + n
            t = nxt
        return out

    def _verify(self, tgt, mask, t, pos, draft_t, q, lengths, dense: bool, generator, steps):
        """Verify [t, d_1..d_K] with p in one forward (a compiled target pads to a few widths;
        batched: the padding's slots are opened in `mask`) and apply the acceptance rule, the
        same for every drafting mode. q (B, K, V): the drafts' distributions (sampling; None when
        greedy or K = 0); lengths: drafts row r verifies, when rows were cut short. Returns
        (accepted counts, next tokens, per-position alpha, target logits, verify width);
        steps: the caller's arange over the widest verify."""
        s, (b, kd), length = self.cfg.sampling, draft_t.shape, tgt.length
        vin = torch.cat([t[:, None], draft_t], 1)
        width = self._verify_width(kd)
        if width > kd + 1:
            vin = torch.cat([vin, t[:, None].expand(b, width - kd - 1)], 1)
            if not dense:
                mask[:, length + kd + 1 : length + width] = True
        attn = None if dense else self._attn(tgt, mask, length + width)
        vpos = None if dense else pos[:, None] + steps[:width]
        t_logits = tgt.forward(vin, attn, vpos, keep=width)[:, : kd + 1, : self.vocab]
        len_t = torch.tensor(lengths, device=self.device) if lengths is not None else None
        if s.greedy:  # one argmax serves the verdict and the per-position agreement
            ok, target_tok = greedy_agreement(draft_t, t_logits)
            if len_t is not None:
                ok &= steps[None, :kd] < len_t[:, None]
            n, nxt = accept_prefix(ok, target_tok)
            return n, nxt, ok.float(), t_logits, width
        p = probs_from_logits(t_logits, s)
        q = q if q is not None else torch.zeros_like(p[:, :0])
        n, nxt = verify_sampling(
            draft_t,
            p,
            q,
            uniforms((b, kd), generator, self.device),
            uniforms((b,), generator, self.device),
            self.cfg.lenience,
            lengths=len_t,
        )
        return n, nxt, expected_alpha(p[:, :kd], q), t_logits, width

    def _target_step(self, tgt, mask, t, pos, dense, out, active, done, generator):
        """One target-only step inside a speculative decode (the floor); returns the next token."""
        s, b = self.cfg.sampling, t.shape[0]
        attn = None if dense else self._attn(tgt, mask, tgt.length + 1)
        xpos = None if dense else pos[:, None]
        logits = tgt.forward(t[:, None], attn, xpos, keep=1)[:, -1, : self.vocab]
        if s.greedy:
            nxt = logits.argmax(-1)
        else:
            nxt = sample_from(probs_from_logits(logits, s), uniforms((b,), generator, self.device))
        out.target_forwards += 1
        if self.cfg.record_probs:
            out.rounds.append(
                RoundRecord(
                    start=[len(tk) for tk in out.tokens],
                    draft=t[:, None][:, :0],
                    accepted=torch.zeros_like(nxt),
                    next_token=nxt,
                    active=active,
                    target_probs=torch.softmax(logits.float(), -1)[:, None],
                )
            )
        for r, tok in enumerate(nxt.tolist()):
            if active[r]:
                out.row_rounds += 1
                out.block_tokens += 1
                out.draft_lengths[0] += 1
                done[r] = self._emit(out.tokens[r], [tok])
        return nxt

    def _catch_up(self, dft: ModelRunner, mask, x, xpos, dense: bool):
        """Feed the drafter all but the last chunk of x (tokens it lags behind, then t) in
        chunks of a few widths (compiled steps: powers of two); returns the last chunk."""
        if x.shape[1] <= 2 or not (self.compile and dft.static):
            return x, xpos
        widths = chunk_widths(x.shape[1])
        start = 0
        for w in widths[:-1]:
            cx = x[:, start : start + w]
            cpos = None if dense else xpos[:, start : start + w]
            attn = None if dense else self._attn(dft, mask, dft.length + w)
            dft.forward(cx, attn, cpos, keep=1)
            start += w
        return x[:, start:], None if dense else xpos[:, start:]

    def _verify_width(self, k: int) -> int:
        """Tokens the verify step feeds: k + 1, or the next of a few widths when the target's
        steps are compiled (padding past the drafts is verified and rolled back unread)."""
        if not self.compile_target or self.cfg.draft_length == "fixed":
            return k + 1
        return next(w for w in self.verify_widths if w >= k + 1)

    def _draft_width(self, tokens: list[list[int]], done: list[bool]) -> int:
        """Drafts this round: gamma, or fewer when no unfinished row has the budget left to use
        them (a round emits at most drafts + 1 tokens), so a decode's last round drafts and
        verifies no token past `max_new_tokens`. A compiled target keeps gamma: one verify shape
        (drafter steps are 1 or 2 tokens either way)."""
        g = self.max_draft
        if self.compile_target and self.cfg.draft_length == "fixed":
            return g
        left = max(self.cfg.max_new_tokens - len(row) for row, d in zip(tokens, done) if not d)
        return max(1, min(g, left - 1))

    def _settle(
        self,
        out: DecodeOutput,
        done: list[bool],
        active: list[bool],
        verdict: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        t_logits: torch.Tensor,
        lengths: list[int],
        row_cut: bool = False,
    ) -> list[list]:
        """The round's one host sync (drafts, accepted counts, next tokens, per-position alpha;
        token ids < 2^24 are exact in fp32), then its counters, its record and its tokens, the
        same for every drafting mode. Marks finished rows in `done`; returns the host rows."""
        draft_t, n, nxt, alpha_pos = verdict
        k = draft_t.shape[1]
        host = torch.cat([draft_t, n[:, None], nxt[:, None], alpha_pos], 1).float().tolist()
        host = [[int(v) for v in row[: k + 2]] + row[k + 2 :] for row in host]
        self._record(out, host, active, k, lengths)
        if self.cfg.record_probs:
            out.rounds.append(
                RoundRecord(
                    start=[len(tk) for tk in out.tokens],
                    draft=draft_t,
                    accepted=n,
                    next_token=nxt,
                    active=active,
                    target_probs=torch.softmax(t_logits.float(), -1),
                    lengths=lengths if row_cut else None,
                )
            )
        for r, row in enumerate(host):
            if not done[r]:
                done[r] = self._emit(out.tokens[r], [*row[: row[k]], row[k + 1]])
        return host

    def _emit(self, row: list[int], tokens: list[int]) -> bool:
        """Append up to the budget, stopping after an EOS; True when the row is finished."""
        eos = self.cfg.eos_token_id
        for tok in tokens:
            row.append(tok)
            if tok in eos or len(row) >= self.cfg.max_new_tokens:
                return True
        return False

    @staticmethod
    def _record(
        out: DecodeOutput, host: list[list], active: list[bool], g: int, lengths: list[int]
    ) -> None:
        """Acceptance counters over the rows still decoding (trials stop at the first reject);
        row r verified lengths[r] <= g of the round's g drafts."""
        for row, a, kr in zip(host, active, lengths):
            if not a:
                continue
            n = row[g]
            out.row_rounds += 1
            out.block_tokens += n + 1
            out.accepted += n
            out.draft_lengths[kr] += 1
            for j in range(min(n + 1, kr)):  # positions that were put to the test
                out.trials_at[j] += 1
                out.accepted_at[j] += int(j < n)
                out.alpha_sum += row[g + 2 + j]
                out.trials += 1
