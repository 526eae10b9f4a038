"""Traffic shapes for ``bench/gears.py``: arrivals and token counts generated in code from published
statistics (seeded, deterministic), beside the shipped Azure conversation trace. No data file from outside
is read except that trace; every number below names where it comes from.

Shapes (the ``tuning`` of each says whether the shifting loop's defaults were tuned on it):

``conversation`` (tuned on)
    The shipped trace, :data:`gearshift.dev.loadgen.DEFAULT_TRACE` (Azure LLM inference trace 2023,
    conversation service): its own arrivals and token counts, about 5.5 req/s over 58 minutes.
``long-prompt`` (tuned on)
    A coding assistant: long prompts, short outputs. Token counts are lognormals matched to the Azure
    LLM inference trace 2023 *code* service as Splitwise reports it (Patel et al., ISCA 2024, §III; the
    numbers as reported, see :data:`CODE_PROMPT_MEDIAN`); arrivals are an inhomogeneous
    Poisson process over one hour with a deep trough and a peak (:func:`long_prompt_rate`).
``long-output`` (held out)
    A chat assistant with ShareGPT-like traffic: short prompts, long outputs. Lognormals matched to the
    ShareGPT means the vLLM paper reports (Kwon et al., SOSP 2023, §6.1 and Fig. 11); arrivals rise and
    fall smoothly over one hour (:func:`long_output_rate`).
``day`` (held out)
    A day-shaped rate (:func:`day_rate`: night trough at 0.2x the afternoon peak) with 24 h compressed
    into 2 h of replay; token counts resampled (bootstrap, prompt and output together) from the
    conversation trace.

A lognormal is fitted to a median and a mean (``median = e^mu``, ``mean = e^(mu + sigma^2/2)``) *after*
the clip to ``[1, hi]``: :func:`lognormal_for` solves sigma (or mu, given sigma) so that the clipped
distribution's mean is the published mean; the clip does not move the median.

Arrivals of a rate ``r(t)`` are drawn by time rescaling (:func:`poisson_arrivals`): a Poisson count with
mean ``∫r``, each arrival at ``Λ⁻¹(u)`` for uniform ``u``, ``Λ`` the cumulative rate on a 1 s grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gearshift.dev.twin import Trace, load_trace

#: Seed of every generated shape (each shape draws from its own stream of it).
SEED = 2023
#: Token counts are clipped to these (inclusive): prompts, outputs.
PROMPT_CLIP = (1, 8000)
OUTPUT_CLIP = (1, 2000)
#: Grid of the cumulative rate, s.
GRID_S = 1.0

# --- published statistics ------------------------------------------------------------------------------
#: Azure LLM inference trace 2023, code service, as reported by Splitwise (Patel et al., "Splitwise:
#: Efficient generative LLM inference using phase splitting", ISCA 2024, §III, its token-count figure):
#: prompt median about 1,500 tokens (mean about 2,048), output median 13 tokens (mean about 28). As
#: reported: not re-derived from the code trace here. The same section reports the conversation
#: service's medians as 1,020 prompt and 129 output tokens, which the shipped conversation trace
#: reproduces exactly (``gearshift.dev.loadgen.DEFAULT_TRACE``: median 1020 and 129) -- a check on the
#: reading.
CODE_PROMPT_MEDIAN, CODE_PROMPT_MEAN = 1500.0, 2048.0
CODE_OUTPUT_MEDIAN, CODE_OUTPUT_MEAN = 13.0, 28.0
#: ShareGPT as the vLLM paper reports it (Kwon et al., "Efficient Memory Management for Large Language
#: Model Serving with PagedAttention", SOSP 2023, §6.1, Fig. 11): mean input 161 tokens, mean output 338
#: tokens (8.4x and 5.8x Alpaca's). As reported. The paper gives means and histograms, no median: the
#: spread is our assumption, :data:`SHAREGPT_SIGMA`.
SHAREGPT_PROMPT_MEAN, SHAREGPT_OUTPUT_MEAN = 161.0, 338.0
#: Log-space standard deviation of both ShareGPT lognormals (assumed: lengths spread over more than an
#: order of magnitude; sigma 1 puts the median at 0.61x the mean and the 99th percentile at 10x the median).
SHAREGPT_SIGMA = 1.0

# --- arrival rates -------------------------------------------------------------------------------------
#: ``long-prompt`` over one hour: mean 2.5 req/s at x1, about the Azure 2023 code trace's own rate (8,819
#: requests in 57 minutes, 2023-11-16 18:17 to 19:14, per the dataset's analysis notebook
#: ``AzureLLMInferenceDataset2023.ipynb``).
LONG_PROMPT_S = 3600.0
LONG_PROMPT_MEAN_RPS = 2.5
#: Its log-rate: a trough (centre, width) and a peak (centre, width), s, each of log-amplitude
#: :data:`LONG_PROMPT_LOG_AMPLITUDE`: the busiest 5 minutes carry about 30x the quietest.
LONG_PROMPT_TROUGH = (900.0, 300.0)
LONG_PROMPT_PEAK = (2400.0, 360.0)
LONG_PROMPT_LOG_AMPLITUDE = 1.75

#: ``long-output`` over one hour: mean 1.75 req/s at x1. Chosen from the gears' predicted capacity
#: (bench/results/gears.json: latency 28.7 req/s, throughput 38.0 req/s, both at the conversation mix's
#: 211 output tokens; at 338 output tokens, decode-bound, about 211/338 of that: 17.9 and 23.7 req/s). The
#: rate peaks at 1.54x its mean (:func:`long_output_rate`), so x1 peaks at 2.7 req/s (light: 15 % of the
#: latency gear) and x8 at 21.5 req/s (heavy: above the latency gear, 0.9x the throughput gear).
LONG_OUTPUT_S = 3600.0
LONG_OUTPUT_MEAN_RPS = 1.75
#: Its floor, as a share of the peak rate (at the start and the end of the hour).
LONG_OUTPUT_FLOOR = 0.3

#: ``day``: 24 h of the day compressed into this much replay (12x: one replay minute is 12 minutes of the
#: day), s. The rate still changes over tens of replay minutes, slower than a shift's 1-2 min lead.
DAY_REPLAY_S = 7200.0
#: Mean 2.4 req/s at x1, peak 4.0 (:data:`DAY_TROUGH`): x4 peaks at 16 req/s (within the latency gear's
#: predicted 28.7), x8 at 32 req/s (between the latency gear's 28.7 and the throughput gear's 38.0).
DAY_MEAN_RPS = 2.4
#: The night trough as a share of the afternoon peak. BurstGPT (Wang et al. 2024, arXiv 2401.17644)
#: shows daily periodicity in 121 days of Azure OpenAI GPT traffic (its README's "Daily Periodicity"
#: figure); the depth, the hours and the cosine are our assumption, not read off that figure.
DAY_TROUGH = 0.2
#: Hour of the trough (the peak is 12 h later, 16:00).
DAY_TROUGH_HOUR = 4.0


# --- generators ----------------------------------------------------------------------------------------
def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, hi: float) -> float:
    """The mean of ``min(X, hi)`` for ``X`` lognormal(mu, sigma) (the clip at 1 below moves it by far less
    than a token for the shapes here and is left out)."""
    z = (math.log(hi) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2.0) * _phi(z - sigma) + hi * (1.0 - _phi(z))


def lognormal_for(
    mean: float, hi: float, *, median: float | None = None, sigma: float | None = None
) -> tuple[float, float]:
    """``(mu, sigma)`` of the lognormal whose clip to ``[1, hi]`` has mean ``mean``: given its ``median``
    (sigma solved) or its ``sigma`` (mu solved), by bisection.

    Raises:
        ValueError: neither or both of ``median`` and ``sigma``, or a mean the clip cannot reach.
    """
    if (median is None) == (sigma is None):
        raise ValueError("lognormal_for needs exactly one of median and sigma")
    if median is not None:
        mu = math.log(median)
        lo, up = 1e-6, 4.0

        def f(s: float) -> float:
            return clipped_lognormal_mean(mu, s, hi) - mean
    else:
        assert sigma is not None
        lo, up = -10.0, math.log(hi) + 10.0

        def f(m: float) -> float:
            return clipped_lognormal_mean(m, sigma, hi) - mean

    if f(lo) > 0 or f(up) < 0:
        raise ValueError(f"no lognormal clipped to [1, {hi:g}] has mean {mean:g}")
    for _ in range(200):
        mid = (lo + up) / 2.0
        lo, up = (mid, up) if f(mid) < 0 else (lo, mid)
    x = (lo + up) / 2.0
    return (mu, x) if median is not None else (x, float(sigma))


def draw_tokens(
    rng: np.random.Generator, mu: float, sigma: float, n: int, clip: tuple[int, int]
) -> np.ndarray:
    """``n`` token counts: lognormal(mu, sigma) rounded and clipped to ``clip``."""
    x = np.rint(rng.lognormal(mu, sigma, n))
    return np.clip(x, clip[0], clip[1]).astype(np.int64)


def poisson_arrivals(
    rate: Callable[[np.ndarray], np.ndarray], duration_s: float, rng: np.random.Generator
) -> np.ndarray:
    """Arrival times (s, sorted) of an inhomogeneous Poisson process of ``rate(t)`` req/s on
    ``[0, duration_s)``, by time rescaling on a :data:`GRID_S` grid (the rate is held over each step)."""
    edges = np.arange(0.0, duration_s + GRID_S / 2, GRID_S)
    mids = (edges[:-1] + edges[1:]) / 2.0
    cum = np.concatenate([[0.0], np.cumsum(np.maximum(rate(mids), 0.0) * np.diff(edges))])
    n = int(rng.poisson(cum[-1]))
    u = np.sort(rng.uniform(0.0, cum[-1], n))
    return np.interp(u, cum, edges)


def _bump(t: np.ndarray, centre: float, width: float) -> np.ndarray:
    return np.exp(-0.5 * ((t - centre) / width) ** 2)


def _long_prompt_shape(t: np.ndarray) -> np.ndarray:
    a = LONG_PROMPT_LOG_AMPLITUDE
    return np.exp(a * _bump(t, *LONG_PROMPT_PEAK) - a * _bump(t, *LONG_PROMPT_TROUGH))


_LONG_PROMPT_NORM = float(np.mean(_long_prompt_shape(np.arange(0.0, LONG_PROMPT_S, GRID_S) + GRID_S / 2)))


def long_prompt_rate(t: np.ndarray, mean_rps: float = LONG_PROMPT_MEAN_RPS) -> np.ndarray:
    """``long-prompt``'s rate at ``t`` (s into the hour), req/s: ``mean_rps`` times
    ``exp(A·g(t; 2400, 360) − A·g(t; 900, 300)) / its mean over the hour``, ``g(t; c, w) =
    exp(−½((t − c)/w)²)``, A = :data:`LONG_PROMPT_LOG_AMPLITUDE`: a deep trough at minute 15, a peak at
    minute 40 (about 30x the trough's 5 minutes), about 1.3x the mean at the hour's start and end."""
    return mean_rps * _long_prompt_shape(np.asarray(t, dtype=float)) / _LONG_PROMPT_NORM


def long_output_rate(t: np.ndarray, mean_rps: float = LONG_OUTPUT_MEAN_RPS) -> np.ndarray:
    """``long-output``'s rate at ``t`` (s into the hour), req/s: ``f + (1 − f)·sin²(πt/3600)`` scaled to
    mean ``mean_rps`` (f = :data:`LONG_OUTPUT_FLOOR`): a smooth rise from 0.46x the mean to a peak of
    1.54x at minute 30, and back."""
    f = LONG_OUTPUT_FLOOR
    shape = f + (1.0 - f) * np.sin(np.pi * np.asarray(t, dtype=float) / LONG_OUTPUT_S) ** 2
    return mean_rps * shape / (f + (1.0 - f) / 2.0)


def day_hour(t: np.ndarray) -> np.ndarray:
    """The hour of the day at replay second ``t`` (24 h over :data:`DAY_REPLAY_S`, from midnight)."""
    return np.asarray(t, dtype=float) * 24.0 / DAY_REPLAY_S


def day_rate(t: np.ndarray, mean_rps: float = DAY_MEAN_RPS) -> np.ndarray:
    """``day``'s rate at replay second ``t``, req/s: ``τ + (1 − τ)·(1 − cos(2π(h − 4)/24))/2`` of the peak
    at hour ``h`` (:func:`day_hour`), τ = :data:`DAY_TROUGH`: trough at 04:00 (0.2x the peak), peak at
    16:00; the mean over the day is ``(1 + τ)/2`` of the peak, scaled to ``mean_rps``."""
    tau = DAY_TROUGH
    h = day_hour(t)
    shape = tau + (1.0 - tau) * (1.0 - np.cos(2.0 * np.pi * (h - DAY_TROUGH_HOUR) / 24.0)) / 2.0
    return mean_rps * shape / ((1.0 + tau) / 2.0)


@dataclass(frozen=True)
class Shape:
    """A traffic shape: its name, what it is, where its numbers come from, whether the shifting loop's
    defaults were tuned on it, and its parameters."""

    name: str
    what: str
    source: str
    tuning: str
    params: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "source": self.source, "tuning": self.tuning, "params": self.params}


_FIT = {
    "code_prompt": lognormal_for(CODE_PROMPT_MEAN, PROMPT_CLIP[1], median=CODE_PROMPT_MEDIAN),
    "code_output": lognormal_for(CODE_OUTPUT_MEAN, OUTPUT_CLIP[1], median=CODE_OUTPUT_MEDIAN),
    "sharegpt_prompt": lognormal_for(SHAREGPT_PROMPT_MEAN, PROMPT_CLIP[1], sigma=SHAREGPT_SIGMA),
    "sharegpt_output": lognormal_for(SHAREGPT_OUTPUT_MEAN, OUTPUT_CLIP[1], sigma=SHAREGPT_SIGMA),
}


def _lognormal_doc(key: str, median: float | None, mean: float, clip: tuple[int, int]) -> dict[str, Any]:
    mu, sigma = _FIT[key]
    return {
        "mu": round(mu, 4),
        "sigma": round(sigma, 4),
        "median": median if median is not None else round(math.exp(mu), 1),
        "mean_after_clip": mean,
        "clip": list(clip),
    }


AZURE_2023 = (
    "Azure LLM inference trace 2023 (Azure/AzurePublicDataset, AzureLLMInferenceDataset2023; Patel et "
    "al., Splitwise, ISCA 2024)"
)
SHAPES: dict[str, Shape] = {
    "conversation": Shape(
        "conversation",
        "the shipped Azure conversation trace: its arrivals and token counts",
        AZURE_2023 + ", conversation service: the shipped file (operator/gearshift/data/README.md)",
        "tuned on",
        {"trace": "gearshift.dev.loadgen.DEFAULT_TRACE unless --trace"},
    ),
    "long-prompt": Shape(
        "long-prompt",
        "a coding assistant: long prompts, short outputs; an hour with a deep trough (minute 15) and a peak "
        "(minute 40), the busiest 5 minutes about 30x the quietest",
        AZURE_2023
        + ", code service, as Splitwise reports it (§III, its token-count figure): prompt median ~1,500, "
        "mean ~2,048 tokens; output median 13, mean ~28 tokens (as reported); 2.5 req/s ~ the code "
        "trace's 8,819 requests in 57 min",
        "tuned on",
        {
            "prompt_lognormal": _lognormal_doc(
                "code_prompt", CODE_PROMPT_MEDIAN, CODE_PROMPT_MEAN, PROMPT_CLIP
            ),
            "output_lognormal": _lognormal_doc(
                "code_output", CODE_OUTPUT_MEDIAN, CODE_OUTPUT_MEAN, OUTPUT_CLIP
            ),
            "duration_s": LONG_PROMPT_S,
            "mean_rps_x1": LONG_PROMPT_MEAN_RPS,
            "rate": "mean x exp(A g(t; peak) - A g(t; trough)) / its mean, g(t; c, w) = exp(-((t-c)/w)^2/2)",
            "trough_centre_width_s": list(LONG_PROMPT_TROUGH),
            "peak_centre_width_s": list(LONG_PROMPT_PEAK),
            "log_amplitude": LONG_PROMPT_LOG_AMPLITUDE,
        },
    ),
    "long-output": Shape(
        "long-output",
        "a chat assistant, ShareGPT-like: short prompts, long outputs; the rate rises smoothly to a peak at "
        "minute 30 (1.54x its mean) and falls back",
        "ShareGPT as the vLLM paper reports it (Kwon et al., SOSP 2023, §6.1, Fig. 11): mean input 161, "
        "mean output 338 tokens (as reported); the lognormals' sigma (1.0) is assumed; the mean rate is "
        "chosen from the gears' predicted capacity (x1 light, x8 heavy)",
        "held out",
        {
            "prompt_lognormal": _lognormal_doc("sharegpt_prompt", None, SHAREGPT_PROMPT_MEAN, PROMPT_CLIP),
            "output_lognormal": _lognormal_doc("sharegpt_output", None, SHAREGPT_OUTPUT_MEAN, OUTPUT_CLIP),
            "duration_s": LONG_OUTPUT_S,
            "mean_rps_x1": LONG_OUTPUT_MEAN_RPS,
            "rate": "mean x (f + (1-f) sin^2(pi t / 3600)) / (f + (1-f)/2)",
            "floor_share_of_peak": LONG_OUTPUT_FLOOR,
            "mean_rps_choice": "x1 peak 2.7 req/s (15 % of the latency gear's ~17.9 at 338 output tokens); "
            "x8 peak 21.5 req/s (above it, 0.9x the throughput gear's ~23.7): bench/results/gears.json's "
            "predicted 28.7 and 38.0 req/s at 211 output tokens, scaled by 211/338",
        },
    ),
    "day": Shape(
        "day",
        "a day compressed 12x into 2 h of replay: night trough at 04:00 (0.2x the peak), afternoon peak at "
        "16:00; the conversation trace's (prompt, output) pairs resampled with replacement",
        "daily periodicity of LLM traffic: BurstGPT (Wang et al. 2024, arXiv 2401.17644; its README's "
        "'Daily Periodicity' figure, Azure OpenAI GPT services); the trough depth, the hours and the "
        "cosine shape are assumed; token mix: " + AZURE_2023 + ", conversation service (bootstrap)",
        "held out",
        {
            "replay_s": DAY_REPLAY_S,
            "compression": 24 * 3600 / DAY_REPLAY_S,
            "mean_rps_x1": DAY_MEAN_RPS,
            "rate": "peak x (tau + (1-tau)(1 - cos(2 pi (h - 4)/24))/2), h = hour of day",
            "trough_share_of_peak": DAY_TROUGH,
            "trough_hour": DAY_TROUGH_HOUR,
            "peak_rps_x1": round(DAY_MEAN_RPS * 2 / (1 + DAY_TROUGH), 3),
        },
    ),
}
#: Shapes the shifting loop's defaults were tuned on; the others are held out.
TUNED_ON = tuple(k for k, s in SHAPES.items() if s.tuning == "tuned on")


def _rng(name: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, list(SHAPES).index(name)])


def make_trace(name: str, conversation: Path, seed: int = SEED) -> Trace:
    """The shape ``name`` at x1 (its own pace and mean rate): ``conversation`` is the conversation trace
    (the ``conversation`` shape itself, and ``day``'s token mix).

    Raises:
        KeyError: an unknown shape.
    """
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}: use one of {', '.join(SHAPES)}")
    if name == "conversation":
        return load_trace(conversation)
    rng = _rng(name, seed)
    if name == "long-prompt":
        t = poisson_arrivals(long_prompt_rate, LONG_PROMPT_S, rng)
        p = draw_tokens(rng, *_FIT["code_prompt"], len(t), PROMPT_CLIP)
        o = draw_tokens(rng, *_FIT["code_output"], len(t), OUTPUT_CLIP)
    elif name == "long-output":
        t = poisson_arrivals(long_output_rate, LONG_OUTPUT_S, rng)
        p = draw_tokens(rng, *_FIT["sharegpt_prompt"], len(t), PROMPT_CLIP)
        o = draw_tokens(rng, *_FIT["sharegpt_output"], len(t), OUTPUT_CLIP)
    elif name == "day":
        t = poisson_arrivals(day_rate, DAY_REPLAY_S, rng)
        conv = load_trace(conversation)
        pick = rng.integers(0, len(conv.t), len(t))
        p, o = conv.prompt[pick], conv.output[pick]
    else:  # pragma: no cover - every shape in SHAPES has a branch
        raise AssertionError(name)
    return Trace(t - t[0] if len(t) else t, p, o)
