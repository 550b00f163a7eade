"""Parallel drafting beside autoregressive drafting, for the same target, in one run.

    python -m specdistill.decode.bench pair=toy pair.drafter=AR_DRAFTER \\
        compare_parallel=PARALLEL_DRAFTER 'parallel_gammas=[2,3,4,5,6,8]' output_dir=OUT

p = target, q = drafter. For every gamma of `parallel_gammas`, `pair.drafter` drafts
autoregressively (gamma drafter steps per round) and the parallel drafter at `compare_parallel`
(a PARD drafter: its config.json names the mask token) drafts with one forward per round
(`decoder.drafting=parallel`). Every timed repeat decodes the prompts with the target alone
once, then with every entry in turn, prompt by prompt, so load drifts hit all alike; a speedup
is the median over repeats of an entry's tokens/s over the same repeat's target-only tokens/s.
Per entry: the drafter's own alpha by draft position (prompt lookup's drafts apart), tau, the
drafter's cost per round in target steps (gamma c, or one parallel forward of gamma +
accepted-lag tokens, measured), measured and theoretical
speedup (`round_speedup`: per-position acceptance over drafter cost + verify cost), and
losslessness (greedy: token-identical to target-only). Both serving modes unless
`both_modes=false`, `transformers` assisted generation with each drafter as the reference, and
the best gamma per drafting mode by measured speedup. Writes OUT/parallel.json and .md.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.data.models.pairs import load_role, resolve_pair
from specdistill.data.runtime import ConfigError
from specdistill.decode.acceptance import round_speedup
from specdistill.decode.bench.draft import interleaved
from specdistill.decode.config import DEFAULT_GAMMA, DecoderSettings
from specdistill.decode.outputs import emitted_tokens
from specdistill.decode.speculative import DecodeOutput, SpeculativeDecoder
from specdistill.decode.validate.modes import merge, mode_name, repeats_bar
from specdistill.decode.validate.settings import ValidateSettings
from specdistill.decode.validate.stage import setup, warm_up
from specdistill.decode.validate.timing import hf_assisted_speed, step_costs


def parse_gammas(raw: Any) -> list[int]:
    gammas = list(raw or [])
    if not gammas or any(
        isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= 15 for g in gammas
    ):
        raise ConfigError(f"parallel_gammas={gammas!r}: name gammas in 1..15, e.g. [2,3,4,5,6,8]")
    return gammas


def parse_policies(raw: Any) -> list[str]:
    """`parallel_policies`: adaptive draft-length policies measured beside the fixed gammas,
    for both drafting modes (at most max(parallel_gammas) drafts a round)."""
    policies = [str(p) for p in (raw or [])]
    known = ["heuristic", "confidence"]
    bad = [p for p in policies if p not in known]
    if bad:
        raise ConfigError(
            f"parallel_policies={policies!r}: name draft-length policies, heuristic or "
            "confidence, or [] for fixed gammas only"
        )
    return policies


def load_parallel_drafter(cfg: DictConfig, st) -> Any:
    """The parallel drafter at `compare_parallel`, on the pair's device and dtype."""
    path = Path(str(cfg.compare_parallel)).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"compare_parallel={cfg.compare_parallel}: no config.json there; point it at a "
            "parallel drafter (distill drafting=parallel writes OUT/best)"
        )
    spec = resolve_pair(OmegaConf.merge(cfg.pair, {"drafter": str(path)}), stage="parallel bench")
    model = load_role(spec, "drafter", device=st.device, dtype=st.dtype).eval()
    if getattr(model.config, "mask_token_id", None) is None:
        raise ConfigError(
            f"compare_parallel={path}: its config.json has no mask_token_id; it is not a "
            "parallel drafter (train one with distill drafting=parallel)"
        )
    return model


@torch.inference_mode()
def first_draft_agreement(target, drafter, batches, continuations: list[list[int]]) -> float:
    """Greedy alpha at draft position 1 over *every* position of the target's continuations:
    the share the drafter's argmax (q) predicts from the true prefix. The decoder's position-1
    alpha is measured at round starts only, which depend on the drafter (each drafting mode
    starts rounds after its own rejections), so this is the like-for-like figure."""
    rows = [ids[j, mask[j].bool()] for ids, mask in batches for j in range(ids.shape[0])]
    device = next(target.parameters()).device  # prompts stay on the host; the models may not
    hits = total = 0
    for prompt, cont in zip(rows, continuations):
        if not cont:
            continue
        seq = torch.cat([prompt.cpu(), torch.tensor(cont)]).to(device)[None]
        span = slice(prompt.shape[0] - 1, prompt.shape[0] - 1 + len(cont))
        p_logits = target(seq).logits[0, span]
        q_logits = drafter(seq).logits[0, span, : p_logits.shape[-1]]  # padding rows cut
        hits += int((q_logits.argmax(-1) == p_logits.argmax(-1)).sum())
        total += len(cont)
    return hits / max(total, 1)


def run_parallel(cfg: DictConfig) -> dict[str, Any]:
    """Measure autoregressive and parallel drafting at every gamma, in each serving mode."""
    gammas = parse_gammas(cfg.get("parallel_gammas"))
    policies = parse_policies(cfg.get("parallel_policies"))
    vs = ValidateSettings.from_cfg(cfg)
    out_dir = vs.output_dir
    st = setup(cfg, max(gammas), vs)
    par = load_parallel_drafter(cfg, st)
    report: dict[str, Any] = {
        "target": str(st.spec.target),
        "drafter_autoregressive": str(st.spec.drafter),
        "drafter_parallel": str(cfg.compare_parallel),
        "mask_token_id": int(par.config.mask_token_id),
        "gammas": gammas,
        "policies": policies,
        "modes": {},
    }
    for ds in [vs.decoder, *([vs.other] if vs.other else [])]:
        name = mode_name(ds.sampling.temperature)
        report["modes"][name] = _measure_mode(vs, st, par, ds, gammas, policies)
        atomic_write_json(out_dir / "parallel.json", report)  # a run cut short keeps its modes
    atomic_write_text(out_dir / "parallel.md", parallel_markdown(report))
    return report


def _measure_mode(
    vs: ValidateSettings, st, par, ds: DecoderSettings, gammas: list[int], policies: list[str]
) -> dict[str, Any]:
    seed, reps, iters = vs.seed, vs.repeats, vs.step_time_iters
    n_new = vs.max_new_tokens
    top = max(gammas)

    def make(drafter, drafting: str, gamma: int | str) -> SpeculativeDecoder:
        """gamma: an int (fixed) or an adaptive policy's name (at most `top` drafts, starting
        from 4 for the heuristic)."""
        length = "fixed" if isinstance(gamma, int) else gamma
        settings = ds.replace(drafting=drafting, draft_length=length, max_draft=top)
        g = gamma if isinstance(gamma, int) else min(DEFAULT_GAMMA, top)
        return SpeculativeDecoder(
            st.target,
            drafter,
            settings.decoder_config(n_new, st.eos, g),
            tokenizer_len=len(st.tok),
        )

    t0 = time.perf_counter()
    probe = make(st.drafter, "autoregressive", DEFAULT_GAMMA)
    c, _ = step_costs(probe, st.warm[0][0], iters, DEFAULT_GAMMA)
    decs: dict[tuple[str, int | str], SpeculativeDecoder] = {}
    for g in [*gammas, *policies]:
        decs[("autoregressive", g)] = make(st.drafter, "autoregressive", g)
        decs[("parallel", g)] = make(par, "parallel", g)
    for dec in decs.values():
        # untimed, exactly as validate warms its decoder
        warm_up(dec, st.batches, st.warm, seed)
    fns = {"": probe.baseline} | {f"{m}:{g}": d.generate for (m, g), d in decs.items()}
    rates: dict[str, list[float]] = {k: [] for k in fns}
    first: dict[str, DecodeOutput] = {}
    label = f"bench parallel {mode_name(ds.sampling.temperature)}"
    bar = repeats_bar(reps, st.batches, label if vs.progress else None)
    for rep in range(reps):
        secs, outs = interleaved(fns, st.batches, seed + rep, bar)
        for k in fns:
            rates[k].append(emitted_tokens(outs[k]) / secs[k])
            first.setdefault(k, merge(outs[k]))
    bar.close()
    base = first[""]
    greedy = probe.cfg.sampling.greedy
    rows = [
        _row(st, dec, mode, g, first[f"{mode}:{g}"], base, rates, f"{mode}:{g}", c, iters, top)
        for (mode, g), dec in decs.items()
    ]
    best = {
        m: max((r for r in rows if r["drafting"] == m), key=lambda r: r["speedup"])["gamma"]
        for m in ("autoregressive", "parallel")
    }
    hf = {}
    if vs.hf_assisted:
        for label, drafter in (("autoregressive", st.drafter), ("parallel", par)):
            hf[label] = hf_assisted_speed(
                st.target, drafter, st.tok, st.warm, st.batches, probe.cfg, reps, base
            )
    agreement = None
    if greedy:
        agreement = {
            label: round(first_draft_agreement(st.target, d, st.batches, base.tokens), 4)
            for label, d in (("autoregressive", st.drafter), ("parallel", par))
        }
    s = probe.cfg.sampling
    return {
        "first_draft_agreement": agreement,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "c_autoregressive": round(c, 4),
        "baseline_tokens_per_s": round(statistics.median(rates[""]), 2),
        "rows": rows,
        "best_gamma": best,
        "hf_assisted": hf,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _row(st, dec, mode: str, g: int | str, o: DecodeOutput, base: DecodeOutput, rates,
         key: str, c: float, iters: int, top: int) -> dict[str, Any]:  # fmt: skip
    """One drafting mode at one gamma (or adaptive policy): acceptance, the round's measured
    costs, the theoretical and the measured speedup (paired with the same repeat's baseline)."""
    alpha_at = [a / t if t else 0.0 for a, t in zip(o.accepted_at, o.trials_at)]
    fixed = isinstance(g, int)
    # an adaptive row's verify is priced at its mean drafts per round
    kv = g if fixed else max(1, round(o.mean_draft_length))
    if mode == "parallel":  # one forward over the accepted lag + t + g-1 masks
        lag = round(o.accepted / max(o.row_rounds, 1))
        width = (g if fixed else top) + lag  # adaptive: priced at the most proposals
        draft_cost, verify = step_costs(
            dec, st.warm[0][0], max(4, iters // 4), kv, drafter_width=width
        )
        draft_cost *= o.drafter_forwards / max(o.target_forwards, 1)
    else:
        _, verify = step_costs(dec, st.warm[0][0], max(4, iters // 4), kv)
        draft_cost = c * o.drafter_forwards / max(o.target_forwards, 1)
    # fixed: per-position acceptance over the round's cost; adaptive: tau over it
    theory = round_speedup(alpha_at, draft_cost, verify) if fixed else o.tau / (draft_cost + verify)
    ratios = [r / b for r, b in zip(rates[key], rates[""])]
    return {
        "drafting": mode,
        "gamma": g,
        "alpha": round(o.alpha, 4),
        "alpha_at": [round(a, 3) for a in alpha_at],
        # the drafter's own drafts (prompt lookup's left out): its masks' acceptance by depth
        "drafter_alpha": round(o.drafter_alpha, 4),
        "drafter_alpha_at": [round(a, 3) for a in o.drafter_alpha_at()],
        "tau": round(o.tau, 3),
        "drafter_forwards_per_round": round(o.drafter_forwards / max(o.target_forwards, 1), 2),
        "drafter_cost_per_round": round(draft_cost, 3),
        "verify_cost": round(verify, 3),
        "mean_draft_length": round(o.mean_draft_length, 3),
        "theoretical_speedup": round(theory, 3),
        "speedup": round(statistics.median(ratios), 3),
        "speedup_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
        "tokens_per_s": round(statistics.median(rates[key]), 2),
        "lossless": o.tokens == base.tokens if dec.cfg.sampling.greedy else None,
    }


def parallel_markdown(report: dict[str, Any]) -> str:
    """One table per serving mode: (drafting, gamma) as rows."""
    lines = [
        "# Parallel vs autoregressive drafting",
        "",
        f"target {report['target']}; autoregressive drafter {report['drafter_autoregressive']}; "
        f"parallel drafter {report['drafter_parallel']} (mask token id {report['mask_token_id']})",
        "",
    ]
    for name, m in report["modes"].items():
        lines += [
            f"## {name} (temperature {m['temperature']}): target-only "
            f"{m['baseline_tokens_per_s']} tokens/s, c (AR drafter step) {m['c_autoregressive']}",
            "",
            "| drafting | gamma | the drafter's alpha by draft position | alpha: the drafter's "
            "/ every draft (lookup's too) | tau | drafter forwards/round "
            "| drafter cost/round (target steps) | verify cost | theoretical | measured speedup "
            "(min-max) | lossless |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            lo, hi = r["speedup_min_max"]
            at = " ".join(f"{a:.2f}" for a in r.get("drafter_alpha_at", r["alpha_at"]))
            alpha = f"{r.get('drafter_alpha', 'n/a')} / {r['alpha']}"
            gamma = r["gamma"]
            if not isinstance(gamma, int):  # an adaptive policy: its mean drafts per round
                gamma = f"{gamma} (mean {r.get('mean_draft_length')}, max {max(report['gammas'])})"
            lines.append(
                f"| {r['drafting']} | {gamma} | {at} | {alpha} | {r['tau']} | "
                f"{r['drafter_forwards_per_round']} | {r['drafter_cost_per_round']} | "
                f"{r['verify_cost']} | {r['theoretical_speedup']}x | {r['speedup']}x ({lo}-{hi}) "
                f"| {r['lossless']} |"
            )
        for label, hf in (m.get("hf_assisted") or {}).items():
            lines.append(
                f"| HF assisted ({label} drafter as assistant_model) | | | | | | | | | "
                f"{hf['speedup']}x | {hf['same_tokens']} |"
            )
        b = m["best_gamma"]
        agree = m.get("first_draft_agreement")
        lines += [
            "",
            *(
                [
                    f"- greedy alpha at draft position 1 over every continuation position "
                    f"(not only round starts): autoregressive {agree['autoregressive']}, "
                    f"parallel {agree['parallel']}"
                ]
                if agree
                else []
            ),
            f"- best gamma by measured speedup: autoregressive {b['autoregressive']}, "
            f"parallel {b['parallel']}",
            "",
        ]
    return "\n".join(lines) + "\n"
