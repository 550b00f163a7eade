"""`Calibration`: P(draft accepted | drafter confidence, recent acceptance), fitted online.

p = target, q = drafter. The confidence policy (`policies.ConfidenceLength`) predicts each
draft's acceptance from q's probability of its own draft and the row's recent acceptance;
drafters are rarely calibrated, so this logistic model learns what those numbers mean from the
acceptance history of the decoder's lifetime.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import torch


def _logit(x: float) -> float:
    c = min(max(x, 1e-6), 1 - 1e-6)
    return math.log(c / (1 - c))


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


class Calibration:
    """P(draft accepted | drafter confidence, recent acceptance), learned from the history.

    A logistic model sigmoid(w0 + w1 logit(conf) + w2 logit(recent)): conf is the drafter's
    probability of its draft (q only), recent the row's moving average of acceptance over earlier
    rounds. Fitted by damped Newton steps to the last `window` observations every `refit_every`
    new ones, with a Gaussian prior of weight `prior` centred on (0, 1/2, 1/2). Drafters are
    rarely calibrated (the toy drafters' probabilities are flat: a distilled one's 0.05 means ~80%
    acceptance) and a sequence's acceptance comes in runs, so the fit learns what each says.
    """

    def __init__(self, prior: float = 4.0, window: int = 2048, refit_every: int = 128) -> None:
        self.prior, self.window, self.refit_every = prior, window, refit_every
        self.w0 = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
        self.w = self.w0.clone()
        self._wf = self.w.tolist()
        # observations as flat float64 arrays (the fit views them as tensors without a copy)
        self.lc, self.lr, self.y = array("d"), array("d"), array("d")
        self._new = 0

    def __call__(self, conf: float, recent: float) -> float:
        w = self._wf
        return _sigmoid(w[0] + w[1] * _logit(conf) + w[2] * _logit(recent))

    def update(self, conf: Sequence[float], recent: Sequence[float], accepted: Sequence[float]):
        self.lc.extend(_logit(c) for c in conf)
        self.lr.extend(_logit(r) for r in recent)
        self.y.extend(float(a) for a in accepted)
        self._new += len(conf)
        if len(self.y) > 2 * self.window:
            for buf in (self.lc, self.lr, self.y):
                del buf[: -self.window]
        # refit often while the history is short, every `refit_every` observations later
        if self._new >= min(self.refit_every, max(16, len(self.y) // 2)):
            self._new = 0
            self.fit()

    def set_prior(self, w0: torch.Tensor) -> None:
        """Move the prior's centre (used at the next fit; taken as is without data)."""
        self.w0 = w0.clone()
        if not self.y:
            self.w = self.w0.clone()
            self._wf = self.w.tolist()

    def fit(self, steps: int = 8) -> None:
        """Damped Newton steps on the penalised log-likelihood (prior: N(w0, 1/prior) per
        weight); a step is halved until the objective falls (plain Newton overshoots when the
        confidences span a narrow range)."""
        if not self.y:
            return
        cols = [
            torch.frombuffer(b, dtype=torch.float64)[-self.window :] for b in (self.lc, self.lr)
        ]
        x = torch.stack([torch.ones_like(cols[0]), *cols], 1)
        y = torch.frombuffer(self.y, dtype=torch.float64)[-self.window :].clone()
        eye = torch.eye(x.shape[1], dtype=x.dtype)

        def loss(w: torch.Tensor) -> float:
            z = x @ w
            nll = torch.nn.functional.softplus(z) - y * z
            return float(nll.sum() + 0.5 * self.prior * ((w - self.w0) ** 2).sum())

        w, cur = self.w, loss(self.w)
        for _ in range(steps):
            p = torch.sigmoid(x @ w)
            grad = x.T @ (p - y) + self.prior * (w - self.w0)
            hess = (x * (p * (1 - p))[:, None]).T @ x + self.prior * eye
            step = torch.linalg.solve(hess, grad)
            for _ in range(20):
                new = loss(w - step)
                if new <= cur:
                    break
                step = step / 2
            else:
                break
            w, cur = w - step, new
            if float(step.abs().max()) < 1e-6:
                break
        self.w = w
        self._wf = w.tolist()
