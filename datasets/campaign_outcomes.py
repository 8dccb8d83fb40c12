"""faultlens's measured outcomes per failure kind: a stratified sample of renders, each decided by the engine.

Rendering every failure of a 90-day campaign on its slice takes 3-10 s each on
one core, so the campaign does not re-render each failure: per rendered kind it
renders a sample (each render with its own seed, onset, severity, machine and
noise), decides every one with ``diagnose_records``, and grows the sample until
the kind's accuracy has a 95% Wilson interval no wider than +/- ``half_width``
(or ``n_max`` renders). Each campaign failure is then charged by drawing one of
its kind's measured outcomes (``draw``), never one cached answer per kind.

The measured decisions are kept on disk (``cache_dir``), one JSON line per
render, in a file keyed by a digest of the code that renders and decides
(every .py/.toml/.json of the package outside the campaign's own accounting),
the slice layout, the NCCL timeout, the job's DP and the sampling parameters:
change any of them and the sample is measured again. This cache is only for
speed; ``--no-cache`` measures afresh.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from faultlens.datasets.campaign_compound import COMPOUND, compound_digest, decide_compound
from faultlens.datasets.campaign_hard import HARD, decide_hard, hard_digest
from faultlens.datasets.campaign_render import Decision, Noise, SliceLayout, decide
from faultlens.vocabulary import ActionType

A = ActionType
OUTCOMES: tuple[str, ...] = ("right", "late", "over_eviction", "wrong_machine", "missed")
# How a render varies (bump SAMPLING_VERSION when this or sample_noise changes: the cache key reads both)
SAMPLING: dict[str, float] = {"onset_min_s": 180.0, "onset_max_s": 480.0, "step_noise_min": 0.005,
                              "step_noise_max": 0.03, "kernel_noise_min": 6.0, "kernel_noise_max": 60.0,
                              "flap_p": 0.3}
SAMPLING_VERSION = 1
# the campaign's own accounting (every campaign* file but the renderer, and the mix): it does not change what
# the engine decides
RENDER_FILE = "campaign_render.py"
NOT_IN_DIGEST = ("failure_mix.toml",)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of k successes in n (95% by default)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def classify(d: Decision, late_after_s: float) -> str:
    """right | late | over_eviction | wrong_machine | missed: what one measured decision was."""
    if d.action in ("none", A.NOTIFY) and d.expected_action not in ("none", A.NOTIFY):
        return "missed"
    if d.detect_s is None and d.expected_action not in ("none", A.NOTIFY):
        return "missed"
    if not d.right:
        return "wrong_machine"
    if d.extra_machines > 0 and d.action in (A.EVICT_NODES, A.ADAPT_PARALLELISM):
        return "over_eviction"  # (run_diagnostics names the machines it checks: that takes none out)
    if (d.detect_s or 0.0) + d.decide_s > late_after_s:
        return "late"
    return "right"


def sample_noise(kind: str, i: int) -> tuple[int, Noise]:
    """The seed and noise of render ``i`` of ``kind`` (stable: the same i renders the same bytes)."""
    digest = hashlib.sha256(f"{kind}:{i}:v{SAMPLING_VERSION}".encode()).digest()
    seed = int.from_bytes(digest[:4], "little")
    rng = np.random.default_rng(seed)
    s = SAMPLING
    return seed, Noise(onset_s=float(round(rng.uniform(s["onset_min_s"], s["onset_max_s"]))),
                       step_noise=float(rng.uniform(s["step_noise_min"], s["step_noise_max"])),
                       kernel_noise_per_hour=float(rng.uniform(s["kernel_noise_min"], s["kernel_noise_max"])),
                       flap=bool(rng.random() < s["flap_p"]))


def code_digest() -> str:
    """A digest of the code that renders and decides a failure (the package minus the campaign's accounting)."""
    import faultlens

    root = Path(faultlens.__file__).resolve().parent.parent
    h = hashlib.sha256()
    for sub in ("faultlens", "collectors", "stream", "models", "diagnosis", "datasets"):
        base = root / sub
        for p in sorted(base.rglob("*")):
            if p.suffix not in (".py", ".toml", ".json") or (p.name.startswith("campaign") and p.name != RENDER_FILE) or p.name in NOT_IN_DIGEST or "__pycache__" in p.parts:
                continue
            if sub == "faultlens" and p.relative_to(base).parts[0] in ("commands",):
                continue
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    h.update(json.dumps([SAMPLING, SAMPLING_VERSION], sort_keys=True).encode())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("FAULTLENS_CACHE_DIR", Path.home() / ".cache" / "faultlens")) / "campaign"


@dataclass
class Outcomes:
    """The measured decisions per rendered kind, and how they were obtained."""

    by_kind: dict[str, list[Decision]]
    late_after_s: float
    rendered: int = 0  # renders made by this run
    cached: int = 0  # renders read back from the cache
    seconds: float = 0.0
    digest: str = ""
    made_wrong: dict[str, int] = field(default_factory=dict)
    hard: bool = False  # the kinds of campaign_hard.HARD were decided from their hard renders

    @property
    def renders(self) -> int:
        return sum(len(v) for v in self.by_kind.values())

    def accuracy(self, kind: str) -> tuple[float, float, float, int]:
        """(share right, Wilson low, Wilson high, n); right = the engine's action fixes the fault."""
        ds = self.by_kind[kind]
        k = sum(d.right for d in ds)
        lo, hi = wilson(k, len(ds))
        return (k / len(ds) if ds else 0.0), lo, hi, len(ds)

    def counts(self, kind: str) -> dict[str, int]:
        out = dict.fromkeys(OUTCOMES, 0)
        for d in self.by_kind[kind]:
            out[classify(d, self.late_after_s)] += 1
        return out

    def mistakes(self) -> list[Decision]:
        """Every measured decision that was not right (for the report)."""
        return [d for ds in self.by_kind.values() for d in ds
                if classify(d, self.late_after_s) in ("over_eviction", "wrong_machine", "missed")]


def draw(outcomes: Sequence[Decision], u: float) -> Decision:
    """One measured outcome for a failure whose uniform draw is ``u``."""
    return outcomes[min(len(outcomes) - 1, int(u * len(outcomes)))]


def _render_one(kind: str, i: int, layout: SliceLayout, fault_class: str, nccl_timeout_s: float,
                job_dp: int, hard: bool = False) -> Decision:

    seed, noise = sample_noise(kind, i)
    if hard and kind in HARD:  # the same render i with its evidence made as a fleet makes it (campaign_hard.py)
        return decide_hard(kind, layout, seed, i, fault_class=fault_class, nccl_timeout_s=nccl_timeout_s,
                           job_dp=job_dp, noise=noise).decision
    if kind in COMPOUND:  # several machines at once (campaign_compound.py)
        return decide_compound(kind, layout, seed, i, nccl_timeout_s=nccl_timeout_s, noise=noise)
    return decide(kind, layout, seed, i, fault_class=fault_class, nccl_timeout_s=nccl_timeout_s, job_dp=job_dp,
                  noise=noise).decision


def _cache_file(cache_dir: Path, digest: str, layout: SliceLayout, nccl_timeout_s: float, job_dp: int,
                kind: str, hard: bool = False) -> Path:
    if hard and kind in HARD:  # hard renders: their own file, keyed by campaign_hard's digest too
        return cache_dir / f"{digest}+{hard_digest()}-{layout.key}-t{nccl_timeout_s:g}-dp{job_dp}-hard-{kind}.jsonl"
    if kind in COMPOUND:  # its renderer is outside the engine's digest: its own digest beside it
        digest = f"{digest}+{compound_digest()}"
    return cache_dir / f"{digest}-{layout.key}-t{nccl_timeout_s:g}-dp{job_dp}-{kind}.jsonl"


def _load(path: Path) -> dict[int, Decision]:
    out: dict[int, Decision] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
            out[int(d["bucket"])] = Decision(**d)
        except (ValueError, TypeError, KeyError):
            continue  # a torn line from an interrupted run: measured again
    return out


def measure(kinds: Mapping[str, str], layout: SliceLayout, *, nccl_timeout_s: float, job_dp: int,
            late_after_s: float, half_width: float = 0.05, n_min: int = 40, n_max: int = 200, batch: int = 20,
            workers: int = 1, cache_dir: Path | None = None, use_cache: bool = True, cached_only: bool = False,
            hard: bool = False, progress: Callable[[str], None] | None = None) -> Outcomes:
    """Render and decide a sample per kind until its 95% interval is within +/- half_width (or n_max).

    ``kinds``: rendered kind -> fault class. Renders already in the cache are read back, not redone.
    ``cached_only``: take the renders the cache holds for a kind as they are (its interval as wide as
    that makes it), rendering only for a kind the cache has none of.
    ``hard``: the kinds of campaign_hard.HARD are decided from their hard renders (their own cache files);
    every other kind from its clean (or compound) render, as without it.
    """
    t0 = time.perf_counter()
    digest = code_digest()
    cache_dir = cache_dir or default_cache_dir()
    out = Outcomes({}, late_after_s, digest=digest, hard=hard)
    pool = ProcessPoolExecutor(workers) if workers > 1 else None
    try:
        for kind, fault_class in sorted(kinds.items()):
            path = _cache_file(cache_dir, digest, layout, nccl_timeout_s, job_dp, kind, hard)
            have = _load(path) if use_cache else {}
            n, top = n_min, n_max
            if cached_only:  # the cache's run of renders from 0 as it is; n_min renders of a kind it lacks
                n = top = next(i for i in range(len(have) + 1) if i not in have) if 0 in have else n_min
            while True:
                missing = [i for i in range(n) if i not in have]
                args = [(kind, i, layout, fault_class, nccl_timeout_s, job_dp, hard) for i in missing]
                done = pool.map(_render_one, *zip(*args, strict=True)) if pool and args else \
                    (_render_one(*a) for a in args)
                path.parent.mkdir(parents=True, exist_ok=True)
                for d in done:  # kept as each arrives: an interrupted run loses only the renders in flight
                    with path.open("a") as fh:
                        fh.write(json.dumps(d.as_dict()) + "\n")
                    have[d.bucket] = d
                    out.rendered += 1
                lo, hi = wilson(sum(have[i].right for i in range(n)), n)
                if (hi - lo) / 2 <= half_width or n >= top:
                    break
                n = min(top, n + batch)
            out.by_kind[kind] = [have[i] for i in range(n)]
            if progress:
                p, lo, hi, _ = out.accuracy(kind)
                progress(f"{kind}: {n} renders, right {p:.3f} [{lo:.3f}, {hi:.3f}]")
    finally:
        if pool:
            pool.shutdown()
    out.cached = out.renders - out.rendered
    out.seconds = time.perf_counter() - t0
    return out
