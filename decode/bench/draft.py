"""Draft-length policies side by side, interleaved in one process on one loaded pair.

    python -m specdistill.decode.bench pair=toy output_dir=OUT \\
        'compare_draft=[1,2,4,8,heuristic,confidence]'

Entries: an integer K or a draft-length policy (`heuristic`, `confidence`), with optional
suffixes `-lookup` (prompt lookup beside the drafter) and `-parallel` (the PARD drafter at
`compare_parallel`), e.g. `4-lookup`. `compare_parallel=DIR` alone measures `parallel_gammas`
and `parallel_policies` with both drafters. Every timed repeat decodes with the target p alone,
then with every entry in turn, prompt by prompt, so load drifts hit all entries alike; a speedup
is the median over repeats of an entry's tokens/s over that repeat's target-only tokens/s. Both
serving modes unless `both_modes=false`, with `transformers` assisted generation beside.
Writes OUT/draft.json and OUT/draft.md. p = target, q = drafter.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.data.models.pairs import load_role, resolve_pair
from specdistill.data.runtime import ConfigError
from specdistill.decode.config import DEFAULT_GAMMA, DecoderSettings
from specdistill.decode.outputs import emitted_tokens
from specdistill.decode.speculative import DecodeOutput, SpeculativeDecoder
from specdistill.decode.validate.engines.hf_assisted import hf_assisted_speed
from specdistill.decode.validate.engines.ours import warm_up
from specdistill.decode.validate.modes import merge, mode_name, positions, repeats_bar
from specdistill.decode.validate.settings import ValidateSettings
from specdistill.decode.validate.setup import setup
from specdistill.decode.validate.timing import step_costs

SUFFIXES = {
    "lookup": {"lookup": True},  # prompt lookup beside the drafter (decode.lookup)
    "parallel": {"drafting": "parallel"},  # the compare_parallel drafter, one forward a round
}


def parse_entries(entries: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, decoder overrides) per entry."""
    if not entries:
        raise ConfigError("compare_draft=[]: name entries, e.g. [1,2,4,8,heuristic,confidence]")
    out: list[tuple[str, dict[str, Any]]] = []
    for e in entries:
        text = str(e)
        head, *suffixes = text.split("-")
        fixed = head.isdigit() and not isinstance(e, bool) and 1 <= int(head) <= 15
        if (fixed or head in ("heuristic", "confidence")) and all(x in SUFFIXES for x in suffixes):
            over: dict[str, Any] = (
                {"draft_length": "fixed", "gamma": int(head)} if fixed else {"draft_length": head}
            )
            for x in suffixes:
                over |= SUFFIXES[x]
            out.append(("-".join([f"K={int(head)}" if fixed else head, *suffixes]), over))
        else:
            raise ConfigError(
                f"compare_draft entry {e!r}: use a fixed K 1..15, heuristic or confidence, each "
                "with optional -lookup and -parallel suffixes, e.g. [1,4,4-lookup,4-parallel]"
            )
    return out


def parallel_entries(cfg: DictConfig) -> list[Any]:
    """`compare_parallel` alone: every `parallel_gammas` K and `parallel_policies` policy, with
    the autoregressive drafter and then the parallel one."""
    gammas = list(cfg.get("parallel_gammas") or [])
    if not gammas or any(
        isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= 15 for g in gammas
    ):
        raise ConfigError(f"parallel_gammas={gammas!r}: name gammas in 1..15, e.g. [2,3,4,5,6,8]")
    policies = [str(p) for p in (cfg.get("parallel_policies") or [])]
    if any(p not in ("heuristic", "confidence") for p in policies):
        raise ConfigError(
            f"parallel_policies={policies!r}: name draft-length policies, heuristic or "
            "confidence, or [] for fixed gammas only"
        )
    return [e for g in [*gammas, *policies] for e in (g, f"{g}-parallel")]


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
    the like-for-like figure, since the decoder's position-1 alpha is measured at round starts,
    which depend on each drafting mode's own rejections."""
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


def run_draft(cfg: DictConfig) -> dict[str, Any]:
    """Measure every entry of `compare_draft` in each serving mode; writes draft.json/.md."""
    raw = list(cfg.compare_draft or []) or (
        parallel_entries(cfg) if cfg.get("compare_parallel") else []
    )
    entries = parse_entries(raw)
    vs = ValidateSettings.from_cfg(cfg)
    gammas = [o["gamma"] for _, o in entries if o and "gamma" in o]
    room = max([*gammas, vs.decoder.max_draft, vs.decoder.gamma])
    st = setup(cfg, room, vs)
    par = None
    if any(o.get("drafting") == "parallel" for _, o in entries):
        par = load_parallel_drafter(cfg, st)
    report: dict[str, Any] = {"modes": {}, "entries": [label for label, _ in entries]}
    if par is not None:
        report |= {"drafter_parallel": str(cfg.compare_parallel),
                   "mask_token_id": int(par.config.mask_token_id)}  # fmt: skip
    for ds in [vs.decoder, *([vs.other] if vs.other else [])]:
        name = mode_name(ds.sampling.temperature)
        report["modes"][name] = _measure_mode(vs, st, ds, entries, par)
        atomic_write_json(vs.output_dir / "draft.json", report)  # a run cut short keeps its modes
    atomic_write_text(vs.output_dir / "draft.md", draft_markdown(report))
    return report


def _measure_mode(
    vs: ValidateSettings,
    st,
    ds: DecoderSettings,
    entries: list[tuple[str, dict[str, Any]]],
    par: Any = None,
) -> dict[str, Any]:
    seed, reps, iters = vs.seed, vs.repeats, vs.step_time_iters

    def make(over: dict[str, Any]) -> SpeculativeDecoder:
        """A decoder on `ds` with an entry's settings (gamma, draft_length, ...) over it."""
        gamma = int(over.get("gamma", ds.gamma))
        settings = ds.replace(**{k: v for k, v in over.items() if k != "gamma"})
        return SpeculativeDecoder(
            st.target,
            par if settings.drafting == "parallel" else st.drafter,
            settings.decoder_config(vs.max_new_tokens, st.eos, gamma),
            tokenizer_len=len(st.tok),
        )

    t0 = time.perf_counter()
    probe = make({"draft_length": "fixed", "gamma": DEFAULT_GAMMA})
    # this machine's step costs, for the table's header only (no entry reads them)
    c, verify = step_costs(probe, st.warm[0][0], iters, DEFAULT_GAMMA)
    decs: dict[str, SpeculativeDecoder] = {}
    for label, over in entries:
        dec = decs[label] = make(over)
        warm_up(dec, st.batches, st.warm, seed)
    base_rates: list[float] = []
    rates: dict[str, list[float]] = {label: [] for label in decs}
    first: dict[str, DecodeOutput] = {}
    base_out = None
    fns = {"": probe.baseline} | {label: dec.generate for label, dec in decs.items()}
    label = f"bench {mode_name(ds.sampling.temperature)}"
    bar = repeats_bar(reps, st.batches, label if vs.progress else None)
    for rep in range(reps):
        # interleaved per batch, not per pass: on a shared machine load changes within seconds
        secs, outs = interleaved(fns, st.batches, seed + rep, bar)
        base_rates.append(emitted_tokens(outs[""]) / secs[""])
        base_out = base_out or merge(outs[""])
        for label in decs:
            rates[label].append(emitted_tokens(outs[label]) / secs[label])
            first.setdefault(label, merge(outs[label]))
    bar.close()
    assert base_out is not None
    base = statistics.median(base_rates)
    greedy = probe.cfg.sampling.greedy
    rows = [
        _row(label, dec, first[label], rates[label], base_rates, base_out, greedy)
        for label, dec in decs.items()
    ]
    hf = None
    if vs.hf_assisted:
        hf = hf_assisted_speed(
            st.target, st.drafter, st.tok, st.warm, st.batches, probe.cfg, reps, base_out.tokens
        )
    agreement = None
    if par is not None and greedy:  # like for like: every continuation position, not round starts
        agreement = {
            label: round(first_draft_agreement(st.target, d, st.batches, base_out.tokens), 4)
            for label, d in (("autoregressive", st.drafter), ("parallel", par))
        }
    s = probe.cfg.sampling
    return {
        "first_draft_agreement": agreement,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "c": round(c, 4),
        "verify_cost_gamma4": round(verify, 3),
        "baseline_tokens_per_s": round(base, 2),
        "baseline_spread": [round(min(base_rates), 2), round(max(base_rates), 2)],
        "rows": rows,
        "hf_assisted": hf,
        "seconds": round(time.perf_counter() - t0, 1),
        "notes": [],
    }


def _row(label: str, dec, out: DecodeOutput, rates: list[float], base_rates: list[float],
         base_out: DecodeOutput, greedy: bool) -> dict[str, Any]:  # fmt: skip
    """One entry's figures; the speedup is paired: each repeat over the same repeat's
    target-only pass."""
    ratios = [r / b for r, b in zip(rates, base_rates)]
    row = {"entry": label, "gamma": dec.max_draft, "drafting": dec.cfg.drafting}
    row |= {"alpha": round(out.alpha, 4), "drafter_alpha": round(out.drafter_alpha, 4)}
    row |= {
        "drafter_forwards_per_round": round(out.drafter_forwards / max(out.target_forwards, 1), 2),
        "tau": round(out.tau, 3),
        "acceptance_by_position": out.acceptance_at(),
        "trials_by_position": list(out.trials_at),
        "mean_draft_length": round(out.mean_draft_length, 3),
        "draft_lengths": list(out.draft_lengths),
    }
    return row | {
        "speedup": round(statistics.median(ratios), 3),
        "speedup_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
        "tokens_per_s": round(statistics.median(rates), 2),
        "lossless": out.tokens == base_out.tokens if greedy else None,
    }


def interleaved(fns: dict[str, Any], batches, seed: int, bar: tqdm | None = None):
    """Run every function on each batch in turn (one generator per function, seeded alike), so
    all of them meet the same load; returns (seconds per function, outputs per function).
    `bar` moves once per batch, after all functions ran on it (never inside a timed call)."""
    gens = {k: torch.Generator(device="cpu").manual_seed(seed) for k in fns}
    secs = dict.fromkeys(fns, 0.0)
    outs: dict[str, list[DecodeOutput]] = {k: [] for k in fns}
    for ids, mask in batches:
        for k, fn in fns.items():
            t0 = time.perf_counter()
            outs[k].append(fn(ids, mask, generator=gens[k]))
            secs[k] += time.perf_counter() - t0
        if bar is not None:
            bar.update(1)
    return secs, outs


def draft_markdown(report: dict[str, Any]) -> str:
    """One table per serving mode: entries as rows (p = target, q = drafter)."""
    lines = ["# Draft-length policies side by side", ""]
    for name, m in report["modes"].items():
        lines += [
            f"## {name} (temperature {m['temperature']}): target-only "
            f"{m['baseline_tokens_per_s']} tokens/s, c {m['c']}",
            "",
            "| entry | tau | acceptance by position | alpha | mean draft length | "
            "drafter forwards/round | speedup (min-max) | lossless |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            lo, hi = r["speedup_min_max"]
            at = positions(r["acceptance_by_position"], r.get("trials_by_position"))
            lines.append(
                f"| {r['entry']} | {r['tau']} | {at}"
                f" | {r['alpha']} | {r['mean_draft_length']} | {r['drafter_forwards_per_round']} | "
                f"{r['speedup']}x ({lo}-{hi}) | "
                f"{r['lossless']} |"
            )
        agree = m.get("first_draft_agreement")
        if agree:
            notes = [
                *m["notes"],
                f"greedy alpha at draft position 1 over every continuation position (not only "
                f"round starts): autoregressive {agree['autoregressive']}, parallel "
                f"{agree['parallel']}",
            ]
            m = {**m, "notes": notes}
        hf = m.get("hf_assisted")
        if hf:
            lines.append(f"| HF assisted (transformers default) | | | | | | {hf['speedup']}x | |")
        lines += ["", *[f"- {n}" for n in m["notes"]], ""]
    return "\n".join(lines) + "\n"
